"""AsyncLLM: the engine client, one reader task, one output-handler task, and `generate`.

Cancellation is the abort path: whatever ends a request early (client gone, stop string, shutdown)
leaves `generate` through the same clean-ups, each owned by what it cleans: the request stream (its
collector closed first), the engine requests still running (aborted, once), the output processor's states,
the in-flight count, the admission ticket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import ExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.client.process_client import EngineDeadError
from engine.messages import AddRequest, EngineStats, Heartbeat, Ready, StepOutputs
from server.http import access_log, unavailable
from server.http.errors import APIError
from server.request.admission import AdmissionLike, AdmissionTicket
from server.request.collector import Collector, OutputKind, RequestStream
from server.request.detokenizer import IncrementalDetokenizer, prepare
from server.request.image_sends import ImageMetrics, ImageMirror, ImageSends
from server.request.input_processor import GenerationSpec
from server.request.output_processor import Counter, OutputMetrics, OutputProcessor, RequestState

log = logging.getLogger("spindle.server")


class EngineClientLike(Protocol):
    ready: Ready
    stats: EngineStats

    def add_request(self, req: AddRequest) -> None: ...  # queues; never waits on the pipe
    def abort(self, request_ids: list[str]) -> None: ...  # queues; drops an add still queued
    async def receive(self) -> StepOutputs | Heartbeat: ...


class LLMMetrics(OutputMetrics, ImageMetrics, Protocol):
    """What AsyncLLM and the routes around it record (server.metrics.prometheus.ServerMetrics)."""

    @property
    def mm_processor_cache_hits(self) -> Counter: ...  # counted by server/multimodal/images.py

    def record_stats(self, stats: EngineStats) -> None: ...
    def rejected(self, reason: str) -> None: ...
    def structured_checked(self, reason: str | None) -> None: ...  # server/structured/output_check.py
    def lora_request(self, name: str, n: int) -> None: ...  # n engine requests under an adapter


DetokenizerFactory = Callable[[GenerationSpec], IncrementalDetokenizer]  # spec -> a fresh one


def detokenizer_factory(tokenizer: Any) -> DetokenizerFactory:
    """Each request's IncrementalDetokenizer over the served tokenizer."""
    if tokenizer is not None:
        prepare(tokenizer)

    def make(spec: GenerationSpec) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            tokenizer,
            spec.prompt_token_ids,
            skip_special_tokens=spec.skip_special_tokens,
            spaces_between_special_tokens=spec.spaces_between_special_tokens,
            stop=spec.stop,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            min_tokens=spec.params.min_tokens,
        )

    return make


class Stopping:
    """Draining for shutdown, one per API process: the app state (routes, /health) and AsyncLLM (generate, drain,
    cut) read and set the same one. Set once, never cleared: from then on new requests get 503."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class InFlight:
    """The `generate` calls in flight (HTTP requests holding engine requests); `drain` waits for none."""

    def __init__(self) -> None:
        self.count = 0
        self._idle: anyio.Event | None = None  # set when the count drops to 0 while a drain waits
        self.on_idle: Callable[[], None] | None = None  # told each time the count drops to 0

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.count -= 1
        if self.count == 0:
            if self._idle is not None:
                self._idle.set()
            if self.on_idle is not None:
                self.on_idle()

    async def wait_idle(self) -> None:
        while self.count:
            self._idle = anyio.Event()
            await self._idle.wait()


class EngineRequests:
    """One `generate` call's engine requests (its states, in order) and how many went to the engine client."""

    def __init__(self) -> None:
        self.states: list[RequestState] = []
        self.sent = 0

    def unfinished(self) -> list[RequestState]:
        """Sent and still running in the engine."""
        return [s for s in self.states[: self.sent] if not s.finished]


