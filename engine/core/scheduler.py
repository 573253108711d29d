"""Continuous batching: which sequences run this step, and how many tokens each.

Policy (as vLLM v1): a token budget per step (`max_num_batched_tokens`) and a cap on running
sequences (`max_num_seqs`). Running decodes go first (one token each), then running partial
prefills, then waiting requests in arrival order ((priority, arrival) under the "priority"
policy), each getting min(remaining, budget left) tokens: chunked prefill, so a long prompt never
stalls running decodes. When KV blocks run out, the running sequence last in that order (the
newest; under "priority" the lowest-priority one) is preempted by recompute. Under "priority", while a
request waits or prefills, the running sequences ranked below it sit out the step (paused, their KV kept), so
a high-priority prompt's first token never shares a step with lower-priority decodes (batch lines).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable

from engine.core.block_manager import BlockManager
from engine.messages import EngineStats
from engine.types.sequence import ScheduledSeq, SeqStatus, Sequence


class RequestRefused(ValueError):
    """A request that can never run under this engine's limits."""


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.time,
        policy: str = "fcfs",
        max_loras: int | None = None,
    ) -> None:
        """max_loras: the most distinct LoRA adapters running at once (--max-loras); a request whose adapter
        would exceed it waits, and requests behind it may go first (vLLM does the same)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, not {policy!r}")
        self.by_priority = policy == "priority"  # fcfs: priority is ignored, as vLLM (its server refuses it)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.bm = block_manager
        self.clock = clock  # wall clock, like the server's arrival_time
        self.running: list[Sequence] = []  # in scheduling order; finished ones dropped lazily
        self._waiting: list[tuple[int, float, int, Sequence]] = []  # heap; aborted ones skipped lazily
        self._num_waiting = 0
        self._order: dict[Sequence, int] = {}  # arrival counter, the FCFS tie-break
        self._by_id: dict[str, Sequence] = {}
        self._counter = 0
        self.num_preemptions = 0
        self.max_loras = max_loras

    # ---- admission + removal ----------------------------------------------------------------
    def add(self, seq: Sequence, *, hold: bool = False) -> None:
        """Queue seq, or with hold keep it WAITING_FOR_GRAMMAR (counted as waiting) until `release`."""
        n, max_tokens = seq.num_prompt_tokens, seq.params.max_tokens
        if n == 0:
            raise RequestRefused("the prompt is empty; send at least one token")
        if n + max_tokens > self.max_model_len:
            raise RequestRefused(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {n + max_tokens} ({n} in the prompt, {max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens"
            )
        final = n + max_tokens  # the last token's K/V is never computed (pooling, max_tokens 0: all are)
        # with a sliding window on every layer, passed blocks are released as the sequence runs
        blocks = self.bm.most_blocks_held(max(final - 1, n), min(self.max_num_batched_tokens, final))
        if blocks > self.bm.num_total_blocks:
            raise RequestRefused(
                f"the request needs {blocks} KV cache blocks ({n} prompt tokens + {max_tokens} "
                f"max_tokens) but the cache holds only {self.bm.num_total_blocks}; shorten it or "
                "start the server with more KV cache memory"
            )
        if seq.request_id in self._by_id:
            raise RequestRefused(f"request id {seq.request_id!r} is already running; use a new id")
        seq.status = SeqStatus.WAITING
        self._by_id[seq.request_id] = seq
        self._order[seq] = self._counter
        self._counter += 1
        if hold:
            seq.status = SeqStatus.WAITING_FOR_GRAMMAR
            self._num_waiting += 1
        else:
            self._push_waiting(seq)

    def release(self, seq: Sequence) -> None:
        """A held sequence may run: it queues in its arrival place (its order was taken at add)."""
        if seq.status is SeqStatus.WAITING_FOR_GRAMMAR and self._by_id.get(seq.request_id) is seq:
            seq.status = SeqStatus.WAITING
            heapq.heappush(self._waiting, (self._rank(seq), seq.arrival_time, self._order[seq], seq))

    def abort(self, request_ids: Iterable[str]) -> list[Sequence]:
        """Finish the named requests now with finish_reason "abort"; unknown ids are ignored."""
        aborted = []
        for rid in request_ids:
            seq = self._by_id.get(rid)
            if seq is not None:
                self.finish(seq, "abort")
                aborted.append(seq)
        return aborted

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free seq's blocks and forget it (it leaves `running` / the waiting heap lazily)."""
        if self._by_id.get(seq.request_id) is not seq:
            return  # already finished
        if seq.status is SeqStatus.WAITING or seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            self._num_waiting -= 1
            if len(self._waiting) > 2 * self._num_waiting + 64:  # drop finished entries at once
                self._waiting = [e for e in self._waiting if e[3].status is SeqStatus.WAITING and e[3] is not seq]
                heapq.heapify(self._waiting)
        del self._by_id[seq.request_id]
        del self._order[seq]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq)

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        self.bm.begin_step()
        chosen: dict[Sequence, int] = {}  # insertion order is the batch order
        drafts: dict[Sequence, int] = {}
        running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        self.running = running
        # decodes first, then partial prefills, each in scheduling order
        order = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if len(order) < len(running):
            order += [s for s in running if s.num_tokens - s.num_computed_tokens != 1]
        paused = self._paused(order)
        if paused:
            order = [s for s in order if s not in paused]
        budget, preempted = self._schedule_running(order, budget, chosen, drafts)
        if not preempted:  # blocks are short: admitting more would only thrash
            budget = self._admit(budget, chosen)
        if paused and not any(s.num_tokens - s.num_computed_tokens > 1 for s in chosen):
            # no prompt of a higher rank got in after all (blocks or seats short): the paused ones run
            self._schedule_running([s for s in paused if s.status is SeqStatus.RUNNING], budget, chosen, drafts)
        return [ScheduledSeq(s, n, drafts.get(s, 0)) for s, n in chosen.items()]

    def _paused(self, order: list[Sequence]) -> set[Sequence]:
        """Under "priority": the running sequences ranked below a waiting or prefilling one sit out this step,
        so that its prompt runs alone (bench/README.md, "Batches beside interactive requests")."""
        if not self.by_priority or not order:
            return set()
        ranks = [self._rank(s) for s in order if s.num_tokens - s.num_computed_tokens > 1]
        if self._waiting:
            head = self._waiting[0]
            if head[3].status is SeqStatus.WAITING and head[2] == self._order.get(head[3]):
                ranks.append(head[0])
        if not ranks:
            return set()
        urgent = min(ranks)
        return {s for s in order if self._rank(s) > urgent}

    def _schedule_running(
        self, order: list[Sequence], budget: int, chosen: dict[Sequence, int], drafts: dict[Sequence, int]
    ) -> tuple[int, bool]:
        """Running sequences in `order` into the step, preempting by recompute when blocks run out:
        (the budget left, whether one was preempted)."""
        preempted = False
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted for an earlier sequence in this step
            rest = seq.num_tokens - seq.num_computed_tokens
            k = len(seq.draft) if rest == 1 else 0  # a decode's draft rides along, as far as the budget goes
            n = min(rest + k, budget)
            k = max(0, n - rest)
            if n <= 0:
                continue
            while not self.bm.allocate(seq, n):
                if k:  # blocks are short: verify nothing before preempting anyone
                    n, k = n - k, 0
                    continue
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                budget += chosen.pop(victim, 0)
                if victim is seq:
                    break
            else:
                chosen[seq] = n
                if k:
                    drafts[seq] = k
                budget -= n
        return budget, preempted

    def _admit(self, budget: int, chosen: dict[Sequence, int]) -> int:
        heap, bm = self._waiting, self.bm
        # never more running than tokens per step: each must get at least one token every step
        cap = min(self.max_num_seqs, self.max_num_batched_tokens)
        adapters = self.running_adapters()
        skipped = []  # waiting for an adapter slot: back in the heap after this step's admissions
        while heap and budget > 0 and len(self.running) < cap:
            seq = heap[0][3]
            if seq.status is not SeqStatus.WAITING or heap[0][2] != self._order.get(seq):
                heapq.heappop(heap)  # aborted while waiting
                continue
            lora = seq.lora.digest if seq.lora is not None else None
            if lora is not None and lora not in adapters and len(adapters) >= (self.max_loras or 0):
                skipped.append(heapq.heappop(heap))
                continue
            # prompt logprobs need every prompt position's logits: no cache hits for those
            hits = bm.lookup(seq) if seq.params.prompt_logprobs is None else []
            if bm.disk_pending:
                break  # the rest of its prefix is read back from disk in the next steps: it waits for that
            computed = len(hits) * bm.block_size
            n = min(seq.num_tokens - computed, budget)
            if not bm.allocate(seq, n, hits):
                break  # FCFS: the head waits for blocks, nobody overtakes it
            heapq.heappop(heap)
            self._num_waiting -= 1
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = computed
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = computed
            if not seq.scheduled_time:
                seq.scheduled_time = self.clock()
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
            bm.register_full_blocks(seq, upto=computed + n)  # siblings admitted next can share them
            if lora is not None:
                adapters.add(lora)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return budget

    def running_adapters(self) -> set[str]:
        """The digests of the adapters of the running sequences."""
        return {s.lora.digest for s in self.running if s.lora is not None and s.status is SeqStatus.RUNNING}

    def _pick_victim(self) -> Sequence:
        """The running sequence that matters least: the last in waiting-queue order."""
        order = self._order
        return max(
            (s for s in self.running if s.status is SeqStatus.RUNNING),
            key=lambda s: (self._rank(s), s.arrival_time, order[s]),
        )

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV; its output so far is re-prefilled with the prompt."""
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._push_waiting(seq)

    def _rank(self, seq: Sequence) -> int:
        return seq.priority if self.by_priority else 0

    def _push_waiting(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (self._rank(seq), seq.arrival_time, self._order[seq], seq))
        self._num_waiting += 1

    def update(self, batch: list[ScheduledSeq]) -> None:
        """After the forward pass (and the new tokens appended): advance and cache full blocks."""
        for s in batch:
            seq = s.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed_tokens += s.num_new_tokens  # a verification's: its accepted positions only
            self.bm.register_full_blocks(seq)
            self.bm.release_passed(seq)  # with a window on every layer: blocks no later query reads
            if s.num_draft:
                self.bm.trim(seq)  # the blocks that held only rejected draft positions

    # ---- observation ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._by_id) - self._num_waiting

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def live(self) -> list[Sequence]:
        """Every sequence not finished (waiting, held or running)."""
        return list(self._by_id.values())

    @property
    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    def stats(self) -> EngineStats:
        used, total = self.bm.usage  # a hybrid model's state slots count as the blocks they weigh
        return EngineStats(
            self.num_running,
            self.num_waiting,
            used,
            total,
            self.num_preemptions,
            self.bm.prefix_cache_queries,
            self.bm.prefix_cache_hits,
        )
