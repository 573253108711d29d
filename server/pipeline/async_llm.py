"""AsyncLLM: the engine client, one reader task, one output-handler task, and `generate`.

Cancellation is the abort path: whatever ends a request early (client gone, stop string, shutdown)
leaves `generate` through the same `finally`, which aborts the engine requests still running, once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.messages import IMAGE_CACHE_MISS, AddRequest, EngineStats, Heartbeat, Ready, StepOutputs
from server.http import access_log
from server.http.access_log import RequestRecord
from server.http.direct_body import WriteBatch
from server.http.errors import APIError
from server.pipeline.input_processor import GenerationSpec, OutputKind
from server.pipeline.output_processor import Collector, Output, OutputProcessor, RequestState

log = logging.getLogger("spindle.server")


class EngineClientLike(Protocol):
    ready: Ready
    stats: EngineStats

    def add_request(self, req: AddRequest) -> None: ...  # queues; never waits on the pipe
    def abort(self, request_ids: list[str]) -> None: ...  # queues; drops an add still queued
    async def receive(self) -> StepOutputs | Heartbeat: ...


class AdmissionLike(Protocol):
    def try_admit(self, num_reqs: int, num_tokens: int) -> str | None: ...
    def would_refuse(self, num_reqs: int, min_num_tokens: int) -> str | None: ...
    def first_token(self, num_tokens: int) -> None: ...
    def release(self, num_reqs: int, num_tokens: int) -> None: ...


DetokenizerFactory = Callable[[GenerationSpec], Any]  # spec -> a fresh IncrementalDetokenizer


class RequestStream:
    """The outputs of one `generate` call: batches of `Output`, until every choice has finished."""

    def __init__(self, collector: Collector, states: list[RequestState], record: RequestRecord | None = None) -> None:
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

    def deliver_directly(self, sink: Callable[[Output], bool] | None) -> None:
        """Unfinished outputs go to `sink` (True: delivered) instead of waking the consumer, while it
        waits with nothing taken; finished ones and declined ones still come through `wait`."""
        record = self._record
        if sink is None or record is None:  # unfinished outputs change no count but the access log's
            self._collector.sink = sink
            return

        def deliver(out: Output) -> bool:
            if not sink(out):
                return False
            self._count([out])
            if not record.log_text:  # the first token's time is taken: later ones need no count
                self._collector.sink = sink
            return True

        self._collector.sink = deliver

    async def next_within(self, timeout: float) -> list[Output] | None:
        """The next batch, or None after `timeout` seconds of silence (for SSE keep-alives)."""
        batch = self.poll()
        if batch is not None:
            return batch
        with anyio.move_on_after(timeout):
            return await self.wait()
        return None

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


class AsyncLLM:
    def __init__(self, client: EngineClientLike, detokenizer: DetokenizerFactory, *,
                 admission: AdmissionLike | None = None, stream_interval: int = 1,
                 on_dead: Callable[[str], None] | None = None, metrics: Any = None) -> None:
        self.client = client
        self.detokenizer = detokenizer
        self.admission = admission
        self.metrics = metrics  # server.metrics.ServerMetrics or None
        self.writes = WriteBatch()  # routes' direct writes (server.http.direct_body), made once per step
        self.output = OutputProcessor(stream_interval=stream_interval, metrics=metrics, flush=self.writes.flush)
        self.on_dead = on_dead
        self.dead: str | None = None  # why the engine is gone; set once
        self.stopping = False  # draining for shutdown: new requests get 503
        self.num_active = 0  # `generate` calls in flight (HTTP requests holding engine requests)
        self._idle: anyio.Event | None = None  # set when num_active drops to 0 while a drain waits
        self._steps_send: MemoryObjectSendStream[StepOutputs]
        self._steps_recv: MemoryObjectReceiveStream[StepOutputs]
        self._steps_send, self._steps_recv = anyio.create_memory_object_stream[StepOutputs](16)
        # A vision model: which images the engine holds (server/multimodal/mirror.py), and the full requests of
        # children sent by hash only, kept until their first output says whether the engine had the images.
        self.images: Any = None  # server.multimodal.mirror.EngineImageMirror
        self._resend: dict[str, AddRequest] = {}

    @property
    def ready(self) -> Ready:
        return self.client.ready

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The reader and the output handler; returns when the engine is dead, or runs until cancelled.

        Neither waits on the engine's stdin: the engine client's own writer task owns it (engine/client.py).
        """
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read)
            tg.start_soon(self._handle)
            task_status.started()

    async def _read(self) -> None:
        from engine.client import EngineDeadError

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
                if self._resend:
                    step = self._resend_misses(step)
                to_abort = await self.output.process_outputs(step)
                if to_abort and self.dead is None:
                    self.client.abort(to_abort)  # queued: the handler never waits for the engine
        if self.dead is not None:
            self.output.fail_all(f"{self.dead}; retry once the server is restarted")

    def _resend_misses(self, step: StepOutputs) -> StepOutputs:
        """A child sent by hash that the engine no longer held: resend it with pixels; the client sees nothing."""
        keep = []
        for ro in step.outputs:
            full = self._resend.pop(ro.request_id, None)  # its first output: the engine took or refused it
            if (full is not None and ro.finish_reason == "error" and (ro.error or "").startswith(IMAGE_CACHE_MISS)
                    and self.dead is None):
                self.images.forget([img.hash for img in full.mm_inputs or ()])
                if self.metrics is not None:
                    self.metrics.mm_engine_cache_misses.inc()
                try:
                    self._send(full)
                except APIError as e:  # the engine died meanwhile
                    keep.append(msgspec.structs.replace(ro, error=e.message))
                    continue
                self.images.record(full.mm_inputs or [])
                continue
            keep.append(ro)
        return step if len(keep) == len(step.outputs) else msgspec.structs.replace(step, outputs=keep)

    def _send_images(self, reqs: list[AddRequest]) -> None:
        """Send one prompt's children (same images): by hash where the mirror says the engine holds them (looked
        up once, so a child does not count on its sibling's images, not yet encoded); recorded once sent."""
        mirror = self.images
        mm = reqs[0].mm_inputs or []
        short, hits = mirror.strip(mm) if mirror is not None else (mm, 0)
        for req in reqs:
            if hits:
                self._send(msgspec.structs.replace(req, mm_inputs=short))
                self._resend[req.request_id] = req
                if self.metrics is not None:
                    self.metrics.mm_engine_cache_hits.inc(hits)
            else:
                self._send(req)
            if mirror is not None:
                mirror.record(mm)

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
        return APIError(f"The server is overloaded ({reason}); retry after a moment.", status=503, retry_after=1)

    def _dead_error(self) -> APIError:
        return APIError(f"The engine is not running ({self.dead}); retry against a restarted server.", status=503)

    @asynccontextmanager
    async def generate(self, specs: Sequence[GenerationSpec]) -> AsyncIterator[RequestStream]:
        """Admit, register the output side, send to the engine; yield the outputs; abort what is left on exit.

        Several specs (completions with several prompts) share one collector; choices are
        numbered spec.index_offset + child index.
        """
        if self.dead is not None:
            raise self._dead_error()
        if self.stopping:
            if self.metrics is not None:
                self.metrics.rejected("shutting_down")
            raise APIError("The server is shutting down; retry against another instance.", status=503,
                           retry_after=1)
        num_reqs = sum(s.n for s in specs)
        num_tokens = sum(s.n * len(s.prompt_token_ids) for s in specs)
        admission = self.admission
        if admission is not None:
            reason = admission.try_admit(num_reqs, num_tokens)
            if reason is not None:
                raise self.overloaded(reason)
        queued: dict[str, int] = {}  # child id -> prompt tokens still counted as queued

        def first_token(state: RequestState) -> None:
            n = queued.pop(state.request_id, None)
            if n is not None and admission is not None:
                admission.first_token(n)

        collector = Collector(specs[0].output_kind if specs else OutputKind.FINAL_ONLY)
        states: list[RequestState] = []
        sent = 0  # child requests handed to the engine client, in `states` order
        record = access_log.current.get()
        if record is not None:
            record.request_id = specs[0].external_id if specs else None
            record.prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
        self.num_active += 1
        try:
            for spec in specs:
                has_stops = bool(spec.stop)
                for i, child_id in enumerate(spec.child_ids()):
                    state = RequestState(child_id, spec.index_offset + i, collector, self.detokenizer(spec),
                                         spec.output_kind, has_stops, len(spec.prompt_token_ids), first_token,
                                         spec.arrival_time)
                    states.append(state)
                    queued[child_id] = len(spec.prompt_token_ids)
                    self.output.add(state)  # registered before sent: a fast engine finds it
            for spec in specs:
                if spec.mm_inputs:
                    reqs = [AddRequest(child_id, spec.prompt_token_ids, spec.child_params(i), spec.arrival_time,
                                       spec.priority, mm_inputs=spec.mm_inputs)
                            for i, child_id in enumerate(spec.child_ids())]
                    self._send_images(reqs)  # raises only when the engine is dead: nothing to abort then
                    sent += len(reqs)
                    continue
                for i, child_id in enumerate(spec.child_ids()):
                    self._send(AddRequest(child_id, spec.prompt_token_ids, spec.child_params(i), spec.arrival_time,
                                          spec.priority))
                    sent += 1
            yield RequestStream(collector, states, record)
        finally:
            self.num_active -= 1
            if self.num_active == 0 and self._idle is not None:
                self._idle.set()
            if record is not None:
                record.completion_tokens = sum(s.num_output_tokens for s in states)
                record.finish_reasons = [s.finish_reason or "abort" for s in states]
            pending = [s.request_id for s in states[:sent] if not s.finished]
            for state in states:
                self.output.remove(state.request_id)
                if self._resend:
                    self._resend.pop(state.request_id, None)
            if admission is not None:
                if queued:
                    admission.release(len(queued), sum(queued.values()))
            if pending and self.dead is None:
                self.client.abort(pending)  # queued, no wait: a cancelled caller aborts all the same
            if pending and self.metrics is not None:
                now = time.time()
                for state in states:
                    if state.request_id in pending:
                        self.metrics.record_finished(
                            reason="abort", arrival=state.arrival_time, scheduled=0.0, first_token=0.0,
                            finished=now, num_prompt_tokens=state.num_prompt_tokens,
                            num_output_tokens=state.num_output_tokens)
                        self.metrics.generation_tokens.inc(state.num_output_tokens)
            collector.close()

    async def drain(self, timeout: float) -> int:
        """Shutdown: refuse new requests, let in-flight ones finish for up to `timeout` s, cut the rest.

        Returns how many engine requests were cut.
        """
        self.stopping = True
        with anyio.move_on_after(timeout):
            while self.num_active:
                self._idle = anyio.Event()
                await self._idle.wait()
        return self.cut("The server is shutting down and could not finish this request in time; "
                        "retry against another instance.")

    def cut(self, message: str) -> int:
        """End every in-flight request now with an error (streams get an error event, then [DONE])."""
        self.stopping = True
        n = len(self.output.states)
        self.output.fail_all(message)
        return n

    def _send(self, req: AddRequest) -> None:
        from engine.client import EngineDeadError

        if self.dead is not None:
            raise self._dead_error()
        try:
            self.client.add_request(req)
        except EngineDeadError as e:
            self._die(str(e))
            raise self._dead_error() from None
