"""Audio made in the tests (tones and noise, written with soundfile / PyAV), the demo Whisper checkpoint, and
transformers' Whisper greedy output to compare the engine and the server with."""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from demo.whisper import make_whisper_demo

SR = 16_000


def tone(seconds: float, sr: int = SR, freq: float = 440.0, seed: int = 0, channels: int = 1) -> np.ndarray:
    """A tone with noise, float32 [frames] (mono) or [frames, channels]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * freq * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 0.7 * t))
    x = (x + rng.normal(0, 0.05, t.shape)).astype(np.float32)
    if channels == 1:
        return x
    return np.stack([x * (1.0 - 0.2 * c) for c in range(channels)], axis=1).astype(np.float32)


def encode(audio: np.ndarray, sr: int, fmt: str) -> bytes:
    """audio -> a file's bytes: wav / flac / ogg / mp3 by soundfile, m4a / webm / mp4 by PyAV."""
    if fmt in ("wav", "flac", "ogg", "mp3"):
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, audio, sr, format=fmt.upper())
        return buf.getvalue()
    return _encode_av(audio, sr, fmt)


def _encode_av(audio: np.ndarray, sr: int, fmt: str) -> bytes:
    import av

    container_fmt, codec = {"m4a": ("ipod", "aac"), "mp4": ("mp4", "aac"), "webm": ("webm", "libopus")}[fmt]
    rate = 48_000 if codec == "libopus" else sr
    data = audio if audio.ndim == 2 else audio[:, None]
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono" if data.shape[1] == 1 else "stereo"  # type: ignore[union-attr]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data.T), format="fltp", layout=stream.layout.name)  # type: ignore[union-attr]
        frame.sample_rate = sr
        resampler = av.AudioResampler(
            format=stream.format.name,
            layout=stream.layout.name,  # type: ignore[union-attr]
            rate=rate,
        )
        for f in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(f):  # type: ignore[union-attr]
                out.mux(packet)
        for packet in stream.encode(None):  # type: ignore[union-attr]
            out.mux(packet)
    return buf.getvalue()


@cache
def demo_whisper(root: str) -> Path:
    """The random tiny Whisper checkpoint, built once per folder."""
    path = Path(root) / "whisper-demo"
    if not (path / "model.safetensors").exists():
        make_whisper_demo(path)
    return path


def hf_whisper(ckpt: Path) -> Any:
    import transformers

    return transformers.WhisperForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_features(ckpt: Path, audio16k: np.ndarray) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(ckpt)
    return fe(audio16k, sampling_rate=SR, return_tensors="pt").input_features


def hf_generate(model: Any, features: torch.Tensor, max_new_tokens: int, **kw: Any) -> list[int]:
    """transformers' greedy Whisper tokens (the decoder prompt not included; eos included when reached)."""
    out = model.generate(features, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return list(out[0].tolist())


def hf_window_generate(
    model: Any, features: torch.Tensor, prompt: list[int], max_new_tokens: int, timestamps: bool
) -> list[int]:
    """One 30 s window decoded greedily by transformers with Whisper's own logits processors (begin-suppress,
    suppress, and WhisperTimeStampLogitsProcessor with timestamps), as `generate` applies them; without its
    seek loop, which re-decodes the rest of a window after a timestamp (spindle decodes each window once)."""
    import copy

    from transformers.generation import GenerationMixin, LogitsProcessorList
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    g = model.generation_config
    procs = [
        SuppressTokensAtBeginLogitsProcessor(g.begin_suppress_tokens, len(prompt)),
        SuppressTokensLogitsProcessor(g.suppress_tokens),
    ]
    if timestamps:
        procs.append(WhisperTimeStampLogitsProcessor(g, begin_index=len(prompt)))
    plain = copy.deepcopy(g)
    plain.suppress_tokens = plain.begin_suppress_tokens = plain.forced_decoder_ids = None
    out = GenerationMixin.generate(
        model,
        input_features=features,
        decoder_input_ids=torch.tensor([prompt]),
        logits_processor=LogitsProcessorList(procs),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        generation_config=plain,
    )
    return list(out[0, len(prompt) :].tolist())
