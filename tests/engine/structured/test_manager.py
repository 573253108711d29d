"""Compiles off the step: a held request does not block others; failures end in "error"; nothing leaks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams, StructuredOutputs
from engine.structured.grammar import GrammarError
from engine.structured.llguidance_backend import LLGuidanceBackend
from engine.types.constraint_state import StructuredGrammar
from tests.engine.structured.conftest import make_core, run, shared_backend
from tests.helpers.engine import tokens

CHOICE = StructuredOutputs("choice", '["alpha", "beta"]')


class GatedBackend:
    """The real backend, but compile waits for `gate` (set by the test) and refuses kind "regex"."""

    def __init__(self, inner: LLGuidanceBackend) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.gate = threading.Event()
        self.compiles = 0

    def compile(self, so: StructuredOutputs) -> StructuredGrammar:
        self.compiles += 1
        assert self.gate.wait(30), "the test never opened the gate"
        if so.kind == "regex":
            raise GrammarError("no regexes today")
        return self.inner.compile(so)

    def fill_bitmasks(self, items: Sequence[tuple[StructuredGrammar, int]], bitmask: torch.Tensor) -> None:
        self.inner.fill_bitmasks(items, bitmask)

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        return self.inner.decode_bytes(token_ids)


@pytest.fixture
def gated(qwen2_ckpt: Path) -> tuple[EngineCore, GatedBackend]:
    plain = make_core(qwen2_ckpt)
    backend = GatedBackend(shared_backend(plain))
    return make_core(qwen2_ckpt, backend=backend), backend


def test_waiting_for_compile_does_not_block_others(gated: tuple[EngineCore, GatedBackend]) -> None:
    core, backend = gated
    core.add_request(
        AddRequest("c", [1, 2, 3], SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=CHOICE), 0.0)
    )
    core.add_request(AddRequest("u", [4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), 1.0))
    got: dict[str, list[int]] = {"c": [], "u": []}
    done: set[str] = set()
    while "u" not in done:  # the unconstrained request runs to the end while "c" compiles
        for o in core.step():
            got[o.request_id] += o.new_token_ids
            if o.finish_reason:
                done.add(o.request_id)
    assert got["u"] and not got["c"] and core.scheduler.num_waiting == 1
    backend.gate.set()
    while core.has_work:
        for o in core.step():
            got[o.request_id] += o.new_token_ids
            if o.finish_reason:
                assert o.finish_reason == "stop"
    assert backend.inner.decode_bytes(got["c"]).decode() in ("alpha", "beta")


def test_compile_failure_finishes_with_error(gated: tuple[EngineCore, GatedBackend]) -> None:
    core, backend = gated
    backend.gate.set()
    bad = StructuredOutputs("regex", "[a-z]+")
    outs = run(
        core,
        [
            ("bad", [1, 2], SamplingParams(max_tokens=8, structured_outputs=bad)),
            ("ok", [1, 2], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=CHOICE)),
        ],
    )
    assert outs["bad"][-1].finish_reason == "error" and "no regexes today" in (outs["bad"][-1].error or "")
    assert not tokens(outs["bad"])
    assert outs["ok"][-1].finish_reason == "stop"


def test_children_share_one_compile(gated: tuple[EngineCore, GatedBackend]) -> None:
    core, backend = gated
    backend.gate.set()
    outs = run(
        core,
        [
            (f"n-{i}", [1, 2], SamplingParams(max_tokens=8, temperature=1.0, seed=i, structured_outputs=CHOICE))
            for i in range(3)
        ],
    )
    assert backend.compiles == 1
    assert all(o[-1].finish_reason == "stop" for o in outs.values())


def test_abort_does_not_leak(gated: tuple[EngineCore, GatedBackend]) -> None:
    core, backend = gated
    long = StructuredOutputs("json", '{"type": "string", "minLength": 40}')  # runs for many steps
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=long)
    core.add_request(AddRequest("held", [1, 2], params, 0.0))
    core.step()
    core.abort(["held"])  # aborted while its grammar compiles
    assert core.structured.num_compiling == 0 and core.scheduler.num_waiting == 0
    assert [(o.request_id, o.finish_reason) for o in core.step()] == [("held", "abort")]
    backend.gate.set()
    core.add_request(AddRequest("running", [1, 2], params, 0.0))
    for _ in range(1000):  # until it runs with a matcher
        assert not [o for o in core.step() if o.finish_reason], "it should still be running"
        if core.structured.num_live:
            break
    core.step()
    core.abort(["running"])  # aborted with a live matcher
    assert core.structured.num_live == 0
    outs = [o for _ in range(3) for o in core.step()]
    assert [(o.request_id, o.finish_reason) for o in outs] == [("running", "abort")]
    assert not core.has_work


def test_warm_up_builds_the_backend_once_before_any_compile(qwen2_ckpt: Path) -> None:
    """The engine process calls warm_up before it says Ready: the backend (a GIL-holding build) is not left to
    the first constrained request's compile, which would stall the step of every running request."""
    from engine.structured.manager import StructuredOutputManager

    builds: list[str] = []

    def make() -> LLGuidanceBackend:
        builds.append(threading.current_thread().name)
        return shared_backend(make_core(qwen2_ckpt))

    manager = StructuredOutputManager(make, torch.device("cpu"), [0])
    manager.warm_up()
    assert builds == [threading.current_thread().name]  # now, here
    grammar = manager.backend().compile(CHOICE)
    assert grammar.completion(10) is not None and builds == [threading.current_thread().name]  # not again
    manager.close()
