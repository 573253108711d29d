"""StructuredOutputs -> an llguidance grammar, and its validation (the server's 400s come from here).

JSON is compiled with compact separators and no free whitespace: a model (a random one above all)
can otherwise loop on legal whitespace until max_tokens and never close the object.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.messages import StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict in the stubs only

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}

# llguidance's limits, set here rather than left to its defaults, so that a hostile constraint is refused in bounded
# time and memory wherever it is compiled (the server's check, the engine's compile, each mask step). What fits:
# every schema of bench/schemas/ (the largest, 240 KB, reaches ~40k grammar symbols and ~3k lexer states).
LIMITS = llguidance.LLParserLimits(
    max_grammar_size=500_000,  # symbols in the grammar's productions: the compile's size (and time) bound
    max_items_in_row=2_000,  # Earley items per row: ambiguity blow-up
    initial_lexer_fuel=1_000_000,  # building the lexer's regexes (~50k/ms: ~20 ms)
    step_lexer_fuel=200_000,  # one mask computation's lexer work (~14k/ms: ~15 ms per step)
    step_max_items=50_000,  # Earley items per mask step (~20k/ms)
    max_lexer_states=50_000,  # lexer DFA states, 1-2 kB each: <= ~100 MB per grammar
    verbose_errors=False,  # errors name the problem, not the parser's state (they go back to the client)
)


class GrammarError(ValueError):
    """The constraint cannot be compiled or enforced; the message names the problem."""


def json_style(so: StructuredOutputs) -> JsonCompileOptions:
    """Compact JSON, or the client's whitespace_pattern between tokens (vLLM's option, as its guidance backend)."""
    if so.whitespace_pattern is None:
        return _COMPACT
    return {"whitespace_flexible": False, "whitespace_pattern": so.whitespace_pattern}


def to_grammar(so: StructuredOutputs) -> str:
    """The llguidance top-level grammar (JSON text) for one constraint. Raises GrammarError."""
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=json_style(so))
    if so.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=json_style(so))
    if so.whitespace_pattern is not None:
        raise GrammarError("whitespace_pattern applies to JSON constraints only")
    if so.kind == "regex":
        return llguidance.grammar_from("regex", so.spec)
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError as e:
            raise GrammarError(f"choice is not a JSON list: {e}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice must be a non-empty list of strings")
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in choices))
    if so.kind == "grammar":
        try:
            text = any_to_lark(so.spec)  # GBNF / EBNF (llama.cpp's, xgrammar's) become Lark; Lark stays
        except Exception as e:  # the converter raises its own error types for syntax errors
            raise GrammarError(f"invalid grammar: {e}") from None
        return llguidance.grammar_from("lark", text)
    raise GrammarError(f"unknown structured output kind {so.kind!r}; expected one of {', '.join(KINDS)}")


@functools.lru_cache(maxsize=1024)
def validate(so: StructuredOutputs) -> str | None:
    """None when the backend can enforce the constraint, else why not (one line per problem)."""
    try:
        grammar = to_grammar(so)
    except GrammarError as e:
        return str(e)
    except Exception as e:  # llguidance's own parse errors (regex syntax and such)
        return str(e).strip() or type(e).__name__
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)
    return error.strip() or None
