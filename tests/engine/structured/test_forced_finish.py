"""Free-form constraints on a random-weight model end with "stop" inside max_tokens
(engine/structured/forced_finish.py).

The model never closes a free string or stops an unbounded number by itself: only the forced finish does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine.core.engine_core import EngineCore
from engine.messages import SamplingParams, StructuredOutputs
from engine.structured.finish_search import completion
from engine.structured.forced_finish import EVERY_STEP, GROWTH, MARGIN, MAX_GAP, advance, closing_token
from engine.structured.relaxed_schema import relax
from engine.types.constraint_state import StructuredState
from tests.engine.structured.conftest import finish, make_core, run, shared_backend
from tests.helpers.engine import tokens

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
FORMATS = {
    "type": "object",
    "required": ["when", "mail", "code", "score", "long"],
    "properties": {
        "when": {"type": "string", "format": "date-time"},
        "mail": {"type": "string", "format": "email"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "score": {"type": "number"},
        "long": {"type": "string", "minLength": 12},
    },
}
NESTED = {
    "type": "array",
    "minItems": 2,
    "items": {
        "type": "object",
        "required": ["id", "child"],
        "properties": {
            "id": {"type": "integer"},
            "child": {"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"]},
        },
    },
}
# strings whose way out is a text no single character reveals (engine/structured/pattern_samples.py)
PATTERNS = {
    "type": "object",
    "required": ["icon", "ctx", "mail"],
    "properties": {
        "icon": {"type": "string", "pattern": "\\.png$"},
        "ctx": {"type": "string", "pattern": "http://schema.org"},
        "mail": {"type": "string", "pattern": "^[\\S]+@[\\S]+\\.[\\S]{2,}$"},
    },
}
SCHEMAS = {
    "person": PERSON,
    "formats": FORMATS,
    "nested": NESTED,
    "patterns": PATTERNS,
    "string": {"type": "string"},
    "object": {"type": "object"},
}
REGEXES = {"email": r"[a-z]+@[a-z]+\.com", "words": r"[a-z]+ [a-z]+", "digits": r"[0-9]+"}
GRAMMAR = 'start: "(" start ")" | NAME\nNAME: /[a-z]+/'
CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"
# its own members (the `http://schema.org` pattern): with the JSON-LD document it bundles, llguidance refuses it
# (schema intersection stack level exceeded)
WITHOUT = {"schemastore/schema-org-place": ("anyOf", "$defs")}
PROMPT = [9707, 11, 1879, 0, 1052, 2]


def constraints() -> dict[str, tuple[StructuredOutputs, object]]:
    out: dict[str, tuple[StructuredOutputs, object]] = {
        f"json:{k}": (StructuredOutputs("json", json.dumps(s)), s) for k, s in SCHEMAS.items()
    }
    out |= {f"regex:{k}": (StructuredOutputs("regex", r), r) for k, r in REGEXES.items()}
    out["json_object"] = (StructuredOutputs("json_object"), {"type": "object"})
    out["grammar"] = (StructuredOutputs("grammar", GRAMMAR), None)
    return out


def text_of(core: EngineCore, ids: list[int]) -> str:
    return shared_backend(core).decode_bytes([t for t in ids if t not in core.eos_token_ids]).decode()


def check(key: str, ref: object, text: str) -> None:
    if key.startswith("json"):
        jsonschema.validate(json.loads(text), ref)  # type: ignore[arg-type]
    elif key.startswith("regex"):
        assert re.fullmatch(str(ref), text), (key, text)
    else:
        assert re.fullmatch(r"(\()*[a-z]+(\))*", text) and text.count("(") == text.count(")"), text


@pytest.fixture(scope="module")
def core(qwen2_ckpt: Path) -> EngineCore:
    return make_core(qwen2_ckpt)


@pytest.mark.parametrize("max_tokens", [100, 160])
def test_free_form_constraints_finish_with_stop(core: EngineCore, max_tokens: int) -> None:
    reqs = []
    for key, (so, _) in constraints().items():
        reqs.append(
            (f"{key}|greedy", PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so))
        )
        for seed in range(2):  # n > 1 as the server sends it: children with seeds seed + i
            reqs.append(
                (
                    f"{key}|s{seed}",
                    PROMPT,
                    SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=so),
                )
            )
    outs = run(core, reqs)
    refs = constraints()
    for rid, o in outs.items():
        key = rid.split("|")[0]
        ids = tokens(o)
        assert finish(o) == ("stop", None), (rid, text_of(core, ids))
        assert len(ids) <= max_tokens
        check(key, refs[key][1], text_of(core, ids))
    assert core.structured.num_live == 0


def test_the_finish_leaves_a_model_that_stops_alone_untouched(core: EngineCore) -> None:
    """A bounded schema a random model completes by itself gives the same tokens with a tiny or a large budget
    as long as the budget fits: the finish only starts where the output would otherwise be cut."""
    so = StructuredOutputs("choice", json.dumps(["alpha", "beta", "gamma"]))
    a = run(core, [("c1", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so))])["c1"]
    b = run(core, [("c2", PROMPT, SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=so))])["c2"]
    assert tokens(a) == tokens(b) and finish(a) == finish(b) == ("stop", None)


def test_too_small_a_budget_gives_a_valid_prefix(core: EngineCore) -> None:
    so = StructuredOutputs("json", json.dumps(PERSON))
    outs = run(
        core,
        [
            (f"t{n}", PROMPT, SamplingParams(max_tokens=n, temperature=1.0, seed=n, structured_outputs=so))
            for n in (1, 3, 6)
        ],
    )
    for rid, o in outs.items():
        assert finish(o) == ("length", None)
        text = text_of(core, tokens(o))
        assert '{"name":"'.startswith(text) or text.startswith('{"name":"'), (rid, text)


def test_forced_eos_waits_for_min_tokens(core: EngineCore) -> None:
    # "[0-9]+" ends only by eos: forcing eos before min_tokens would be masked by the sampler (an empty row)
    so = StructuredOutputs("regex", REGEXES["digits"])
    outs = run(
        core,
        [
            ("m1", PROMPT, SamplingParams(max_tokens=30, min_tokens=20, temperature=0.0, structured_outputs=so)),
            ("m2", PROMPT, SamplingParams(max_tokens=30, min_tokens=30, temperature=0.0, structured_outputs=so)),
        ],
    )
    assert finish(outs["m1"]) == ("stop", None)
    assert 20 < len(tokens(outs["m1"])) <= 30
    assert finish(outs["m2"]) == ("length", None)  # eos is never allowed: a valid prefix, no error
    assert re.fullmatch("[0-9]+", text_of(core, tokens(outs["m2"])))


@pytest.mark.parametrize("key", sorted(constraints()))
def test_completion_finishes_the_grammar(core: EngineCore, key: str) -> None:
    """From the start and from inside a free-form part, the found tokens take the matcher to the end."""
    backend = shared_backend(core)
    so, ref = constraints()[key]
    template = backend.compile(so)
    for prefix in (
        [],
        *[
            tokens(o)
            for o in run(
                core, [("p", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=3, structured_outputs=so))]
            ).values()
        ],
    ):
        g = template.copy()
        assert g.accept_tokens(prefix[:7])
        path = g.completion(400)
        assert path is not None and len(path) < 120, key
        assert g.accept_tokens(path)
        assert g.is_terminated() or path[-1] in core.eos_token_ids
        check(key, ref, text_of(core, prefix[:7] + path))


def test_a_grammar_with_no_end_is_searched_a_bounded_number_of_times() -> None:
    """Every object needs another: no finish exists. The search gives up and is retried at half the budget."""

    class NoEnd:
        calls = 0

        def completion(self, limit: int) -> list[int] | None:
            NoEnd.calls += 1
            return None

        def finishes(self, tokens: list[int]) -> bool:
            raise AssertionError("nothing was found to replay")

    state = StructuredState(StructuredOutputs("json", "{}"), grammar=NoEnd())  # type: ignore[arg-type]
    for budget in range(100_000, 0, -1):
        assert closing_token(state, budget, frozenset()) is None
    assert NoEnd.calls <= 18  # log2(100000) + 1


@pytest.mark.parametrize("replays", [True, False])
def test_the_finish_is_looked_for_rarely_until_it_is_near(replays: bool) -> None:
    """Searches halve the distance to where the finish must start, then run every step; a finish found earlier
    that still finishes (replays) is taken instead of a new search."""

    class Fixed:
        calls = 0

        def completion(self, limit: int) -> list[int] | None:
            Fixed.calls += 1
            return [7] * 10 if limit >= 10 else None

        def finishes(self, tokens: list[int]) -> bool:
            return replays

    state = StructuredState(StructuredOutputs("json", "{}"), grammar=Fixed())  # type: ignore[arg-type]
    forced = []
    for budget in range(10_000, 0, -1):
        token = closing_token(state, budget, frozenset())
        if token is not None:
            forced.append(budget)
        advance(state, 7 if token is not None else 1)
    early = 10 // GROWTH + MARGIN  # the finish never grew: a third of it early
    assert forced == list(range(10 + early, early, -1))  # the ten tokens, ending a margin before the end
    assert Fixed.calls == 1 if replays else Fixed.calls <= 10_000 // MAX_GAP + EVERY_STEP + 16


def test_sentencepiece_vocabulary_finishes_too(llama_ckpt: Path) -> None:
    """A SentencePiece vocabulary (pieces with a leading "▁", byte fallback): the same finish, other tokens."""
    core = make_core(llama_ckpt)
    keys = ["json:person", "json:nested", "regex:email", "json_object"]
    refs = constraints()
    outs = run(
        core,
        [
            (
                f"{k}|{seed}",
                [1, 450, 4996],
                SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs=refs[k][0]),
            )
            for k in keys
            for seed in range(2)
        ],
    )
    for rid, o in outs.items():
        key = rid.split("|")[0]
        assert finish(o) == ("stop", None), (rid, text_of(core, tokens(o)))
        check(key, refs[key][1], text_of(core, tokens(o)))


def test_a_finish_token_the_sampler_would_ban_is_not_forced(core: EngineCore) -> None:
    """allowed_token_ids without the finish's tokens: the row is left to the grammar (no empty row, no error)."""
    so = StructuredOutputs("regex", r"[a-z]+@[a-z]+\.com")
    letters = [t for t in range(200) if shared_backend(core).decode_bytes([t]).isalpha()]
    outs = run(
        core,
        [
            (
                "a",
                PROMPT,
                SamplingParams(max_tokens=20, temperature=0.0, allowed_token_ids=letters, structured_outputs=so),
            )
        ],
    )["a"]
    assert finish(outs) == ("length", None)
    text = text_of(core, tokens(outs))
    assert re.fullmatch("[a-z]*", text), text  # only letters: "@" was never forced past the ban


