"""Finishing a constrained output within max_tokens instead of cutting it.

A model may stay inside a free-form part of a grammar (a string with no maxLength, an unbounded
integer, `[a-z]+`) for as long as it likes; a random-weight one never leaves. When the tokens a request
may still generate come down to what finishing the grammar takes (plus MARGIN), the mask allows only the
next token of that finish (engine/structured/finish_search.py), so the output parses and ends with "stop".
A model that finishes by itself is never touched; one cut by a max_tokens too small for any finish gets a
valid prefix, as before.

The finish is looked for rarely: at the first step, then halfway to where it would have to start (at most
MAX_GAP tokens on: the model may open members whose required parts lengthen the finish manyfold), and every step
once within EVERY_STEP tokens of it (one token can open a deep structure).
"""

from __future__ import annotations

import logging
from collections.abc import Container

from engine.types.constraint_state import StructuredGrammar, StructuredState

log = logging.getLogger("engine")

MARGIN = 4  # the finish starts this many tokens before it would have to: it ends just inside max_tokens
GROWTH = 3  # and a 1/GROWTH of its length earlier (or by the most it grew between two searches, when more): one token
# can lengthen it (a new array item whose pattern must be met: a UUID's adds a third)
EVERY_STEP = 16
MAX_GAP = 32  # tokens between searches at most: what the model opens meanwhile can lengthen the finish manyfold
MAX_MISSES = 32  # steps in a row a finish is looked for again after one no longer fits


def closing_token(state: StructuredState, budget: int, banned: Container[int]) -> int | None:
    """The one token this step must take to finish in time, or None (the grammar's mask as usual).

    budget: tokens the request may still generate, this step's included; banned: tokens the sampler will
    mask anyway (eos before min_tokens), which the finish waits for rather than force."""
    if state.closing is None and budget <= state.check_at and state.grammar is not None:
        try:
            _look(state, state.grammar, budget)
        except Exception:  # the finish is an extra: a failing search must end neither the request nor the engine
            log.exception("structured output: looking for a finish failed; this request is not finished early")
            state.check_at = -1
    if not state.closing or state.closing[0] in banned:
        return None
    return state.closing[0]


def _look(state: StructuredState, grammar: StructuredGrammar, budget: int) -> None:
    """Find the finish (or replay the last one); force it now, or say when to look again."""
    # the last finish found often still finishes (the model wrote on inside the same string): replaying it
    # costs ~1/50 of a search
    path = state.finish
    if not (path and len(path) <= budget and grammar.finishes(path)):
        path = state.finish = grammar.completion(budget)
    if path is None:  # no finish fits (or none was found): look again later, the model may close things
        # one fitted before: the finish grew for a while (a string's pattern to complete), and may shrink back
        # within a few tokens (the string closed), so look again at the next step rather than at half the budget
        state.misses += 1 if state.finish_len else 0
        state.check_at = budget - 1 if 0 < state.misses <= MAX_MISSES else budget // 2
        return
    # the finish's length moves as the model writes (inside a string it is longer): of the last two, the longer
    longest = max(len(path), state.finish_len)
    state.growth = max(state.growth, len(path) - state.finish_len if state.finish_len else 0)
    state.finish_len, state.misses = len(path), 0
    early = max(longest // GROWTH, state.growth) + MARGIN
    if budget <= longest + early:
        state.closing = list(path)
    else:
        gap = budget - longest - early
        state.check_at = budget - 1 if gap <= EVERY_STEP else budget - min(gap // 2, MAX_GAP)


def advance(state: StructuredState, token: int) -> None:
    """The sampled token was accepted by the grammar: follow the finish, or drop it when the model left it."""
    if state.finish and token == state.finish[0]:
        state.finish = state.finish[1:]
    if not state.closing:
        return
    if token == state.closing[0]:
        del state.closing[0]
    else:  # a banned token's turn: the model went elsewhere, so the finish is found again next step
        state.closing = None
        state.check_at = 1 << 30
