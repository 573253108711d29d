"""--state-snapshot-interval and --state-snapshot-memory (a hybrid model's recurrent-state snapshots for prefix
hits): defaults, each limit met, passed and crossed, the SPINDLE_* variables, the engine config they reach and the
--help group they show in."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from server.cli import config_from_args
from server.cli_help import GROUP_OF
from server.config import ServerConfig
from tests.engine.models.hybrid_families import build_hybrid

HALF_GIB = 1 << 29


def engine(*argv: str) -> tuple[int, int | None]:
    cfg = config_from_args(["--model", "demo", *argv]).engine_config()
    return cfg.state_snapshot_interval, cfg.state_snapshot_memory


def test_defaults_reach_the_engine_as_before() -> None:
    assert engine() == (64, None)  # every 64 tokens, an eighth of --kv-cache-memory (engine/execution)


@pytest.mark.parametrize(("value", "want"), [("0", 0), ("1", 1), ("256", 256)])
def test_interval_from_zero_up(value: str, want: int) -> None:
    assert engine("--state-snapshot-interval", value)[0] == want  # 0: no snapshots, no prefix hits on hybrids


def test_a_negative_interval_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--state-snapshot-interval must be 0 .* got -1"):
        engine("--state-snapshot-interval", "-1")


@pytest.mark.parametrize(
    ("memory", "want"), [("0", 0), ("256MiB", HALF_GIB // 2), ("512MiB", HALF_GIB), (str(HALF_GIB - 1), HALF_GIB - 1)]
)
def test_memory_up_to_half_the_kv_budget(memory: str, want: int) -> None:
    assert engine("--kv-cache-memory", "1GiB", "--state-snapshot-memory", memory)[1] == want


@pytest.mark.parametrize("memory", [str(HALF_GIB + 1), "1GiB", "4GiB"])
def test_memory_over_half_the_kv_budget_is_refused(memory: str) -> None:
    with pytest.raises(ValueError, match=r"--state-snapshot-memory \(\d+ bytes\) must be at most half of --kv-cache"):
        engine("--kv-cache-memory", "1GiB", "--state-snapshot-memory", memory)


def test_with_num_blocks_the_snapshots_come_on_top() -> None:
    """--num-blocks fixes the KV blocks: the snapshots are not out of --kv-cache-memory, so no half bound."""
    assert engine("--num-blocks", "64", "--kv-cache-memory", "1GiB", "--state-snapshot-memory", "2GiB")[1] == 2 << 30


def test_memory_that_is_not_a_size_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--state-snapshot-memory"):
        engine("--state-snapshot-memory", "-1")


def test_environment_variables() -> None:
    env = {"SPINDLE_MODEL": "demo", "SPINDLE_STATE_SNAPSHOT_INTERVAL": "32", "SPINDLE_STATE_SNAPSHOT_MEMORY": "64MiB"}
    cfg = ServerConfig.from_env(env).engine_config()
    assert (cfg.state_snapshot_interval, cfg.state_snapshot_memory) == (32, 64 << 20)
    unset = ServerConfig.from_env(env | {"SPINDLE_STATE_SNAPSHOT_MEMORY": "none"}).engine_config()
    assert unset.state_snapshot_memory is None
    flags_win = ServerConfig.from_env(env, state_snapshot_interval=0).engine_config()
    assert flags_win.state_snapshot_interval == 0
    with pytest.raises(ValueError, match="SPINDLE_STATE_SNAPSHOT_MEMORY"):
        ServerConfig.from_env(env | {"SPINDLE_STATE_SNAPSHOT_MEMORY": "lots"})


def test_both_flags_show_with_the_kv_cache_flags() -> None:
    assert GROUP_OF["--state-snapshot-interval"] == GROUP_OF["--state-snapshot-memory"] == "scheduling"


@pytest.mark.parametrize(("argv", "interval", "snapshots"), [([], 64, 1), (["--state-snapshot-interval", "0"], 0, 0)])
def test_the_flags_shape_a_hybrid_engines_snapshots(
    tmp_path_factory: pytest.TempPathFactory, argv: list[str], interval: int, snapshots: int
) -> None:
    """A tiny Qwen3.5 engine built from the flags: its pool's snapshot interval and count (the memory flag gives
    room for exactly one slot's state, the interval flag 0 turns them off)."""
    ckpt = build_hybrid(tmp_path_factory.getbasetemp() / "hybrids", "qwen3_5")
    base = ["--model", str(ckpt), "--num-blocks", "64", "--block-size", "16", "--max-num-seqs", "2"]
    probe = EngineCore(config_from_args(base).engine_config()).runner.states
    assert probe is not None
    per_slot = sum(t[0].numel() * t.element_size() for layer in probe.layers for t in layer)
    cfg = config_from_args([*base, "--state-snapshot-memory", str(per_slot), *argv]).engine_config()
    pool = EngineCore(cfg).block_manager.state
    assert pool is not None and (pool.interval, pool.num_snapshots) == (interval, snapshots)
