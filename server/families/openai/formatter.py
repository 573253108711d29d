"""/v1/chat/completions' answers: ChatFormatter (the plain chat answer, streamed chunks or one body) and
ParsedChatFormatter (answers read by a tool-call and/or reasoning parser: `message.tool_calls`,
`message.reasoning` and the streamed deltas; the parsers are server/structured/parsing.py's).
"""

from __future__ import annotations

from typing import Any

from server.http import sse
from server.reasoning.token_count import Decode, reasoning_tokens
from server.request.collector import Output
from server.request.logprobs import TokenTexts, chat_logprobs
from server.request.openai_protocol import (
    ChatChoice,
    ChatChoiceIds,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageReasoning,
    ChatStreamChoice,
    ChatStreamChoiceIds,
    CompletionTokensDetails,
    DeltaMessage,
    ReasoningUsage,
    Usage,
    encoder,
)
from server.structured.parsing import ChoiceParser, ChoiceParsers
from server.tools.choice import ToolPlan
from server.tools.parser import ToolCallDelta, assemble

_enc = encoder.encode


class ChatFormatter:
    """The plain chat answer. Stateless per output, so the output handler may format and write a stream's
    chunks itself (`direct_ok`)."""

    direct_ok = True

    def __init__(
        self, request_id: str, created: int, model: str, n: int, texts: TokenTexts | None, token_ids: bool = False
    ) -> None:
        self.id = request_id
        self.created = created
        self.model = model
        self.n = n
        self.texts = texts  # set when logprobs were asked for
        self.token_ids = token_ids  # return_token_ids
        self._plain = texts is None and not token_ids
        head = _enc({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model})
        self._prefix = b"data: " + head[:-1] + b',"choices":['

    def stream_start(self) -> bytes:
        """The first chunk of every choice carries the role, as OpenAI sends it."""
        choices = b",".join(
            b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}' % i
            for i in range(self.n)
        )
        return self._prefix + choices + b"]}\n\n"

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        if usage is None and len(batch) == 1 and self._plain and batch[0].finish_reason is None:
            return b"%s%s]}\n\n" % (self._prefix, self._plain_choice(batch[0]))  # the per-token case
        parts = []
        for out in batch:
            if out.finish_reason is None and self._plain:
                parts.append(self._plain_choice(out))
            else:
                lp = chat_logprobs(out.logprobs or [], self.texts) if self.texts is not None else None
                if self.token_ids:
                    parts.append(
                        _enc(
                            ChatStreamChoiceIds(
                                out.index,
                                DeltaMessage(content=out.text),
                                lp,
                                out.finish_reason,
                                out.stop_reason,
                                out.token_ids,
                            )
                        )
                    )
                else:
                    parts.append(
                        _enc(
                            ChatStreamChoice(
                                out.index, DeltaMessage(content=out.text), lp, out.finish_reason, out.stop_reason
                            )
                        )
                    )
        tail = b"]}\n\n" if usage is None else b'],"usage":' + _enc(usage) + b"}\n\n"
        return self._prefix + b",".join(parts) + tail

    def _plain_choice(self, out: Output) -> bytes:  # the hot path: no objects, one encode
        return b'{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}' % (out.index, _enc(out.text))

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse.frame(_enc(ChatCompletionStreamResponse(self.id, self.created, self.model, [], usage=usage)))

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        choices: list[ChatChoice] = []
        for o in outputs:
            lp = chat_logprobs(o.logprobs or [], self.texts) if self.texts is not None else None
            message = ChatMessage("assistant", o.text)
            if self.token_ids:
                choices.append(ChatChoiceIds(o.index, message, lp, o.finish_reason, o.stop_reason, o.token_ids))
            else:
                choices.append(ChatChoice(o.index, message, lp, o.finish_reason, o.stop_reason))
        return _enc(ChatCompletionResponse(self.id, self.created, self.model, choices, usage))


