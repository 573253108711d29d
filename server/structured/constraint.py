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

Strict or best effort, as OpenAI defines it: a JSON schema with `json_schema.strict: true` is enforced whole or
refused (a 400 naming what the backend cannot enforce). Without it (OpenAI's default; vLLM's structured_outputs.json
and guided_json; tool parameters, server/structured/tool_schemas.py) the schema goes through
engine/structured/relaxed_schema.py: what the grammar can enforce is enforced, the rest (oneOf as anyOf, unknown
formats,
uniqueItems, not, if/then/else, ...) is relaxed; the Constraint names it (the route's response header, a debug
log line) and keeps the full schema, so the output is validated against it afterwards
(server/structured/output_check.py).

Entry points:
  `structured_outputs(req, caps)` the whole check for a route: Constraint or None, every problem a 400.
  `requested_constraint(req)`     sync, no compiling: what the request asks for and the field that asked.
  `check_constraint(so, param, caps)` size + compile check of a constraint built elsewhere (tool calling).
  `relax_schema(schema, param, caps)` best effort for one schema built into another constraint (tool parameters).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from anyio.lowlevel import RunVar

from engine.messages import StructuredOutputs
from engine.structured import grammar, relaxed_schema
from engine.structured.one_of import first_one_of
from server.config import RequestCaps
from server.http.errors import bad_request
from server.request.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputsParams,
)
from server.structured.answer_budget import check_answer_fits

MAX_CONCURRENT_COMPILES = 2  # worker threads compiling at once (per event loop); the rest wait their turn
CACHE_SIZE = 512  # validation results kept (a digest and a short message, or a relaxed spec, each)
RELAXED_HEADER = b"x-structured-output-relaxed"  # what a best-effort constraint did not enforce, comma-separated
log = logging.getLogger("spindle.server")

# The backend's checks, module attributes so tests can put stand-ins here. `backend_validate`: None when it can
# enforce the constraint, else why not. `backend_relax`: a JSON schema as the backend can enforce it, and what
# that leaves out (raises GrammarError when not even that works).
backend_validate: Callable[[StructuredOutputs], str | None] = grammar.validate
backend_relax: Callable[[dict[str, Any], Any], relaxed_schema.Relaxed] = relaxed_schema.relax


@dataclass(frozen=True, slots=True)
class Relaxation:
    """What a best-effort constraint left out, and the whole schema its output is validated against."""

    keywords: tuple[str, ...]
    schema: Any

    def header(self) -> tuple[bytes, bytes]:
        return RELAXED_HEADER, ", ".join(self.keywords).encode("ascii", "replace")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's validated constraint: `so` goes to the engine; `relaxed` is set when it enforces less than asked."""

    so: StructuredOutputs
    relaxed: Relaxation | None = None


_Result = tuple[str | None, str, tuple[str, ...]]  # (error, spec the engine gets, relaxed keywords)
_results: OrderedDict[bytes, _Result] = OrderedDict()
_limiter: RunVar[anyio.CapacityLimiter] = RunVar("spindle_structured_limiter")


@dataclass(frozen=True, slots=True)
class Requested:
    """A request's constraint and the field that asked for it (the `param` of its 400s)."""

    constraint: StructuredOutputs
    param: str  # e.g. "response_format.json_schema.schema", "structured_outputs.regex", "guided_choice"
    pattern_param: str | None = None  # the field that gave constraint.whitespace_pattern
    strict: bool = True  # False: a JSON schema enforced as far as the backend can (best effort)


def requested_constraint(req: CompletionRequest | ChatCompletionRequest, *, prefix: str = "") -> Requested | None:
    """What the request asks for, without compiling anything; None when it asks for no constraint.

    400 (param named) for two constraints at once, json_schema without a schema, an empty choice list, and the
    options the backend cannot honour. `prefix` goes in front of every param (/generate: "sampling_params.").
    """
    rf = req.response_format
    strict = rf is not None and rf.json_schema is not None and rf.json_schema.strict is True
    so = req.structured_outputs
    found = _asked(req, prefix)
    patterns = _whitespace_patterns(req)
    if not found:
        if patterns:
            raise bad_request(
                f"{prefix + patterns[0][0]} needs a JSON constraint (json_schema, json or json_object) to apply to.",
                prefix + patterns[0][0],
            )
        return None
    if len(found) > 1:
        names = " and ".join(prefix + f[0] for f in found)
        raise bad_request(
            f"Only one structured-output constraint is allowed per request, got {names}; send one of them.",
            prefix + found[1][0],
        )
    param, kind, value = found[0]
    param = prefix + param
    if kind == "choice" and not value:
        raise bad_request(f"{param} must be a non-empty list of strings.", param)
    strip_additional = so is not None and so.disable_additional_properties and kind == "json"
    constraint = StructuredOutputs(kind, _spec(kind, value, param, strip_additional))
    strict = strict or kind != "json"
    if not patterns:
        return Requested(constraint, param, strict=strict)
    return _with_pattern(Requested(constraint, param, strict=strict), patterns, prefix)