@pytest.mark.parametrize("phase", range(8))
def test_a_finish_that_grows_with_each_new_item_is_still_forced_in_time(phase: int) -> None:
    """Between items the finish is 20 tokens; inside one (3 of every 8 tokens, its pattern to complete) it is 30: a
    new item lengthens it by half in one token. The finish starts early enough for that, and where a search finds none
    that fits it looks again at the next step (the item closes soon) rather than at half the budget."""
    written = [phase]

    class Items:
        def completion(self, limit: int) -> list[int] | None:
            size = 30 if written[0] % 8 in (1, 2, 3) else 20
            return [7] * size if size <= limit else None

        def finishes(self, tokens: list[int]) -> bool:
            return False

    state = StructuredState(StructuredOutputs("json", "{}"), grammar=Items())  # type: ignore[arg-type]
    forced = 0
    for budget in range(300, 0, -1):
        token = closing_token(state, budget, frozenset())
        if token is None:
            assert forced == 0, "the model wrote on inside the finish"
            written[0] += 1
        forced += token is not None
        advance(state, 7 if token is not None else 1)
        if forced and not state.closing:
            break
    assert forced in (20, 30) and budget >= 1


def test_a_finish_that_grows_manyfold_after_the_first_search_is_found_in_time() -> None:
    """The first search finds 10 tokens; then the model opens a member whose required parts take 240: a search
    halfway to the end would come too late, one every MAX_GAP tokens finds it with room to spare."""
    written = [0]

    class Opens:
        def completion(self, limit: int) -> list[int] | None:
            size = 10 if written[0] < 40 else 240
            return [7] * size if size <= limit else None

        def finishes(self, tokens: list[int]) -> bool:
            return False

    state = StructuredState(StructuredOutputs("json", "{}"), grammar=Opens())  # type: ignore[arg-type]
    forced = 0
    for budget in range(384, 0, -1):
        token = closing_token(state, budget, frozenset())
        written[0] += token is None
        forced += token is not None
        advance(state, 7 if token is not None else 1)
    assert forced == 240