def _call_json(d: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": d.arguments}
    if d.name is not None:
        function["name"] = d.name
    out: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        out["id"] = d.id
        out["type"] = "function"
    out["function"] = function
    return out


class ParsedChatFormatter(ChatFormatter):
    """ChatFormatter for answers read by parsers. Stateful per choice, so each output must be formatted exactly
    once (`direct_ok` False: no direct write from the output handler, whose declined outputs the SSE responder
    would format again)."""

    direct_ok = False

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        n: int,
        texts: TokenTexts | None,
        token_ids: bool,
        *,
        tools: ToolPlan | None,
        reasoning: str | None,
        prompt: str,
        decode: Decode | None = None,
    ) -> None:
        super().__init__(request_id, created, model, n, texts, token_ids)
        self._plain = False
        self._parsers = ChoiceParsers(tools, reasoning, prompt)
        self._choices: dict[int, ChoiceParser] = {}
        self.decode = decode  # set with a reasoning parser: usage counts the reasoning tokens
        self._ids: dict[int, list[int]] = {}  # per streamed choice: its token ids so far
        self._reasoned: dict[int, int] = {}  # per streamed choice whose reasoning ended: its reasoning tokens

    def _count(self, index: int) -> int:
        parser = self._choices[index].reasoning
        if index in self._reasoned or parser is None or self.decode is None:
            return self._reasoned.get(index, 0)
        n = reasoning_tokens(parser, self._ids.get(index, []), self.decode)
        if parser.ended:  # final once the end tag is out: counted once
            self._reasoned[index] = n
        return n

    def _usage(self, usage: Usage, reasoning: int | None = None) -> Usage:
        """`usage` with its completion_tokens_details (reasoning: the streamed choices' count so far)."""
        if self.decode is None:
            return usage
        if reasoning is None:
            reasoning = sum(self._count(i) for i in self._choices)
        return ReasoningUsage(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens,
            usage.prompt_tokens_details,
            CompletionTokensDetails(reasoning),
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        return super().usage_chunk(self._usage(usage))

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        parts = []
        for out in batch:
            parser = self._choices.get(out.index)
            if parser is None:
                parser = self._choices[out.index] = self._parsers.new()
            d = parser.feed(out.text, out.finish_reason is not None)
            if self.decode is not None:
                self._ids.setdefault(out.index, []).extend(out.token_ids)
            finish = parser.finish_reason(out.finish_reason)
            if not (d.reasoning or d.content or d.calls or finish or out.logprobs or self.token_ids):
                continue  # held back (a tag may be starting): nothing to say yet
            delta = DeltaMessage(
                content=d.content or None,
                reasoning=d.reasoning or None,
                reasoning_content=d.reasoning or None,
                tool_calls=[_call_json(c) for c in d.calls] or None,
            )
            lp = chat_logprobs(out.logprobs or [], self.texts) if self.texts is not None else None
            if self.token_ids:
                parts.append(_enc(ChatStreamChoiceIds(out.index, delta, lp, finish, out.stop_reason, out.token_ids)))
            else:
                parts.append(_enc(ChatStreamChoice(out.index, delta, lp, finish, out.stop_reason)))
        if not parts and usage is None:
            return None
        tail = b"]}\n\n" if usage is None else b'],"usage":' + _enc(self._usage(usage)) + b"}\n\n"
        return self._prefix + b",".join(parts) + tail

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        choices: list[ChatChoice] = []
        reasoning = 0
        for o in outputs:
            parser = self._parsers.new()
            d = parser.feed(o.text, True)
            if self.decode is not None:
                reasoning += reasoning_tokens(parser.reasoning, o.token_ids, self.decode)
            calls = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in assemble(d.calls)
            ]
            message: ChatMessage
            if self._parsers.reasoning_cls is not None:
                message = ChatMessageReasoning(
                    "assistant",
                    d.content or None,
                    calls,
                    reasoning=d.reasoning or None,
                    reasoning_content=d.reasoning or None,
                )
            else:
                message = ChatMessage("assistant", d.content or (None if calls else ""), calls)
            lp = chat_logprobs(o.logprobs or [], self.texts) if self.texts is not None else None
            finish = parser.finish_reason(o.finish_reason)
            if self.token_ids:
                choices.append(ChatChoiceIds(o.index, message, lp, finish, o.stop_reason, o.token_ids))
            else:
                choices.append(ChatChoice(o.index, message, lp, finish, o.stop_reason))
        usage = self._usage(usage, reasoning)
        return _enc(ChatCompletionResponse(self.id, self.created, self.model, choices, usage))
