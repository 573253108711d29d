"""Audio files -> Whisper's log-mel windows, in the multimodal worker process (server/multimodal/image_worker.py).

Decoding: `soundfile` (libsndfile: WAV, FLAC, OGG, MP3), else PyAV (ffmpeg: M4A, MP4, WebM, anything it reads);
either way mixed to mono and resampled to 16 kHz (PyAV's resampler). The duration cap is enforced on the samples
actually decoded, block by block, so a header that lies about the length costs no more than the cap. Audio past
30 s is split near each 30 s boundary at its quietest point (the lowest-energy 20 ms within the last second
before the boundary), as vLLM does; each window's features come from transformers' WhisperFeatureExtractor.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np

SR = 16_000
WINDOW = 30 * SR  # samples per Whisper window
SEARCH = SR  # the quietest split point is looked for in the last second before a boundary
FRAME = SR // 50  # 20 ms energy frames


class AudioError(ValueError):
    """The file is not usable audio; the message is the client's 400."""


def _soundfile(blob: bytes, cap: int) -> tuple[np.ndarray, int] | None:
    """(samples [frames, channels] float32, rate), or None when libsndfile does not know the format."""
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(blob))
    except (sf.LibsndfileError, RuntimeError, TypeError):
        return None
    parts, total = [], 0
    with f:
        limit = cap * f.samplerate
        try:
            for block in f.blocks(blocksize=1 << 16, dtype="float32", always_2d=True):
                total += block.shape[0]
                if total > limit:
                    raise AudioError("too long")
                parts.append(block)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise AudioError(f"the audio file is truncated or corrupt ({e})") from None
        rate, channels = f.samplerate, f.channels
    return (np.concatenate(parts) if parts else np.zeros((0, channels), np.float32)), rate


def _resample(mono: np.ndarray, rate: int) -> np.ndarray:
    """mono float32 at `rate` -> 16 kHz through PyAV's (ffmpeg's swr) resampler."""
    if rate == SR or mono.size == 0:
        return mono
    import av

    frame = av.AudioFrame.from_ndarray(mono[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    res = av.AudioResampler(format="flt", layout="mono", rate=SR)
    out = [f.to_ndarray()[0] for f in res.resample(frame) + res.resample(None)]
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def _pyav(blob: bytes, max_seconds: float) -> np.ndarray:
    """Any container ffmpeg reads -> 16 kHz mono float32, decoding stopped past the cap."""
    import av

    try:
        container = av.open(io.BytesIO(blob), mode="r")
    except (av.FFmpegError, ValueError, IndexError) as e:
        raise AudioError(
            f"the file could not be decoded as audio ({type(e).__name__}); send WAV, FLAC, OGG, MP3, M4A, MP4 or WebM"
        ) from None
    with container:
        if not container.streams.audio:
            raise AudioError("the file has no audio stream")
        res = av.AudioResampler(format="flt", layout="mono", rate=SR)
        parts, total, limit = [], 0, int(max_seconds * SR)
        try:
            for frame in container.decode(audio=0):
                for f in res.resample(frame):
                    parts.append(f.to_ndarray()[0])
                    total += parts[-1].shape[0]
                if total > limit:
                    raise AudioError("too long")
            parts += [f.to_ndarray()[0] for f in res.resample(None)]
        except av.FFmpegError as e:
            raise AudioError(f"the audio file is truncated or corrupt ({type(e).__name__})") from None
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def decode(blob: bytes, max_seconds: float) -> np.ndarray:
    """An audio file's bytes -> 16 kHz mono float32; AudioError naming the problem."""
    if not blob:
        raise AudioError("the audio file is empty")
    try:
        got = _soundfile(blob, int(max_seconds) + 1)
        if got is not None:
            samples, rate = got
            audio = _resample(samples.mean(axis=1).astype(np.float32), rate)
        else:
            audio = _pyav(blob, max_seconds)
    except AudioError as e:
        if str(e) != "too long":
            raise
        audio = None
    if audio is None or audio.shape[0] > max_seconds * SR:
        raise AudioError(f"the audio is longer than the server's limit of {max_seconds:g} s (--max-audio-duration-s)")
    if audio.shape[0] == 0:
        raise AudioError("the audio holds no samples (zero length)")
    return audio


def split_points(audio: np.ndarray) -> list[int]:
    """Window starts: each window ends at the quietest 20 ms frame of the second before its 30 s boundary."""
    starts, start = [0], 0
    while audio.shape[0] - start > WINDOW:
        lo = start + WINDOW - SEARCH
        seg = audio[lo : start + WINDOW]
        frames = seg[: len(seg) // FRAME * FRAME].reshape(-1, FRAME)
        quiet = int(np.argmin((frames**2).mean(axis=1))) if len(frames) else 0
        start = lo + quiet * FRAME + FRAME // 2
        starts.append(start)
    return starts


def windows(extractor: Any, audio: np.ndarray) -> list[dict[str, Any]]:
    """The features of each window: bytes (float32 [mels, 3000]), shape, hash, start and length in seconds."""
    starts = split_points(audio)
    ends = starts[1:] + [audio.shape[0]]
    out = []
    for a, b in zip(starts, ends):
        feats = extractor(audio[a:b], sampling_rate=SR, return_tensors="np").input_features[0]
        feats = np.ascontiguousarray(feats, dtype=np.float32)
        data = feats.tobytes()
        out.append(
            {
                "features": data,
                "shape": list(feats.shape),
                "hash": hashlib.sha256(data).hexdigest(),
                "start": a / SR,
                "seconds": (b - a) / SR,
            }
        )
    return out


def make_extractor(model_dir: str) -> Any:
    # why late: transformers is heavy; only the multimodal worker of a speech model loads it
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(model_dir)


def process(extractor: Any, blob: bytes, max_seconds: float) -> dict[str, Any] | str:
    """The worker's "audio" op: the windows and the duration, or the reason for a 400."""
    try:
        audio = decode(blob, max_seconds)
    except AudioError as e:
        return str(e)
    return {"duration": audio.shape[0] / SR, "windows": windows(extractor, audio)}
