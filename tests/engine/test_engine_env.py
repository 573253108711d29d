"""engine/config.py's EngineEnv: the SPINDLE_* variables the engine reads, each spelling as the modules that use
them always took it, and a bad timeout refused with one line naming the variable."""

from __future__ import annotations

import pytest

from engine.config import EngineEnv


def test_defaults_when_nothing_is_set() -> None:
    assert EngineEnv.read({}) == EngineEnv()
    assert EngineEnv() == EngineEnv(True, "", True, False, 120.0, "INFO", "")


@pytest.mark.parametrize("text", ["0", "false", " Off ", "NO"])
def test_cpu_kernels_off_spellings(text: str) -> None:
    assert not EngineEnv.read({"SPINDLE_CPU_KERNELS": text}).cpu_kernels
    assert EngineEnv.read({"SPINDLE_CPU_KERNELS": "yes"}).cpu_kernels


def test_each_variable_reaches_its_field() -> None:
    env = EngineEnv.read(
        {
            "SPINDLE_KERNEL_CHOICE": "amx,dot",
            "SPINDLE_SPEC_DRAFT_COST": "0",
            "SPINDLE_GGUF_DEQUANTIZE": "1",
            "SPINDLE_DISTRIBUTED_TIMEOUT": "3",
            "SPINDLE_LOG_LEVEL": "debug",
            "SPINDLE_ENGINE_COMMAND": "python -m bench.fake_engine_process",
        }
    )
    assert env == EngineEnv(True, "amx,dot", False, True, 3.0, "DEBUG", "python -m bench.fake_engine_process")
    assert not EngineEnv.read({"SPINDLE_GGUF_DEQUANTIZE": ""}).gguf_dequantize
    assert EngineEnv.read({"SPINDLE_SPEC_DRAFT_COST": "no"}).spec_draft_cost  # only "0" turns it off


def test_the_live_environment_is_read_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_LOG_LEVEL", "warning")
    assert EngineEnv.read().log_level == "WARNING"
    monkeypatch.setenv("SPINDLE_LOG_LEVEL", "error")
    assert EngineEnv.read().log_level == "ERROR"


@pytest.mark.parametrize(("text", "why"), [("soon", "a number of seconds, not 'soon'"), ("0", "positive")])
def test_a_bad_timeout_names_the_variable(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"SPINDLE_DISTRIBUTED_TIMEOUT must be {why}"):
        EngineEnv.read({"SPINDLE_DISTRIBUTED_TIMEOUT": text})
