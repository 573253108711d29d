"""Server configuration: one frozen dataclass, validated on construction, readable from SPINDLE_* env vars.

Every check of a setting lives here, and this module imports nothing else from the server (it is the root the
rest reads): the names of the tool-call and reasoning parsers are constants it owns, which
tests/server/test_config.py holds equal to the registries' keys.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

from engine.config import EngineConfig, parse_bytes
from engine.lora.config import LoRAModule, check_lora_serving, parse_lora_modules
from engine.pooling_config import CONVERTS, check_pooler_overrides

WorkerClass = Literal["trio", "asyncio", "uvloop"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
SchedulingPolicy = Literal["fcfs", "priority"]
Runner = Literal["generate", "pooling"]
DataParallelPolicy = Literal["affinity", "round_robin"]
MetricsCompat = Literal["vllm"]
ENV_PREFIX = "SPINDLE_"
# --tool-call-parser and --reasoning-parser names: the keys of server/tools/registry.py TOOL_PARSERS and
# server/reasoning/parser.py REASONING_PARSERS, in their order
TOOL_CALL_PARSER_NAMES = ("hermes", "mistral")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")
# What `spindle render` (and SPINDLE_RENDER_ONLY=1) says without a model: it never builds the demo (torch)
RENDER_NEEDS_MODEL = "spindle render needs --model (a local checkpoint folder with the tokenizer)"


@dataclass(frozen=True, slots=True)
class RequestCaps:
    """Bounds on the work one request may cause (ServerConfig's fields of the same names; each has a flag)."""

    max_prompts_per_request: int = 2048
    max_choices_per_request: int = 4096  # n x prompts: engine requests
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 262144
    max_structured_output_size: int = 256 << 10  # bytes of a constraint's spec (server/pipeline/structured.py)
    max_documents_per_request: int = 1000  # /score and /rerank documents (one engine batch)
    priority_scheduling: bool = False  # --scheduling-policy priority: else a non-zero priority is refused


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # None: the built-in demo checkpoint
    served_model_name: str | None = None  # None: the --model value
    tokenizer: str | None = None  # None: the model folder
    max_model_len: int | None = None  # None: the checkpoint's limit
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    stream_interval: int = 1  # tokens between stream events (the first token always leaves at once)
    max_num_queued_reqs: int | None = None  # requests waiting for their first token; beyond: 503
    max_num_queued_tokens: int | None = None  # prompt tokens waiting for their first token; beyond: 503
    chat_template: str | None = None  # a file path or the template text
    trust_request_chat_template: bool = False
    api_keys: tuple[str, ...] = ()  # also SPINDLE_API_KEY (one key, or several separated by commas)
    metrics_public: bool = False  # with api_keys: /metrics stays open for scrapers
    renderer_num_workers: int = 1
    seed: int = 0
    dtype: str = "auto"
    quantization: str | None = None  # "int8": weight-only int8 on CPU (engine/layers/linear.py); off by default
    shutdown_timeout: float = 10.0  # seconds for in-flight requests and the engine to stop
    worker_class: WorkerClass = "trio"
    kv_cache_memory: int = 1 << 30
    num_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    chat_template_render_timeout: float = 5.0
    sse_keepalive: float = 15.0  # seconds of silence before an SSE comment line; 0: off
    responses_store_size: int = 4096  # stored /v1/responses, all API processes together (LRU); 0: store none
    log_level: LogLevel = "info"
    log_requests: bool = False  # prompt and output text in the access log (off: token counts only)
    device: str = "auto"
    engine_ready_timeout: float = 600.0
    engine_heartbeat_timeout: float = 10.0  # seconds without any frame: the engine is stopped or gone
    structured_outputs_warmup: bool = True  # the engine builds its grammar backend before it says Ready
    engine_step_timeout: float = 600.0  # seconds one step may run before the engine counts as hung; 0: off
    max_request_body: int = 32 << 20  # bytes
    # Per-connection kernel send buffer (bytes; 0: the OS default, which grows to MBs). Small, so a slow
    # SSE reader makes sends block within ~100 events and its outputs merge instead of piling up in buffers.
    socket_send_buffer: int = 16 << 10
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    runner: Runner = "generate"  # "pooling": embeddings, classify, score, rerank, /pooling (generation routes 400)
    convert: str = "auto"  # runner "pooling": embed | classify | auto (engine/pooling_config.py CONVERTS)
    pooler_config: dict[str, Any] = field(default_factory=dict)  # JSON: engine/pooling_config.py POOLER_KEYS
    scheduling_policy: SchedulingPolicy = "fcfs"  # as vLLM: "priority" honours requests' priority, else it is refused
    # Bounds on the work one request may cause (a 400 naming the flag); far above what normal clients send.
    max_prompts_per_request: int = 2048  # /v1/completions prompt lists; embeddings, classify and /pooling inputs
    max_documents_per_request: int = 1000  # /score and /rerank documents (Cohere's recommended most)
    max_choices_per_request: int = 4096  # n x prompts
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 262144  # above any vocabulary: refuses only padded (repeated) lists
    # Tool calling and reasoning (vLLM's flags): TOOL_CALL_PARSER_NAMES and REASONING_PARSER_NAMES.
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # "hermes" | "mistral": reads tool calls out of the model's text
    reasoning_parser: str | None = None  # "deepseek_r1" | "qwen3": splits <think>...</think> into `reasoning`
    # bytes of one constraint's spec (schema, regex, choices, grammar): 256 KiB takes the large real-world schemas
    # (SchemaStore's, Kubernetes objects with their definitions: up to ~200 KB); what a spec costs to compile is
    # bounded by the grammar backend's own limits (engine/structured/grammar.py LIMITS), not by its bytes
    max_structured_output_size: int = 256 << 10
    # Tensor parallelism (engine/distributed/): torchrun's names; nodes other than 0 run --headless.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node only)
    headless: bool = False  # this node only runs engine ranks, no API server (node_rank > 0)
    distributed_timeout: float = 120.0  # seconds to join the group, and the longest one collective may wait
    # Data parallel (server/pipeline/engine_pool.py): engine cores, each with its own KV cache and max_num_seqs
    data_parallel_size: int = 1
    api_server_count: int = 1  # API processes sharing one listening socket and one engine (server/runtime/launcher.py)
    data_parallel_policy: DataParallelPolicy = "affinity"  # "round_robin": no load or prefix look (benchmarks)
    # `spindle render` (server/render_app.py): tokenizer, templates and render routes only; no engine, no torch
    render_only: bool = False
    disable_ui: bool = False  # no chat page at / and /ui (server/api/ui.py); `spindle render` never has one
    metrics_compat: MetricsCompat | None = None  # "vllm": /metrics also under vLLM's names (server/metrics/vllm_names.py)
    # Deployment (server/http/deploy.py): TLS through Hypercorn, CORS (vLLM's flags, JSON lists), a proxy's path prefix
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers (vLLM's default is ["*"])
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # the prefix a path-prefix proxy serves this server under, e.g. /llm
    # images (a Qwen2-VL checkpoint): most per request by modality, vLLM's JSON ('{"image": 4}'); and the hosts
    # whose http(s) image URLs the server fetches (none by default: data: URLs only)
    limit_mm_per_prompt: dict[str, Any] = dataclasses.field(default_factory=lambda: {"image": 4})
    allowed_media_domains: tuple[str, ...] = ()
    # GiB of preprocessed images the image worker keeps by content (vLLM's --mm-processor-cache-gb); 0: off
    mm_processor_cache_gb: float = 4.0
    # LoRA adapters per request (vLLM's flags; engine/lora/): --lora-modules load at start-up; more at run time
    # only with SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1 (/v1/load_lora_adapter, /v1/unload_lora_adapter)
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1  # distinct adapters in one engine step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in the engine (None: max_loras)
    lora_dtype: str = "auto"  # auto: the model's dtype
    allow_runtime_lora_updating: bool = False
    # a speech model's audio routes: the largest upload (MB, as vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB) and the
    # longest audio (seconds), each a 400 beyond it
    max_audio_filesize_mb: float = 25.0
    max_audio_duration_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", str(self.log_level).lower())  # WARNING and warning alike
        if not self.mm_processor_cache_gb >= 0:
            raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {self.mm_processor_cache_gb}")
        if not self.max_audio_filesize_mb > 0:
            raise ValueError(f"--max-audio-filesize-mb must be > 0, got {self.max_audio_filesize_mb}")
        if not self.max_audio_duration_s > 0:
            raise ValueError(f"--max-audio-duration-s must be > 0, got {self.max_audio_duration_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        positive = ("max_num_seqs", "max_num_batched_tokens", "stream_interval", "renderer_num_workers",
                    "block_size", "kv_cache_memory", "max_request_body", *_CAP_FIELDS)
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.socket_send_buffer < 0:
            raise ValueError(f"--socket-send-buffer must be 0 (OS default) or positive, got {self.socket_send_buffer}")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens", "num_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{_flag(name)} must be at least 1 (or unset for no limit), got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be at least 0, got {self.max_logprobs}")
        for name in ("shutdown_timeout", "chat_template_render_timeout", "engine_ready_timeout",
                     "engine_heartbeat_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.engine_step_timeout < 0:
            raise ValueError(f"SPINDLE_ENGINE_STEP_TIMEOUT must be 0 (off) or positive, got {self.engine_step_timeout}")
        if self.sse_keepalive < 0:
            raise ValueError(f"--sse-keepalive must be 0 (off) or positive, got {self.sse_keepalive}")
        if self.responses_store_size < 0:
            raise ValueError(f"--responses-store-size must be 0 (store none) or positive, "
                             f"got {self.responses_store_size}")
        if self.worker_class not in get_args(WorkerClass):
            raise ValueError(f"--worker-class must be one of trio, asyncio, uvloop; got {self.worker_class!r}")
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(f"--scheduling-policy must be fcfs or priority; got {self.scheduling_policy!r}")
        if self.runner not in get_args(Runner):
            raise ValueError(f"--runner must be generate or pooling; got {self.runner!r}")
        _check_pooler_config(self.pooler_config, self.convert, self.runner)
        if self.log_level not in get_args(LogLevel):
            raise ValueError(f"--log-level must be one of {', '.join(get_args(LogLevel))}; got {self.log_level!r}")
        _check_parsers(self)
        _check_data_parallel(self)
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {self.api_server_count}")
        if self.api_server_count > 1 and (self.render_only or self.headless):
            raise ValueError("--api-server-count above 1 needs a full server (not spindle render or --headless)")
        if self.headless != (self.node_rank > 0):
            raise ValueError("--headless is for nodes other than 0 (--node-rank 1 and up), and those run only "
                             f"headless; got --node-rank {self.node_rank}{' --headless' if self.headless else ''}")
        if any(not k for k in self.api_keys):
            raise ValueError("--api-key must not be empty")
        _check_deploy(self)
        check_lora_serving(self.enable_lora, self.lora_modules, self.model_name, self.allow_runtime_lora_updating)
        self._engine_config(self.model or "<demo>")  # the engine's own checks (dtype, sizes) fail here, at startup
        _check_render_only(self)

    @property
    def model_path(self) -> str:
        if self.model is not None:
            return self.model
        from demo.checkpoints import demo_checkpoint_path  # why here: it imports torch

        return str(demo_checkpoint_path())

    @property
    def model_name(self) -> str:
        """The name responses show and requests may ask for."""
        return self.served_model_name or self.model or "spindle-demo"

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model_path

    def engine_config(self) -> EngineConfig:
        return self._engine_config(self.model_path)

    def _engine_config(self, model: str) -> EngineConfig:
        return EngineConfig(
            model=model, dtype=self.dtype, quantization=self.quantization, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory, num_blocks=self.num_blocks,
            enable_prefix_caching=self.enable_prefix_caching, seed=self.seed, device=self.device,
            scheduling_policy=self.scheduling_policy, runner=self.runner, convert=self.convert,
            pooler_config={k: str(v).upper() if k == "pooling_type" else v for k, v in self.pooler_config.items()},
            tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes, node_rank=self.node_rank,
            master_addr=self.master_addr, master_port=self.master_port, distributed_timeout=self.distributed_timeout,
            structured_outputs_warmup=self.structured_outputs_warmup, enable_lora=self.enable_lora,
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras,
            lora_dtype=self.lora_dtype,
        )

    def request_caps(self) -> RequestCaps:
        """The per-request bounds check_request enforces (ModelLimits.caps)."""
        return RequestCaps(**{name: getattr(self, name) for name in _CAP_FIELDS},
                           priority_scheduling=self.scheduling_policy == "priority")

    def resolved(self) -> ServerConfig:
        """The same config with the demo checkpoint path filled in (done at startup, not at validation)."""
        return dataclasses.replace(self, model=self.model_path,
                                   served_model_name=self.served_model_name or
                                   (self.model if self.model is not None else "spindle-demo"))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Read SPINDLE_<FIELD> (upper case) for every field; `overrides` win. Unknown SPINDLE_ vars are logged."""
        env = dict(os.environ if environ is None else environ)
        hints = get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name in _NOT_CONFIG:
                continue
            if name not in names:  # other tools share the prefix: say so, but do not refuse to start
                logging.getLogger("spindle.server").warning("ignoring %s: not a server setting", key)
                continue
            values[name] = _parse(name, hints[name], raw, key)
        if "api_keys" not in values and env.get(ENV_PREFIX + "API_KEY", "").strip():  # vLLM's VLLM_API_KEY twin
            values["api_keys"] = _parse("api_keys", tuple, env[ENV_PREFIX + "API_KEY"], ENV_PREFIX + "API_KEY")
        values.update(overrides)
        return cls(**values)


# The fields that become RequestCaps: each at least 1.
_CAP_FIELDS = ("max_prompts_per_request", "max_choices_per_request", "max_stop_strings", "max_stop_string_length",
               "max_stop_token_ids", "max_logit_bias", "max_allowed_token_ids", "max_structured_output_size",
               "max_documents_per_request")
# SPINDLE_* variables that other parts of the project read (not ServerConfig fields).
_NOT_CONFIG = frozenset({"api_key", "output_chunk", "cache_dir", "fuzz_examples", "direct_write",
                         "engine_command",  # engine_command: engine/client/process_client.py, benchmarks and tests only
                         "cpu_kernels",  # read by the engine (engine/cpu_kernels/build.py)
                         "chromium", "update_screenshot"})  # tests/e2e/browser.py, tests/e2e/test_ui.py
# Byte sizes: written "2GiB", "512MiB", "1.5G" or plain bytes, as env vars and as flags.
SIZE_FIELDS = ("kv_cache_memory", "max_request_body", "max_structured_output_size")
# JSON objects: written as JSON text, as env vars and as flags.
JSON_FIELDS = ("default_chat_template_kwargs", "pooler_config", "limit_mm_per_prompt")
# Lists of strings: written as a JSON list ('["https://a.example"]', vLLM's format), as env vars and as flags.
JSON_LIST_FIELDS = ("allowed_origins", "allowed_methods", "allowed_headers", "allowed_media_domains")


def parse_json_object(name: str, text: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON-object setting's value; the error names the flag."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{_flag(name)}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{_flag(name)}: expected a JSON object, e.g. '{{\"pooling_type\": \"MEAN\"}}'")
    return value


def parse_json_list(name: str, text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A JSON-list-of-strings setting's value (vLLM's format: '["*"]'); the error names the flag."""
    if isinstance(text, (list, tuple)):
        value: Any = list(text)
    else:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{_flag(name)}: not JSON: {e}; expected a list, e.g. '[\"https://app.example\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{_flag(name)}: expected a JSON list of strings, e.g. '[\"https://app.example\"]'")
    return tuple(value)


def _check_pooler_config(cfg: dict[str, Any], convert: str, runner: str) -> None:
    if convert not in CONVERTS:
        raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}; got {convert!r}")
    if runner != "pooling" and (cfg or convert != "auto"):
        raise ValueError(f"--{'pooler-config' if cfg else 'convert'} applies to --runner pooling only")
    check_pooler_overrides(cfg)


def _check_data_parallel(config: ServerConfig) -> None:
    if config.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {config.data_parallel_size}")
    if config.data_parallel_policy not in get_args(DataParallelPolicy):
        raise ValueError(f"--data-parallel-policy must be affinity or round_robin; got {config.data_parallel_policy!r}")
    if config.data_parallel_size > 1 and (config.nnodes > 1 or config.master_port):
        raise ValueError("--data-parallel-size above 1 runs its engines on this node only, each picking a free "
                         "rendezvous port: leave --nnodes and --master-port unset")


def _check_parsers(config: ServerConfig) -> None:
    if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}; "
                         f"got {config.tool_call_parser!r}")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSER_NAMES:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_NAMES)}; "
                         f"got {config.reasoning_parser!r}")


