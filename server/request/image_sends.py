"""A vision model's requests on their way to the engine: an image the engine holds (by the API's mirror of its
encoder cache, server/multimodal/mirror.py) crosses the pipe as its hash only; a child the engine no longer
held comes back refused with IMAGE_CACHE_MISS and is resent with pixels, once, before the client sees anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from engine.messages import IMAGE_CACHE_MISS, AddRequest, ImageInput, StepOutputs
from server.http.errors import APIError
from server.request.output_processor import Counter


class ImageMirror(Protocol):
    """Which images the engine holds (server.multimodal.mirror.EngineImageMirror)."""

    def strip(self, inputs: list[ImageInput]) -> tuple[list[ImageInput], int]: ...
    def record(self, inputs: list[ImageInput]) -> None: ...
    def forget(self, keys: list[str]) -> None: ...


class ImageMetrics(Protocol):
    @property
    def mm_engine_cache_hits(self) -> Counter: ...
    @property
    def mm_engine_cache_misses(self) -> Counter: ...


class ImageSends:
    """`send` hands one request to the engine client (raises APIError when the engine is dead)."""

    def __init__(self, send: Callable[[AddRequest], None], metrics: ImageMetrics | None) -> None:
        self._send = send
        self.metrics = metrics
        self.mirror: ImageMirror | None = None  # set by the app for a vision model
        self._resend: dict[str, AddRequest] = {}  # children sent by hash only, until their first output

    def send(self, reqs: list[AddRequest]) -> None:
        """Send one prompt's children (same images): by hash where the mirror says the engine holds them (looked
        up once, so a child does not count on its sibling's images, not yet encoded); recorded once sent."""
        mirror = self.mirror
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

    def resend_misses(self, step: StepOutputs, engine_alive: bool) -> StepOutputs:
        """A child sent by hash that the engine no longer held: resend it with pixels; the client sees nothing."""
        if not self._resend:
            return step
        keep = []
        for ro in step.outputs:
            full = self._resend.pop(ro.request_id, None)  # its first output: the engine took or refused it
            if (
                full is not None
                and ro.finish_reason == "error"
                and (ro.error or "").startswith(IMAGE_CACHE_MISS)
                and engine_alive
                and self.mirror is not None
            ):
                self.mirror.forget([img.hash for img in full.mm_inputs or ()])
                if self.metrics is not None:
                    self.metrics.mm_engine_cache_misses.inc()
                try:
                    self._send(full)
                except APIError as e:  # the engine died meanwhile
                    keep.append(msgspec.structs.replace(ro, error=e.message))
                    continue
                self.mirror.record(full.mm_inputs or [])
                continue
            keep.append(ro)
        return step if len(keep) == len(step.outputs) else msgspec.structs.replace(step, outputs=keep)

    def forget(self, request_ids: Iterable[str]) -> None:
        """The requests ended: nothing of theirs to resend."""
        if self._resend:
            for rid in request_ids:
                self._resend.pop(rid, None)
