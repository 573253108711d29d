"""The tensor-parallel flags reach the EngineConfig; --headless is for nodes other than 0, and they need it."""

from __future__ import annotations

import pytest

from server.cli import config_from_args


def test_flags_reach_the_engine_config() -> None:
    config = config_from_args(
        [
            "--tensor-parallel-size",
            "4",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "29500",
        ]
    )
    engine = config._engine_config("ckpt")
    assert (engine.tensor_parallel_size, engine.nnodes, engine.node_rank) == (4, 2, 0)
    assert (engine.master_addr, engine.master_port) == ("10.0.0.1", 29500)
    assert config_from_args(
        ["--headless", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2", "--master-port", "29500"]
    ).parallel.headless


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "1"], "headless"),
        (["--headless"], "headless"),
        (["--tensor-parallel-size", "3", "--nnodes", "2", "--master-port", "1"], "nnodes"),
        (["--tensor-parallel-size", "2", "--nnodes", "2"], "master-port"),
        (["--tensor-parallel-size", "0"], "tensor-parallel-size"),
    ],
)
def test_bad_combinations_fail_at_startup(argv: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        config_from_args(argv)
