"""`spindle [serve] [flags]`, `spindle render [flags]` and `spindle make-demo [--arch NAME] PATH`. Flags use
vLLM's names; SPINDLE_* env vars fill the rest.

This module only turns argv into a ServerConfig and hands it to the process's start-up (server/runtime/).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from typing import Any

from engine.lora.config import parse_lora_modules
from server.cli_help import MODEL_HELP, group_for, make_parser, metavar
from server.config import (
    JSON_FIELDS,
    JSON_LIST_FIELDS,
    SIZE_FIELDS,
    ServerConfig,
    check_model_exists,
    parse_json_list,
    parse_json_object,
    parse_size,
)
from server.fleet.catalog import scan
from server.runtime.headless import run_headless
from server.runtime.http_server import run_server
from server.runtime.launcher import run_api_servers

# flag -> (ServerConfig field, type, help). Booleans are switches.
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--host", "host", str, "address to listen on"),
    ("--port", "port", int, "port to listen on"),
    ("--model", "model", str, MODEL_HELP),
    (
        "--models-dir",
        "models_dir",
        str,
        "serve every model in this folder (HF folders, .gguf files) by name, each "
        "loaded on its first request; optional models.yaml there holds per-model settings",
    ),
    (
        "--max-loaded-models",
        "max_loaded_models",
        int,
        "with --models-dir: engines loaded at once (default 1; the least recently used idle one is unloaded)",
    ),
    (
        "--model-idle-timeout",
        "model_idle_timeout",
        float,
        "with --models-dir: unload a model after this many seconds without requests (default: never)",
    ),
    ("--served-model-name", "served_model_name", str, "the model name clients use (default: --model)"),
    ("--tokenizer", "tokenizer", str, "tokenizer folder (default: the model folder)"),
    ("--max-model-len", "max_model_len", int, "context length: prompt + output tokens"),
    ("--max-num-seqs", "max_num_seqs", int, "requests in one batch"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "tokens in one engine step"),
    ("--stream-interval", "stream_interval", int, "tokens between stream events"),
    ("--max-num-queued-reqs", "max_num_queued_reqs", int, "requests waiting for a first token before 503"),
    ("--max-num-queued-tokens", "max_num_queued_tokens", int, "prompt tokens waiting before 503"),
    ("--chat-template", "chat_template", str, "chat template file or text"),
    ("--renderer-num-workers", "renderer_num_workers", int, "template/tokenizer worker processes"),
    ("--seed", "seed", int, "engine seed"),
    (
        "--dtype",
        "dtype",
        str,
        "auto (default: the fastest path that passes its self-checks here, e.g. bf16 over a GGUF file's blocks on "
        "AVX512-BF16), float32, bfloat16 or float16",
    ),
    (
        "--generation-config",
        "generation_config",
        str,
        "sampling defaults for fields a request leaves out: auto (default: the model's; a GGUF file's "
        "general.sampling.*, else llama.cpp's), vllm (the API's plain ones) or a folder with generation_config.json",
    ),
    ("--quantization", "quantization", str, "int8: weight-only int8 weights, per output channel (CPU; off by default)"),
    ("--shutdown-timeout", "shutdown_timeout", float, "seconds to finish in-flight requests on shutdown"),
    ("--worker-class", "worker_class", str, "trio (default), asyncio or uvloop"),
    ("--block-size", "block_size", int, "KV-cache block size in tokens"),
    ("--kv-cache-memory", "kv_cache_memory", str, "KV-cache size, e.g. 2GiB"),
    ("--num-blocks", "num_blocks", int, "KV-cache blocks (overrides --kv-cache-memory)"),
    (
        "--kv-disk-cache-size",
        "kv_disk_cache_size",
        float,
        "GiB of KV blocks kept on disk past eviction and restarts (default 4, at most a tenth of free disk; 0: off)",
    ),
    (
        "--state-snapshot-interval",
        "state_snapshot_interval",
        int,
        "hybrid models (Qwen3.5, LFM2, Granite 4.0-H): snapshot each sequence's recurrent state every this many "
        "tokens (rounded up to whole blocks; default 64) so prefix-cache hits resume there; 0: no prefix hits on them",
    ),
    (
        "--state-snapshot-memory",
        "state_snapshot_memory",
        str,
        "hybrid models: bytes of those snapshots, e.g. 256MiB, taken out of --kv-cache-memory (default an eighth of "
        "it, at most half; least recently used evicted first)",
    ),
    ("--max-logprobs", "max_logprobs", int, "most top logprobs a request may ask for"),
    ("--chat-template-render-timeout", "chat_template_render_timeout", float, "seconds a template may render"),
    ("--sse-keepalive", "sse_keepalive", float, "seconds of stream silence before a keep-alive comment (0: off)"),
    ("--responses-store-size", "responses_store_size", int, "stored /v1/responses, all API processes (LRU; 0: none)"),
    (
        "--responses-store-max-bytes",
        "responses_store_max_bytes",
        str,
        "bytes the stored /v1/responses may hold, e.g. 256MiB (the default; LRU past it)",
    ),
    ("--batch-dir", "batch_dir", str, "folder of /v1/files uploads and /v1/batches state (default: spindle's cache)"),
    ("--batch-max-file-bytes", "batch_max_file_bytes", str, "largest /v1/files upload, e.g. 200MiB (the default)"),
    ("--batch-max-in-flight", "batch_max_in_flight", int, "batch lines in the engine at once (default 4)"),
    ("--log-level", "log_level", str, "debug, info, warning, error"),
    ("--device", "device", str, "auto, cpu or cuda"),
    (
        "--cpu-threads",
        "cpu_threads",
        int,
        "the engine's CPU threads per operation (default: the fewest of the CPUs in the affinity mask, the "
        "cgroup CPU quota rounded up and the physical cores)",
    ),
    ("--socket-send-buffer", "socket_send_buffer", int, "kernel send buffer per connection in bytes (0: OS default)"),
    ("--max-request-body", "max_request_body", str, "largest request body, e.g. 32MiB; bigger ones get 413"),
    (
        "--scheduling-policy",
        "scheduling_policy",
        str,
        "fcfs (default: a request's non-zero priority gets 400) or priority (lower runs first)",
    ),
    (
        "--runner",
        "runner",
        str,
        "generate (default) or pooling: embeddings, classify, score, rerank, /pooling, "
        "Cohere's /v2/embed and /v2/rerank",
    ),
    (
        "--convert",
        "convert",
        str,
        "with --runner pooling: embed, classify or auto (default: classify for a "
        "*ForSequenceClassification checkpoint, embed otherwise)",
    ),
    (
        "--pooler-config",
        "pooler_config",
        str,
        "with --runner pooling, JSON over the checkpoint's own (sentence-transformers files): "
        '{"pooling_type": "LAST" | '
        '"CLS" | "MEAN" | "ALL" | "STEP", "normalize": true, "use_activation": true, "step_tag_id": id, '
        '"returned_token_ids": [...], "is_matryoshka": false, "matryoshka_dimensions": [...]}',
    ),
    (
        "--speculative-config",
        "speculative_config",
        str,
        'speculative decoding, JSON with vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_max": n, "prompt_lookup_min": m}; each sequence drafts as many as pay (up to k)',
    ),
    ("--max-prompts-per-request", "max_prompts_per_request", int, "most prompts in one /v1/completions request"),
    (
        "--max-documents-per-request",
        "max_documents_per_request",
        int,
        "most documents in one /score or /rerank request (one engine batch; default 1000)",
    ),
    ("--max-choices-per-request", "max_choices_per_request", int, "most choices (n x prompts) in one request"),
    ("--max-stop-strings", "max_stop_strings", int, "most stop strings in one request"),
    ("--max-stop-string-length", "max_stop_string_length", int, "longest stop string, in characters"),
    ("--max-stop-token-ids", "max_stop_token_ids", int, "most stop_token_ids in one request"),
    ("--max-logit-bias", "max_logit_bias", int, "most logit_bias entries in one request"),
    ("--max-allowed-token-ids", "max_allowed_token_ids", int, "most allowed_token_ids in one request"),
    (
        "--max-structured-output-size",
        "max_structured_output_size",
        str,
        "largest structured-output spec (JSON schema, regex, choices, grammar) in one request, e.g. 256KiB",
    ),
    (
        "--tool-call-parser",
        "tool_call_parser",
        str,
        "hermes, mistral, llama3_json, pythonic or qwen3_coder: read tool calls out of the output (tool_choice "
        "required / named use its format)",
    ),
    (
        "--reasoning-parser",
        "reasoning_parser",
        str,
        "deepseek_r1 or qwen3: split <think>...</think> into message.reasoning / reasoning_content",
    ),
    ("--tensor-parallel-size", "tensor_parallel_size", int, "engine ranks sharing each layer (torch.distributed)"),
    ("--nnodes", "nnodes", int, "nodes the tensor-parallel ranks span"),
    ("--node-rank", "node_rank", int, "this node (0 serves the API; the others run --headless)"),
    ("--master-addr", "master_addr", str, "node 0's address, where the ranks meet"),
    ("--master-port", "master_port", int, "node 0's rendezvous port (0: a free one; one node only)"),
    (
        "--api-server-count",
        "api_server_count",
        int,
        "API-server processes accepting on one socket in front of the one engine core (admission and /metrics shared)",
    ),
    (
        "--data-parallel-size",
        "data_parallel_size",
        int,
        "engine cores, each with its own KV cache and --max-num-seqs; requests go by load and prompt prefix",
    ),
    (
        "--data-parallel-policy",
        "data_parallel_policy",
        str,
        "affinity (default: load and prompt prefix) or round_robin, how requests are spread over the engines",
    ),
    ("--metrics-compat", "metrics_compat", str, "vllm: /metrics also under vLLM's names (vllm:*), for routers"),
    ("--ssl-keyfile", "ssl_keyfile", str, "TLS private key file (PEM); with --ssl-certfile serves HTTPS and h2"),
    ("--ssl-certfile", "ssl_certfile", str, "TLS certificate chain file (PEM)"),
    ("--allowed-origins", "allowed_origins", str, "CORS: JSON list of browser origins, e.g. '[\"https://a.example\"]'"),
    ("--allowed-methods", "allowed_methods", str, 'CORS: JSON list of methods (default ["*"])'),
    ("--allowed-headers", "allowed_headers", str, 'CORS: JSON list of request headers (default ["*"])'),
    ("--root-path", "root_path", str, "the path prefix a proxy serves this server under, e.g. /llm"),
    (
        "--limit-mm-per-prompt",
        "limit_mm_per_prompt",
        str,
        "most images per request on a vision model, JSON: '{\"image\": 4}' (the default)",
    ),
    (
        "--allowed-media-domains",
        "allowed_media_domains",
        str,
        "hosts whose http(s) image URLs are fetched, JSON list (default none: data: URLs only)",
    ),
    (
        "--mm-processor-cache-gb",
        "mm_processor_cache_gb",
        float,
        "GiB of preprocessed images cached by content in the image worker (default 4; 0: off)",
    ),
    ("--max-loras", "max_loras", int, "with --enable-lora: distinct adapters in one batch (default 1)"),
    ("--max-lora-rank", "max_lora_rank", int, "with --enable-lora: the largest adapter rank (default 16)"),
    ("--max-cpu-loras", "max_cpu_loras", int, "with --enable-lora: adapters kept loaded (default --max-loras)"),
    ("--lora-dtype", "lora_dtype", str, "with --enable-lora: auto (the model's), float32, bfloat16 or float16"),
    (
        "--max-audio-filesize-mb",
        "max_audio_filesize_mb",
        float,
        "largest audio upload on /v1/audio/* in MB (default 25; more: 400)",
    ),
    (
        "--max-audio-duration-s",
        "max_audio_duration_s",
        float,
        "longest audio on /v1/audio/* in seconds (default 600; more: 400, checked while decoding)",
    ),
]


# Switches that set their ServerConfig field to True: flag -> (field, help).
_SWITCHES: list[tuple[str, str, str]] = [
    ("--metrics-public", "metrics_public", "with --api-key: leave /metrics open"),
    (
        "--log-requests",
        "log_requests",
        "put request bodies and output text in the access log (off by default: privacy)",
    ),
    ("--trust-request-chat-template", "trust_request_chat_template", "let requests bring their own chat_template"),
    ("--enable-auto-tool-choice", "enable_auto_tool_choice", 'allow tool_choice "auto" (needs --tool-call-parser)'),
    ("--headless", "headless", "a node other than 0: run its tensor-parallel ranks only, no API server"),
    ("--allow-credentials", "allow_credentials", "CORS: allow cookies and Authorization from browsers"),
    ("--disable-ui", "disable_ui", "serve no chat page at / and /ui"),
    (
        "--enable-lora",
        "enable_lora",
        "serve LoRA adapters: a request's model names one (--lora-modules, /v1/load_lora_adapter)",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser, groups = make_parser(
        "An OpenAI-compatible LLM server (also Anthropic's, Cohere's and vLLM's routes). With no flags it serves "
        "SmolLM2-135M-Instruct on http://127.0.0.1:8000."
    )
    _add_value_flags(groups)
    _add_switches(groups)
    _add_lora_and_cache_flags(groups)
    return parser


def _add_value_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """The flags of _FLAGS, then --api-key (repeatable)."""
    for flag, dest, typ, text in _FLAGS:
        group_for(groups, flag).add_argument(
            flag, dest=dest, type=typ, default=None, help=text, metavar=metavar(flag, typ)
        )
    group_for(groups, "--api-key").add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY",
        help="require this bearer key on every route but /health (repeatable; or SPINDLE_API_KEY)",
    )


def _add_switches(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """The switches of _SWITCHES; unset they stay None so env vars and defaults can fill them."""
    for flag, dest, text in _SWITCHES:
        group_for(groups, flag).add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=text)


def _add_lora_and_cache_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """--lora-modules, and the prefix cache's off switch (--enable-prefix-caching: accepted, hidden)."""
    group_for(groups, "--lora-modules").add_argument(
        "--lora-modules",
        dest="lora_modules",
        nargs="+",
        default=None,
        metavar="ADAPTER",
        help='adapters to serve: name=path items, or JSON {"name", "path", "base_model_name"}',
    )
    cache = group_for(groups, "--no-enable-prefix-caching")
    cache.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_const",
        const=False,
        default=None,
        help="turn the prefix cache off",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_const",
        const=True,
        help=argparse.SUPPRESS,
    )


