"""Tiny random-weight engines with constrained decoding; one LLTokenizer per checkpoint for the session (~1.5 s
each)."""

from __future__ import annotations

from pathlib import Path

from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, RequestOutput, SamplingParams
from engine.structured.backend import StructuredBackend
from engine.structured.llguidance_backend import LLGuidanceBackend
from engine.structured.manager import StructuredOutputManager
from tests.helpers.engine import make_core as plain_core

_BACKENDS: dict[tuple[Path, int], LLGuidanceBackend] = {}


def shared_backend(core: EngineCore) -> LLGuidanceBackend:
    key = (Path(core.config.model), core.vocab_size)
    if key not in _BACKENDS:
        _BACKENDS[key] = LLGuidanceBackend.from_checkpoint(key[0], core.vocab_size, sorted(core.eos_token_ids))
    return _BACKENDS[key]


def make_core(ckpt: Path, backend: StructuredBackend | None = None, **kw: object) -> EngineCore:
    """An EngineCore whose grammar backend is shared across the session (or the given stand-in)."""
    core = plain_core(ckpt, **kw)
    b = backend if backend is not None else shared_backend(core)
    core.structured = StructuredOutputManager(lambda: b, core.runner.device, core.eos_token_ids)
    return core


def run(
    core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams]], max_steps: int = 2000
) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, *_ in reqs}
    for rid, prompt, params in reqs:
        core.add_request(AddRequest(rid, prompt, params, arrival_time=0.0))
    steps = 0
    while core.has_work:
        for o in core.step():
            outs[o.request_id].append(o)
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return outs


def finish(outs: list[RequestOutput]) -> tuple[str | None, str | None]:
    return outs[-1].finish_reason, outs[-1].error
