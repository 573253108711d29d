"""The ONE loop over each engine step's outputs: detokenize, stop strings, build outputs, hand them over.

Per request the work is: extend ids, (detokenize), decide whether to emit, put into the collector.
The collector is a memory object stream of size 1; when its slot is taken, the new output is
merged into the waiting one, so a slow client gets bigger, rarer chunks and memory stays flat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import anyio.lowlevel

from engine.messages import RequestOutput, StepOutputs, TokenLogprobs
from server.config import ServerEnv
from server.request.collector import Collector, Output, OutputKind
from server.request.detokenizer import IncrementalDetokenizer

log = logging.getLogger("spindle.server")


CHUNK = ServerEnv.read().output_chunk
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


@dataclass(slots=True, eq=False)
class RequestState:
    """One engine request (one choice) on the output side."""

    request_id: str
    index: int
    collector: Collector
    detok: IncrementalDetokenizer
    kind: OutputKind
    has_stops: bool
    num_prompt_tokens: int
    on_first_token: Callable[[RequestState], None] | None = None
    arrival_time: float = 0.0
    unsent: list[int] = field(init=False, default_factory=list)  # ids not yet handed over (DELTA) / all (FINAL_ONLY)
    detok_done: int = field(init=False, default=0)  # how many of `unsent` the detokenizer has seen
    num_output_tokens: int = field(init=False, default=0)
    last_emit: int = field(init=False, default=0)  # num_output_tokens at the last hand-over
    logprobs: list[TokenLogprobs] | None = field(init=False, default=None)
    finished: bool = field(init=False, default=False)  # the engine is done with it (finished, stopped here, or failed)
    emitted: bool = field(init=False, default=False)
    num_cached_tokens: int = field(init=False, default=0)
    last_time: float = field(init=False, default=0.0)  # step time of the latest token (metrics)
    # echo + logprobs: sent with the first output
    prompt_logprobs: list[TokenLogprobs | None] | None = field(init=False, default=None)
    finish_reason: str | None = field(init=False, default=None)  # for the access log


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
        if len(new) > 1 and state.has_stops:
            return self._feed_each(state, new, finished)
        matched: str | None = state.detok.update(new, finished)
        return matched

    def _feed_each(self, state: RequestState, new: list[int], finished: bool) -> str | None:
        """A step's several ids (speculation) fed one at a time, as steps of one token would be: a stop string
        ends the request at the token that completes it, and the ids after it are dropped, so the text, usage
        and logprobs equal decoding without speculation."""
        last = len(new) - 1
        for j, token in enumerate(new):
            matched: str | None = state.detok.update([token], finished and j == last)
            if matched is not None:
                self._drop(state, last - j)
                return matched
        return None

    @staticmethod
    def _drop(state: RequestState, k: int) -> None:
        """Forget the request's last `k` ids, delivered past the stop string that ended it."""
        if k <= 0:
            return
        del state.unsent[-k:]
        state.detok_done = len(state.unsent)
        state.num_output_tokens -= k
        if state.logprobs:  # one per id when asked for
            del state.logprobs[-k:]

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
