"""truncation "auto" (server/families/responses/context.py): the fewest turns dropped to fit, at, just under and
just over the limit, found by bisection; and input_file parts (server/families/responses/files.py)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from server.families.responses.context import Prompt, cut_points, fit_prompt
from server.families.responses.items import chat_messages
from server.http.errors import APIError
from server.request.input_processor import ModelLimits
from server.request.openai_protocol import ChatCompletionRequest

pytestmark = pytest.mark.anyio
SYSTEM = {"role": "system", "content": "rules"}


def conversation(turns: int) -> list[dict[str, Any]]:
    """rules, then `turns` x (user "u<i>" of 10 tokens, assistant of 5), the last user turn unanswered."""
    out: list[dict[str, Any]] = [SYSTEM]
    for i in range(turns):
        out.append({"role": "user", "content": f"u{i}"})
        if i < turns - 1:
            out.append({"role": "assistant", "content": f"a{i}"})
    return out


COST = {"system": 3, "user": 10, "assistant": 5}


class Prompts:
    """A stand-in renderer: a message's tokens by role; records what it was asked to render."""

    def __init__(self) -> None:
        self.rendered: list[list[str]] = []

    async def __call__(self, chat: ChatCompletionRequest) -> Prompt:
        messages = chat.messages or []
        self.rendered.append([m["content"] for m in messages])
        return "", [0] * sum(COST[m["role"]] for m in messages), None


async def fit(turns: int, max_len: int, max_tokens: int | None) -> Prompts:
    prompts = Prompts()
    chat = ChatCompletionRequest(model="m", messages=conversation(turns), max_tokens=max_tokens)
    await fit_prompt(chat, ModelLimits(max_model_len=max_len, vocab_size=10), prompts)
    return prompts


@pytest.mark.parametrize("turns", [1, 2, 5, 16])
async def test_nothing_dropped_at_and_under_the_limit(turns: int) -> None:
    full = 3 + 10 * turns + 5 * (turns - 1)
    for max_len, max_tokens in ((full + 4, 4), (full + 5, 4), (full + 1, None)):  # at, under; no max_tokens
        prompts = await fit(turns, max_len, max_tokens)
        assert prompts.rendered == [[m["content"] for m in conversation(turns)]]  # the whole, rendered once


@pytest.mark.parametrize("turns", [2, 5, 16])
@pytest.mark.parametrize("over", [1, 15, 16, 30])
async def test_over_the_limit_the_oldest_turns_go_and_the_system_turn_stays(turns: int, over: int) -> None:
    full = 3 + 10 * turns + 5 * (turns - 1)
    prompts = Prompts()
    chat = ChatCompletionRequest(model="m", messages=conversation(turns), max_tokens=4)
    text, ids, _ = await fit_prompt(chat, ModelLimits(max_model_len=full + 4 - over, vocab_size=10), prompts)
    dropped = min(-(-over // 15), turns - 1)  # whole turns of 15 tokens, the last user turn always kept
    assert len(ids) == full - 15 * dropped
    assert len(prompts.rendered) <= 2 + (turns - 1).bit_length()  # the full one, then a bisection
    kept = next(r for r in prompts.rendered if len(r) == len(conversation(turns)) - 2 * dropped)
    assert kept[0] == "rules" and kept[1] == f"u{dropped}"


async def test_a_last_turn_too_long_alone_is_left_for_the_chat_path_to_refuse() -> None:
    prompts = Prompts()
    chat = ChatCompletionRequest(model="m", messages=conversation(3), max_tokens=4)
    _, ids, _ = await fit_prompt(chat, ModelLimits(max_model_len=10, vocab_size=10), prompts)
    assert len(ids) == 13  # rules + u2: still too long, and refused downstream with the usual 400


def test_cuts_are_at_user_turns_after_the_system_ones() -> None:
    messages = chat_messages(
        "rules",
        [
            {"role": "user", "content": "a"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "x"},
            {"role": "user", "content": "b"},
        ],
    )
    assert cut_points(messages) == (1, [1, 4])  # the call's output never starts what is kept


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_input_file_is_text_with_its_name() -> None:
    text = "línea 1\n東京 🦊\n"
    for data in (b64(text.encode()), f"data:text/markdown;base64,{b64(text.encode())}"):
        part = {"type": "input_file", "filename": "notes.md", "file_data": data}
        assert chat_messages(None, [{"role": "user", "content": [part]}]) == [
            {"role": "user", "content": f"notes.md:\n{text}"}
        ]
    nameless = {"type": "input_file", "file_data": b64(b"x")}
    assert chat_messages(None, [{"role": "user", "content": [{"type": "input_text", "text": "see"}, nameless]}]) == [
        {"role": "user", "content": "see\nx"}
    ]


@pytest.mark.parametrize(
    "part, param, needle",
    [
        ({"file_id": "file-1"}, "file_id", "no Files API"),
        ({"file_url": "https://x/y.txt"}, "file_url", "no Files API"),
        ({}, "file_data", "file_data is required"),
        ({"file_data": "data:application/pdf;base64," + b64(b"x")}, "file_data", "PDF"),
        ({"file_data": b64(b"%PDF-1.4\n")}, "file_data", "PDF"),
        ({"file_data": b64(b"\xff\xfe")}, "file_data", "not UTF-8"),
        ({"file_data": b64(b"a\x00b")}, "file_data", "binary"),
        ({"file_data": "abc"}, "file_data", "not valid base64"),
        ({"file_data": "data:text/plain,hello"}, "file_data", "must be base64"),
        ({"file_data": b64(b"x"), "filename": 3}, "filename", "must be a string"),
    ],
)
def test_input_file_400s_name_the_field(part: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(APIError) as e:
        chat_messages(None, [{"role": "user", "content": [{"type": "input_file", **part}]}])
    assert e.value.status == 400 and e.value.param == f"input[0].content[0].{param}" and needle in e.value.message
