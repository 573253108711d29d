"""The llguidance backend: an LLTokenizer per engine, an LLMatcher per request."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import llguidance
import numpy as np
import torch

from engine.messages import StructuredOutputs
from engine.structured.finish_search import Marks, completion, preferred_tokens, structural_marks
from engine.structured.grammar import LIMITS, GrammarError, to_grammar
from engine.structured.pattern_samples import required_keys, schema_samples
from engine.types.constraint_state import StructuredGrammar

INITIAL_MEMO = 64  # max_tokens values whose first finish is kept per compiled grammar
PAR_MIN_ROWS = 4  # from this many rows the LLExecutor's threads beat filling one row after another
MAX_HINTS = 2048  # token sequences (samples of the schema's patterns and their suffixes) per grammar


def _check(bitmask: torch.Tensor) -> None:
    """llguidance writes through the tensor's pointer: it must be what that write assumes."""
    if not (bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.dim() == 2 and bitmask.is_contiguous()):
        raise ValueError("the bitmask must be a contiguous 2-D int32 CPU tensor")


def _fill_rows(
    executor: llguidance.LLExecutor, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor
) -> None:
    """llguidance.torch.fill_next_token_bitmask_par: that module torch.compile's a function at import, which
    loads torch._dynamo and Triton (seconds, and nanobind's leak report at exit) in a CPU-only engine."""
    _check(bitmask)
    executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def load_tokenizer(folder: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The checkpoint's tokenizer for llguidance, n_vocab = the model's logits width (~1.5-2.5 s: call it lazily).

    Rows past the tokenizer's tokens (a padded embedding) have no bytes, so no grammar ever allows them.
    """
    folder = Path(folder)
    eos = list(eos_token_ids) or None
    file = folder / "tokenizer.json"
    if file.is_file():  # tokenizer.json as is: a second faster than loading transformers' tokenizer first
        return llguidance.LLTokenizer(file.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=eos)
    from llguidance.hf import from_tokenizer  # why late: it imports transformers, heavy and rarely needed
    from transformers import AutoTokenizer  # why late: only a folder without tokenizer.json needs it

    hf = AutoTokenizer.from_pretrained(folder)  # a slow-only tokenizer folder (tokenizer.model): converted
    return from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Finish:
    """What completion() needs besides the matcher, shared by a grammar's copies."""

    preferred: np.ndarray
    eos: list[int]
    marks: Marks
    hints: tuple[list[int], ...] = ()  # ways out of the schema's pattern strings (engine/structured/pattern_samples.py)
    keys: tuple[list[int], ...] = ()  # the schema's required keys, `"name":` and `name":`
    tokenizer: llguidance.LLTokenizer | None = None  # the finish's bytes are retokenized with it (fewer tokens)

    def search(self, matcher: llguidance.LLMatcher, limit: int) -> list[int] | None:
        return completion(matcher, self.preferred, self.eos, limit, self.hints, self.marks, self.keys, self.tokenizer)


class LLGuidanceGrammar:
    def __init__(
        self, matcher: llguidance.LLMatcher, finish: Finish, initial: dict[int, list[int] | None] | None = None
    ) -> None:
        self.matcher = matcher
        self._finish_with = finish
        # completion() from the state this matcher was copied in, by limit, shared by the copies while they have
        # accepted nothing: every request with this constraint asks it at its first step; None once moved
        self._initial: dict[int, list[int] | None] | None = initial if initial is not None else {}

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        self._initial = None
        return bool(self.matcher.consume_tokens(list(token_ids)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check(bitmask)
        words = bitmask[row]  # llguidance.torch.fill_next_token_bitmask, without importing it (see _fill_rows)
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def rollback(self, num_tokens: int) -> None:
        self._initial = None
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def error(self) -> str:
        return str(self.matcher.get_error()) if self.matcher.is_error() else ""

    def completion(self, limit: int) -> list[int] | None:
        memo = self._initial
        if memo is None:
            return self._finish_with.search(self.matcher, limit)
        if limit not in memo:
            if len(memo) >= INITIAL_MEMO:
                memo.clear()
            memo[limit] = self._finish_with.search(self.matcher, limit)
        found = memo[limit]
        return None if found is None else list(found)

    def finishes(self, token_ids: Sequence[int]) -> bool:
        m = self.matcher.deep_copy()
        return bool(m.consume_tokens(list(token_ids))) and bool(m.is_stopped())

    def copy(self) -> LLGuidanceGrammar:
        # deep_copy: ~1 µs against ~1 ms for a fresh LLMatcher (bench/README.md, "Constrained decoding's cost")
        return LLGuidanceGrammar(self.matcher.deep_copy(), self._finish_with, self._initial)


class LLGuidanceBackend:
    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self._finish_with = Finish(
            preferred_tokens(tokenizer),
            [int(t) for t in tokenizer.eos_tokens],
            structural_marks(tokenizer),
            tokenizer=tokenizer,
        )
        self._executor: llguidance.LLExecutor | None = None

    @classmethod
    def from_checkpoint(cls, folder: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> LLGuidanceBackend:
        return cls(load_tokenizer(folder, vocab_size, eos_token_ids))

    def compile(self, so: StructuredOutputs) -> LLGuidanceGrammar:
        grammar = to_grammar(so)
        matcher = llguidance.LLMatcher(
            self.tokenizer, grammar, log_level=0, limits=LIMITS
        )  # never raises: check is_error
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip() or "the grammar cannot be compiled")
        return LLGuidanceGrammar(matcher, self._finish_for(so))

    def _finish_for(self, so: StructuredOutputs) -> Finish:
        """The search's options, with hints from the schema's patterns (each sample and its suffixes) and its
        required keys."""
        if so.kind != "json" or ('"pattern"' not in so.spec and '"required"' not in so.spec):
            return self._finish_with
        schema = json.loads(so.spec)
        hints: list[list[int]] = []
        for sample in schema_samples(schema):
            for start in range(len(sample)):
                hints.append([int(t) for t in self.tokenizer.tokenize_str(sample[start:])])
        keys = [
            [int(t) for t in self.tokenizer.tokenize_str(text)]
            for key in required_keys(schema)
            for text in (f'"{key}":', f'{key}":')
        ]
        return replace(
            self._finish_with,
            hints=tuple(sorted(hints, key=len)[:MAX_HINTS]),  # short ways out first
            keys=tuple(keys),
        )

    def fill_bitmasks(self, items: Sequence[tuple[StructuredGrammar, int]], bitmask: torch.Tensor) -> None:
        grammars = [(g, row) for g, row in items if isinstance(g, LLGuidanceGrammar)]
        if len(grammars) < PAR_MIN_ROWS or len(grammars) < len(items):
            for g2, row in items:
                g2.fill_bitmask(bitmask, row)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        _fill_rows(self._executor, [(g.matcher, row) for g, row in grammars], bitmask)

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        return bytes(self.tokenizer.decode_bytes(list(token_ids)))
