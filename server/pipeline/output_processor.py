"""The ONE loop over each engine step's outputs: detokenize, stop strings, build outputs, hand them over.

Per request the work is: extend ids, (detokenize), decide whether to emit, put into the collector.
The collector is a memory object stream of size 1; when its slot is taken, the new output is
merged into the waiting one, so a slow client gets bigger, rarer chunks and memory stays flat.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import anyio.lowlevel

from engine.messages import PooledData, RequestOutput, StepOutputs, TokenLogprobs
from server.http.wakeup import Waiter, waiter_class

log = logging.getLogger("spindle.server")


class OutputKind(enum.IntEnum):
    """How a request's outputs are shaped (a GenerationSpec's `output_kind`: DELTA for streams)."""

    DELTA = 1  # every output carries what is new since the last one
    FINAL_ONLY = 2  # one output, at the end


CHUNK = int(os.environ.get("SPINDLE_OUTPUT_CHUNK", "128"))
_DELTA = OutputKind.DELTA
_FINAL = OutputKind.FINAL_ONLY


class Counter(Protocol):
    def inc(self, amount: float = 1.0) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class OutputMetrics(Protocol):
    """What the output side records (server.metrics.prometheus.ServerMetrics)."""

    @property
    def ttft(self) -> Histogram: ...
    @property
    def itl(self) -> Histogram: ...
    @property
    def generation_tokens(self) -> Counter: ...

    def record_finished(
        self,
        *,
        reason: str,
        arrival: float,
        scheduled: float,
        first_token: float,
        finished: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None: ...


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


class RequestState:
    """One engine request (one choice) on the output side."""

    __slots__ = (
        "request_id",
        "index",
        "collector",
        "detok",
        "kind",
        "has_stops",
        "unsent",
        "detok_done",
        "num_output_tokens",
        "last_emit",
        "logprobs",
        "num_prompt_tokens",
        "finished",
        "emitted",
        "num_cached_tokens",
        "on_first_token",
        "arrival_time",
        "last_time",
        "prompt_logprobs",
        "finish_reason",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        collector: Collector,
        detok: Any,
        kind: OutputKind,
        has_stops: bool,
        num_prompt_tokens: int,
        on_first_token: Callable[[RequestState], None] | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.collector = collector
        self.detok = detok  # IncrementalDetokenizer
        self.kind = kind
        self.has_stops = has_stops
        self.unsent: list[int] = []  # ids not yet handed over (DELTA) / all ids (FINAL_ONLY)
        self.detok_done = 0  # how many of `unsent` the detokenizer has seen
        self.num_output_tokens = 0
        self.last_emit = 0  # num_output_tokens at the last hand-over
        self.logprobs: list[TokenLogprobs] | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.finished = False  # the engine is done with it (finished, stopped here, or failed)
        self.emitted = False
        self.num_cached_tokens = 0
        self.on_first_token = on_first_token
        self.arrival_time = arrival_time
        self.last_time = 0.0  # step time of the latest token (metrics)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # echo + logprobs: sent with the first output
        self.finish_reason: str | None = None  # for the access log


class OutputProcessor:
    def __init__(
        self, *, stream_interval: int = 1, chunk_size: int = CHUNK, metrics: OutputMetrics | None = None
    ) -> None:
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}
        self.stream_interval = stream_interval
        self.chunk_size = chunk_size

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def remove_all(self, states: Iterable[RequestState]) -> None:
        """The requests' consumer left: their outputs, if any still come, are dropped."""
        for state in states:
            self.states.pop(state.request_id, None)

    def record_aborted(self, states: Iterable[RequestState], now: float) -> None:
        """Requests cut short here (their consumer left) finish in the metrics as "abort"."""
        metrics = self.metrics
        if metrics is None:
            return
        for state in states:
            metrics.record_finished(
                reason="abort",
                arrival=state.arrival_time,
                scheduled=0.0,
                first_token=0.0,
                finished=now,
                num_prompt_tokens=state.num_prompt_tokens,
                num_output_tokens=state.num_output_tokens,
            )
            metrics.generation_tokens.inc(state.num_output_tokens)

    async def process_outputs(self, step: StepOutputs) -> list[str]:
        """Hand every request its news; return the ids a stop string (or bad ids) ended, to abort in the engine."""
        outputs = step.outputs
        to_abort: list[str] = []
        states = self.states
        size = self.chunk_size
        now = step.timestamp
        for start in range(0, len(outputs), size):
            if start:
                await anyio.lowlevel.checkpoint()  # let routes send between chunks of a big step
            for ro in outputs[start : start + size]:
                state = states.get(ro.request_id)
                if state is None:
                    continue
                try:
                    if self._process_one(state, ro, now):
                        to_abort.append(ro.request_id)
                except Exception:  # one request's fault fails that request only; the handler runs on
                    log.exception("processing the output of request %s failed", ro.request_id)
                    if not state.finished:
                        self._fail(state, "internal error while processing this request's output")
                        to_abort.append(ro.request_id)
        return to_abort

    def _process_one(self, state: RequestState, ro: RequestOutput, now: float) -> bool:
        """Returns True when the request must be aborted in the engine (it ended here, not there)."""
        if ro.new_token_ids:
            self._take_ids(state, ro, now)
        finish = ro.finish_reason
        if finish == "error":
            self._fail(state, ro.error or "the engine refused the request")
            return False
        stop_reason: int | str | None = ro.stop_token_id
        abort = False
        try:
            if state.has_stops:  # stop strings are searched every step, so the engine stops early
                matched = self._feed(state, finish is not None)
                if matched is not None:
                    finish, stop_reason, abort = "stop", matched, finish is None
            if finish is None:
                self._maybe_emit(state)
                return False
            if not state.has_stops:
                self._feed(state, True)
        except ValueError as e:  # DetokenizeError: ids the tokenizer cannot decode
            self._fail(state, f"the model produced token ids the tokenizer cannot decode: {e}")
            return True
        self._finish(state, finish, stop_reason, ro, now)
        return abort

    def _take_ids(self, state: RequestState, ro: RequestOutput, now: float) -> None:
        """A step's new ids (and logprobs) onto the request; the first token's bookkeeping; TTFT / ITL."""
        ids = ro.new_token_ids
        metrics = self.metrics
        if state.num_output_tokens == 0:
            state.num_cached_tokens = ro.num_cached_tokens
            state.prompt_logprobs = ro.prompt_logprobs
            if state.on_first_token is not None:
                state.on_first_token(state)
            if metrics is not None and state.arrival_time:
                metrics.ttft.observe(max(now - state.arrival_time, 0.0))
        elif metrics is not None:
            metrics.itl.observe(max(now - state.last_time, 0.0))
        state.last_time = now
        state.num_output_tokens += len(ids)
        if state.unsent:
            state.unsent.extend(ids)
        else:
            state.unsent = list(ids)
        if ro.logprobs:
            if state.logprobs is None:
                state.logprobs = ro.logprobs  # the decoded frame's own list: ours to extend
            else:
                state.logprobs.extend(ro.logprobs)

    def _maybe_emit(self, state: RequestState) -> None:
        """An unfinished request's news to its collector, unless FINAL_ONLY, paced by --stream-interval, or
        nothing visible yet (held back: the ids go with the next output). Raises DetokenizeError (ValueError)."""
        if state.kind == _FINAL:
            return
        if state.emitted and state.num_output_tokens - state.last_emit < self.stream_interval:
            return
        if state.has_stops:  # fed by _process_one
            text = state.detok.take_delta()
        else:
            new = state.unsent[state.detok_done :] if state.detok_done else state.unsent
            state.detok_done = len(state.unsent)
            text = state.detok.next_delta(new)
        if not text and not state.logprobs:
            return
        out = Output(
            state.index, text, state.unsent, state.num_output_tokens, logprobs=state.logprobs, first=not state.emitted
        )
        state.unsent = []
        state.detok_done = 0
        state.logprobs = None
        out.num_cached_tokens = state.num_cached_tokens
        if not state.emitted:
            out.prompt_logprobs = state.prompt_logprobs
        state.emitted = True
        state.last_emit = state.num_output_tokens
        state.collector.put(out)

    def _feed(self, state: RequestState, finished: bool) -> str | None:
        """Give the detokenizer the ids it has not seen; returns a matched stop string."""
        new = state.unsent[state.detok_done :] if state.detok_done else state.unsent
        if not new and not finished:
            return None
        state.detok_done = len(state.unsent)
        matched: str | None = state.detok.update(new, finished)
        return matched

    def _finish(
        self, state: RequestState, finish: str, stop_reason: int | str | None, ro: RequestOutput, now: float
    ) -> None:
        text = state.detok.take_delta() if state.kind == _DELTA else state.detok.output_text
        out = Output(
            state.index,
            text,
            state.unsent,
            state.num_output_tokens,
            finish,
            stop_reason,
            state.logprobs,
            first=not state.emitted,
        )
        out.num_cached_tokens = state.num_cached_tokens
        out.pooled = ro.pooled
        out.no_speech_prob = ro.no_speech_prob
        if not state.emitted:
            out.prompt_logprobs = state.prompt_logprobs
        if self.metrics is not None:
            self.metrics.record_finished(
                reason=finish,
                arrival=ro.arrival_time or state.arrival_time,
                scheduled=ro.scheduled_time,
                first_token=ro.first_token_time,
                finished=now,
                num_prompt_tokens=state.num_prompt_tokens,
                num_output_tokens=state.num_output_tokens,
            )
            self.metrics.generation_tokens.inc(state.num_output_tokens)
        self._close(state, out)

    def _fail(self, state: RequestState, message: str) -> None:
        out = Output(state.index, "", [], state.num_output_tokens, "error", first=not state.emitted)
        out.error = message
        if self.metrics is not None:
            self.metrics.record_finished(
                reason="error",
                arrival=state.arrival_time,
                scheduled=0.0,
                first_token=0.0,
                finished=time.time(),
                num_prompt_tokens=state.num_prompt_tokens,
                num_output_tokens=state.num_output_tokens,
            )
        self._close(state, out)

    def _close(self, state: RequestState, out: Output) -> None:
        state.finished = True
        state.finish_reason = out.finish_reason
        state.emitted = True
        self.states.pop(state.request_id, None)
        state.collector.put(out)

    def fail_all(self, message: str) -> None:
        """The engine died: every in-flight request gets an error now."""
        for state in list(self.states.values()):
            self._fail(state, message)
