"""Grammars compiled off the engine's step, cached by constraint; one matcher per request; masks per step.

A constrained request waits in the scheduler (WAITING_FOR_GRAMMAR, vLLM's WAITING_FOR_FSM) until its
compile finishes; everything else keeps running. The backend itself (the LLTokenizer: ~1 s) is built when the
engine process starts (`warm_up`), or, with that off, by the first compile in the compile thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.messages import StructuredOutputs
from engine.structured.backend import StructuredBackend, allocate_bitmask
from engine.structured.bitmask import allow_only, apply_token_bitmask
from engine.structured.drafts import row_grammar
from engine.structured.forced_finish import advance, closing_token
from engine.types.constraint_state import StructuredGrammar, StructuredState
from engine.types.sequence import Sequence

log = logging.getLogger("engine")
CACHE_SIZE = 256  # compiled grammars kept; a request copies its grammar, so eviction frees only the template


@dataclass(frozen=True, slots=True)
class SamplerBans:
    """Tokens the sampler will mask this step: eos and stop ids before min_tokens, all but allowed_token_ids."""

    early_stops: frozenset[int]
    allowed: frozenset[int] | None

    def __contains__(self, token: object) -> bool:
        return token in self.early_stops or (self.allowed is not None and token not in self.allowed)


@dataclass(slots=True)
class PendingMasks:
    filled: Future[None]
    bitmask: torch.Tensor
    rows: list[int]  # logits row of each bitmask row


class StructuredOutputManager:
    def __init__(
        self,
        make_backend: Callable[[], StructuredBackend],
        device: torch.device,
        eos_token_ids: Collection[int],
        max_workers: int = 1,
    ) -> None:
        self._make_backend = make_backend
        self.device = device
        self._eos = frozenset(eos_token_ids)
        self._max_workers = max_workers
        self._backend: StructuredBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started by the first constrained request
        self._cache: OrderedDict[StructuredOutputs, Future[StructuredGrammar]] = OrderedDict()
        self._waiting: dict[Sequence, Future[StructuredGrammar]] = {}  # insertion order: arrival
        self._wake = threading.Event()  # set whenever a compile finishes
        self._bitmask: torch.Tensor | None = None
        self._filler: ThreadPoolExecutor | None = None  # one thread: fills the step's bitmask during forward
        self.num_live = 0  # matchers held by unfinished sequences (leak check)

    # ---- compiling ---------------------------------------------------------------------------
    def backend(self) -> StructuredBackend:
        with self._backend_lock:  # compile threads race to build it once
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def warm_up(self) -> None:
        """Build the backend now (the engine process, before it says Ready): built by the first constrained
        request instead, it holds the GIL (~1 s for a 150k vocabulary), stalling every running request's step
        and the heartbeat thread."""
        t0 = time.perf_counter()
        backend = self.backend()
        log.info("grammar backend ready: %d tokens in %.2f s", backend.vocab_size, time.perf_counter() - t0)

    def _compile_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar")
        return self._pool

    def _compile(self, so: StructuredOutputs) -> StructuredGrammar:
        return self.backend().compile(so)

    def submit(self, seq: Sequence) -> None:
        """Start (or join) the compile of seq's constraint; seq must be held by the scheduler meanwhile."""
        so = seq.params.structured_outputs
        assert so is not None
        seq.structured = StructuredState(so, active=so.reasoning_end is None)
        key = grammar_key(so)
        fut = self._cache.get(key)
        if fut is None:
            fut = self._compile_pool().submit(self._compile, so)
            fut.add_done_callback(lambda _: self._wake.set())
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._waiting[seq] = fut

    @property
    def num_compiling(self) -> int:
        return len(self._waiting)

    def poll(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """(sequences whose matcher is ready, (sequences whose compile failed, why)); both leave the wait."""
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, str]] = []
        for seq, fut in list(self._waiting.items()):
            if not fut.done():
                continue
            del self._waiting[seq]
            error = fut.exception()
            if error is not None:
                failed.append((seq, f"structured output: {str(error).strip() or type(error).__name__}"))
                continue
            assert seq.structured is not None
            seq.structured.grammar = fut.result().copy()
            self.num_live += 1
            ready.append(seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or timeout passes (the step has nothing else to run)."""
        if any(f.done() for f in self._waiting.values()):
            return
        self._wake.wait(timeout)
        self._wake.clear()

    def release(self, seq: Sequence) -> None:
        """seq finished or was aborted: drop its matcher, or forget its pending compile."""
        self._waiting.pop(seq, None)
        state = seq.structured
        if state is not None and state.grammar is not None:
            state.grammar = None
            self.num_live -= 1

    # ---- the step ------------------------------------------------------------------------------
    def start_masks(self, seqs: list[Sequence]) -> PendingMasks | None:
        """Fill the bitmask rows of seqs' active grammars in a thread, overlapping the forward pass
        (the matchers do not move until the sampled tokens come back); None when none is constrained.
        A verification's rows share the sequence's state; a later row is masked by the grammar after the
        draft tokens before it (engine/structured/drafts.py)."""
        items: list[tuple[StructuredState, int, int, SamplerBans, int | None]] = []
        firsts: dict[int, int] = {}  # id(state) -> the token count of its sequence's first row
        for i, s in enumerate(seqs):
            st = s.structured
            if st is None or not st.active or st.grammar is None:
                continue
            first = firsts.setdefault(id(st), s.num_tokens)
            drafted = s.token_ids[-1] if s.num_tokens > first else None  # the draft token before this row
            items.append((st, i, s.params.max_tokens - s.num_output_tokens, self._banned(s), drafted))
        if not items:
            return None
        backend = self.backend()
        bitmask = self._bitmask_rows(len(items), backend.vocab_size)
        rows = [(st, budget, banned, drafted) for st, _, budget, banned, drafted in items]
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        fut = self._filler.submit(self._fill, backend, rows, bitmask)
        return PendingMasks(fut, bitmask, [i for _, i, _, _, _ in items])

    def _banned(self, seq: Sequence) -> SamplerBans:
        """What the sampler masks at this step whatever the grammar says."""
        p = seq.params
        early = self._eos.union(p.stop_token_ids) if seq.num_output_tokens < p.min_tokens else frozenset()
        return SamplerBans(early, frozenset(p.allowed_token_ids) if p.allowed_token_ids else None)

    @staticmethod
    def _fill(
        backend: StructuredBackend,
        rows: list[tuple[StructuredState, int, SamplerBans, int | None]],
        bitmask: torch.Tensor,
    ) -> None:
        plain: list[tuple[StructuredGrammar, int]] = []
        last: dict[int, StructuredGrammar | None] = {}  # id(state) -> the grammar of its previous row
        for row, (state, budget, banned, drafted) in enumerate(rows):
            if drafted is not None:  # a verification's later row: no forced finish there (drafts.draft_room)
                prev = last.get(id(state))
                g = last[id(state)] = row_grammar(prev, drafted) if prev is not None else None
                if g is None:
                    bitmask[row] = -1  # never read: the draft token before it was rejected
                else:
                    plain.append((g, row))
                continue
            last[id(state)] = state.grammar
            token = closing_token(state, budget, banned)
            if token is not None:
                allow_only(bitmask, row, token)
            elif state.grammar is not None:
                plain.append((state.grammar, row))
        backend.fill_bitmasks(plain, bitmask)

    @torch.inference_mode()  # the runner's logits are inference tensors: in-place work needs the mode
    def mask_logits(self, logits: torch.Tensor, pending: PendingMasks) -> None:
        """Ban, in place, what each constrained row's grammar forbids next (logits row i is seqs[i]'s)."""
        pending.filled.result()
        apply_token_bitmask(logits, pending.bitmask, pending.rows)

    def _bitmask_rows(self, n: int, vocab_size: int) -> torch.Tensor:
        buf = self._bitmask
        if buf is None or buf.shape[0] < n:
            buf = self._bitmask = allocate_bitmask(max(n, 8), vocab_size, pin=self.device.type == "cuda")
        return buf[:n]

    def accept(self, seq: Sequence, token: int) -> str | None:
        """Feed the sampled token: None (go on), "stop" (the grammar is complete), or an error message."""
        state = seq.structured
        if state is None or state.grammar is None:
            return None
        if not state.active:  # the token that completes reasoning_end is not the constraint's
            end = (state.spec.reasoning_end or "").encode()
            state.tail = (state.tail + self.backend().decode_bytes([token]))[-max(len(end), 1) * 4 :]
            if end in state.tail:
                state.active = True
            return None
        if not state.grammar.accept_tokens([token]):
            error = state.grammar.error() or "not allowed"
            return f"structured output: token {token} was rejected by the grammar: {error}"
        advance(state, token)
        return "stop" if state.grammar.is_terminated() else None

    def close(self) -> None:
        for pool in (self._pool, self._filler):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def grammar_key(so: StructuredOutputs) -> StructuredOutputs:
    """The cache key: the constraint without reasoning_end (the grammar is the same)."""
    return StructuredOutputs(so.kind, so.spec) if so.reasoning_end is not None else so
