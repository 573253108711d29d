"""ServerConfig validation, SPINDLE_* env vars, and the CLI's vLLM-named flags."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import server.config
from server.cli import config_from_args
from server.config import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, ServerConfig
from server.reasoning.parser import REASONING_PARSERS
from server.tools.parser_names import TOOL_PARSERS


def test_env_vars_are_typed() -> None:
    cfg = ServerConfig.from_env(
        {
            "SPINDLE_PORT": "9000",
            "SPINDLE_MAX_NUM_QUEUED_REQS": "5",
            "SPINDLE_TRUST_REQUEST_CHAT_TEMPLATE": "true",
            "SPINDLE_API_KEYS": "a, b",
            "SPINDLE_KV_CACHE_MEMORY": "512MiB",
            "SPINDLE_SHUTDOWN_TIMEOUT": "2.5",
            "SPINDLE_LOG_LEVEL": "WARNING",
            "SPINDLE_MAX_MODEL_LEN": "none",
            "SPINDLE_WORKER_CLASS": "uvloop",
            "SPINDLE_OUTPUT_CHUNK": "64",
            "OTHER": "x",
        }
    )
    assert (cfg.http.port, cfg.scheduling.max_num_queued_reqs, cfg.model.trust_request_chat_template) == (9000, 5, True)
    assert (
        cfg.http.api_keys == ("a", "b") and cfg.engine.kv_cache_memory == 512 << 20 and cfg.http.shutdown_timeout == 2.5
    )
    assert cfg.outputs.log_level == "warning" and cfg.model.max_model_len is None and cfg.http.worker_class == "uvloop"


@pytest.mark.parametrize(
    "env",
    [
        {"SPINDLE_PORT": "x"},
        {"SPINDLE_ENABLE_PREFIX_CACHING": "maybe"},
        {"SPINDLE_STREAM_INTERVAL": "0"},
        {"SPINDLE_WORKER_CLASS": "gevent"},
        {"SPINDLE_DTYPE": "int4"},
    ],
)
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
    cfg = config_from_args(
        [
            "--model",
            "/m",
            "--port",
            "5678",
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "64",
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--no-enable-prefix-caching",
            "--trust-request-chat-template",
            "--kv-cache-memory",
            "1GiB",
            "--worker-class",
            "asyncio",
            "--max-num-queued-tokens",
            "100",
            "--stream-interval",
            "4",
            "--max-logprobs",
            "3",
        ]
    )
    assert (cfg.http.port, cfg.engine.seed, cfg.model.model, cfg.model.model_name, cfg.model.max_model_len) == (
        5678,
        7,
        "/m",
        "tiny",
        64,
    )
    assert (
        cfg.http.api_keys == ("k1", "k2")
        and not cfg.engine.enable_prefix_caching
        and cfg.model.trust_request_chat_template
    )
    assert (
        cfg.engine.kv_cache_memory == 1 << 30
        and cfg.http.worker_class == "asyncio"
        and cfg.scheduling.max_num_queued_tokens == 100
    )
    engine = cfg.engine_config()
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching, engine.seed) == ("/m", 64, False, 7)


def test_scheduling_policy_and_request_caps() -> None:
    cfg = config_from_args(
        [
            "--scheduling-policy",
            "priority",
            "--max-prompts-per-request",
            "8",
            "--max-choices-per-request",
            "16",
            "--max-stop-strings",
            "4",
            "--max-stop-string-length",
            "32",
            "--max-stop-token-ids",
            "5",
            "--max-logit-bias",
            "300",
            "--max-allowed-token-ids",
            "1",
        ]
    )
    assert cfg.engine_config().scheduling_policy == "priority"
    caps = cfg.scheduling.request_caps()
    assert caps.priority_scheduling and (caps.max_prompts_per_request, caps.max_choices_per_request) == (8, 16)
    assert (caps.max_stop_strings, caps.max_stop_string_length, caps.max_stop_token_ids) == (4, 32, 5)
    assert (caps.max_logit_bias, caps.max_allowed_token_ids) == (300, 1)
    env = ServerConfig.from_env({"SPINDLE_SCHEDULING_POLICY": "priority", "SPINDLE_MAX_LOGIT_BIAS": "9"})
    assert env.scheduling.scheduling_policy == "priority" and env.scheduling.max_logit_bias == 9
    default = ServerConfig()
    assert default.scheduling.scheduling_policy == "fcfs" and default.engine_config().scheduling_policy == "fcfs"
    assert not default.scheduling.request_caps().priority_scheduling


@pytest.mark.parametrize(
    "env",
    [
        {"SPINDLE_SCHEDULING_POLICY": "lifo"},
        {"SPINDLE_MAX_STOP_STRINGS": "0"},
        {"SPINDLE_MAX_PROMPTS_PER_REQUEST": "-1"},
        {"SPINDLE_MAX_CHOICES_PER_REQUEST": "0"},
        {"SPINDLE_MAX_STOP_STRING_LENGTH": "0"},
        {"SPINDLE_MAX_STOP_TOKEN_IDS": "0"},
        {"SPINDLE_MAX_LOGIT_BIAS": "0"},
        {"SPINDLE_MAX_ALLOWED_TOKEN_IDS": "0"},
    ],
)
def test_bad_caps_and_policy_are_refused_naming_the_flag(env: dict[str, str]) -> None:
    with pytest.raises(ValueError) as e:
        ServerConfig.from_env(env)
    assert next(iter(env)).removeprefix("SPINDLE_").lower().replace("_", "-") in str(e.value)


def test_max_structured_output_size_takes_sizes() -> None:
    assert (
        ServerConfig().scheduling.request_caps().max_structured_output_size == 256 * 1024
    )  # the largest real-world schemas (~240 KB) pass
    assert (
        config_from_args(["--max-structured-output-size", "1KiB"]).scheduling.request_caps().max_structured_output_size
        == 1024
    )
    assert (
        ServerConfig.from_env({"SPINDLE_MAX_STRUCTURED_OUTPUT_SIZE": "300"}).scheduling.max_structured_output_size
        == 300
    )
    with pytest.raises(ValueError, match="--max-structured-output-size"):
        ServerConfig.from_env({"SPINDLE_MAX_STRUCTURED_OUTPUT_SIZE": "0"})


def test_responses_store_max_bytes_takes_sizes() -> None:
    assert ServerConfig().outputs.responses_store_max_bytes == 256 << 20
    assert config_from_args(["--responses-store-max-bytes", "2MiB"]).outputs.responses_store_max_bytes == 2 << 20
    assert (
        ServerConfig.from_env({"SPINDLE_RESPONSES_STORE_MAX_BYTES": "1000"}).outputs.responses_store_max_bytes == 1000
    )
    with pytest.raises(ValueError, match="--responses-store-max-bytes"):
        ServerConfig.from_env({"SPINDLE_RESPONSES_STORE_MAX_BYTES": "0"})


def test_the_parser_names_config_checks_are_the_registries_keys() -> None:
    """config.py owns the names (it imports nothing else from the server): they must not drift from the parsers."""
    assert TOOL_CALL_PARSER_NAMES == tuple(TOOL_PARSERS)
    assert REASONING_PARSER_NAMES == tuple(REASONING_PARSERS)
    for name in TOOL_CALL_PARSER_NAMES:
        assert ServerConfig.from_settings(tool_call_parser=name).outputs.tool_call_parser == name
    for name in REASONING_PARSER_NAMES:
        assert ServerConfig.from_settings(reasoning_parser=name).outputs.reasoning_parser == name
    with pytest.raises(
        ValueError,
        match="--tool-call-parser must be one of hermes, mistral, llama3_json, pythonic, qwen3_coder; got 'x'",
    ):
        ServerConfig.from_settings(tool_call_parser="x")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of deepseek_r1, qwen3; got 'x'"):
        ServerConfig.from_settings(reasoning_parser="x")


def test_config_imports_nothing_else_from_the_server() -> None:
    """Every module may read the config; it reads none of them (no import cycle through it, at any depth)."""
    imported = []
    for path in Path(server.config.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not [
        m for m in imported if m == "server" or m.startswith("server.") and not m.startswith("server.config.")
    ]


def test_quantization_flag_reaches_the_engine_and_is_checked_at_startup() -> None:
    assert config_from_args([]).engine_config().quantization is None  # off by default
    assert config_from_args(["--quantization", "int8"]).engine_config().quantization == "int8"
    assert ServerConfig.from_env({"SPINDLE_QUANTIZATION": "int8"}).model.quantization == "int8"
    with pytest.raises(ValueError, match="--quantization must be one of int8"):
        config_from_args(["--quantization", "int4"])


def test_make_demo_shape_writes_that_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import demo.checkpoints as random_checkpoint
    import demo.shapes as demo_shapes
    from server.cli import main

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(
        random_checkpoint, "write_shaped_checkpoint", lambda path, shape, **kw: calls.append((str(path), shape))
    )
    assert main(["make-demo", "--shape", "llama-3.2-1b", str(tmp_path / "l")]) == 0
    assert calls == [(str(tmp_path / "l"), demo_shapes.SHAPES["llama-3.2-1b"])]
    assert main(["make-demo", "--shape"]) == 2  # no path: the usage line


def test_pooling_flags() -> None:
    cfg = config_from_args(
        [
            "--runner",
            "pooling",
            "--convert",
            "classify",
            "--pooler-config",
            '{"pooling_type": "cls", "use_activation": false}',
            "--max-documents-per-request",
            "8",
        ]
    )
    engine = cfg.engine_config()
    assert (engine.convert, engine.pooler_config) == ("classify", {"pooling_type": "CLS", "use_activation": False})
    assert cfg.scheduling.request_caps().max_documents_per_request == 8
    for argv, why in (
        (["--convert", "embed"], "--runner pooling only"),
        (["--pooler-config", '{"normalize": true}'], "--runner pooling only"),
        (["--runner", "pooling", "--convert", "rerank"], "--convert must be one of"),
        (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}'], "pooling_type"),
        (["--runner", "pooling", "--max-documents-per-request", "0"], "at least 1"),
    ):
        with pytest.raises(ValueError, match=why):
            config_from_args(argv)


@pytest.mark.parametrize(("args", "size"), [([], 4 << 30), (["--kv-disk-cache-size", "0"], 0)])
def test_kv_blocks_go_to_disk_by_default(args: list[str], size: int) -> None:
    assert config_from_args(["--model", "demo", *args]).engine_config().kv_disk_cache_size == size
