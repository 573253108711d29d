"""`--dtype auto`: the fastest path this machine has for the checkpoint, decided by what runs here, not by a CPU
flag string alone.

- GPU: the checkpoint's own dtype (float32 where it names none).
- CPU, a GGUF model whose blocks stay packed: bfloat16 activations when the quantized kernels built and passed
  their self-checks for every block type of the file with bfloat16 rows (they need AVX512-BF16); float32 otherwise.
- CPU, a safetensors checkpoint: its own dtype when this CPU multiplies it natively (bfloat16: the bf16 GEMM kernel
  built and passed its self-check; float16: AMX-FP16), float32 otherwise.

`--dtype float32` always gives float32: the dtype the tests that compare with transformers token for token ask for.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.gguf.header import GGUFError, read_header

log = logging.getLogger(__name__)
_UNQUANTIZED = frozenset({0, 1, 30})  # F32, F16, BF16: tensors read as plain floats, whatever the activations
_DTYPES = ("float32", "bfloat16", "float16")


def auto_dtype(checkpoint_dtype: str | None, device: torch.device, packed_gguf: list[Path] | None) -> str:
    """The dtype --dtype auto runs (module docstring). packed_gguf: the GGUF files of a model whose blocks stay
    packed on CPU (None: a safetensors checkpoint, or blocks dequantized at load)."""
    dtype, why = _choose(checkpoint_dtype, device, packed_gguf)
    log.info("--dtype auto: %s (%s)", dtype, why)
    return dtype


def _choose(checkpoint_dtype: str | None, device: torch.device, packed_gguf: list[Path] | None) -> tuple[str, str]:
    if device.type != "cpu":
        return (checkpoint_dtype, "the checkpoint's") if checkpoint_dtype in _DTYPES else ("float32", "no dtype named")
    if packed_gguf is not None:
        if _bf16_blocks_run(packed_gguf):
            return "bfloat16", "bf16 activations over the file's packed blocks"
        return "float32", "no self-checked bf16 block kernel here"
    if checkpoint_dtype == "bfloat16" and _bf16_gemm_runs():
        return "bfloat16", "the checkpoint's, with the self-checked bf16 GEMM kernel"
    if checkpoint_dtype == "float16" and getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)():
        return "float16", "the checkpoint's, with AMX-FP16"
    return "float32", "no native half-precision product for this checkpoint here"


def _bf16_gemm_runs() -> bool:
    try:
        from engine.cpu_kernels import gemm
    except ImportError:
        return False
    return gemm.available()  # built for this CPU (AVX512-BF16) and its self-check passed


def _bf16_blocks_run(files: list[Path]) -> bool:
    """Whether every quantized block type in the files has a kernel here that passed its self-check (bfloat16
    rows included)."""
    try:
        from engine.cpu_kernels import quant_gemm

        types = {t.ggml_type for f in files for t in read_header(f).tensors.values()} - _UNQUANTIZED
    except (ImportError, GGUFError, OSError):
        return False
    missing = sorted(t for t in types if not quant_gemm.supports(t))
    if missing:
        log.info("--dtype auto: float32 (no bf16 kernel here for GGUF block types %s)", missing)
    return bool(types) and not missing