def _asked(req: CompletionRequest | ChatCompletionRequest, prefix: str) -> list[tuple[str, str, Any]]:
    """Every constraint the request names, as (param, kind, value): response_format, structured_outputs (its
    unsupported options refused), then the guided_* fields."""
    found = _response_format(req.response_format)
    so = req.structured_outputs
    if so is not None:
        _refuse_options(so, prefix + "structured_outputs.")
        for name, kind in (("json", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            value = getattr(so, name)
            if value is not None:
                found.append((f"structured_outputs.{name}", kind, value))
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", ""))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value))
    return found


def _whitespace_patterns(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str]]:
    """The whitespace patterns given, as (param, pattern)."""
    so = req.structured_outputs
    given = (
        ("structured_outputs.whitespace_pattern", so.whitespace_pattern if so is not None else None),
        ("guided_whitespace_pattern", req.guided_whitespace_pattern),
    )
    return [(p, v) for p, v in given if v is not None]


def _with_pattern(requested: Requested, patterns: list[tuple[str, str]], prefix: str) -> Requested:
    """`requested` with the whitespace pattern; 400 when two patterns differ or the constraint is not JSON."""
    param, kind = requested.param, requested.constraint.kind
    pattern_param, pattern = prefix + patterns[0][0], str(patterns[0][1])
    if len(patterns) > 1 and patterns[1][1] != pattern:
        raise bad_request(f"{pattern_param} and {prefix + patterns[1][0]} differ; send one of them.", pattern_param)
    if kind not in ("json", "json_object"):
        raise bad_request(
            f"{pattern_param} applies to JSON constraints (json_schema, json, json_object), not to {param}.",
            pattern_param,
        )
    constraint = msgspec.structs.replace(requested.constraint, whitespace_pattern=pattern)
    return Requested(constraint, param, pattern_param, requested.strict)


def _response_format(rf: ResponseFormat | None) -> list[tuple[str, str, Any]]:
    if rf is not None and rf.type == "json_object":
        return [("response_format", "json_object", "")]
    if rf is None or rf.type != "json_schema":
        return []
    if rf.json_schema is None:
        raise bad_request(
            'response_format of type json_schema needs a json_schema object: {"name": ..., "schema": {...}}.',
            "response_format.json_schema",
        )
    if rf.json_schema.schema is None:
        raise bad_request(
            "response_format.json_schema needs a schema (a JSON Schema object).", "response_format.json_schema.schema"
        )
    return [("response_format.json_schema.schema", "json", rf.json_schema.schema)]


def _refuse_options(so: StructuredOutputsParams, prefix: str) -> None:
    if so.structural_tag is not None:
        raise bad_request(
            f"{prefix}structural_tag is not supported; use json, regex, choice or grammar.", prefix + "structural_tag"
        )


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
        raise bad_request(
            f"{param} is {size} bytes, but this server allows at most {cap} bytes per constraint "
            f"(--max-structured-output-size).",
            param,
        )


async def check_constraint(so: StructuredOutputs, param: str, caps: RequestCaps) -> None:
    """400 naming `param` when `so` is over the size cap or the backend cannot enforce it (its message).

    Compiles in a worker thread (at most MAX_CONCURRENT_COMPILES at once); a cached result skips the thread.
    For constraints built outside this module too (tool calling: the tools' parameter schemas).
    """
    check_size(so, param, caps)
    error = await _validate(so)
    if error is not None:
        raise bad_request(f"Invalid {param}: {error}", param)


async def structured_outputs(
    req: CompletionRequest | ChatCompletionRequest, caps: RequestCaps, *, prefix: str = "", tokenizer: Any = None
) -> Constraint | None:
    """The request's validated constraint for SamplingParams.structured_outputs, or None; every problem a 400.

    `reasoning_end` is left None (the reasoning parser sets it). Call after check_request, before rendering. With
    the model's tokenizer, a JSON schema no answer of which fits max_tokens is a 400 too (answer_budget.py).
    """
    found = requested_constraint(req, prefix=prefix)
    if found is None:
        return None
    pattern = found.constraint.whitespace_pattern
    if pattern is not None and found.pattern_param is not None:  # its own 400 first: a bad regex names its field
        await check_constraint(StructuredOutputs("regex", pattern), found.pattern_param, caps)
    if found.strict:
        await check_constraint(found.constraint, found.param, caps)
        constraint = Constraint(found.constraint)
    else:
        constraint = await relax_constraint(found.constraint, found.param, caps)
    completion = getattr(req, "max_completion_tokens", None)
    await check_answer_fits(
        constraint.so,
        req.max_tokens if completion is None else completion,
        prefix + ("max_tokens" if completion is None else "max_completion_tokens"),
        found.param,
        tokenizer,
    )
    return constraint


async def relax_constraint(so: StructuredOutputs, param: str, caps: RequestCaps) -> Constraint:
    """Best effort for a JSON-schema constraint: what the backend can enforce of it, and what it leaves out."""
    check_size(so, param, caps)
    error, spec, keywords = await _cached(so, b"relax", lambda: _run_relax(so, exclusive=True))
    if error is not None:
        raise bad_request(f"Invalid {param}: {error}", param)
    engine = msgspec.structs.replace(so, spec=spec) if spec != so.spec else so
    if not keywords:
        return Constraint(engine)
    log.debug("structured output: %s relaxed, not enforced: %s", param, ", ".join(keywords))
    return Constraint(engine, Relaxation(keywords, json.loads(so.spec)))


async def relax_schema(
    schema: dict[str, Any], param: str, caps: RequestCaps, style: Any = None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Best effort for a schema another constraint embeds (a tool's parameters): the schema to embed (x-guidance
    asks for llguidance's lenient mode when something was relaxed) and what was relaxed; a 400 naming `param`."""
    so = StructuredOutputs("json", json.dumps(schema))
    check_size(so, param, caps)
    mode = b"embed" + json.dumps(style, sort_keys=True).encode()
    error, spec, keywords = await _cached(so, mode, lambda: _run_relax(so, style))
    if error is not None:
        raise bad_request(f"Invalid {param}: {error}", param)
    return (json.loads(spec) if spec != so.spec else schema), keywords


def _run_relax(so: StructuredOutputs, style: Any = None, *, exclusive: bool = False) -> _Result:
    """exclusive: a oneOf the grammar would read as anyOf is refused (an answer could meet two of its branches)."""
    try:
        schema = json.loads(so.spec)
    except ValueError as e:
        return f"the JSON schema is not valid JSON: {e}", so.spec, ()
    if isinstance(schema, bool):
        return (None, so.spec, ()) if schema else ("the schema false allows nothing", so.spec, ())
    if not isinstance(schema, dict):
        return "the JSON schema must be an object", so.spec, ()
    try:
        out = backend_relax(schema, style if style is not None else grammar.json_style(so))
    except Exception as e:  # GrammarError, or the backend's own failure: the constraint's problem, never a 500
        return str(e).strip() or type(e).__name__, so.spec, ()
    keywords = out.keywords
    if exclusive and "oneOf" in keywords:
        refusal = one_of_refusal(out.schema)
        if refusal is not None:
            return refusal, so.spec, ()
        keywords = tuple(k for k in keywords if k != "oneOf")  # read as anyOf, but no value meets two branches
    return None, (so.spec if out.schema is schema else json.dumps(out.schema)), keywords


def one_of_refusal(relaxed: Any) -> str | None:
    """Why a oneOf the grammar reads as anyOf is refused, and what to send instead; None when no value can meet two
    of its branches (one branch; a fallback that compiled the schema as it came, disjoint branches and all)."""
    where = first_one_of(relaxed)
    if where is None:
        return None
    return (
        f"oneOf at {where} cannot be enforced: its branches are not provably exclusive, so an "
        "answer could match two of them and fail the schema. Send anyOf where matching several branches is fine, or "
        "tell the branches apart (different types, a required property with different const or enum values, or a "
        "property one branch requires and the others forbid)."
    )


def _key(so: StructuredOutputs, mode: bytes = b"") -> bytes:
    h = hashlib.blake2b(so.kind.encode() + mode, digest_size=16)
    h.update(b"\0")
    h.update(so.spec.encode())
    if so.whitespace_pattern is not None:
        h.update(b"\0" + so.whitespace_pattern.encode())
    return h.digest()


async def _validate(so: StructuredOutputs) -> str | None:
    plain = StructuredOutputs(so.kind, so.spec, whitespace_pattern=so.whitespace_pattern)  # reasoning_end: no matter
    error, _, _ = await _cached(plain, b"", lambda: (_run_backend(plain), plain.spec, ()))
    return error


async def _cached(so: StructuredOutputs, mode: bytes, run: Callable[[], _Result]) -> _Result:
    """`run`'s result for this constraint and mode: from the LRU, or from a worker thread (a few at a time)."""
    key = _key(so, mode)
    if key in _results:
        _results.move_to_end(key)
        return _results[key]
    result = await anyio.to_thread.run_sync(run, limiter=_compile_limiter())
    _results[key] = result
    while len(_results) > CACHE_SIZE:
        _results.popitem(last=False)
    return result


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
