"""What the output side hands the routes: each choice's Output (its news since the last hand-over, or its whole
state), and the Collector, the one-slot mailbox between server/request/output_processor.py and a request's route
that merges a newer output into the one not yet taken; the RequestStream a route takes one `generate` call's
outputs from."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Protocol

import anyio

from engine.messages import PooledData, TokenLogprobs
from server.http.access_log import RequestRecord
from server.http.wakeup import Waiter, waiter_class


class OutputKind(enum.IntEnum):
    """How a request's outputs are shaped (a GenerationSpec's `output_kind`: DELTA for streams)."""

    DELTA = 1  # every output carries what is new since the last one
    FINAL_ONLY = 2  # one output, at the end


_DELTA = OutputKind.DELTA


class Output:
    """One choice's news since the last hand-over (DELTA) or its whole state (FINAL_ONLY)."""

    __slots__ = (
        "index",
        "text",
        "token_ids",
        "finish_reason",
        "stop_reason",
        "logprobs",
        "prompt_logprobs",
        "num_output_tokens",
        "num_cached_tokens",
        "error",
        "first",
        "pooled",
        "no_speech_prob",
        "_parts",
    )

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        num_output_tokens: int,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        first: bool = False,
    ) -> None:
        self.index = index
        self.text = text
        self.token_ids = token_ids
        self.num_output_tokens = num_output_tokens  # cumulative, for usage
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.logprobs = logprobs
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.first = first  # the choice's first output (chat sends delta.role with it)
        self.pooled: PooledData | None = None  # runner "pooling": the request's raw output, on its final output
        self.no_speech_prob: float | None = None  # a Whisper request's, on its final output
        self._parts: list[str] | None = None  # merged texts, joined once when the consumer takes the output

    def merge(self, newer: Output, kind: OutputKind) -> None:
        """Fold a later output of the same choice into this one, which the consumer has not taken yet.

        Amortized O(1) per merged token: lists this output owns grow in place and texts join once, at
        `settle()`, so a client that reads rarely costs no more than one that keeps up."""
        if kind == _DELTA:
            if self._parts is None:
                self._parts = [self.text]
            self._parts.append(newer.text)
            self.token_ids.extend(newer.token_ids)
            if newer.logprobs:
                if self.logprobs is None:
                    self.logprobs = newer.logprobs
                else:
                    self.logprobs.extend(newer.logprobs)
        else:
            self.text = newer.text
            self.token_ids = newer.token_ids
            self.logprobs = newer.logprobs
        self.num_output_tokens = newer.num_output_tokens
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason
        self.error = newer.error
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
        if newer.pooled is not None:
            self.pooled = newer.pooled
        if newer.no_speech_prob is not None:
            self.no_speech_prob = newer.no_speech_prob
        self.num_cached_tokens = max(self.num_cached_tokens, newer.num_cached_tokens)

    def settle(self) -> None:
        """Join the merged texts (the consumer is about to read `text`)."""
        if self._parts is not None:
            self.text = "".join(self._parts)
            self._parts = None

    def __repr__(self) -> str:
        return (
            f"Output(index={self.index}, text={self.text!r}, ids={self.token_ids}, "
            f"finish={self.finish_reason}, stop={self.stop_reason!r}, error={self.error!r})"
        )


