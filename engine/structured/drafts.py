"""A constrained sequence's speculative drafts (engine/spec/): cut to what its grammar allows, and the grammar
state behind each verification row.

The grammar advances over accepted tokens only (StructuredOutputManager.accept, after verification); a draft is
checked on a copy of the matcher. Row j of a verification is masked by the grammar after draft tokens 0..j-1,
which is the mask plain decoding would apply at that position, so greedy output is the same token for token.
The forced finish near max_tokens (engine/structured/forced_finish.py) is a state machine plain decoding steps
once per token; drafts stop short of where it may act, so it never has to run for a drafted row.
"""

from __future__ import annotations

from engine.types.constraint_state import StructuredGrammar, StructuredState


def draft_room(state: StructuredState, budget: int) -> int:
    """How many draft tokens the sequence may verify at once; budget: the tokens it may still generate.

    0 while the constraint is inactive (reasoning_end not seen: a draft token could switch it on) and while a
    finish is forced or about to be looked for; else the rows stay above the budget at which it is looked for."""
    if not state.active or state.grammar is None or state.closing is not None:
        return 0
    return max(budget - state.check_at - 1, 0)


def allowed_prefix(state: StructuredState, draft: list[int]) -> list[int]:
    """The longest head of `draft` the grammar accepts from its current state: a forbidden token ends the draft
    (so does one after the grammar is complete). The sequence's own matcher does not move."""
    if state.grammar is None or not draft:
        return []
    probe = state.grammar.copy()
    n = 0
    while n < len(draft) and probe.accept_tokens([draft[n]]):
        n += 1
    return draft[:n]


def row_grammar(previous: StructuredGrammar, token: int) -> StructuredGrammar | None:
    """The grammar for the next verification row: a copy of the previous row's advanced over its draft token;
    None when the grammar forbids it (the row's logits are then never used: the draft was rejected before)."""
    g = previous.copy()
    return g if g.accept_tokens([token]) else None
