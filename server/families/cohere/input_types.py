"""Cohere's `input_type` as a model's prompt: the text sentence-transformers puts before an input of that kind
(config_sentence_transformers.json "prompts"). A prompt of the same name wins; Cohere's search_query and
search_document also find a "query" / "document" (or "passage") prompt. A model with no prompts embeds every kind
the same way, so Cohere's five types are all accepted there; otherwise an input type that names no prompt is a
400 listing those that do."""

from __future__ import annotations

from engine.messages import PoolingInfo
from server.http.errors import bad_request

COHERE_INPUT_TYPES = ("search_document", "search_query", "classification", "clustering", "image")
_ALIASES = {"search_query": ("query",), "search_document": ("document", "passage", "doc")}


def _prompt_name(input_type: str, prompts: dict[str, str]) -> str | None:
    for name in (input_type, *_ALIASES.get(input_type, ())):
        if name in prompts:
            return name
    return None


def supported_input_types(info: PoolingInfo) -> list[str]:
    if not info.prompts:
        return list(COHERE_INPUT_TYPES)
    cohere = [t for t in COHERE_INPUT_TYPES if t not in info.prompts and _prompt_name(t, info.prompts)]
    return sorted(info.prompts) + cohere


def prompt_for(input_type: str | None, info: PoolingInfo) -> str:
    """The text put before each input of this type ("" for none); a 400 for a type the model has no prompt for."""
    prompts = info.prompts
    if input_type is None:
        return prompts[info.default_prompt_name] if info.default_prompt_name is not None else ""
    name = _prompt_name(input_type, prompts)
    if name is not None:
        return prompts[name]
    if not prompts and input_type in COHERE_INPUT_TYPES:
        return ""
    raise bad_request(
        f"input_type {input_type!r} is not supported by this model; supported: "
        f"{', '.join(supported_input_types(info))}.",
        "input_type",
    )
