"""The request side of structured output: a request's constraint -> engine.messages.StructuredOutputs, or a 400.

Where a constraint can come from (at most one per request; two are a 400 naming both fields):
  OpenAI: response_format {type: text | json_object | json_schema {name, schema, strict}} (chat and completions)
  vLLM:   structured_outputs {json | regex | choice | grammar | json_object}, and its older guided_json,
          guided_regex, guided_choice, guided_grammar; /inference/v1/generate: sampling_params.structured_outputs
Options the backend cannot honour are refused, never ignored: structural_tag. whitespace_pattern (and
guided_whitespace_pattern) is the whitespace a JSON constraint allows between tokens (none without it).
disable_additional_properties is applied to the schema here; disable_any_whitespace holds already (JSON is
compiled without free whitespace) and disable_fallback too (there is one backend).

Validation compiles the constraint with the engine's backend (engine/structured/grammar.py `validate`) in a
worker thread, a few at a time (a CapacityLimiter), so a slow schema never stalls the event loop; results are
kept in a small LRU keyed by a digest of (kind, spec), and a hit needs no thread. Each spec is capped at
--max-structured-output-size bytes (RequestCaps.max_structured_output_size) before anything compiles it.

Entry points:
  `structured_outputs(req, caps)` the whole check for a route: constraint or None, every problem a 400.
  `requested_constraint(req)`     sync, no compiling: what the request asks for and the field that asked.
  `check_constraint(so, param, caps)` size + compile check of a constraint built elsewhere (tool calling).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from anyio.lowlevel import RunVar

from engine.messages import StructuredOutputs
from engine.structured import grammar
from server.config import RequestCaps
from server.http.errors import bad_request
from server.protocol.openai import ChatCompletionRequest, CompletionRequest, StructuredOutputsParams

MAX_CONCURRENT_COMPILES = 2  # worker threads compiling at once (per event loop); the rest wait their turn
CACHE_SIZE = 512  # validation results kept (a digest and a short message each)

# The backend's check: None when it can enforce the constraint, else why not. A module attribute, so tests
# can put a stand-in here.
backend_validate: Callable[[StructuredOutputs], str | None] = grammar.validate

_results: OrderedDict[bytes, str | None] = OrderedDict()
_limiter: RunVar[anyio.CapacityLimiter] = RunVar("spindle_structured_limiter")


@dataclass(frozen=True, slots=True)
class Requested:
    """A request's constraint and the field that asked for it (the `param` of its 400s)."""

    constraint: StructuredOutputs
    param: str  # e.g. "response_format.json_schema.schema", "structured_outputs.regex", "guided_choice"
    pattern_param: str | None = None  # the field that gave constraint.whitespace_pattern


def requested_constraint(req: CompletionRequest | ChatCompletionRequest, *, prefix: str = "") -> Requested | None:
    """What the request asks for, without compiling anything; None when it asks for no constraint.

    400 (param named) for two constraints at once, json_schema without a schema, an empty choice list, and the
    options the backend cannot honour. `prefix` goes in front of every param (/generate: "sampling_params.").
    """
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", ""))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object: "
                              '{"name": ..., "schema": {...}}.', "response_format.json_schema")
        if rf.json_schema.schema is None:
            raise bad_request("response_format.json_schema needs a schema (a JSON Schema object).",
                              "response_format.json_schema.schema")
        found.append(("response_format.json_schema.schema", "json", rf.json_schema.schema))
    so = req.structured_outputs
    if so is not None:
        _refuse_options(so, prefix + "structured_outputs.")
        for name, kind in (("json", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            value = getattr(so, name)
            if value is not None:
                found.append((f"structured_outputs.{name}", kind, value))
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", ""))
    given = (("structured_outputs.whitespace_pattern", so.whitespace_pattern if so is not None else None),
             ("guided_whitespace_pattern", req.guided_whitespace_pattern))
    patterns = [(p, v) for p, v in given if v is not None]
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value))
    if not found:
        if patterns:
            raise bad_request(f"{prefix + patterns[0][0]} needs a JSON constraint (json_schema, json or "
                              f"json_object) to apply to.", prefix + patterns[0][0])
        return None
    if len(found) > 1:
        names = " and ".join(prefix + f[0] for f in found)
        raise bad_request(f"Only one structured-output constraint is allowed per request, got {names}; "
                          f"send one of them.", prefix + found[1][0])
    param, kind, value = found[0]
    param = prefix + param
    if kind == "choice" and not value:
        raise bad_request(f"{param} must be a non-empty list of strings.", param)
    strip_additional = so is not None and so.disable_additional_properties and kind == "json"
    constraint = StructuredOutputs(kind, _spec(kind, value, param, strip_additional))
    if not patterns:
        return Requested(constraint, param)
    pattern_param, pattern = prefix + patterns[0][0], str(patterns[0][1])
    if len(patterns) > 1 and patterns[1][1] != pattern:
        raise bad_request(f"{pattern_param} and {prefix + patterns[1][0]} differ; send one of them.", pattern_param)
    if kind not in ("json", "json_object"):
        raise bad_request(f"{pattern_param} applies to JSON constraints (json_schema, json, json_object), not to "
                          f"{param}.", pattern_param)
    return Requested(msgspec.structs.replace(constraint, whitespace_pattern=pattern), param, pattern_param)


