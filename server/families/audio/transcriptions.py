"""POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI's multipart form) on a Whisper checkpoint.

The form is read with a streaming parser under --max-audio-filesize-mb (server/families/audio/multipart.py); the
multimodal worker decodes the file (capped at --max-audio-duration-s while decoding), splits it into 30 s
windows and computes their features; each window becomes one engine request through the same `generate` as
chat, all at once, so the engine batches them. Without `language`, one engine step over the first window picks
the language (the most likely language token after <|startoftranscript|>, as Whisper's detect_language).
"""

from __future__ import annotations

import time

from engine.messages import AudioInput, SamplingParams
from server.app_state import AppState
from server.families.audio.formats import (
    TIMESTAMPED,
    Segment,
    body,
    join_texts,
    split_segments,
    srt,
    text_tokens,
    verbose_json,
    vtt,
)
from server.families.audio.multipart import Form, read_form
from server.families.audio.request import AudioRequest, form_error, parse_form
from server.families.audio.stream import TranscriptStream
from server.http.asgi import Receive, Scope, Send, header, send_error, serve_post
from server.http.errors import APIError, bad_request
from server.multimodal.audio import SpeechSupport, Window, decode_audio, speech_support
from server.multimodal.whisper_tokens import LANGUAGES
from server.render.renderer import Renderer
from server.request.async_llm import AsyncLLM
from server.request.collector import Output, OutputKind
from server.request.formatter import output_error
from server.request.input_processor import (
    GenerationSpec,
    ModelLimits,
    check_request,
    external_request_id,
    max_tokens_for,
    unique_prefix,
)
from server.request.respond import respond


def not_speech_error(path: str) -> APIError:
    return bad_request(
        f"This server's model is not a speech-to-text model; {path} needs a Whisper checkpoint.", "model"
    )


class AudioRoute:
    """Raw ASGI: the multipart form, then the transcription (task "transcribe") or translation ("translate")."""

    def __init__(self, state: AppState, task: str) -> None:
        self.state, self.task = state, task

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")
        headers = [(b"x-request-id", xid.encode())] if xid else []
        path = str(scope.get("path", ""))
        model = self.state.config.model.model  # None: the built-in demo, a text model (model_path would import torch)
        support = speech_support(model) if model is not None else None

        async def read() -> tuple[SpeechSupport, Form]:
            if support is None:
                raise not_speech_error(path)
            self.state.require()
            return support, await read_form(scope, receive, self.state.config.media.max_audio_filesize_mb)

        async def work(got: tuple[SpeechSupport, Form]) -> None:
            await self._work(parse_form(got[1]), got[0], xid, send)

        async def error(send: Send, e: APIError) -> None:
            await send_error(send, e, headers)

        await serve_post(receive, send, read, work, error)

    async def _work(self, req: AudioRequest, support: SpeechSupport, xid: str | None, send: Send) -> None:
        llm, renderer, limits = self.state.require()
        self.state.check_model(req.model)
        if self.task == "translate" and "translate" not in support.task_to_id:
            raise bad_request("this model is English-only: it cannot translate", "model")
        try:
            check_request(req.sampling, limits)
        except APIError as e:
            raise form_error(e) from None
        cfg = self.state.config
        duration, windows = await decode_audio(self.state.mm_pool, req.file, cfg.media.max_audio_duration_s)
        external = external_request_id(xid, None)
        language = await self._language(llm, support, req.language, windows[0], external)
        _check_to_language(support, self.task, req.to_language, language)
        prev = await renderer.encode(" " + req.prompt, add_special_tokens=False) if req.prompt else []
        timestamps = req.response_format in TIMESTAMPED
        prompt = support.decoder_prompt(language, self.task, timestamps, prev)
        params = audio_params(req, prompt, limits)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        specs = [
            GenerationSpec(
                external,
                f"{unique_prefix()}-{external}",
                prompt,
                params,
                output_kind=kind,
                arrival_time=time.time(),
                index_offset=k,
                audio=AudioInput(w.hash, w.features, w.shape, timestamps),
            )
            for k, w in enumerate(windows)
        ]
        headers = [(b"x-request-id", external.encode())]
        if req.stream:
            await respond(
                llm,
                specs,
                TranscriptStream(len(windows), duration, req.include_usage),
                send,
                stream=True,
                include_usage=True,
                keepalive=cfg.outputs.sse_keepalive,
                headers=headers,
            )
            return
        outs = await _finals(llm, specs)
        ctype, data = await self._body(req, support, renderer, language, duration, windows, outs)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(data)).encode()), *headers],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def _language(
        self, llm: AsyncLLM, support: SpeechSupport, asked: str | None, first: Window, external: str
    ) -> str | None:
        """The request's language code: as asked, else detected on the first window (None: English-only model)."""
        if not support.multilingual:
            if asked is not None and asked.strip().lower() not in ("en", "english"):
                raise bad_request("this model is English-only; language must be en", "language")
            return None
        if asked is not None:
            return support.language_code(asked)
        params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=sorted(support.lang_to_id.values()))
        spec = GenerationSpec(
            external,
            f"{unique_prefix()}-{external}-lang",
            [support.sot],
            params,
            arrival_time=time.time(),
            audio=AudioInput(first.hash, first.features, first.shape, rules=False),
        )
        out = (await _finals(llm, [spec]))[0]
        return support.code_of(out.token_ids[0]) if out.token_ids else "en"

    async def _body(
        self,
        req: AudioRequest,
        support: SpeechSupport,
        renderer: Renderer,
        language: str | None,
        duration: float,
        windows: list[Window],
        outs: list[Output],
    ) -> tuple[bytes, bytes]:
        fmt = req.response_format
        if fmt not in TIMESTAMPED:
            return body(fmt, join_texts([o.text for o in outs]), duration)
        segments: list[Segment] = []
        seeks: list[int] = []
        texts = []
        for w, out in zip(windows, outs):
            lps = [lp.logprob for lp in out.logprobs] if out.logprobs else None
            texts.append(await renderer.decode(text_tokens(support, out.token_ids)))
            for seg in split_segments(support, out.token_ids, lps, w):
                seg.text = await renderer.decode(seg.tokens)
                seg.no_speech_prob = out.no_speech_prob
                segments.append(seg)
                seeks.append(int(round(w.start * 100)))  # Whisper's seek: the window's start in mel frames
        text = join_texts(texts)
        if fmt == "srt":
            return b"text/plain; charset=utf-8", srt(segments).encode()
        if fmt == "vtt":
            return b"text/vtt; charset=utf-8", vtt(segments).encode()
        task = "translate" if self.task == "translate" else "transcribe"
        return b"application/json", verbose_json(
            task, LANGUAGES.get(language or "en", "english"), duration, text, segments, req.temperature, seeks
        )


