"""The outputs of one `generate` call, as its consumer (respond.py) takes them."""

from __future__ import annotations

import time

import anyio

from server.http.access_log import RequestRecord
from server.http.wakeup import Waiter
from server.request.collector import Collector, Output, OutputKind
from server.request.output_processor import RequestState


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
