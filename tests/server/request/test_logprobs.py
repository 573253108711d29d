"""Engine logprobs -> OpenAI's shapes: a masked token's -inf is written as vLLM writes it, never as null."""

from __future__ import annotations

import math

import msgspec

from engine.messages import TokenLogprobs
from server.request.logprobs import chat_logprobs, completion_logprobs


class Texts:
    def __call__(self, token_id: int) -> str:
        return f"t{token_id}"


def test_minus_infinity_becomes_the_floor_in_both_shapes() -> None:
    entry = TokenLogprobs(1, -0.5, 1, [1, 2, 3], [-0.5, -math.inf, -1e30])
    chat = msgspec.json.decode(msgspec.json.encode(chat_logprobs([entry], Texts())))  # type: ignore[arg-type]
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.5, -9999.0, -9999.0]
    comp, _ = completion_logprobs([entry], Texts(), 0)  # type: ignore[arg-type]
    assert comp.top_logprobs == [{"t1": -0.5, "t2": -9999.0, "t3": -9999.0}]
    assert comp.token_logprobs == [-0.5]
