"""POST /infill: llama.cpp's fill-in-the-middle route (llama.vim, llama.vscode, Continue's llama.cpp provider).

`input_prefix`, `input_suffix`, `input_extra` ([{"filename", "text"}]: other files, put before the prefix) and
`prompt` (text after the prefix) become the model's FIM prompt (server/request/fim.py); then the completions path.
The answer is llama.cpp's: `{"content", "stop", "tokens_predicted", "tokens_evaluated", ...}`, or streamed as
server-sent events of `{"content", "stop"}` chunks."""

from __future__ import annotations

import msgspec

from server.http.asgi import Send
from server.request.collector import Output
from server.request.fim import ExtraChunk, fim_prompt_ids, require_fim
from server.request.formatter import StreamFraming
from server.request.input_processor import build_spec, check_request, external_request_id
from server.request.openai_protocol import CompletionRequest, Int64, Usage, encoder
from server.request.post_route import PostRoute
from server.request.prompt_tokens import render_errors
from server.request.respond import respond

_enc = encoder.encode
FRAMING = StreamFraming(done=b"")  # llama.cpp ends its stream with the `stop: true` chunk, no [DONE]


class InfillChunk(msgspec.Struct):
    text: str = ""
    filename: str = "tmp"


class InfillRequest(msgspec.Struct, kw_only=True):
    """llama.cpp's /infill body; options llama.cpp has and this server has not (samplers, cache_prompt, t_max_*)
    are ignored as llama.cpp ignores unknown ones."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = msgspec.field(default_factory=list)
    prompt: str = ""
    model: str | None = None
    stream: bool = False
    n_predict: Int64 | None = None
    temperature: float | None = None
    top_k: Int64 | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def completion(self) -> CompletionRequest:
        seed = None if self.seed is None or self.seed < 0 else self.seed  # llama.cpp: -1 means a random seed
        max_tokens = None if self.n_predict is None or self.n_predict < 0 else self.n_predict  # -1: no limit
        return CompletionRequest(
            model=self.model,
            stream=self.stream,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=seed,
            stop=self.stop,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


infill_decoder = msgspec.json.Decoder(InfillRequest)


class InfillFormatter:
    direct_ok = True  # stateless per output

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens

    def stream_start(self) -> bytes | None:
        return None

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        out = batch[-1]
        if out.finish_reason is None:
            return b'data: {"content":%s,"stop":false}\n\n' % _enc(out.text)
        return b"data: " + self._body(out) + b"\n\n"

    def usage_chunk(self, usage: Usage) -> bytes:
        return b""

    def _body(self, out: Output) -> bytes:
        return _enc(
            {
                "content": out.text,
                "stop": True,
                "model": self.model,
                "tokens_predicted": out.num_output_tokens,
                "tokens_evaluated": self.prompt_tokens,
                "tokens_cached": out.num_cached_tokens,
                "stop_type": "limit" if out.finish_reason == "length" else "eos",
                "stopping_word": out.stop_reason if isinstance(out.stop_reason, str) else "",
                "truncated": False,
            }
        )

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        return self._body(outputs[0])


class InfillRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(infill_decoder, body)
        completion = req.completion()
        check_request(completion, limits)
        tokens = require_fim(renderer.tokenizer, "input_prefix")
        external = external_request_id(xid, None)
        with llm.admit(1, 1) as ticket:
            extra = [ExtraChunk(c.filename, c.text) for c in req.input_extra]
            with render_errors("input_prefix"):
                ids = await fim_prompt_ids(
                    renderer, tokens, req.input_prefix, req.input_suffix, extra=extra, prompt=req.prompt
                )
            spec = build_spec(completion, ids, limits, external_id=external, stream=req.stream)
            fmt = InfillFormatter(self.state.shown_model(req.model), len(spec.prompt_token_ids))
            await respond(
                llm,
                [spec],
                fmt,
                send,
                stream=req.stream,
                headers=[(b"x-request-id", external.encode())],
                framing=FRAMING,
                ticket=ticket,
            )