def _check_deploy(config: ServerConfig) -> None:
    """TLS files, the root path and --metrics-compat (server/http/deploy.py applies them)."""
    if (config.ssl_keyfile is None) != (config.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both, or neither")
    for name in ("ssl_keyfile", "ssl_certfile"):
        value = getattr(config, name)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: no such file")
    root = config.root_path
    if root and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one (e.g. /llm), got {root!r}")
    if config.metrics_compat not in (None, "vllm"):
        raise ValueError(f"--metrics-compat must be vllm, got {config.metrics_compat!r}")


def _check_render_only(config: ServerConfig) -> None:
    """`spindle render` and SPINDLE_RENDER_ONLY=1 alike: a model folder (the demo build needs torch), no ranks."""
    if not config.render_only:
        return
    if config.model is None:
        raise ValueError(RENDER_NEEDS_MODEL)
    if config.headless:
        raise ValueError("spindle render runs no engine ranks: --headless does not apply")


def parse_size(name: str, text: str | int) -> int:
    """A size setting's value in bytes; the error names the flag."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"{_flag(name)}: {e}") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse(name: str, hint: Any, raw: str, key: str) -> Any:
    text = raw.strip()
    try:
        if name in SIZE_FIELDS:
            return parse_bytes(text)
        if name == "api_keys":
            return tuple(k.strip() for k in text.split(",") if k.strip())
        if name in JSON_FIELDS:
            return parse_json_object(name, text)
        if name in JSON_LIST_FIELDS:
            return parse_json_list(name, text)
        if name == "lora_modules":
            return parse_lora_modules(text)
        args = set(get_args(hint))
        optional = type(None) in args
        if optional and text.lower() in ("", "none", "null"):
            return None
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        if base is bool or hint is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if base is int or hint is int:
            return int(text)
        if base is float or hint is float:
            return float(text)
        return text
    except ValueError as e:
        raise ValueError(f"{key}={raw!r}: {e}") from None
