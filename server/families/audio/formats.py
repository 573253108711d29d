"""What a transcription answers, per `response_format`: json, text, verbose_json (segments with timestamps), srt,
vtt; and the text a stream's deltas add up to (the same text as without streaming).

Each 30 s window is one engine request. Its tokens split into segments at Whisper's timestamp tokens (a segment
is the text between a start and an end timestamp; the times are the window's start plus the tokens' times); the
windows' texts are stripped and joined with one space.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from server.multimodal.audio import SpeechSupport, Window

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TIMESTAMPED = ("verbose_json", "srt", "vtt")


@dataclass
class Segment:
    start: float
    end: float
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    no_speech_prob: float | None = None  # its window's (the engine's, at <|startoftranscript|>)


def split_segments(
    support: SpeechSupport, tokens: list[int], logprobs: list[float] | None, window: Window
) -> list[Segment]:
    """One window's tokens -> its segments (times in the file); text tokens after the last timestamp end at the
    window's end."""
    tb, off, length = support.timestamp_begin, window.start, window.seconds
    out: list[Segment] = []
    start: float | None = None
    cur: list[int] = []
    lps: list[float] = []
    for k, t in enumerate(tokens):
        if t == support.eot:
            break
        if t >= tb:
            at = min(support.seconds(t), length)  # a timestamp past the window's audio ends with the audio
            if start is not None and cur:
                out.append(Segment(off + start, off + at, cur, lps))
                cur, lps, start = [], [], None
            else:
                start = at
        elif t < support.eot:
            cur.append(t)
            if logprobs is not None:
                lps.append(logprobs[k])
    if cur:
        out.append(Segment(off + (start or 0.0), off + length, cur, lps))
    return out


def text_tokens(support: SpeechSupport, tokens: list[int]) -> list[int]:
    """The tokens that are text (every Whisper special token, timestamps included, is at or past eot)."""
    return [t for t in tokens if t < support.eot]


def join_texts(texts: list[str]) -> str:
    return " ".join(t.strip() for t in texts if t.strip())


def compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def usage(duration: float) -> dict[str, Any]:
    """OpenAI's usage of a whisper transcription: the audio's length in whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(duration)}


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[Segment]) -> str:
    return "".join(
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n" for i, s in enumerate(segments, 1)
    )


def vtt(segments: list[Segment]) -> str:
    return "WEBVTT\n\n" + "".join(
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n" for s in segments
    )


def verbose_json(
    task: str, language: str, duration: float, text: str, segments: list[Segment], temperature: float, seeks: list[int]
) -> bytes:
    segs = [
        {
            "id": i,
            "seek": seek,
            "start": round(s.start, 2),
            "end": round(s.end, 2),
            "text": s.text,
            "tokens": s.tokens,
            "temperature": temperature,
            "avg_logprob": sum(s.logprobs) / len(s.logprobs) if s.logprobs else 0.0,
            "compression_ratio": compression_ratio(s.text),
            "no_speech_prob": s.no_speech_prob,
        }
        for i, (s, seek) in enumerate(zip(segments, seeks))
    ]
    return msgspec.json.encode(
        {
            "task": task,
            "language": language,
            "duration": duration,
            "text": text,
            "segments": segs,
            "usage": usage(duration),
        }
    )


def body(fmt: str, text: str, duration: float) -> tuple[bytes, bytes]:
    """(content type, body) of json and text."""
    if fmt == "text":
        return b"text/plain; charset=utf-8", text.encode()
    return b"application/json", msgspec.json.encode({"text": text, "usage": usage(duration)})
