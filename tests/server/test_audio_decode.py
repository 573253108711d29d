"""server/multimodal/audio_decode.py: files of every format to 16 kHz mono, the duration cap at, under and over it
(on decoded samples: a header that claims less, or more, does not matter), bad files, window splitting, features."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from server.multimodal.audio_decode import SR, WINDOW, AudioError, decode, make_extractor, process, split_points
from tests.helpers.audio import demo_whisper, encode, tone


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3", "m4a", "webm", "mp4"])
def test_formats_decode_to_16k_mono(fmt: str) -> None:
    got = decode(encode(tone(1.5, sr=22_050, channels=2), 22_050, fmt), 60)
    assert got.dtype == np.float32 and got.ndim == 1
    assert int(1.5 * SR) <= len(got) <= int(1.5 * SR) + 2100  # AAC / Opus priming and padding


def _pcm16_wav(frames: int) -> bytes:
    return encode(np.zeros(frames, np.float32), SR, "wav")


def test_duration_cap_at_under_over() -> None:
    assert len(decode(_pcm16_wav(5 * SR), 5.0)) == 5 * SR
    assert len(decode(_pcm16_wav(5 * SR - 1), 5.0)) == 5 * SR - 1
    with pytest.raises(AudioError, match=r"longer than the server's limit of 5 s \(--max-audio-duration-s\)"):
        decode(_pcm16_wav(5 * SR + 1), 5.0)
    with pytest.raises(AudioError, match="--max-audio-duration-s"):
        decode(encode(tone(5.1), SR, "m4a"), 5.0)  # the PyAV path counts too


def test_a_header_that_lies_about_the_length() -> None:
    """A WAV whose header claims a 0xFFFFFFFF-byte data chunk (as streamed WAVs do) holding 8 s: cut at the cap."""
    wav = bytearray(_pcm16_wav(8 * SR))
    at = wav.index(b"data")
    wav[at + 4 : at + 8] = struct.pack("<I", 0xFFFFFFFF)
    wav[4:8] = struct.pack("<I", 0xFFFFFFFF)
    with pytest.raises(AudioError, match="--max-audio-duration-s"):
        decode(bytes(wav), 5.0)
    assert len(decode(bytes(wav), 10.0)) == 8 * SR


@pytest.mark.parametrize(
    "blob, words", [(b"", "empty"), (b"this is plain text, not audio" * 20, "could not be decoded")]
)
def test_bad_files(blob: bytes, words: str) -> None:
    with pytest.raises(AudioError, match=words):
        decode(blob, 60)


def test_zero_length_and_truncated() -> None:
    with pytest.raises(AudioError, match="zero length"):
        decode(_pcm16_wav(0), 60)
    m4a = encode(tone(2.0), SR, "m4a")
    with pytest.raises(AudioError):
        decode(m4a[: len(m4a) // 2], 60)


def test_split_at_the_quietest_point() -> None:
    audio = tone(70.0)
    audio[int(29.3 * SR) : int(29.3 * SR) + 400] = 0.0  # a 25 ms gap in the second before 30 s
    starts = split_points(audio)
    assert len(starts) == 3
    assert int(29.3 * SR) <= starts[1] <= int(29.3 * SR) + 400
    assert all(b - a <= WINDOW for a, b in zip(starts, starts[1:] + [len(audio)]))
    assert split_points(tone(30.0)) == [0]


def test_windows_features_equal_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import WhisperFeatureExtractor

    ckpt = demo_whisper(str(tmp_path_factory.mktemp("w")))
    ext = make_extractor(str(ckpt))
    audio = tone(40.0)
    got = process(ext, encode(audio, SR, "wav"), 60.0)
    assert isinstance(got, dict) and got["duration"] == pytest.approx(40.0)
    wins = got["windows"]
    assert len(wins) == 2 and wins[0]["start"] == 0.0
    ref = WhisperFeatureExtractor.from_pretrained(ckpt)
    first = decode(encode(audio, SR, "wav"), 60.0)[: int(wins[0]["seconds"] * SR)]
    want = ref(first, sampling_rate=SR, return_tensors="np").input_features[0]
    assert wins[0]["shape"] == [80, 3000]
    assert np.array_equal(np.frombuffer(wins[0]["features"], np.float32).reshape(80, 3000), want)
    assert process(ext, b"", 60.0) == "the audio file is empty"
