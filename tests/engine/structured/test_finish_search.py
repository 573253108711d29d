"""The forced finish's search writes its finish as the tokenizer writes those bytes
(engine/structured/finish_search.py), and a schema whose shortest finish fits max_tokens ends valid at, and
over, that budget.

GitHub's repository webhook object: 64 required members, sixty of them URL strings. Token by token the walk
took 475 tokens (`"`, `archive`, `_url`, `":`, `""`, `,` per member) and every answer at max_tokens 384 was cut
invalid; written as BPE writes the same bytes (`":"","` is one token) it takes 289.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine.core.engine_core import EngineCore
from engine.messages import SamplingParams, StructuredOutputs
from engine.structured.finish_search import completion
from engine.structured.relaxed_schema import relax
from tests.engine.structured.conftest import finish, make_core, run, shared_backend
from tests.helpers.engine import tokens

CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"
PROMPT = [9707, 11, 1879, 0, 1052, 2]


@pytest.fixture(scope="module")
def core(qwen2_ckpt: Path) -> EngineCore:
    return make_core(qwen2_ckpt)


def webhook() -> tuple[dict[str, object], StructuredOutputs]:
    schema = json.loads((CORPUS / "github-webhooks" / "repository-lite.json").read_text())
    return schema, StructuredOutputs("json", json.dumps(relax(schema, {"whitespace_flexible": False}).schema))


def text_of(core: EngineCore, ids: list[int]) -> str:
    return shared_backend(core).decode_bytes([t for t in ids if t not in core.eos_token_ids]).decode()


def test_the_finish_is_written_as_the_tokenizer_writes_it(core: EngineCore) -> None:
    schema, so = webhook()
    backend = shared_backend(core)
    g = backend.compile(so)
    f = backend._finish_for(so)
    walked = completion(g.matcher, f.preferred, f.eos, 3000, f.hints, f.marks, f.keys)  # no tokenizer: the walk
    path = g.completion(3000)
    assert walked is not None and path is not None
    assert len(path) < 0.7 * len(walked) and len(path) < 384
    assert backend.decode_bytes(path) == backend.decode_bytes(walked)  # the same answer, fewer tokens
    jsonschema.validate(json.loads(text_of(core, path)), schema)
    # the walk may go past the limit: only the retokenized finish has to fit
    assert g.completion(len(path)) == path and g.completion(len(path) - 1) is None


def test_a_retokenization_the_grammar_refuses_keeps_the_walk(core: EngineCore) -> None:
    """`{"a":1}` then end: `1}` as one token may not be allowed where the grammar wants digits; whatever the
    tokenizer writes, the finish returned is one the grammar takes whole to its end."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = shared_backend(core).compile(StructuredOutputs("json", json.dumps(schema)))
    path = g.completion(20)
    assert path is not None and g.accept_tokens(path)
    assert g.is_terminated() or path[-1] in core.eos_token_ids


@pytest.mark.parametrize("over", [0, 12, 95])
def test_a_budget_the_shortest_finish_fits_ends_valid(core: EngineCore, over: int) -> None:
    """At the finish's own length (forced from the first token), just over and well over (the model writes
    first, then the finish closes from where it stands): every answer ends `stop` and validates."""
    schema, so = webhook()
    need = shared_backend(core).compile(so).completion(3000)
    assert need is not None
    budget = len(need) + over
    reqs = [
        (f"r{seed}", PROMPT, SamplingParams(max_tokens=budget, temperature=1.0, seed=seed, structured_outputs=so))
        for seed in range(2)
    ]
    for o in run(core, reqs).values():
        assert finish(o) == ("stop", None), text_of(core, tokens(o))
        assert len(tokens(o)) <= budget
        jsonschema.validate(json.loads(text_of(core, tokens(o))), schema)


def test_just_under_the_shortest_finish_is_cut(core: EngineCore) -> None:
    """One token short of the finish found: nothing forces a finish that does not fit, the answer is cut at
    max_tokens (a valid prefix); the server refuses such a budget up front where it can tell
    (engine/structured/answer_floor.py)."""
    _, so = webhook()
    need = shared_backend(core).compile(so).completion(3000)
    assert need is not None
    params = SamplingParams(max_tokens=len(need) - 1, temperature=1.0, seed=0, structured_outputs=so)
    (o,) = run(core, [("r", PROMPT, params)]).values()
    assert finish(o) == ("length", None) and len(tokens(o)) == len(need) - 1


def test_a_pattern_string_with_a_min_length_has_a_way_out(core: EngineCore) -> None:
    """JSONSchemaBench's AWS X-Ray segment (Github_hard o79409): `trace_id` needs 35 characters and a `-` the
    search never wrote (every digit left the mask as it was, so it wrote digits to any limit); the pattern's sample
    padded to the minLength is a way out."""
    schema = {
        "type": "object",
        "required": ["trace_id"],
        "properties": {"trace_id": {"type": "string", "minLength": 35, "pattern": "\\d+-[A-Fa-f0-9]*-[A-Fa-f0-9]{24}"}},
    }
    g = shared_backend(core).compile(StructuredOutputs("json", json.dumps(relax(schema, {}).schema)))
    path = g.completion(120)
    assert path is not None
    jsonschema.validate(json.loads(text_of(core, path)), schema)