class AsyncLLM:
    def __init__(
        self,
        client: EngineClientLike,
        detokenizer: DetokenizerFactory,
        *,
        admission: AdmissionLike | None = None,
        stream_interval: int = 1,
        on_dead: Callable[[str], None] | None = None,
        metrics: LLMMetrics | None = None,
        stopping: Stopping | None = None,
    ) -> None:
        self.client = client
        self.detokenizer = detokenizer
        self.admission = admission
        self.metrics = metrics
        self.output = OutputProcessor(stream_interval=stream_interval, metrics=metrics)
        self.on_dead = on_dead
        self.dead: str | None = None  # why the engine is gone; set once
        self.stopping = stopping if stopping is not None else Stopping()  # the app's, shared (AppState.stopping)
        self._in_flight = InFlight()
        self._steps_send: MemoryObjectSendStream[StepOutputs]
        self._steps_recv: MemoryObjectReceiveStream[StepOutputs]
        self._steps_send, self._steps_recv = anyio.create_memory_object_stream[StepOutputs](16)
        # A vision model: which images the engine holds, and children sent by hash only (server/request/image_sends.py)
        self._images = ImageSends(self._send, metrics)

    @property
    def images(self) -> ImageMirror | None:
        """A vision model's mirror of the engine's encoder cache (server/multimodal/mirror.py); set by the app."""
        return self._images.mirror

    @images.setter
    def images(self, mirror: ImageMirror | None) -> None:
        self._images.mirror = mirror

    @property
    def num_active(self) -> int:
        """`generate` calls in flight (HTTP requests holding engine requests)."""
        return self._in_flight.count

    def on_idle(self, callback: Callable[[], None]) -> None:
        """Call `callback` each time the last `generate` call in flight ends (--models-dir: work that outlives its
        HTTP request, a background response, keeps its model busy until then)."""
        self._in_flight.on_idle = callback

    @property
    def ready(self) -> Ready:
        return self.client.ready

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The reader and the output handler; returns when the engine is dead, or runs until cancelled.

        Neither waits on the engine's stdin: the engine client's own writer task owns it
        (engine/client/process_client.py).
        """
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read)
            tg.start_soon(self._handle)
            task_status.started()

    async def _read(self) -> None:
        async with self._steps_send:
            try:
                metrics = self.metrics
                while True:
                    frame = await self.client.receive()
                    if metrics is not None:
                        metrics.record_stats(frame.stats)
                    if type(frame) is StepOutputs:
                        await self._steps_send.send(frame)
            except EngineDeadError as e:
                # Marked dead before the stream closes: the handler drains what was read, then fails the rest.
                self._die(str(e))
            except Exception as e:  # a frame we cannot use is as fatal as a dead pipe; never hang requests
                log.exception("engine reader failed")
                self._die(f"engine core unusable: {e!r}")

    async def _handle(self) -> None:
        async with self._steps_recv:
            async for step in self._steps_recv:
                step = self._images.resend_misses(step, self.dead is None)
                to_abort = await self.output.process_outputs(step)
                if to_abort and self.dead is None:
                    self.client.abort(to_abort)  # queued: the handler never waits for the engine
        if self.dead is not None:
            self.output.fail_all(f"{self.dead}; retry once the server is restarted")

    def _die(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        log.error("%s", why)
        if self.on_dead is not None:
            self.on_dead(why)

    def overloaded(self, reason: str) -> APIError:
        """The 503 for a request admission refuses (counted as `queue_full`)."""
        if self.metrics is not None:
            self.metrics.rejected("queue_full")
        return unavailable.overloaded(reason)

    def admit(self, num_reqs: int, min_tokens: int, ticket: AdmissionTicket | None = None) -> AdmissionTicket:
        """A request's admission ticket (or `ticket`, resized) holding `num_reqs` engine requests and at least
        `min_tokens` prompt tokens: taken before rendering, a 503 when the queue surely has no room."""
        ticket = ticket if ticket is not None else AdmissionTicket(self.admission)
        reason = ticket.resize(num_reqs, min_tokens, "at least ")
        if reason is not None:
            raise self.overloaded(reason)
        return ticket

    @asynccontextmanager
    async def generate(
        self, specs: Sequence[GenerationSpec], ticket: AdmissionTicket | None = None
    ) -> AsyncIterator[RequestStream]:
        """Admit, register the output side, send to the engine; yield the outputs; clean up on exit.

        `ticket`: the one the route took before rendering (`admit`), settled here to the exact prompt tokens;
        none: a new one. Several specs (completions with several prompts) share one collector; choices are
        numbered spec.index_offset + child index. The clean-ups run in the reverse order of registration.
        """
        self.check_open()
        ticket = ticket if ticket is not None else AdmissionTicket(self.admission)
        reason = ticket.settle({child: len(s.prompt_token_ids) for s in specs for child in s.child_ids()})
        if reason is not None:
            raise self.overloaded(reason)
        with ExitStack() as cleanup:
            cleanup.callback(ticket.release)
            cleanup.enter_context(self._in_flight)
            engine = EngineRequests()
            cleanup.callback(self._forget, engine.states)  # before registering: a failure midway leaves none
            cleanup.callback(self._abort_unfinished, engine)
            stream = self._register(specs, ticket, engine.states)
            cleanup.callback(stream.close)  # first: nothing more reaches the consumer, who has left
            self._send_all(specs, engine)
            yield stream

    def check_open(self, *, count: bool = True) -> None:
        """503 when new requests cannot start: the engine is dead, or the server drains (counted as a
        `shutting_down` rejection unless `count` is False: a health probe is no rejected request)."""
        if self.dead is not None:
            raise unavailable.engine_dead(self.dead)
        if self.stopping.is_set():
            if count and self.metrics is not None:
                self.metrics.rejected("shutting_down")
            raise unavailable.shutting_down()

    def _register(
        self, specs: Sequence[GenerationSpec], ticket: AdmissionTicket, states: list[RequestState]
    ) -> RequestStream:
        """One RequestState per engine request, into `states` and the output processor, before anything is sent:
        a fast engine finds it."""
        collector = Collector(specs[0].output_kind if specs else OutputKind.FINAL_ONLY)

        def first_token(state: RequestState) -> None:
            ticket.first_token(state.request_id)

        for spec in specs:
            for i, child_id in enumerate(spec.child_ids()):
                state = RequestState(
                    child_id,
                    spec.index_offset + i,
                    collector,
                    self.detokenizer(spec),
                    spec.output_kind,
                    bool(spec.stop),
                    len(spec.prompt_token_ids),
                    first_token,
                    spec.arrival_time,
                )
                states.append(state)
                self.output.add(state)
        record = access_log.current.get()
        if record is not None:
            record.request_id = specs[0].external_id if specs else None
            record.prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
        return RequestStream(collector, states, record)

    def _send_all(self, specs: Sequence[GenerationSpec], engine: EngineRequests) -> None:
        """One AddRequest per child (n > 1: child ids `<id>-<i>`, seeds `seed + i`), in `engine.states` order."""
        for spec in specs:
            if spec.lora is not None and self.metrics is not None:
                self.metrics.lora_request(spec.lora.name, spec.n)
            reqs = [
                AddRequest(
                    child_id,
                    spec.prompt_token_ids,
                    spec.child_params(i),
                    spec.arrival_time,
                    spec.priority,
                    mm_inputs=spec.mm_inputs or None,
                    lora=spec.lora,
                    audio=spec.audio,
                )
                for i, child_id in enumerate(spec.child_ids())
            ]
            if spec.mm_inputs:
                self._images.send(reqs)  # raises only when the engine is dead: nothing to abort then
                engine.sent += len(reqs)
                continue
            for req in reqs:
                self._send(req)
                engine.sent += 1

    def _abort_unfinished(self, engine: EngineRequests) -> None:
        """The engine requests still running: aborted (queued, no wait: a cancelled caller aborts all the same),
        and counted as aborted in the metrics."""
        pending = engine.unfinished()
        if not pending:
            return
        if self.dead is None:
            self.client.abort([s.request_id for s in pending])
        self.output.record_aborted(pending, time.time())

    def _forget(self, states: list[RequestState]) -> None:
        self.output.remove_all(states)
        self._images.forget(s.request_id for s in states)

    async def drain(self, timeout: float) -> int:
        """Shutdown: refuse new requests, let in-flight ones finish for up to `timeout` s, cut the rest.

        Returns how many engine requests were cut.
        """
        self.stopping.set()
        with anyio.move_on_after(timeout):
            await self._in_flight.wait_idle()
        return self.cut(
            "The server is shutting down and could not finish this request in time; retry against another instance."
        )

    def cut(self, message: str) -> int:
        """End every in-flight request now with an error (streams get an error event, then [DONE])."""
        self.stopping.set()
        n = len(self.output.states)
        self.output.fail_all(message)
        return n

    def _send(self, req: AddRequest) -> None:
        if self.dead is not None:
            raise unavailable.engine_dead(self.dead)
        try:
            self.client.add_request(req)
        except EngineDeadError as e:
            self._die(str(e))
            raise unavailable.engine_dead(self.dead or str(e)) from None
