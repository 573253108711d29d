"""server/families/audio/formats.py and stream.py: segments from Whisper's timestamp tokens, srt / vtt, the joined
text, usage; a stream's deltas add up to the non-streamed text whatever the order windows finish in."""

from __future__ import annotations

import json

import pytest

from server.families.audio.formats import (
    body,
    compression_ratio,
    join_texts,
    split_segments,
    srt,
    text_tokens,
    usage,
    verbose_json,
    vtt,
)
from server.families.audio.stream import TranscriptStream
from server.multimodal.audio import SpeechSupport, Window
from server.request.collector import Output

SUPPORT = SpeechSupport(
    sot=50258,
    eot=50257,
    no_timestamps=50363,
    prev_sot=50361,
    lang_to_id={"en": 50259},
    task_to_id={"transcribe": 50359, "translate": 50358},
    max_target_positions=448,
)
TB = 50364


def ts(seconds: float) -> int:
    return TB + round(seconds / 0.02)


def test_segments_from_timestamp_pairs() -> None:
    w = Window(b"", [80, 3000], "h", 30.0, 12.0)
    tokens = [ts(0.0), 10, 11, ts(2.0), ts(2.0), 12, ts(5.5), ts(6.0), 13, 14, 50257]
    segs = split_segments(SUPPORT, tokens, [-0.1 * k for k in range(len(tokens))], w)
    assert [(s.start, s.end, s.tokens) for s in segs] == [
        (30.0, 32.0, [10, 11]),
        (32.0, 35.5, [12]),
        (36.0, 42.0, [13, 14]),
    ]  # the last ends with the window
    assert segs[0].logprobs == [-0.1, -0.2]


def test_timestamps_past_the_audio_end_with_it() -> None:
    segs = split_segments(SUPPORT, [ts(1.0), 10, ts(20.0), ts(25.0), 11], None, Window(b"", [], "h", 0.0, 3.0))
    assert [(s.start, s.end) for s in segs] == [(1.0, 3.0), (3.0, 3.0)]


def test_srt_vtt_and_text() -> None:
    w = Window(b"", [], "h", 3600.0, 30.0)
    segs = split_segments(SUPPORT, [ts(1.234 - 0.014), 10, ts(2.5)], None, w)
    segs[0].text = " hi there"
    assert srt(segs) == "1\n01:00:01,220 --> 01:00:02,500\nhi there\n\n"
    assert vtt(segs) == "WEBVTT\n\n01:00:01.220 --> 01:00:02.500\nhi there\n\n"
    assert join_texts([" a b ", "", "  c"]) == "a b c"
    assert text_tokens(SUPPORT, [1, 50257, 50363, TB, 2]) == [1, 2]
    assert usage(3.01) == {"type": "duration", "seconds": 4} and usage(3.0)["seconds"] == 3
    assert compression_ratio("") == 0.0 and compression_ratio("ab" * 100) > 2


def test_bodies() -> None:
    ctype, data = body("text", "hello", 1.0)
    assert ctype.startswith(b"text/plain") and data == b"hello"
    ctype, data = body("json", "hello", 1.5)
    assert json.loads(data) == {"text": "hello", "usage": {"type": "duration", "seconds": 2}}
    segs = split_segments(SUPPORT, [ts(0.0), 10, ts(1.0)], [0.0, -0.5, 0.0], Window(b"", [], "h", 0.0, 2.0))
    segs[0].text = " x"
    v = json.loads(verbose_json("transcribe", "english", 2.0, "x", segs, 0.0, [0]))
    assert v["segments"][0]["avg_logprob"] == -0.5 and v["segments"][0]["start"] == 0.0
    assert v["language"] == "english" and v["usage"]["seconds"] == 2
    assert v["segments"][0]["no_speech_prob"] is None  # the engine did not report one: null, not a made-up number


def _deltas(chunks: list[bytes | None]) -> list[str]:
    out = []
    for c in chunks:
        if c:
            for line in c.decode().split("\n\n"):
                if line:
                    out.append(json.loads(line.removeprefix("data: "))["delta"])
    return out


@pytest.mark.parametrize("order", ["in order", "second window first"])
def test_stream_deltas_add_up_to_the_text(order: str) -> None:
    fmt = TranscriptStream(2, 31.0)
    w0 = [Output(0, " Hello", [1], 1), Output(0, " world ", [2], 2), Output(0, "", [3], 3, finish_reason="stop")]
    w1 = [Output(1, " again", [4], 1), Output(1, ".", [5], 2, finish_reason="length")]
    seq = w0 + w1 if order == "in order" else [w1[0], w0[0], w1[1], w0[1], w0[2]]
    chunks = [fmt.stream_chunk([o], None) for o in seq]
    assert "".join(_deltas(chunks)) == "Hello world again." == join_texts([" Hello world ", " again."])
    done = json.loads(fmt.usage_chunk(None).decode().removeprefix("data: "))  # type: ignore[arg-type]
    assert done == {
        "type": "transcript.text.done",
        "text": "Hello world again.",
        "logprobs": None,
        "usage": {"type": "duration", "seconds": 31},
    }
