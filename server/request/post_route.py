"""The shared front of the JSON POST routes (PostRoute). What follows validation is `respond`
(respond.py)."""

from __future__ import annotations

from server.app_state import AppState
from server.http.asgi import Receive, Scope, Send, header, serve_json_post
from server.http.errors import APIError
from server.multimodal.audio import speech_support
from server.render.renderer import Renderer
from server.request.logprobs import TokenTexts


class PostRoute:
    """The shared front of the JSON POST routes: X-Request-Id (echoed on errors), body, disconnect."""

    runner: str | None = None  # the --runner the route needs ("generate" or "pooling"); None: either
    speech_ok = False  # whether the route serves a speech-to-text model (tokenizing does; generating text does not)

    def __init__(self, state: AppState) -> None:
        self.state = state
        self._texts: TokenTexts | None = None  # token strings for logprobs, built on first use

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")
        headers = [(b"x-request-id", xid.encode())] if xid else []
        path = str(scope.get("path", ""))
        await serve_json_post(
            scope,
            receive,
            send,
            self.state.config.http.max_request_body,
            lambda body: self._checked_work(body, xid, send, path),
            headers,
        )

    async def _checked_work(self, body: bytes, xid: str | None, send: Send, path: str) -> None:
        self.check_runner(path)
        self.check_speech(path)
        await self._work(body, xid, send)

    def check_runner(self, path: str) -> None:
        """400 for a generation route on a pooling server (--runner pooling), and the other way round."""
        have = self.state.config.model.runner
        if self.runner is None or self.runner == have:
            return
        if have == "pooling":
            raise APIError(
                "This server runs a pooling model (--runner pooling): it serves /v1/embeddings, "
                "/classify, /score, /rerank, /pooling and /v2/embed, not generation; start a server "
                f"with --runner generate for {path}.",
                status=400,
            )
        raise APIError(
            f"This server runs a generation model (--runner generate); {path} needs a server started "
            "with --runner pooling.",
            status=400,
        )

    def check_speech(self, path: str) -> None:
        """400 for a text route on a speech-to-text model (Whisper): its decoder needs audio."""
        model = self.state.config.model.model
        if not self.speech_ok and model is not None and speech_support(model) is not None:
            raise APIError(
                f"This server runs a speech-to-text model: it serves /v1/audio/transcriptions and "
                f"/v1/audio/translations, not {path}.",
                status=400,
                param="model",
            )

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        raise NotImplementedError

    def token_texts(self, renderer: Renderer, wanted: bool) -> TokenTexts | None:
        """The token strings logprobs are written with, when `wanted`."""
        if wanted and self._texts is None:
            self._texts = TokenTexts(renderer.tokenizer)
        return self._texts if wanted else None
