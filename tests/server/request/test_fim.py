"""Fill-in-the-middle prompts (server/request/fim.py): which vocabularies have FIM tokens, and the layout llama.cpp's
format_infill gives with and without the repository and file-separator tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from server.request.fim import ExtraChunk, fim_prompt_ids, fim_tokens
from tests.engine.gguf.files import smollm2_file

pytestmark = pytest.mark.anyio


def word_tokenizer(specials: list[str]) -> tokenizers.Tokenizer:
    words = ["a", "b", "c", "x.py", "myproject", "filename", "\n", "---", "snippet"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    tok.add_special_tokens(specials)
    return tok


class Renderer:  # the one method fim_prompt_ids uses, on a tokenizer of whole words
    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def test_smollm2_has_no_fim_tokens() -> None:
    """The default model's vocabulary has <repo_name> and <file_sep> but no <fim_*>: FIM routes answer a 400."""
    from engine.gguf.folder import resolve_gguf

    found = resolve_gguf(smollm2_file())
    assert found is not None
    tok = tokenizers.Tokenizer.from_file(str(Path(found[0]) / "tokenizer.json"))
    assert tok.token_to_id("<file_sep>") is not None and fim_tokens(tok) is None


async def test_starcoder_layout_with_repository_and_files() -> None:
    tok = word_tokenizer(["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"])
    fim = fim_tokens(tok)
    assert fim is not None and fim.repo is not None and fim.file_sep is not None
    renderer: Any = Renderer(tok)
    ids = await fim_prompt_ids(renderer, fim, "a", "b", extra=[ExtraChunk("x.py", "c")], prompt="c")
    words = [tok.id_to_token(i) for i in ids]
    assert words == (
        ["<repo_name>", "myproject", "\n", "<file_sep>", "x.py", "\n", "c", "<file_sep>", "filename", "\n"]
        + ["<fim_prefix>", "a", "c", "<fim_suffix>", "b", "<fim_middle>"]
    )


async def test_without_file_separators_chunks_are_joined_by_llama_cpps_snippet_line() -> None:
    tok = word_tokenizer(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    fim = fim_tokens(tok)
    assert fim is not None and fim.repo is None and fim.file_sep is None
    renderer: Any = Renderer(tok)
    ids = await fim_prompt_ids(renderer, fim, "a", "", extra=[ExtraChunk("x.py", "c")])
    expected = [*await renderer.encode("\n\n--- snippet ---\n\n", False), *await renderer.encode("c", False)]
    assert ids == expected + [fim.prefix, *await renderer.encode("a", False), fim.suffix, fim.middle]
    assert fim_tokens(word_tokenizer(["<fim_prefix>", "<fim_suffix>"])) is None  # all three or none
