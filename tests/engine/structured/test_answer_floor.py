"""The fewest tokens any answer of a schema takes (engine/structured/answer_floor.py): a lower bound, never above
an answer the grammar writes, and high enough to tell the webhook objects that cannot fit 384 tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.engine_core import EngineCore
from engine.messages import StructuredOutputs
from engine.structured.answer_floor import Vocabulary, min_answer_tokens
from engine.structured.relaxed_schema import relax
from tests.engine.structured.conftest import make_core, shared_backend

CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"
TINY = Vocabulary([b"a", b"b", b"c", b"d", b"ab", b"cd", b'"abc', b'd":', b"x", b"y", b'"', b":", b","])


def obj(*keys: str, **props: object) -> dict[str, object]:
    return {"type": "object", "required": list(keys), "properties": props}


@pytest.fixture(scope="module")
def core(qwen2_ckpt: Path) -> EngineCore:
    return make_core(qwen2_ckpt)


@pytest.fixture(scope="module")
def vocab(core: EngineCore) -> Vocabulary:
    tok = shared_backend(core).tokenizer
    return Vocabulary(bytes(tok.decode_bytes([i])) for i in range(shared_backend(core).vocab_size))


def test_cover_counts_the_tokens_that_hold_a_name() -> None:
    assert TINY.sound
    assert TINY.cover(b"abcd") == 2  # `"abc` reaching in from the left, then `d":` out to the right
    assert TINY.cover(b"cdab") == 2  # cd, ab
    assert TINY.cover(b"xyx") == 3  # one byte each
    assert TINY.cover(b"") == 0
    assert TINY.cover(b"ab") == 1  # `ab` alone, or inside `"abc`


def test_a_token_that_could_hold_two_names_makes_no_claim() -> None:
    """`a":"","b` would hold the end of one name and the start of the next: the bound is 0, not wrong."""
    spanning = Vocabulary([b"a", b"b", b'a":"","b'])
    assert not spanning.sound
    assert min_answer_tokens(obj("aaaa", "bbbb"), spanning) == 0
    assert Vocabulary([b"a", b'":"","']).sound  # no name byte on either side: holds no name


def test_what_the_grammar_may_leave_out_counts_nothing() -> None:
    two = obj("xy", "yx")
    assert min_answer_tokens(two, TINY) == 4
    assert min_answer_tokens({**two, "type": ["object", "null"]}, TINY) == 0  # null needs no member
    assert min_answer_tokens({k: v for k, v in two.items() if k != "type"}, TINY) == 0  # any type
    assert min_answer_tokens({"anyOf": [two, obj("xy")]}, TINY) == 2  # the cheaper branch
    assert min_answer_tokens({"allOf": [two, obj("xyxy")]}, TINY) == 4  # the dearer member
    nested = obj("xy", xy=obj("yx", "yy"))
    assert min_answer_tokens(nested, TINY) == 2 + 4
    assert min_answer_tokens({"type": "array", "minItems": 3, "items": two}, TINY) == 12
    # a branch without a type is an object when the schema around it says so
    assert min_answer_tokens({"type": "object", "oneOf": [{"required": ["xy"]}, {"required": ["yx", "xx"]}]}, TINY) == 2


def test_refs_are_followed_inside_the_document_only() -> None:
    schema = {
        "$defs": {"p": obj("xy", "yx")},
        "type": "object",
        "required": ["x"],
        "properties": {"x": {"$ref": "#/$defs/p"}},
    }
    assert min_answer_tokens(schema, TINY) == 1 + 4
    loop = {"$defs": {"n": {**obj("xy"), "properties": {"xy": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    assert 0 < min_answer_tokens(loop, TINY) < 200  # a required recursion is cut at the depth limit
    elsewhere = {**schema, "properties": {"x": {"$ref": "other.json#/p"}}}
    assert min_answer_tokens(elsewhere, TINY) == 1
    rebased = {**schema, "$defs": {"p": {**obj("xy", "yx"), "$id": "https://x/p"}}}
    assert min_answer_tokens(rebased, TINY) == 1  # a subschema with its own base: its refs are not the root's


@pytest.mark.parametrize(
    "name",
    [
        "github-webhooks/repository-lite",
        "github-webhooks/workflow-run",
        "github-webhooks/simple-pull-request",
        "github-webhooks/issue-comment",
        "kubernetes/apiresource-meta-v1",
        "bfcl/simple_java-SearchableSnapshotDirectory.create",
        "bfcl/multiple-MBTI.analyse",
    ],
)
def test_the_floor_is_never_above_an_answer_the_grammar_writes(core: EngineCore, vocab: Vocabulary, name: str) -> None:
    schema = json.loads((CORPUS / f"{name}.json").read_text())
    so = StructuredOutputs("json", json.dumps(relax(schema, {"whitespace_flexible": False}).schema))
    found = shared_backend(core).compile(so).completion(4000)
    floor = min_answer_tokens(json.loads(so.spec), vocab)
    assert found is not None or name == "github-webhooks/simple-pull-request"  # its finish: over 4000 tries' worth
    assert found is None or 0 < floor <= len(found)


def test_the_webhooks_that_cannot_fit_384_tokens_are_told_apart(vocab: Vocabulary) -> None:
    floors = {}
    for name in ("repository-lite", "workflow-run", "simple-pull-request"):
        schema = json.loads((CORPUS / "github-webhooks" / f"{name}.json").read_text())
        floors[name] = min_answer_tokens(relax(schema, {"whitespace_flexible": False}).schema, vocab)
    assert floors["repository-lite"] <= 289  # its finish takes 289 (tests/engine/structured/test_finish_search.py)
    assert floors["workflow-run"] > 384 and floors["simple-pull-request"] > 384
