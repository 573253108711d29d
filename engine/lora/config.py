"""The LoRA settings' checks (vLLM's flags), shared by EngineConfig and the server's config; no torch."""

from __future__ import annotations

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank


def check_lora_settings(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, lora_dtype: str) -> None:
    """ValueError naming the flag when a setting is out of range."""
    if max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
    if max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"--max-lora-rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, got {max_lora_rank}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})")
    if lora_dtype not in LORA_DTYPES:
        raise ValueError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {lora_dtype!r}")
