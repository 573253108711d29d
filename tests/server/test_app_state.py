"""AppState.require and AsyncLLM.generate: every "not now" is a 503 with Retry-After
(server/http/unavailable.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngineClient

from engine.messages import SamplingParams
from server.app_state import AppState
from server.config import ServerConfig
from server.http.errors import APIError
from server.request.async_llm import AsyncLLM
from server.request.input_processor import GenerationSpec, ModelLimits

pytestmark = pytest.mark.anyio


def refusal(call: Any) -> APIError:
    with pytest.raises(APIError) as e:
        call()
    return e.value


def ready_state() -> tuple[AppState, AsyncLLM]:
    state = AppState(ServerConfig(), "m", limits=ModelLimits(max_model_len=64, vocab_size=100))
    state.llm = llm = AsyncLLM(FakeEngineClient(lambda req: [1]), lambda spec: None, stopping=state.stopping)
    state.renderer = object()  # type: ignore[assignment]  # require() only checks that it is there
    return state, llm


def test_require_refuses_with_503_and_retry_after() -> None:
    starting = refusal(AppState(ServerConfig(), "m").require)
    state, llm = ready_state()
    assert state.require()[0] is llm
    llm.dead = "engine core exited with 1"
    dead = refusal(state.require)
    llm.dead = None
    state.stopping.set()
    stopping = refusal(state.require)
    render_stopping = refusal(state.require_renderer)
    for error, words in (
        (starting, "still starting"),
        (dead, "engine core exited with 1"),
        (stopping, "shutting down"),
        (render_stopping, "shutting down"),
    ):
        assert (error.status, error.retry_after) == (503, 1) and words in error.message


async def test_generate_refuses_like_require() -> None:
    _, llm = ready_state()
    spec = GenerationSpec(external_id="a", request_id="a", prompt_token_ids=[1], params=SamplingParams(max_tokens=1))
    for setup, words in (
        (lambda: setattr(llm, "dead", "gone"), "engine is not running (gone)"),
        (lambda: (setattr(llm, "dead", None), llm.stopping.set()), "shutting down"),
    ):
        setup()
        with pytest.raises(APIError) as e:
            async with llm.generate([spec]):
                pass
        assert (e.value.status, e.value.retry_after) == (503, 1) and words in e.value.message


class Rejections:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def rejected(self, reason: str) -> None:
        self.reasons.append(reason)


async def test_one_stopping_state_for_the_routes_health_and_generate() -> None:
    """A drain (AsyncLLM) stops the routes and /health (AppState) too; a probe's 503 is no counted rejection."""
    state, llm = ready_state()
    metrics = Rejections()
    llm.metrics = metrics  # type: ignore[assignment]  # only `rejected` is reached
    assert await llm.drain(0.0) == 0
    assert state.stopping.is_set()
    for call in (lambda: state.require_renderer(count=False), state.require):
        error = refusal(call)
        assert (error.status, error.retry_after) == (503, 1) and "shutting down" in error.message
    assert metrics.reasons == ["shutting_down"]
