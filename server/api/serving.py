"""What the routes share: the POST front (PostRoute), and `respond`: run `generate`, then stream SSE events or
send one JSON body."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from server.http import direct_body, sse
from server.http.asgi import SSE_HEADERS, Receive, Scope, Send, header, send_json, serve_json_post
from server.api.openai.logprobs import TokenTexts
from server.api.state import AppState
from server.pipeline.async_llm import AsyncLLM
from server.http.errors import APIError
from server.pipeline.input_processor import GenerationSpec
from server.pipeline.output_processor import Output
from server.protocol.openai import PromptTokensDetails, Usage


class Formatter(Protocol):
    def stream_start(self) -> bytes | None: ...
    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None: ...
    def usage_chunk(self, usage: Usage) -> bytes: ...
    def final(self, outputs: list[Output], usage: Usage) -> bytes: ...


@dataclass(frozen=True)
class StreamFraming:
    """A stream's bytes that are not chunks: OpenAI's by default; another wire format (Anthropic's) brings its own."""

    done: bytes = sse.DONE  # ends the stream
    keepalive: bytes = sse.KEEPALIVE  # sent on silence before the first token
    error: Callable[[APIError], bytes] = sse.error_frame  # an error after the response started


OPENAI_FRAMING = StreamFraming()


class UsageCounter:
    """Prompt tokens once per prompt (shared by its n choices), completion tokens summed over choices."""

    def __init__(self, specs: Sequence[GenerationSpec]) -> None:
        self.prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
        self._spec_of = {s.index_offset + i: k for k, s in enumerate(specs) for i in range(s.n)}
        self._completion: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # per spec: its prompt's cached tokens

    def add(self, batch: list[Output]) -> None:
        for out in batch:
            self._completion[out.index] = out.num_output_tokens
            if out.num_cached_tokens:
                k = self._spec_of.get(out.index, 0)
                self._cached[k] = max(self._cached.get(k, 0), out.num_cached_tokens)

    def usage(self) -> Usage:
        completion = sum(self._completion.values())
        return Usage(self.prompt_tokens, completion, self.prompt_tokens + completion,
                     PromptTokensDetails(sum(self._cached.values())))


def _usage(counter: UsageCounter, last: dict[int, Output]) -> Usage:
    counter.add(list(last.values()))
    return counter.usage()


def output_error(llm: AsyncLLM, out: Output) -> APIError:
    if llm.dead is not None:  # the engine died under it: a server fault, as issue 3 specifies
        return APIError(f"{out.error}", status=500)
    if llm.stopping:  # cut by shutdown: the client should retry elsewhere
        return APIError(f"{out.error}", status=503, retry_after=1)
    return APIError(out.error or "the request failed", status=400)


async def respond(llm: AsyncLLM, specs: Sequence[GenerationSpec], fmt: Formatter, send: Send, *, stream: bool,
                  include_usage: bool = False, continuous_usage: bool = False, keepalive: float = 0.0,
                  headers: list[tuple[bytes, bytes]] | None = None, framing: StreamFraming = OPENAI_FRAMING) -> None:
    """Everything after validation. Raises APIError only before the response started."""
    counter = UsageCounter(specs)
    async with llm.generate(specs) as outputs:
        if not stream:
            finals: dict[int, Output] = {}
            async for batch in outputs:
                counter.add(batch)
                for out in batch:
                    if out.error is not None:
                        raise output_error(llm, out)
                    if out.finish_reason is not None:
                        finals[out.index] = out
            await send_json(send, 200, fmt.final([finals[i] for i in sorted(finals)], counter.usage()), headers)
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + (headers or [])})
        start = fmt.stream_start()
        if start is not None:
            await send({"type": "http.response.body", "body": start, "more_body": True})
        failed = False
        waiting_first = keepalive > 0  # keep-alives cover the queue wait; a started stream keeps flowing
        last: dict[int, Output] = {}
        data: bytes | None = None
        # A formatter with per-choice state (chat_parsing's) must see each output once: no direct writes.
        direct_ok = len(outputs.states) == 1 and getattr(fmt, "direct_ok", True)
        direct = direct_body.for_current_request(llm.writes) if direct_ok else None

        def deliver(out: Output) -> bool:  # runs in the output handler: format and write, no wake-up
            nonlocal waiting_first
            last[out.index] = out  # declined, it reaches the route too, merged: same or later counts
            try:
                chunk = fmt.stream_chunk([out], _usage(counter, last) if continuous_usage else None)
            except Exception:  # a formatting bug must fail this request in its own task, not the handler
                return False
            if chunk is None or direct is None or not direct.send(chunk):
                return False
            waiting_first = False  # the stream flows: no keep-alive when the route's wait times out
            return True

        async def body(data: bytes, more: bool) -> None:
            if direct is not None and direct.pending:  # bytes a partial direct write left go first
                await direct.flush()
            await send({"type": "http.response.body", "body": data, "more_body": more})

        if direct is not None:
            outputs.deliver_directly(deliver)
        try:
            while outputs.remaining:
                got = outputs.poll()
                if got is None:
                    if waiting_first:
                        got = await outputs.next_within(keepalive)
                        if got is None:
                            if waiting_first:
                                await body(framing.keepalive, True)
                            continue
                        waiting_first = False
                    else:
                        got = await outputs.wait()
                error = None
                for out in got:
                    last[out.index] = out
                    if out.error is not None:
                        error = out
                if error is not None:
                    data = framing.error(output_error(llm, error))
                    failed = True
                else:
                    data = fmt.stream_chunk(got, _usage(counter, last) if continuous_usage else None)
                if failed or not outputs.remaining:  # the last chunk leaves with the tail: one send fewer
                    break
                if data:
                    await body(data, True)
                data = None
        finally:
            outputs.deliver_directly(None)
        counter.add(list(last.values()))
        tail = framing.done
        if include_usage and not failed:
            tail = fmt.usage_chunk(counter.usage()) + framing.done
        await body((data or b"") + tail, False)


class PostRoute:
    """The shared front of the JSON POST routes: X-Request-Id (echoed on errors), body, disconnect."""

    runner: str | None = None  # the --runner the route needs ("generate" or "pooling"); None: either

    def __init__(self, state: AppState) -> None:
        self.state = state
        self._texts: TokenTexts | None = None  # token strings for logprobs, built on first use

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")
        headers = [(b"x-request-id", xid.encode())] if xid else []
        await serve_json_post(scope, receive, send, self.state.config.max_request_body,
                              lambda body: self._checked_work(body, xid, send), headers)

    async def _checked_work(self, body: bytes, xid: str | None, send: Send) -> None:
        self.check_runner()
        await self._work(body, xid, send)

    def check_runner(self) -> None:
        """400 for a generation route on an embedding server (--runner pooling), and the other way round."""
        have = self.state.config.runner
        if self.runner is None or self.runner == have:
            return
        if have == "pooling":
            raise APIError("This server runs an embedding model (--runner pooling): it serves /v1/embeddings, not "
                           "generation; start a server with --runner generate for this route.", status=400)
        raise APIError("This server runs a generation model (--runner generate); /v1/embeddings needs a server "
                       "started with --runner pooling.", status=400)

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        raise NotImplementedError

    def token_texts(self, renderer: Any, wanted: bool) -> TokenTexts | None:
        """The token strings logprobs are written with, when `wanted`."""
        if wanted and self._texts is None:
            self._texts = TokenTexts(renderer.tokenizer)
        return self._texts if wanted else None