def test_a_failing_search_disables_the_finish_for_that_request_only(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        calls = 0

        def completion(self, limit: int) -> list[int] | None:
            Broken.calls += 1
            raise RuntimeError("matcher exploded")

        def finishes(self, tokens: list[int]) -> bool:
            return False

    state = StructuredState(StructuredOutputs("json", "{}"), grammar=Broken())  # type: ignore[arg-type]
    for budget in range(50, 0, -1):
        assert closing_token(state, budget, frozenset()) is None
    assert Broken.calls == 1 and "looking for a finish failed" in caplog.text


@pytest.mark.parametrize(
    "name",
    [
        "openapi/openapi-v3.0",
        "schemastore/band-manifest",
        "check-jsonschema/github-workflows",
        "schemastore/schema-org-place",
        "check-jsonschema/citation-file-format",
    ],
)
def test_completion_finishes_real_schemas(core: EngineCore, name: str) -> None:
    """Real schemas whose finish a naive search misses: optional `x-` members added forever (a closing bracket
    comes first between members), strings only a pattern's text leaves (`\\.png$`, `http://schema.org`), every
    optional key written before the required `title` (the schema's required keys come first)."""
    schema = json.loads((CORPUS / f"{name}.json").read_text())
    for key in WITHOUT.get(name, ()):
        del schema[key]
    so = StructuredOutputs("json", json.dumps(relax(schema, {"whitespace_flexible": False}).schema))
    g = shared_backend(core).compile(so)
    path = g.completion(384)
    assert path is not None and g.accept_tokens(path)
    assert g.is_terminated() or path[-1] in core.eos_token_ids


def test_a_pattern_string_between_members_is_not_closed_by_brackets(core: EngineCore) -> None:
    """Inside a string whose pattern holds back the closing quote, a comma may come and a quote may not, as between
    members: the closing-bracket rule must not fire there (it wrote `}}` forever), the pattern's sample leads out."""
    schema = {
        "type": "object",
        "required": ["env", "n"],
        "properties": {
            "env": {"type": "string", "pattern": "^.*\\$\\{\\{(.|[\\r\\n])*\\}\\}.*$"},
            "n": {"type": "integer"},
        },
    }
    g = shared_backend(core).compile(StructuredOutputs("json", json.dumps(relax(schema, {}).schema)))
    assert g.accept_tokens(shared_backend(core).tokenizer.tokenize_str('{"env":"a,b'))
    path = g.completion(60)
    assert path is not None and g.accept_tokens(path) and (g.is_terminated() or path[-1] in core.eos_token_ids)


def test_the_finish_writes_the_required_key_not_the_optional_ones_before_it(core: EngineCore) -> None:
    """Properties come in the schema's order and the mask cannot tell an optional key from a required one: without
    the schema's required keys the search writes optional members ahead of `z`, with them it skips them."""
    optional = {
        f"a{i:02}": {"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"]} for i in range(40)
    }
    schema = {
        "type": "object",
        "properties": {**optional, "z": {"type": "integer"}},
        "required": ["z"],
        "additionalProperties": False,
    }
    backend = shared_backend(core)
    g = backend.compile(StructuredOutputs("json", json.dumps(schema)))
    path = g.completion(384)
    assert path is not None and len(path) <= 8
    assert json.loads(text_of(core, path)).keys() == {"z"}
    f = backend._finish_for(StructuredOutputs("json", json.dumps(schema)))
    plain = completion(g.matcher, f.preferred, f.eos, 384, f.hints, f.marks)  # keys=(): no required keys first
    assert plain is None or len(json.loads(text_of(core, plain))) > 1  # optional members first


