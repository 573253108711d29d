"""A streamed transcription: OpenAI's `transcript.text.delta` events, then one `transcript.text.done` with the
whole text and the usage (unless stream_include_usage is false) (the `openai` SDK's TranscriptionTextDeltaEvent /
TranscriptionTextDoneEvent).

Windows run at once in the engine but their text streams in order: a later window's text is held until every
earlier window finished. The deltas add up to exactly the non-streamed text: each window's text stripped, the
windows joined by one space (a window's trailing whitespace is held back until more text follows it).
"""

from __future__ import annotations

import msgspec

from server.families.audio.formats import usage
from server.request.collector import Output
from server.request.openai_protocol import Usage


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class TranscriptStream:
    """The route's Formatter (server/request/formatter.py) for `stream: true`."""

    direct_ok = False  # per-window state: each output must be formatted exactly once

    def __init__(self, windows: int, duration: float, include_usage: bool = True) -> None:
        self.include_usage = include_usage
        self.texts = [""] * windows
        self.done = [False] * windows
        self.duration = duration
        self.sent = ""  # the text the deltas so far add up to

    def stream_start(self) -> bytes | None:
        return None

    def _current(self) -> str:
        """The text that may be sent now: finished windows, then the first unfinished one (held past it)."""
        parts = []
        for text, done in zip(self.texts, self.done):
            parts.append(text.strip())
            if not done:
                break
        return " ".join(p for p in parts if p)

    def stream_chunk(self, batch: list[Output], usage_so_far: Usage | None) -> bytes | None:
        for out in batch:
            self.texts[out.index] += out.text
            if out.finish_reason is not None:
                self.done[out.index] = True
        now = self._current()
        if len(now) <= len(self.sent) or not now.startswith(self.sent):
            return None
        delta, self.sent = now[len(self.sent) :], now
        return _event({"type": "transcript.text.delta", "delta": delta, "logprobs": None})

    def usage_chunk(self, _usage: Usage) -> bytes:
        """The stream's last event (respond's usage slot): the whole text and the audio's duration."""
        done: dict[str, object] = {"type": "transcript.text.done", "text": self.sent, "logprobs": None}
        if self.include_usage:
            done["usage"] = usage(self.duration)
        return _event(done)

    def final(self, outputs: list[Output], _usage: Usage) -> bytes:
        raise NotImplementedError("a streamed transcription has no single body")
