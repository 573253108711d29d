"""Images and audio: how many images a prompt may carry, whose image URLs are fetched, the image cache, and the
largest audio a speech model's routes take (server/multimodal/, server/families/audio/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MediaConfig:
    # images (a Qwen2-VL checkpoint): most per request by modality, vLLM's JSON ('{"image": 4}'); and the hosts
    # whose http(s) image URLs the server fetches (none by default: data: URLs only)
    limit_mm_per_prompt: dict[str, Any] = field(default_factory=lambda: {"image": 4})
    allowed_media_domains: tuple[str, ...] = ()
    # GiB of preprocessed images the image worker keeps by content (vLLM's --mm-processor-cache-gb); 0: off
    mm_processor_cache_gb: float = 4.0
    # a speech model's audio routes: the largest upload (MB, as vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB) and the
    # longest audio (seconds), each a 400 beyond it
    max_audio_filesize_mb: float = 25.0
    max_audio_duration_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.mm_processor_cache_gb >= 0:
            raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {self.mm_processor_cache_gb}")
        if not self.max_audio_filesize_mb > 0:
            raise ValueError(f"--max-audio-filesize-mb must be > 0, got {self.max_audio_filesize_mb}")
        if not self.max_audio_duration_s > 0:
            raise ValueError(f"--max-audio-duration-s must be > 0, got {self.max_audio_duration_s}")
