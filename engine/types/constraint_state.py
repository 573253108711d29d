"""A sequence's constraint state (`Sequence.structured`) and the matcher protocol it holds (the backends of
engine/structured/backend.py implement it).

engine/structured/manager.py creates it and feeds it tokens; engine/structured/forced_finish.py moves its finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(slots=True)
class StructuredState:
    """A sequence's constraint: its own matcher, and whether the constraint applies yet (reasoning_end)."""

    spec: StructuredOutputs
    grammar: StructuredGrammar | None = None  # None until compiled
    active: bool = True  # False until the output contains spec.reasoning_end
    tail: bytes = b""  # the output's last bytes while inactive: reasoning_end may span tokens
    closing: list[int] | None = None  # the finish being forced near max_tokens (engine/structured/forced_finish.py)
    finish: list[int] | None = None  # the last finish found, from an earlier state (closing.py tries it first)
    check_at: int = 1 << 30  # look for a finish once the tokens left are at most this
    finish_len: int = 0  # the length of the last finish found (0: none yet)
    growth: int = 0  # the most the finish grew from one search to the next
    misses: int = 0  # searches in a row that found no finish within the tokens left, after one had been found