def config_from_args(argv: Sequence[str], *, render_only: bool = False, default_model: bool = False) -> ServerConfig:
    """Flags over SPINDLE_* env vars over defaults. render_only: `spindle render` (server/config/ checks it).
    default_model: with no model named, serve DEFAULT_MODEL (fetched once if need be) rather than the demo."""
    args = build_parser().parse_args(list(argv))
    given = {k: v for k, v in vars(args).items() if v is not None}
    for name in SIZE_FIELDS:  # "2GiB", "512MiB", plain bytes: read as the SPINDLE_* variable is
        if name in given:
            given[name] = parse_size(name, given[name])
    for name in JSON_FIELDS:
        if name in given:
            given[name] = parse_json_object(name, given[name])
    for name in JSON_LIST_FIELDS:
        if name in given:
            given[name] = parse_json_list(name, given[name])
    if "lora_modules" in given:
        given["lora_modules"] = parse_lora_modules(given["lora_modules"])
    if "api_keys" in given:
        given["api_keys"] = tuple(given["api_keys"])
    if render_only:
        given["render_only"] = True
    return ServerConfig.from_env(default_model=default_model, **given)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-demo":
        return _make_demo(argv[1:])
    render_only = bool(argv) and argv[0] == "render"  # server/render_app.py: no engine, no torch
    if argv and argv[0] in ("serve", "render"):
        argv = argv[1:]
    try:
        config = config_from_args(argv, render_only=render_only, default_model=True)
        if config.model.model is not None:
            check_model_exists(config.model.model)
        if config.models.models_dir is not None:  # the folder and its models.yaml are checked before serving
            scan(config.models.models_dir)
        if not config.parallel.headless:
            check_port_free(config.http.host, config.http.port)
    except ValueError as e:
        print(f"spindle: {e}", file=sys.stderr)
        return 2
    return run(config)


def check_port_free(host: str, port: int) -> None:
    """The address is taken (another server?): say so before any model loads (ValueError), not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Hypercorn binds: a TIME_WAIT port is free
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass --host / --port") from e


def run(config: ServerConfig) -> int:
    """The process's role, from its config: engine ranks only, the --api-server-count launcher, or one server."""
    if config.parallel.headless:  # a node other than 0 (server/runtime/headless.py)
        return run_headless(config)
    if config.parallel.api_server_count > 1:  # N API processes, one engine core (server/runtime/launcher.py)
        return run_api_servers(config)
    return run_server(config)  # `spindle serve` or `spindle render` (server/runtime/http_server.py)


def _make_demo(args: list[str]) -> int:
    """`make-demo [--vision | --arch NAME | --shape NAME] PATH`: write the demo checkpoint (--vision: a random-weight
    Qwen2-VL one; --arch: another family at the demo's size; --shape: a real model's shape in bf16; see
    demo/checkpoints.py)."""
    from demo.checkpoints import make_demo_command  # why here: it imports torch

    return make_demo_command(args)
