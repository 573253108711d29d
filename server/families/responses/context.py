"""What a Responses request's conversation holds beyond its own items: `item_reference`s resolved from the
store, and `truncation: "auto"`, which drops turns from the conversation's start until the prompt fits.

truncation "auto" cuts at user turns (a turn's function calls and their outputs go with it; the leading system
turns, `instructions` among them, stay) and keeps the fewest cuts that fit: the prompt shorter than
max_model_len, and with max_output_tokens, prompt + max_output_tokens within it (the chat path's own rule). It
searches the cut by bisection, rendering and tokenizing a few candidates. If even the last user turn alone does
not fit, the request goes on with it and the chat path's 400 says why. "disabled" (the default) is that 400
for any prompt too long.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from server.families.responses.store import ResponseStore
from server.http.errors import bad_request
from server.request.input_processor import ModelLimits
from server.request.openai_protocol import ChatCompletionRequest

Prompt = tuple[str, list[int], Any]  # (rendered text, token ids, images' engine inputs)


async def resolve_references(items: list[Any], store: ResponseStore) -> list[Any]:
    """The request's input items with each {"type": "item_reference", "id"} replaced by that stored item (a
    404 naming input[i].id when no stored response holds it)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            ref = item.get("id")
            if not isinstance(ref, str) or not ref:
                raise bad_request(
                    f"input[{i}].id is required: the id of an item of a stored response.", f"input[{i}].id"
                )
            item = await store.item(ref, f"input[{i}].id")
        out.append(item)
    return out


def fits(num_prompt: int, chat: ChatCompletionRequest, limits: ModelLimits) -> bool:
    max_len = limits.max_model_len
    return num_prompt < max_len and (chat.max_tokens is None or num_prompt + chat.max_tokens <= max_len)


def cut_points(messages: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """(how many leading system messages stay, the indices where the kept conversation may start: its first
    message, then each later user turn)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    return head, [head, *(i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user")]


async def fit_prompt(
    chat: ChatCompletionRequest, limits: ModelLimits, prompt: Callable[[ChatCompletionRequest], Awaitable[Prompt]]
) -> Prompt:
    """truncation "auto": the prompt of the longest conversation suffix (cut at a user turn) that fits."""
    messages = chat.messages or []
    head, cuts = cut_points(messages)
    tried: dict[int, Prompt] = {}

    async def at(k: int) -> Prompt:
        if k not in tried:
            kept = [*messages[:head], *messages[cuts[k] :]]
            tried[k] = await prompt(msgspec.structs.replace(chat, messages=kept))
        return tried[k]

    if fits(len((await at(0))[1]), chat, limits):
        return tried[0]
    lo, hi = 1, len(cuts) - 1  # the answer is in [lo, hi]; hi: the last user turn, kept even if too long
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(len((await at(mid))[1]), chat, limits):
            hi = mid
        else:
            lo = mid + 1
    return await at(hi) if hi >= 1 else tried[0]
