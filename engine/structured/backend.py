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
from engine.types.constraint_state import StructuredGrammar


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
