"""The LoRA flags through the CLI into ServerConfig and EngineConfig, and their combined checks."""

from __future__ import annotations

import pytest

from server.cli import config_from_args
from server.config import ServerConfig


def test_flags_reach_the_engine_config() -> None:
    c = config_from_args(
        [
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            '{"name": "b", "path": "/y"}',
            "--max-loras",
            "2",
            "--max-lora-rank",
            "64",
            "--max-cpu-loras",
            "3",
            "--lora-dtype",
            "float32",
        ]
    )
    e = c.engine_config()
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras, e.lora_dtype) == (True, 2, 64, 3, "float32")
    assert [m.name for m in c.lora.lora_modules] == ["a", "b"]
    env = ServerConfig.from_env(
        {"SPINDLE_ENABLE_LORA": "1", "SPINDLE_LORA_MODULES": "a=/x b=/y", "SPINDLE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    )
    assert env.lora.allow_runtime_lora_updating and [m.path for m in env.lora.lora_modules] == ["/x", "/y"]


@pytest.mark.parametrize(
    "kw, why",
    [
        (
            {"lora_modules": config_from_args(["--enable-lora", "--lora-modules", "a=/x"]).lora.lora_modules},
            "need --enable-lora",
        ),
        ({"enable_lora": True}, None),
        ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "--max-cpu-loras"),
        ({"enable_lora": True, "max_lora_rank": 7}, "--max-lora-rank"),
        ({"enable_lora": True, "tensor_parallel_size": 2}, None),
        ({"enable_lora": True, "allow_runtime_lora_updating": True, "api_server_count": 2}, None),
    ],
)
def test_combined_checks(kw: dict[str, object], why: str | None) -> None:
    if why is None:
        ServerConfig.from_settings(**kw)
        return
    with pytest.raises(ValueError, match=why):
        ServerConfig.from_settings(**kw)


def test_duplicate_and_base_names_are_refused() -> None:
    with pytest.raises(ValueError, match="names must be unique"):
        config_from_args(["--enable-lora", "--lora-modules", "a=/x", "a=/y"])
    with pytest.raises(ValueError, match="differ from the model's"):
        config_from_args(["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"])