def test_required_keys_of_other_objects_do_not_loop_in_an_open_object(core: EngineCore) -> None:
    """`"z":` fits as an extra key of the open object `o` too: taken once per mask, then the search goes on."""
    schema = {
        "type": "object",
        "required": ["o", "z"],
        "properties": {
            "o": {"type": "object", "required": ["q"], "properties": {"q": {"type": "integer"}}},
            "z": {"type": "integer"},
        },
    }
    g = shared_backend(core).compile(StructuredOutputs("json", json.dumps(relax(schema, {}).schema)))
    path = g.completion(200)
    assert path is not None and g.accept_tokens(path)
    jsonschema.validate(json.loads(text_of(core, path)), schema)


def test_many_alike_members_do_not_use_up_the_search(core: EngineCore) -> None:
    """Forty required URL members (a GitHub webhook's repository has sixty): after the first, every option inside
    each URL string leads to a mask seen before, and trying them all at each step used up the search's tries before
    the object closed, so a budget the finish fits in was cut invalid. The option taken at such a mask is tried
    first."""
    schema = {
        "type": "object",
        "required": [f"link_{i}" for i in range(40)],
        "properties": {f"link_{i}": {"type": "string", "format": "uri"} for i in range(40)},
    }
    so = StructuredOutputs("json", json.dumps(relax(schema, {"whitespace_flexible": False}).schema))
    path = shared_backend(core).compile(so).completion(600)
    assert path is not None and len(path) < 480
    jsonschema.validate(json.loads(text_of(core, path)), schema)
    outs = run(
        core,
        [
            (f"u{seed}", PROMPT, SamplingParams(max_tokens=480, temperature=1.0, seed=seed, structured_outputs=so))
            for seed in range(2)
        ],
    )
    for o in outs.values():
        assert finish(o) == ("stop", None), text_of(core, tokens(o))
        jsonschema.validate(json.loads(text_of(core, tokens(o))), schema)
