"""With n-gram speculation one engine step delivers several tokens; a stop string found inside them ends the
accepted run where the stop string ends, so the request's text, token ids, usage (num_output_tokens), logprobs,
finish and stop reason, streamed or not, equal the plain engine's for every request shape: stop strings, stop
token ids, min_tokens, max_tokens reached inside a draft, n > 1, logprobs.

Both engines run in this process (tests/helpers/engine.py) and their outputs go through the real output processor
and incremental detokenizer, as in the server. The drafts come from an oracle (the plain run's own continuation,
some tokens corrupted), so steps both accept and reject several tokens whatever the random checkpoint writes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, EngineStats, SamplingParams, StepOutputs
from engine.spec import adaptive, ngram, speculator
from server.request.collector import Collector, Output, OutputKind
from server.request.detokenizer import IncrementalDetokenizer
from server.request.output_processor import OutputProcessor, RequestState
from tests.helpers.engine import greedy, make_core, run, tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
STATS = EngineStats(0, 0, 0, 1, 0, 0, 0)
LENGTH = 40  # tokens of each prompt's reference continuation
PROMPTS = [[9707, 11, 1879, 0], [785, 3974, 13876, 38835], [16, 17, 18]]


class Engines:
    def __init__(self, ckpt: Path) -> None:
        self.plain = make_core(ckpt)
        self.spec = make_core(ckpt, speculative_config=NGRAM)
        self.tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        self.refs: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + its greedy continuation
        for i, p in enumerate(PROMPTS):
            self.refs[tuple(p)] = p + tokens(run(self.plain, [(f"ref{i}", p, greedy(LENGTH), 0)])[f"ref{i}"])
        self.rng = random.Random(7)

    def propose(self, ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
        ref = next((r for p, r in self.refs.items() if ids[: len(p)] == list(p) and ids == r[: len(ids)]), None)
        if ref is None:
            return []
        return [t + 1 if self.rng.random() < 0.25 else t for t in ref[len(ids) : len(ids) + k]]


@pytest.fixture(scope="module")
def engines(qwen2_ckpt: Path) -> Iterator[Engines]:
    made = Engines(qwen2_ckpt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ngram, "propose", made.propose)
        # every step drafts its most and verifies it: the adaptive policy times steps, and on a busy machine it may
        # draft nothing, or find that a verification costs more than it gains and drop the draft
        mp.setattr(speculator, "draft_length", lambda state, cost, most, jump=0.0, probe=True: most)
        mp.setattr(adaptive.StepCost, "pays", lambda self, num_seqs, gain, draft_tokens, draft_seconds=0.0: True)
        yield made


def serve(
    core: EngineCore,
    tok: tokenizers.Tokenizer,
    prompt: list[int],
    params: SamplingParams,
    stops: list[str],
    n: int,
    kind: OutputKind,
) -> tuple[list[dict[str, Any]], int]:
    """n choices of one request through `core` and the output processor as the server runs them: per choice its
    outputs folded (text, ids, logprobs, usage, finish), and the most tokens one step delivered to one choice."""
    proc = OutputProcessor()
    collectors = []
    for i in range(n):
        detok = IncrementalDetokenizer(tok, prompt, stop=stops, min_tokens=params.min_tokens)
        collectors.append(Collector(kind))
        proc.add(RequestState(f"r{i}", i, collectors[-1], detok, kind, bool(stops), len(prompt)))
        core.add_request(AddRequest(f"r{i}", prompt, params, arrival_time=0.0))
    folded: list[dict[str, Any]] = [{"text": "", "ids": [], "logprobs": [], "outputs": 0} for _ in range(n)]
    widest = 0
    while core.has_work:
        outs = core.step()
        widest = max([widest, *(len(o.new_token_ids) for o in outs)])
        core.abort(anyio.run(proc.process_outputs, StepOutputs(outs, 0.0, STATS)))
        for collector, f in zip(collectors, folded):
            while (batch := collector.poll()) is not None:
                for out in batch:
                    _fold(f, out)
    return folded, widest


def _fold(f: dict[str, Any], out: Output) -> None:
    f["text"] += out.text
    f["ids"] += out.token_ids
    f["logprobs"] += [(lp.token_id, round(lp.logprob, 3), lp.top_ids) for lp in out.logprobs or ()]
    f["usage"], f["finish"], f["stop"] = out.num_output_tokens, out.finish_reason, out.stop_reason
    f["outputs"] += 1


@st.composite
def shapes(draw: st.DrawFn) -> dict[str, Any]:
    """A request: its prompt, sampling (stop ids as positions in the reference), stop strings as spans of the
    reference's text, n, and streamed or not."""
    max_tokens = draw(st.integers(1, LENGTH))
    return {
        "prompt": draw(st.sampled_from(PROMPTS)),
        "max_tokens": max_tokens,
        "min_tokens": draw(st.sampled_from([0, 0, draw(st.integers(1, max_tokens))])),
        "logprobs": draw(st.sampled_from([None, 2])),
        "stop_at": draw(st.lists(st.integers(0, LENGTH - 1), max_size=2)),
        "spans": draw(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 6)), max_size=2)),
        "n": draw(st.integers(1, 2)),
        "kind": draw(st.sampled_from(list(OutputKind))),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes())
def test_speculation_ends_where_the_plain_engine_does(engines: Engines, shape: dict[str, Any]) -> None:
    prompt = shape["prompt"]
    ref = engines.refs[tuple(prompt)][len(prompt) :]
    text = engines.tok.decode(ref)
    stops = [s for a, w in shape["spans"] if (s := text[a % len(text) :][:w]).strip()]
    params = SamplingParams(
        max_tokens=shape["max_tokens"],
        min_tokens=shape["min_tokens"],
        temperature=0.0,
        ignore_eos=True,
        logprobs=shape["logprobs"],
        stop_token_ids=[ref[i] for i in shape["stop_at"]],
    )
    want, _ = serve(engines.plain, engines.tok, prompt, params, stops, shape["n"], shape["kind"])
    got, _ = serve(engines.spec, engines.tok, prompt, params, stops, shape["n"], shape["kind"])
    for w, g in zip(want, got):
        assert {k: v for k, v in g.items() if k != "outputs"} == {k: v for k, v in w.items() if k != "outputs"}


def test_a_stop_string_inside_a_multi_token_step(engines: Engines) -> None:
    """The shape the speculative run must get right: the stop string ends inside a step of several tokens."""
    prompt = PROMPTS[0]
    ref = engines.refs[tuple(prompt)][len(prompt) :]
    params = SamplingParams(max_tokens=LENGTH, temperature=0.0, ignore_eos=True, logprobs=2)
    text = engines.tok.decode(ref)
    stop = text[len(engines.tok.decode(ref[:12])) :][:3]
    want, _ = serve(engines.plain, engines.tok, prompt, params, [stop], 1, OutputKind.FINAL_ONLY)
    got, widest = serve(engines.spec, engines.tok, prompt, params, [stop], 1, OutputKind.FINAL_ONLY)
    assert widest > 1 and want[0]["finish"] == "stop" and want[0]["usage"] < LENGTH
    assert got == want
