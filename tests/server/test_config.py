"""ServerConfig validation, SPINDLE_* env vars, and the CLI's vLLM-named flags."""

from __future__ import annotations

import pytest

from server.cli import config_from_args
from server.config import ServerConfig


def test_env_vars_are_typed() -> None:
    cfg = ServerConfig.from_env({"SPINDLE_PORT": "9000", "SPINDLE_MAX_NUM_QUEUED_REQS": "5",
                                 "SPINDLE_TRUST_REQUEST_CHAT_TEMPLATE": "true", "SPINDLE_API_KEYS": "a, b",
                                 "SPINDLE_KV_CACHE_MEMORY": "512MiB", "SPINDLE_SHUTDOWN_TIMEOUT": "2.5",
                                 "SPINDLE_LOG_LEVEL": "WARNING", "SPINDLE_MAX_MODEL_LEN": "none",
                                 "SPINDLE_WORKER_CLASS": "uvloop", "SPINDLE_OUTPUT_CHUNK": "64", "OTHER": "x"})
    assert (cfg.port, cfg.max_num_queued_reqs, cfg.trust_request_chat_template) == (9000, 5, True)
    assert cfg.api_keys == ("a", "b") and cfg.kv_cache_memory == 512 << 20 and cfg.shutdown_timeout == 2.5
    assert cfg.log_level == "warning" and cfg.max_model_len is None and cfg.worker_class == "uvloop"


@pytest.mark.parametrize("env", [{"SPINDLE_PORT": "x"}, {"SPINDLE_ENABLE_PREFIX_CACHING": "maybe"},
                                 {"SPINDLE_STREAM_INTERVAL": "0"},
                                 {"SPINDLE_WORKER_CLASS": "gevent"}, {"SPINDLE_DTYPE": "int4"}])
def test_bad_env_is_refused_naming_it(env: dict[str, str]) -> None:
    with pytest.raises(ValueError) as e:
        ServerConfig.from_env(env)
    key = next(iter(env))
    assert key in str(e.value) or key.removeprefix("SPINDLE_").lower().replace("_", "-") in str(e.value)


def test_unknown_spindle_vars_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    assert ServerConfig.from_env({"SPINDLE_NO_SUCH_SETTING": "1"}) == ServerConfig()
    assert "SPINDLE_NO_SUCH_SETTING" in caplog.text


def test_cli_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_PORT", "1234")
    monkeypatch.setenv("SPINDLE_SEED", "7")
    cfg = config_from_args(["--model", "/m", "--port", "5678", "--served-model-name", "tiny", "--max-model-len",
                            "64", "--api-key", "k1", "--api-key", "k2", "--no-enable-prefix-caching",
                            "--trust-request-chat-template", "--kv-cache-memory", "1GiB", "--worker-class", "asyncio",
                            "--max-num-queued-tokens", "100", "--stream-interval", "4", "--max-logprobs", "3"])
    assert (cfg.port, cfg.seed, cfg.model, cfg.model_name, cfg.max_model_len) == (5678, 7, "/m", "tiny", 64)
    assert cfg.api_keys == ("k1", "k2") and not cfg.enable_prefix_caching and cfg.trust_request_chat_template
    assert cfg.kv_cache_memory == 1 << 30 and cfg.worker_class == "asyncio" and cfg.max_num_queued_tokens == 100
    engine = cfg.engine_config()
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching, engine.seed) == ("/m", 64, False, 7)
