"""One decoder layer of a decode step in one call, through decoder_layer.cpp: the structs it reads, mirrored (and
checked against the C++ layout at load).

engine/models/fused_decode.py fills a `Layer` per decoder layer at load and a `Step` per step, then calls
`run_layer(layer, step, x, normed)` for each layer in turn.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from engine.cpu_kernels.build import kernel

ABI = 4
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class Projection(ctypes.Structure):
    # ggml_type -1: w is a packed bf16 weight; else w holds rows of that ggml type's blocks, row_bytes a row
    _fields_ = [("w", _P), ("scale", _P), ("bias", _P), ("n", _I), ("k", _I), ("ggml_type", _I), ("row_bytes", _L)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", Projection * 3),  # q|k|v's parts (one where the weight is one), each into its columns
        ("o", Projection),
        ("gate_up", Projection * 2),
        ("down", Projection),
        ("ln2", _P),
        ("next_ln1", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("post_attn", _P),  # Gemma's closing norms, or None
        ("post_ff", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("los", _P),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("hidden", _I),
        ("eps", _F),
        ("scale", _F),
        ("softcap", _F),
        ("f32_norms", _I),  # norm weights float32 (1 + w), Gemma's
        ("gelu", _I),  # 1: gelu_tanh-gated MLP, 0: SiLU
        ("rope", _I),  # 1: the step's local rope table (Gemma 3's windowed layers)
        ("qkv_parts", _I),
        ("gate_up_parts", _I),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _I),
        ("cos", _P),
        ("sin", _P),
        ("slots", _P),
        ("tables", _P),
        ("table_stride", _L),
        ("lens", _P),
        ("c_sblock", _L),
        ("c_stok", _L),
        ("c_shead", _L),
        ("block_size", _I),
        ("threads", _I),
        ("parallel_macs", _L),
        ("parallel_bytes", _L),
        ("quant_gemm", _P),  # quant_gemm.cpp's product, for projections of blocks
        ("cos_local", _P),  # the local rope table's cos / sin, or None
        ("sin_local", _P),
    ]


def _mirrored() -> list[int]:
    """What spindle_decoder_layer_layout reports, as these ctypes structs lay themselves out."""
    return [
        ctypes.sizeof(Projection),
        Projection.row_bytes.offset,
        ctypes.sizeof(Layer),
        Layer.gate_up_parts.offset,
        ctypes.sizeof(Step),
        Step.sin_local.offset,
    ]


def _layout_fault(_: Any) -> str | None:
    """A struct here that no longer mirrors decoder_layer.cpp's (a field added on one side only) reads garbage."""
    layout = kernel("decoder_layer", ABI, [ctypes.POINTER(_L)], symbol="spindle_decoder_layer_layout")
    want = _mirrored()
    got = (_L * len(want))()
    layout(got)
    if list(got) == want:
        return None
    return f"its structs lay out as {list(got)} in decoder_layer.cpp but as {want} in decoder_layer.py"


@functools.cache
def _kernel() -> Any:
    return kernel("decoder_layer", ABI, [ctypes.POINTER(Layer), ctypes.POINTER(Step), _P, _P], check=_layout_fault)


def available() -> bool:
    return _kernel() is not None


def run_layer(layer: Layer, step: Step, x: int, normed: int) -> None:
    """x, normed: data pointers of the step's contiguous bf16 [T, hidden] residual stream and its normed copy."""
    _kernel()(ctypes.byref(layer), ctypes.byref(step), x, normed)