def audio_params(req: AudioRequest, prompt: list[int], limits: ModelLimits) -> SamplingParams:
    """The engine's parameters: the form's sampling fields (checked by check_request) on the decoder prompt."""
    s = req.sampling
    try:
        max_tokens = max_tokens_for(s, prompt, limits)
    except APIError as e:
        raise form_error(e) from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        top_k=s.top_k or 0,
        min_p=s.min_p or 0.0,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        seed=s.seed,
        logprobs=0 if req.response_format == "verbose_json" else None,
    )


def _check_to_language(support: SpeechSupport, task: str, to_language: str | None, language: str | None) -> None:
    """to_language: a translation's target is English; a transcription's is the audio's own language."""
    if to_language is None:
        return
    if task == "translate" or not support.multilingual:
        if to_language.strip().lower() not in ("en", "english"):
            raise bad_request(
                f"to_language must be en: this model writes English only here, got {to_language!r}", "to_language"
            )
        return
    try:
        target = support.language_code(to_language)
    except APIError:
        raise bad_request(
            f"to_language {to_language!r} is not a language this model knows; use an ISO-639-1 code such as 'en'",
            "to_language",
        ) from None
    if target != language:
        raise bad_request(
            f"to_language {to_language!r} differs from the audio's language {language!r}: a "
            "transcription keeps the audio's language (/v1/audio/translations translates to "
            "English)",
            "to_language",
        )


async def _finals(llm: AsyncLLM, specs: list[GenerationSpec]) -> list[Output]:
    """Every spec's final output in spec order (an error output: its APIError), through `generate`."""
    finals: dict[int, Output] = {}
    async with llm.generate(specs) as outputs:
        async for batch in outputs:
            for out in batch:
                if out.error is not None:
                    raise output_error(llm, out)
                if out.finish_reason is not None:
                    finals[out.index] = out
    return [finals[k] for k in sorted(finals)]
