"""A speech model's audio on the API side: what the checkpoint says about its tokens, and the audio worker.

`speech_support` reads a Whisper checkpoint's config.json and generation_config.json (its special token ids,
languages, tasks); None for any other model. Decoding and feature extraction run in the multimodal worker process
(server/multimodal/image_worker.py with server/multimodal/audio_decode.py), never on the event loop.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.http.errors import APIError, bad_request
from server.multimodal.images import ImagePool, call_image_worker
from server.multimodal.whisper_tokens import LANGUAGES, NAMES_TO_CODES, TIME_PRECISION
from server.render.worker_pool import WorkerPool

ARCHITECTURE = "WhisperForConditionalGeneration"
AUDIO_TIMEOUT = 120.0  # seconds one file's decoding and features may take in the worker (600 s of audio: ~5 s)


@dataclass(frozen=True)
class SpeechSupport:
    """A Whisper checkpoint's special tokens (generation_config.json) and decoder length."""

    sot: int
    eot: int
    no_timestamps: int
    prev_sot: int | None
    lang_to_id: dict[str, int]  # language code -> token id; empty for an English-only model
    task_to_id: dict[str, int]
    max_target_positions: int

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return bool(self.lang_to_id)

    def language_code(self, value: str) -> str:
        """A request's `language` (ISO-639-1 code or English name) -> the code; 400 for one the model lacks."""
        code = value.strip().lower()
        code = NAMES_TO_CODES.get(code, code)
        if code not in self.lang_to_id:
            raise bad_request(
                f"language {value!r} is not one this model knows; use an ISO-639-1 code such as 'en'", "language"
            )
        return code

    def code_of(self, token: int) -> str:
        for code, tid in self.lang_to_id.items():
            if tid == token:
                return code
        return "en"

    def decoder_prompt(self, language: str | None, task: str, timestamps: bool, prev: list[int]) -> list[int]:
        """[<|startofprev|> prompt...] <|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>], as Whisper."""
        ids: list[int] = []
        if prev and self.prev_sot is not None:
            ids = [self.prev_sot] + prev[-(self.max_target_positions // 2 - 1) :]
        ids.append(self.sot)
        if self.multilingual:
            ids += [self.lang_to_id[language or "en"], self.task_to_id[task]]
        if not timestamps:
            ids.append(self.no_timestamps)
        return ids

    def seconds(self, token: int) -> float:
        return (token - self.timestamp_begin) * TIME_PRECISION


@functools.cache
def speech_support(model_dir: str) -> SpeechSupport | None:
    """The checkpoint's speech settings, or None for a model that is not Whisper."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        path = Path(model_dir) / "generation_config.json"
        gen = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return None
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        return None
    langs = {str(k).strip("<|>"): int(v) for k, v in (gen.get("lang_to_id") or {}).items()}
    tasks = {str(k): int(v) for k, v in (gen.get("task_to_id") or {}).items()}
    eot = int(gen.get("eos_token_id", cfg.get("eos_token_id", 50257)))
    prev = gen.get("prev_sot_token_id")
    return SpeechSupport(
        sot=int(gen.get("decoder_start_token_id", cfg.get("decoder_start_token_id", 50258))),
        eot=eot,
        no_timestamps=int(gen.get("no_timestamps_token_id", 50363)),
        prev_sot=int(prev) if prev is not None else None,
        lang_to_id={k: v for k, v in langs.items() if k in LANGUAGES},
        task_to_id=tasks,
        max_target_positions=int(cfg.get("max_target_positions", 448)),
    )


@asynccontextmanager
async def open_audio_worker(model_dir: str, cache_bytes: int) -> AsyncIterator[WorkerPool]:
    """The multimodal worker set up for a speech model: WhisperFeatureExtractor from the checkpoint's folder."""
    config = {"audio_model": model_dir, "cache_bytes": cache_bytes}
    async with WorkerPool.open(1, config, max_waiting=64, module="server.multimodal.image_worker") as pool:
        yield pool


@dataclass(frozen=True)
class Window:
    features: bytes
    shape: list[int]
    hash: str
    start: float  # seconds into the file
    seconds: float


async def decode_audio(pool: ImagePool | None, blob: bytes, max_seconds: float) -> tuple[float, list[Window]]:
    """The file's duration and its 30 s windows' features, from the worker; 400 for a file that is not usable."""
    try:
        got: dict[str, Any] = await call_image_worker(pool, ["audio", blob, max_seconds], AUDIO_TIMEOUT)
    except APIError as e:
        if e.status == 400:
            raise bad_request(e.message, "file") from None
        raise
    wins = [
        Window(w["features"], list(w["shape"]), str(w["hash"]), float(w["start"]), float(w["seconds"]))
        for w in got["windows"]
    ]
    return float(got["duration"]), wins