def _refuse_options(so: StructuredOutputsParams, prefix: str) -> None:
    if so.structural_tag is not None:
        raise bad_request(f"{prefix}structural_tag is not supported; use json, regex, choice or grammar.",
                          prefix + "structural_tag")


def _spec(kind: str, value: Any, param: str, no_additional: bool) -> str:
    """The constraint's text as the engine takes it (engine.messages.StructuredOutputs.spec)."""
    if kind == "json_object":
        return ""
    if kind == "choice":
        return msgspec.json.encode(value).decode()
    if kind != "json":
        return str(value)
    if not no_additional:
        return value if isinstance(value, str) else msgspec.json.encode(value).decode()
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise bad_request(f"Invalid {param}: the JSON schema is not valid JSON: {e}", param) from None
    return msgspec.json.encode(no_additional_properties(schema)).decode()


def no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema with `properties` and no
    `additionalProperties` gets `"additionalProperties": false`. Iterative (decoded nesting can be deep)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def check_size(so: StructuredOutputs, param: str, caps: RequestCaps) -> None:
    """400 when the spec is over --max-structured-output-size (bytes, UTF-8)."""
    cap = caps.max_structured_output_size
    size = len(so.spec.encode()) + len((so.whitespace_pattern or "").encode())
    if size > cap:
        raise bad_request(f"{param} is {size} bytes, but this server allows at most {cap} bytes per constraint "
                          f"(--max-structured-output-size).", param)


async def check_constraint(so: StructuredOutputs, param: str, caps: RequestCaps) -> None:
    """400 naming `param` when `so` is over the size cap or the backend cannot enforce it (its message).

    Compiles in a worker thread (at most MAX_CONCURRENT_COMPILES at once); a cached result skips the thread.
    For constraints built outside this module too (tool calling: the tools' parameter schemas).
    """
    check_size(so, param, caps)
    error = await _validate(so)
    if error is not None:
        raise bad_request(f"Invalid {param}: {error}", param)


async def structured_outputs(req: CompletionRequest | ChatCompletionRequest, caps: RequestCaps, *,
                             prefix: str = "") -> StructuredOutputs | None:
    """The request's validated constraint for SamplingParams.structured_outputs, or None; every problem a 400.

    `reasoning_end` is left None (the reasoning parser sets it). Call after check_request, before rendering.
    """
    found = requested_constraint(req, prefix=prefix)
    if found is None:
        return None
    pattern = found.constraint.whitespace_pattern
    if pattern is not None and found.pattern_param is not None:  # its own 400 first: a bad regex names its field
        await check_constraint(StructuredOutputs("regex", pattern), found.pattern_param, caps)
    await check_constraint(found.constraint, found.param, caps)
    return found.constraint


def _key(so: StructuredOutputs) -> bytes:
    h = hashlib.blake2b(so.kind.encode(), digest_size=16)
    h.update(b"\0")
    h.update(so.spec.encode())
    if so.whitespace_pattern is not None:
        h.update(b"\0" + so.whitespace_pattern.encode())
    return h.digest()


async def _validate(so: StructuredOutputs) -> str | None:
    key = _key(so)
    if key in _results:
        _results.move_to_end(key)
        return _results[key]
    plain = StructuredOutputs(so.kind, so.spec, whitespace_pattern=so.whitespace_pattern)  # reasoning_end: no matter
    error = await anyio.to_thread.run_sync(_run_backend, plain, limiter=_compile_limiter())
    _results[key] = error
    while len(_results) > CACHE_SIZE:
        _results.popitem(last=False)
    return error


def _run_backend(so: StructuredOutputs) -> str | None:
    try:
        return backend_validate(so)
    except Exception as e:  # the backend's own failures are the constraint's problem, never a 500
        return str(e).strip() or type(e).__name__


def _compile_limiter() -> anyio.CapacityLimiter:
    try:
        return _limiter.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(MAX_CONCURRENT_COMPILES)
        _limiter.set(limiter)
        return limiter


def clear_cache() -> None:
    """Forget cached validation results (tests)."""
    _results.clear()
