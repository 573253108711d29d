"""A sequence's constraint state (`Sequence.structured`): a leaf, so engine/core/sequence.py imports nothing that
imports it back.

engine/structured/manager.py creates it and feeds it tokens; engine/structured/forced_finish.py moves its finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.messages import StructuredOutputs
from engine.structured.backend import StructuredGrammar


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