class Collector:
    """A parent request's outputs on their way to the route: a one-slot mailbox that merges when full.

    Semantically a memory object stream of size 1 whose sender merges instead of blocking; written
    out because anyio's stream costs a checkpoint, two WouldBlock exceptions and a backend lookup
    per wake-up (bench/README.md, "Per-token wake-up"), and the per-token path is a benchmark target; the
    consumer sleeps on a reusable `server.http.wakeup` waiter rather than a fresh Event per token. The
    waiter is woken each time the empty slot fills; a consumer may bring its own (`use_waiter`), whose
    wake-up may take the news at once (`poll`), in the producer's task.
    """

    __slots__ = ("kind", "closed", "_batch", "_waiter")

    def __init__(self, kind: OutputKind) -> None:
        self.kind = kind
        self.closed = False  # the consumer left: outputs are dropped (its finally aborts the request)
        self._batch: list[Output] | None = None
        self._waiter: Waiter | None = None  # made on the first wait, inside the event loop: once per request

    def put(self, out: Output) -> None:
        if self.closed:
            return
        batch = self._batch
        if batch is None:
            self._batch = [out]
            if self._waiter is not None:
                self._waiter.wake()
            return
        for old in batch:  # the consumer has not taken the slot: merge into it
            if old.index == out.index:
                old.merge(out, self.kind)
                return
        batch.append(out)

    def use_waiter(self, waiter: Waiter | None) -> None:
        """The consumer's own waiter (None: the default one, made at the next wait)."""
        self._waiter = waiter

    def peek(self) -> list[Output] | None:
        """The waiting batch, left in the slot."""
        batch = self._batch
        if batch is not None:
            for out in batch:
                out.settle()
        return batch

    def poll(self) -> list[Output] | None:
        batch = self._batch
        self._batch = None
        if batch is not None:
            for out in batch:
                out.settle()
        return batch

    async def wait(self) -> list[Output]:
        while self._batch is None:
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = waiter_class()()
            await waiter.wait()
        batch = self._batch
        self._batch = None
        for out in batch:
            out.settle()
        return batch

    def close(self) -> None:
        self.closed = True
        self._batch = None


class ChoiceTotals(Protocol):
    """What the access log reads of each choice's state (server/request/output_processor.py RequestState)."""

    @property
    def num_output_tokens(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...


class RequestStream:
    """The outputs of one `generate` call: batches of `Output`, until every choice has finished."""

    def __init__(
        self, collector: Collector, states: Sequence[ChoiceTotals], record: RequestRecord | None = None
    ) -> None:
        self._collector = collector
        self.states = states
        self.remaining = len(states)
        self._record = record  # the access log's record of this HTTP request, if it logs

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[Output]:
        if not self.remaining:
            raise StopAsyncIteration
        batch = self.poll()
        return batch if batch is not None else await self.wait()

    def poll(self) -> list[Output] | None:
        """The waiting batch, if any, without a checkpoint (the engine is ahead of the client)."""
        batch = self._collector.poll()
        if batch is not None:
            self._count(batch)
        return batch

    async def wait(self) -> list[Output]:
        batch = await self._collector.wait()
        self._count(batch)
        return batch

    def use_waiter(self, waiter: Waiter | None) -> None:
        """Wake the consumer through `waiter`, whose wake-up may take the news at once (`poll`) in the
        output handler's task (the direct write path, server/http/direct_body.py); None: the default waiter."""
        self._collector.use_waiter(waiter)

    def peek(self) -> list[Output] | None:
        """The waiting batch, left for `poll` or `wait`."""
        return self._collector.peek()

    async def next_within(self, timeout: float) -> list[Output] | None:
        """The next batch, or None after `timeout` seconds of silence (for SSE keep-alives)."""
        batch = self.poll()
        if batch is not None:
            return batch
        with anyio.move_on_after(timeout):
            return await self.wait()
        return None

    def close(self) -> None:
        """The consumer left: the collector drops whatever still comes (closed first, so nothing more is
        delivered), and the access log's record gets the request's totals."""
        self._collector.close()
        record = self._record
        if record is not None:
            record.completion_tokens = sum(s.num_output_tokens for s in self.states)
            record.finish_reasons = [s.finish_reason or "abort" for s in self.states]

    def _count(self, batch: list[Output]) -> None:
        for out in batch:
            if out.finish_reason is not None:
                self.remaining -= 1
        record = self._record
        if record is not None:
            if not record.first_token:
                record.first_token = time.monotonic()
            if record.log_text:  # --log-requests only: keep the text for the access log
                delta = self._collector.kind == OutputKind.DELTA
                for out in batch:
                    record.texts[out.index] = record.texts.get(out.index, "") + out.text if delta else out.text
