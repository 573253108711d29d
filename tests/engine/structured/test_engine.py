"""EngineCore with constraints on a random-weight model: every output parses and finishes "stop"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from engine.core.engine_core import EngineCore
from engine.messages import SamplingParams, StructuredOutputs
from tests.engine.structured.conftest import finish, make_core, run, shared_backend
from tests.helpers.engine import tokens

# Bounded parts (maxLength, ranges, enums): a random model finishes this by itself; free-form ones are finished
# near max_tokens by engine/structured/forced_finish.py (tests/engine/structured/test_forced_finish.py).
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "kind", "ok"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "kind": {"enum": ["a", "b"]},
        "ok": {"type": "boolean"},
    },
}
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "(" expr ")"\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/'
CONSTRAINTS = {
    "json": StructuredOutputs("json", json.dumps(SCHEMA)),
    "json_object": StructuredOutputs("json_object"),
    "regex": StructuredOutputs("regex", r"[a-z]{3,8}-[0-9]{2}"),
    "choice": StructuredOutputs("choice", json.dumps(CHOICES)),
    "grammar": StructuredOutputs("grammar", LARK),
}
PROMPT = [9707, 11, 1879, 0, 1052, 2]


def check(kind: str, text: str) -> None:
    if kind == "json":
        obj = json.loads(text)
        assert set(obj) == set(SCHEMA["required"])  # type: ignore[arg-type]
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
        assert obj["kind"] in ("a", "b") and isinstance(obj["ok"], bool)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text


def text_of(core: EngineCore, ids: list[int]) -> str:
    ids = [t for t in ids if t not in core.eos_token_ids]  # a grammar may end on eos
    return shared_backend(core).decode_bytes(ids).decode()


@pytest.fixture(scope="module")
def core(qwen2_ckpt: Path) -> EngineCore:
    return make_core(qwen2_ckpt)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_kind_parses_and_stops(core: EngineCore, sampling: str) -> None:
    reqs = []
    for kind, so in CONSTRAINTS.items():
        for seed in range(3 if sampling == "seeded" else 1):
            params = SamplingParams(
                max_tokens=128, temperature=0.0 if sampling == "greedy" else 1.0, seed=seed, structured_outputs=so
            )
            reqs.append((f"{kind}-{seed}", PROMPT, params))
    outs = run(core, reqs)
    for rid, o in outs.items():
        kind, text = rid.rsplit("-", 1)[0], text_of(core, tokens(o))
        assert finish(o) == ("stop", None), (rid, text)
        check(kind, text)
    assert core.structured.num_live == 0 and core.structured.num_compiling == 0


def test_n_children_each_get_a_matcher(core: EngineCore) -> None:
    so = CONSTRAINTS["json"]
    # the server's n > 1: children <id>-<i>, seeds seed + i, the same constraint (compiled once, copied each)
    reqs = [
        (f"n-{i}", PROMPT, SamplingParams(max_tokens=128, temperature=1.0, seed=7 + i, structured_outputs=so))
        for i in range(4)
    ]
    outs = run(core, reqs)
    texts = [text_of(core, tokens(o)) for o in outs.values()]
    for o, t in zip(outs.values(), texts):
        assert finish(o) == ("stop", None)
        check("json", t)
    assert len(set(texts)) > 1  # independent matchers: different draws, each valid


def test_neighbours_greedy_output_unchanged(core: EngineCore) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    neighbours = [(f"plain-{i}", [100 + i, 200, 300 + i], plain) for i in range(3)]
    alone = run(core, neighbours)
    constrained = [
        (f"c-{k}", PROMPT, SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=so))
        for k, so in CONSTRAINTS.items()
    ]
    mixed = run(core, [neighbours[0], *constrained, *neighbours[1:]])
    for rid, _, _ in neighbours:
        assert tokens(mixed[rid]) == tokens(alone[rid])


def test_prefix_cache_hits_for_constrained(core: EngineCore) -> None:
    prompt = list(range(1000, 1100))
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=CONSTRAINTS["choice"])
    first = run(core, [("pc-0", prompt, params)])
    second = run(core, [("pc-1", prompt, params)])
    assert first["pc-0"][-1].num_cached_tokens == 0
    assert second["pc-1"][-1].num_cached_tokens >= 96
    assert tokens(first["pc-0"]) == tokens(second["pc-1"])


def test_grammar_completion_ends_despite_ignore_eos_and_min_tokens(core: EngineCore) -> None:
    so = CONSTRAINTS["choice"]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, min_tokens=20, structured_outputs=so)
    outs = run(core, [("ie", PROMPT, params)])["ie"]
    assert finish(outs) == ("stop", None)
    assert text_of(core, tokens(outs)) in CHOICES


def test_reasoning_end_starts_the_constraint_after_it(core: EngineCore) -> None:
    # a random model will not write "</think>": the marker is the text of its own first two greedy tokens
    free = run(core, [("free", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))])["free"]
    ids = tokens(free)
    marker = shared_backend(core).decode_bytes(ids).decode(errors="ignore")
    assert marker
    so = msgspec.structs.replace(CONSTRAINTS["regex"], reasoning_end=marker)
    outs = run(core, [("think", PROMPT, SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=so))])
    got = tokens(outs["think"])
    assert got[:2] == ids  # unconstrained until the marker is complete, constrained from the next token
    assert finish(outs["think"]) == ("stop", None)
    check("regex", text_of(core, got[2:]))


def test_preemption_keeps_matchers_consistent(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt, num_blocks=10, block_size=8)
    so = CONSTRAINTS["json"]
    reqs = [
        (f"p-{i}", PROMPT + [i] * 20, SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs=so))
        for i in range(4)
    ]
    outs = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for o in outs.values():
        assert o[-1].finish_reason in ("stop", "length")
        if o[-1].finish_reason == "stop":
            check("json", text_of(core, tokens(o)))
    assert core.structured.num_live == 0
