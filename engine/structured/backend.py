"""The grammar backend interface, in the shape of vLLM's structured-output backends.

A backend compiles a StructuredOutputs into a grammar object in its initial state (slow: runs in the
manager's compile thread, and the result is cached); each request then gets its own `copy()` of it.
A second backend (xgrammar: GrammarCompiler + GrammarMatcher) implements the same two protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.messages import StructuredOutputs


class StructuredGrammar(Protocol):
    """One request's matcher: which tokens may come next, given the tokens accepted so far."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over the tokens; False (and `error()` says why) when one is not allowed."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed set into bitmask[row] (int32 words, bit j of word w = token 32w + j)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted (speculative decoding; a recompute that drops output)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and admits no more tokens (or it consumed an EOS)."""
        ...

    def error(self) -> str:
        """Why the matcher failed; "" while it is fine."""
        ...

    def completion(self, limit: int) -> list[int] | None:
        """Tokens (at most limit) that finish the grammar from here, short rather than shortest; None when
        none is found. Does not move the matcher (engine/structured/forced_finish.py forces them near max_tokens)."""
        ...

    def finishes(self, token_ids: Sequence[int]) -> bool:
        """These tokens, from here, complete the grammar (a finish found earlier, checked again: cheap)."""
        ...

    def copy(self) -> StructuredGrammar:
        """An independent matcher in the same state (the cached compiled grammar -> one per request)."""
        ...


class StructuredBackend(Protocol):
    """Compiles constraints for one tokenizer; `vocab_size` is the model's (padded) logits width."""

    vocab_size: int

    def compile(self, so: StructuredOutputs) -> StructuredGrammar:
        """The grammar in its initial state; raises engine.structured.grammar.GrammarError (or ValueError)."""
        ...

    def fill_bitmasks(self, items: Sequence[tuple[StructuredGrammar, int]], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] for each (grammar, row); a backend may do the rows in parallel."""
        ...

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The bytes of these tokens (reasoning_end detection)."""
        ...


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """[rows, words] int32, all tokens allowed; pinned for a non-blocking copy to the GPU."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
