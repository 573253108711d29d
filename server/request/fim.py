"""Fill-in-the-middle prompts: the text before and after a gap, in the model's own FIM tokens, as llama.cpp's server
builds them (`format_infill`): the repo-level pattern where the vocabulary has it (arXiv 2409.12186),

    [REPO]myproject\\n [SEP]file0\\n chunk0 ... [SEP]filename\\n [PRE]prefix prompt [SUF]suffix [MID]

Shared by llama.cpp's /infill, OpenAI's `suffix` on /v1/completions and Ollama's on /api/generate. A vocabulary
without FIM tokens is a 400: a prompt without them would be answered, but not as a fill-in-the-middle."""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers

from server.http.errors import bad_request
from server.render.renderer import Renderer

_PROJECT = "myproject\n"  # llama.cpp's fixed repository name
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # llama.cpp's, for a vocabulary without a file separator
_FILENAME = "filename\n"  # llama.cpp's name for the file being completed


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None


# (prefix, suffix, middle, repository names, file separator): Qwen2.5-Coder's, then StarCoder's (1 and 2)
_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|repo_name|>",), "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<repo_name>", "<reponame>"), "<file_sep>"),
)


def fim_tokens(tokenizer: tokenizers.Tokenizer) -> FimTokens | None:
    """The vocabulary's FIM tokens (None: it has none)."""
    for pre, suf, mid, repos, sep in _SPELLINGS:
        p, s, m = (tokenizer.token_to_id(t) for t in (pre, suf, mid))
        if p is not None and s is not None and m is not None:
            repo = next((i for i in map(tokenizer.token_to_id, repos) if i is not None), None)
            return FimTokens(p, s, m, repo, tokenizer.token_to_id(sep))
    return None


def require_fim(tokenizer: tokenizers.Tokenizer, param: str) -> FimTokens:
    tokens = fim_tokens(tokenizer)
    if tokens is None:
        raise bad_request(
            f"{param}: this model's vocabulary has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
            "<|fim_middle|> or StarCoder's <fim_prefix>, ...): serve a code model trained for infilling.",
            param,
        )
    return tokens


@dataclass(frozen=True)
class ExtraChunk:
    """One of /infill's `input_extra` entries: another file's text, put before the prefix."""

    filename: str
    text: str


async def fim_prompt_ids(
    renderer: Renderer,
    tokens: FimTokens,
    prefix: str,
    suffix: str,
    *,
    extra: list[ExtraChunk] | None = None,
    prompt: str = "",
) -> list[int]:
    """The token ids llama.cpp's format_infill gives (without its batch-size cut: a prompt too long for the model is
    refused by the length check instead), with the beginning token where the tokenizer adds one."""

    async def ids(text: str) -> list[int]:
        return await renderer.encode(text, False) if text else []

    head: list[int] = []
    if tokens.repo is not None:
        head += [tokens.repo, *await ids(_PROJECT)]
    for chunk in extra or []:
        if tokens.file_sep is not None:
            head += [tokens.file_sep, *await ids(chunk.filename + "\n")]
        else:
            head += await ids(_CHUNK_SEPARATOR)
        head += await ids(chunk.text)
    if tokens.file_sep is not None:
        head += [tokens.file_sep, *await ids(_FILENAME)]
    start = _added_bos(renderer.tokenizer)
    body = [tokens.prefix, *await ids(prefix), *await ids(prompt), tokens.suffix, *await ids(suffix), tokens.middle]
    return head + start + body


def _added_bos(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """[bos] when the tokenizer puts one in front of a text (llama_vocab_get_add_bos), else []."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    special = tokenizer.encode("a", add_special_tokens=True).ids
    return list(special[:1]) if len(special) > len(plain) and special[1:][: len(plain)] == plain else []
