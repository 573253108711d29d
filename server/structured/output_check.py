"""After a best-effort constraint: each finished answer validated against the whole schema the grammar only partly
enforced (response_format's, or a relaxed tool's parameters), and the result counted
(spindle_structured_output_checked_total, spindle_structured_output_invalid_total{reason}), so relaxations are
measurable.

`CheckedFormatter` wraps the route's formatter and keeps each choice's text as it goes out; after the response is
sent, `OutputCheck.finish` parses it as the formatter did (reasoning, tool calls) and validates it with jsonschema
in a worker thread. Only answers the grammar ended are checked (finish_reason "stop" with no stop string): a cut
answer is a prefix, not an answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, Protocol

import anyio.to_thread

from server.metrics.prometheus import STRUCTURED_INVALID_REASONS as INVALID_REASONS
from server.request.collector import Output
from server.request.formatter import Formatter
from server.request.openai_protocol import Usage
from server.structured.constraint import RELAXED_HEADER, Constraint, Relaxation
from server.structured.parsing import ChoiceParsers
from server.tools.parser import assemble

log = logging.getLogger("spindle.server")

_ALIASES = {"then": "if", "else": "if", "minContains": "contains", "maxContains": "contains", "$ref": "other"}
_UNDER = (
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
)  # relaxed as a whole


class CheckMetrics(Protocol):
    def structured_checked(self, reason: str | None) -> None: ...


def invalid_reason(value: Any, schema: Any) -> str | None:
    """None when `value` satisfies `schema` (formats checked where jsonschema can), else a label of
    INVALID_REASONS. Raises when the schema cannot be read (a remote $ref)."""
    import jsonschema  # why late: only relaxed answers are checked

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    if error is None:
        return None
    path = [str(p) for p in error.schema_path]
    keyword = next((p for p in path if p in _UNDER), str(error.validator))
    keyword = _ALIASES.get(keyword, keyword)
    return keyword if keyword in INVALID_REASONS else "other"


class OutputCheck:
    """One request's answers, kept as they are sent, checked once the response is done."""

    def __init__(
        self,
        metrics: CheckMetrics | None,
        parsers: ChoiceParsers | None,
        *,
        schema: Relaxation | None = None,
        tools: dict[str, Relaxation] | None = None,
    ) -> None:
        self.metrics = metrics
        self.parsers = parsers
        self.schema = schema  # response_format's (the answer's content)
        self.tools = tools or {}  # relaxed functions by name (their calls' arguments)
        self._texts: dict[int, list[str]] = {}
        self._ended: dict[int, bool] = {}  # choice -> ended by the grammar (checked), or cut (not checked)

    def take(self, outputs: list[Output]) -> None:
        for out in outputs:
            if out.text:
                self._texts.setdefault(out.index, []).append(out.text)
            if out.finish_reason is not None:
                self._ended[out.index] = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)

    async def finish(self) -> None:
        """Validate the finished answers (a worker thread) and count the results."""
        texts = ["".join(self._texts.get(i, ())) for i, ended in sorted(self._ended.items()) if ended]
        if not texts or self.metrics is None:
            return
        reasons = await anyio.to_thread.run_sync(lambda: [r for t in texts for r in self._check(t)])
        for reason in reasons:
            self.metrics.structured_checked(reason)

    def _check(self, text: str) -> Iterator[str | None]:
        content, calls = text, []
        if self.parsers is not None:
            d = self.parsers.new().feed(text, True)
            content, calls = d.content, assemble(d.calls)
        targets = [(content, self.schema.schema)] if self.schema is not None else []
        targets += [(c.arguments, self.tools[c.name].schema) for c in calls if c.name in self.tools]
        for answer, schema in targets:
            try:
                value = json.loads(answer)
            except ValueError:
                yield "not_json"
                continue
            try:
                yield invalid_reason(value, schema)
            except Exception as e:  # the schema reaches what the checker cannot (a remote $ref): not counted
                log.debug("structured output: the answer could not be checked: %s", e)


class CheckedFormatter:
    """A formatter that hands every output to an OutputCheck on its way out. Stateful (it keeps the texts), so
    no direct writes from the output handler (`direct_ok` False: each output is formatted exactly once)."""

    direct_ok = False

    def __init__(self, inner: Formatter, check: OutputCheck) -> None:
        self.inner = inner
        self.check = check

    def stream_start(self) -> bytes | None:
        return self.inner.stream_start()

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        self.check.take(batch)
        return self.inner.stream_chunk(batch, usage)

    def usage_chunk(self, usage: Usage) -> bytes:
        return self.inner.usage_chunk(usage)

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        self.check.take(outputs)
        return self.inner.final(outputs, usage)


def relaxed_check(
    metrics: CheckMetrics | None,
    constraint: Constraint | None,
    tools: dict[str, Relaxation],
    parsers: ChoiceParsers | None = None,
) -> OutputCheck | None:
    """The request's OutputCheck, or None when its constraint is enforced whole (nothing to check afterwards)."""
    relaxed = constraint.relaxed if constraint is not None else None
    if relaxed is None and not tools:
        return None
    return OutputCheck(metrics, parsers, schema=relaxed, tools=tools)


def relaxed_headers(constraint: Constraint | None, tools: dict[str, Relaxation]) -> list[tuple[bytes, bytes]]:
    """X-Structured-Output-Relaxed: what the grammar did not enforce ("oneOf, uniqueItems"; a tool's as
    "name(keyword, ...)"); no header when it enforces everything."""
    parts = list(constraint.relaxed.keywords) if constraint is not None and constraint.relaxed is not None else []
    parts += [f"{name}({', '.join(r.keywords)})" for name, r in tools.items()]
    if not parts:
        return []
    if tools:
        log.debug("structured output: tool parameters relaxed, not enforced: %s", "; ".join(parts))
    return [(RELAXED_HEADER, ", ".join(parts).encode("ascii", "replace"))]
