"""`respond`: everything after validation. `generate`, then one JSON body (`send_body`) or a stream of
server-sent events (`SseResponder`). Raises APIError only before the response started."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field

from server.http import direct_body
from server.http.asgi import Send, send_json
from server.http.direct_body import DirectBody
from server.http.wakeup import InlineWaiter
from server.request.admission import AdmissionTicket
from server.request.async_llm import AsyncLLM
from server.request.collector import Output, RequestStream
from server.request.formatter import OPENAI_FRAMING, Formatter, StreamFraming, UsageCounter, output_error
from server.request.input_processor import GenerationSpec
from server.request.openai_protocol import Usage

Headers = list[tuple[bytes, bytes]]
BeforeEnd = Callable[[], Awaitable[None]] | None  # runs after the last output, before the response's last bytes


async def respond(
    llm: AsyncLLM,
    specs: Sequence[GenerationSpec],
    fmt: Formatter,
    send: Send,
    *,
    stream: bool,
    include_usage: bool = False,
    continuous_usage: bool = False,
    keepalive: float = 0.0,
    headers: Headers | None = None,
    framing: StreamFraming = OPENAI_FRAMING,
    before_end: BeforeEnd = None,
    ticket: AdmissionTicket | None = None,
) -> None:
    """Run `specs` and answer: one JSON body, or (`stream`) server-sent events. `before_end` (the check of
    relaxed structured answers) is awaited once every output is in, so it is done when the client sees the end.
    `ticket`: the admission ticket the route took before rendering (AsyncLLM.admit)."""
    counter = UsageCounter(specs)
    async with llm.generate(specs, ticket) as outputs:
        if not stream:
            await send_body(llm, outputs, fmt, send, counter, headers, before_end)
            return
        sse = SseResponder(
            llm, outputs, fmt, send, counter, continuous_usage=continuous_usage, keepalive=keepalive, framing=framing
        )
        await sse.run(include_usage, headers, before_end)


async def send_body(
    llm: AsyncLLM,
    outputs: RequestStream,
    fmt: Formatter,
    send: Send,
    counter: UsageCounter,
    headers: Headers | None,
    before_end: BeforeEnd = None,
) -> None:
    """The JSON responder: every choice's final output, then one body (an error output: its status instead)."""
    finals: dict[int, Output] = {}
    async for batch in outputs:
        counter.add(batch)
        for out in batch:
            if out.error is not None:
                raise output_error(llm, out)
            if out.finish_reason is not None:
                finals[out.index] = out
    body = fmt.final([finals[i] for i in sorted(finals)], counter.usage())
    if before_end is not None:
        await before_end()
    await send_json(send, 200, body, headers)


@dataclass
class StreamState:
    """What the route's loop and the output handler's direct delivery (`SseResponder.deliver`) both update."""

    waiting_first: bool  # keep-alives cover the queue wait; a started stream keeps flowing
    last: dict[int, Output] = field(default_factory=dict)  # each choice's latest output: the usage counts it
    failed: bool = False  # an error event went out: no usage chunk after it


@dataclass(eq=False)
class SseResponder:
    """The SSE responder: the stream's start, its chunks (written by the output handler itself where it can:
    server/http/direct_body.py), keep-alives while waiting for the first token, an error event, the tail."""

    llm: AsyncLLM
    outputs: RequestStream
    fmt: Formatter
    send: Send
    counter: UsageCounter
    _: KW_ONLY
    continuous_usage: bool
    keepalive: float
    framing: StreamFraming
    state: StreamState = field(init=False)
    direct: DirectBody | None = field(init=False)

    def __post_init__(self) -> None:
        self.state = StreamState(waiting_first=self.keepalive > 0)
        direct_ok = len(self.outputs.states) == 1 and self.fmt.direct_ok
        self.direct = direct_body.for_current_request() if direct_ok else None

    async def run(self, include_usage: bool, headers: Headers | None, before_end: BeforeEnd = None) -> None:
        start_headers = [*self.framing.headers, *(headers or [])]
        await self.send({"type": "http.response.start", "status": 200, "headers": start_headers})
        start = self.fmt.stream_start()
        if start is not None:
            await self.send({"type": "http.response.body", "body": start, "more_body": True})
        outputs, data = self.outputs, None
        if self.direct is not None:
            outputs.use_waiter(InlineWaiter(self.deliver))
        try:
            while outputs.remaining:
                got = await self._next()
                if got is None:
                    continue
                data = self._chunk(got)
                if self.state.failed or not outputs.remaining:  # the last chunk leaves with the tail: one send fewer
                    break
                if data:
                    await self._body(data, True)
                data = None
        finally:
            outputs.use_waiter(None)
        if before_end is not None:
            await before_end()
        await self._body((data or b"") + self._tail(include_usage), False)

    def deliver(self) -> bool:
        """The collector's wake-up, in the output handler: format the waiting output and hand it to the direct
        writer, no wake-up. False: declined (or finished), the route takes it."""
        got = self.outputs.peek()
        if got is None or len(got) != 1 or got[0].finish_reason is not None or got[0].error is not None:
            return False
        out = got[0]
        state = self.state
        state.last[out.index] = out  # declined, it reaches the route too, merged: same or later counts
        try:
            chunk = self.fmt.stream_chunk([out], self._usage())
        except Exception:  # a formatting bug must fail this request in its own task, not the handler
            return False
        if chunk is None or self.direct is None or not self.direct.send(chunk):
            return False
        self.outputs.poll()  # taken: counted (the access log), and the route is not woken
        state.waiting_first = False  # the stream flows: no keep-alive when the route's wait times out
        return True

    async def _next(self) -> list[Output] | None:
        """The next batch; None when a keep-alive went out instead (silence while waiting for the first token)."""
        outputs, state = self.outputs, self.state
        got = outputs.poll()
        if got is not None:
            return got
        if not state.waiting_first:
            return await outputs.wait()
        got = await outputs.next_within(self.keepalive)
        if got is None:
            if state.waiting_first:  # a direct delivery during the wait started the stream
                await self._body(self.framing.keepalive, True)
            return None
        state.waiting_first = False
        return got

    def _chunk(self, got: list[Output]) -> bytes | None:
        """The batch's chunk, or the error event of its failed output."""
        state = self.state
        error = None
        for out in got:
            state.last[out.index] = out
            if out.error is not None:
                error = out
        if error is not None:
            state.failed = True
            return self.framing.error(output_error(self.llm, error))
        return self.fmt.stream_chunk(got, self._usage())

    def _usage(self) -> Usage | None:
        """The usage so far, for stream_options.continuous_usage_stats (None: not asked for)."""
        if not self.continuous_usage:
            return None
        self.counter.add(list(self.state.last.values()))
        return self.counter.usage()

    def _tail(self, include_usage: bool) -> bytes:
        self.counter.add(list(self.state.last.values()))
        if include_usage and not self.state.failed:
            return self.fmt.usage_chunk(self.counter.usage()) + self.framing.done
        return self.framing.done

    async def _body(self, data: bytes, more: bool) -> None:
        direct = self.direct
        if direct is not None:  # what the direct path still holds goes first (queued frames, a partial write)
            await direct.flush()
        await self.send({"type": "http.response.body", "body": data, "more_body": more})
