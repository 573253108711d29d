"""Outputs and streaming: how often a stream speaks, the tool-call and reasoning parsers (vLLM's flags), stored
/v1/responses, /metrics names, and what the log says.

The parser names are constants this package owns (it imports nothing else from the server): the keys of
server/tools/parser_names.py TOOL_PARSERS and server/reasoning/parser.py REASONING_PARSERS, in their order, which
tests/server/test_config.py holds equal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from server.config.values import check_at_least_one

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
MetricsCompat = Literal["vllm"]
TOOL_CALL_PARSER_NAMES = ("hermes", "mistral", "llama3_json", "pythonic", "qwen3_coder")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class OutputConfig:
    stream_interval: int = 1  # tokens between stream events (the first token always leaves at once)
    sse_keepalive: float = 15.0  # seconds of silence before an SSE comment line; 0: off
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSER_NAMES: reads tool calls out of the model's text
    reasoning_parser: str | None = None  # "deepseek_r1" | "qwen3": splits <think>...</think> into `reasoning`
    responses_store_size: int = 4096  # stored /v1/responses, all API processes together (LRU); 0: store none
    responses_store_max_bytes: int = 256 << 20  # what they may hold together (LRU past it), each item once
    # "vllm": /metrics also under vLLM's names (server/metrics/vllm_names.py)
    metrics_compat: MetricsCompat | None = None
    log_level: LogLevel = "info"
    log_requests: bool = False  # prompt and output text in the access log (off: token counts only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", str(self.log_level).lower())  # WARNING and warning alike
        check_at_least_one(self, ("stream_interval",))
        if self.sse_keepalive < 0:
            raise ValueError(f"--sse-keepalive must be 0 (off) or positive, got {self.sse_keepalive}")
        if self.responses_store_size < 0:
            raise ValueError(
                f"--responses-store-size must be 0 (store none) or positive, got {self.responses_store_size}"
            )
        check_at_least_one(self, ("responses_store_max_bytes",))
        if self.log_level not in get_args(LogLevel):
            raise ValueError(f"--log-level must be one of {', '.join(get_args(LogLevel))}; got {self.log_level!r}")
        self._check_parsers()
        if self.metrics_compat not in (None, "vllm"):
            raise ValueError(f"--metrics-compat must be vllm, got {self.metrics_compat!r}")

    def _check_parsers(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}; got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_NAMES)}; got {self.reasoning_parser!r}"
            )
