"""The four prompt shapes of /v1/completions (and the pooling routes' `input`): a string, strings, token ids, or
lists of token ids, each normalised to one text or token-id list per prompt."""

from __future__ import annotations

from typing import Any

from server.http.errors import bad_request


def num_prompts(prompt: str | list[Any] | None) -> int:
    """How many prompts `completion_prompts` will make of this (a bad shape counts as whatever it is refused as)."""
    if not isinstance(prompt, list) or not prompt or type(prompt[0]) is int:
        return 1
    return len(prompt)


def completion_prompts(prompt: str | list[Any] | None) -> list[str | list[int]]:
    """Normalise the four prompt shapes into a list of (text | token ids), one per choice group."""
    if prompt is None:
        raise bad_request(
            "prompt is required: a string, a list of strings, token ids, or a list of token-id lists.", "prompt"
        )
    return prompt_items(prompt, "prompt")


def prompt_items(value: str | list[Any], param: str) -> list[str | list[int]]:
    """The four prompt (or pooling `input`) shapes -> one text or token-id list each; a 400 naming `param`."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request(f"{param} must not be an empty list.", param)
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(type(v) is int for v in value):
        return [list(value)]
    if all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
        return [list(v) for v in value]
    raise bad_request(
        f"{param} must be a string, a list of strings, a list of token ids, or a list of non-empty "
        "token-id lists; do not mix them.",
        param,
    )
