"""Compile every kernel for a CUDA GPU without one (Triton ships ptxas), so type and shape errors that the
CPU interpreter lets through are caught on any machine.

    python -m engine.triton_kernels.compile_check [--arch 90] [--quick]    (needs TRITON_INTERPRET unset)

Prints each variant's registers and spill stack as ptxas allotted them (cuobjdump --dump-resource-usage).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Variant:
    module: str
    kernel: str
    pointers: dict[str, str]  # pointer argument -> element type ("bf16", "i32", ...)
    constexprs: dict[str, Any]
    floats: tuple[str, ...] = ()
    num_warps: int = 4


def variants(quick: bool = False) -> list[Variant]:
    """Every kernel in each dtype at head_dim 64 and 128; quick: bfloat16 at head_dim 128 only."""
    from engine.triton_kernels.paged_decode_attention import decode_num_warps  # why late: @triton.jit reads main's env
    from engine.triton_kernels.paged_prefill_attention import prefill_num_warps  # why late: as above

    out: list[Variant] = []
    for dt in (["bf16"] if quick else DTYPES.values()):
        act = {"x_ptr": dt, "res_ptr": dt, "w_ptr": dt, "out_ptr": dt, "res_out_ptr": dt}
        for has_res in (False, True):
            out.append(Variant("rmsnorm", "_rms_norm_kernel", act, {"HAS_RESIDUAL": has_res, "BLOCK": 4096},
                               ("eps",), num_warps=16))
        out.append(Variant("rotary", "_rotary_kernel",
                           {"pos_ptr": "i64", "q_ptr": dt, "k_ptr": dt, "cs_ptr": "fp32"},
                           {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8}))
        out.append(Variant("kv_cache_write", "_kv_write_kernel",
                           {"k_ptr": dt, "v_ptr": dt, "kc_ptr": dt, "vc_ptr": dt, "slot_ptr": "i64"},
                           {"HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128}))
        precision = "ieee" if dt == "fp32" else "tf32"
        for d in ((128,) if quick else (64, 128)):
            attn = {"q_ptr": dt, "kc_ptr": dt, "vc_ptr": dt, "bt_ptr": "i32", "seq_lens_ptr": "i32", "out_ptr": dt}
            for splits in (1, 4):
                out.append(Variant("paged_decode_attention", "_decode_kernel",
                                   {**attn, "part_ptr": "fp32", "lse_ptr": "fp32"},
                                   {"NUM_SPLITS": splits, "HEAD_DIM": d, "BLOCK_G": 16, "BLOCK_N": 32,
                                    "BLOCK_D": d, "DOT_PRECISION": precision, "UPCAST": False}, ("scale",),
                                   num_warps=decode_num_warps(d)))
            out.append(Variant("paged_decode_attention", "_merge_kernel",
                               {"part_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": dt},
                               {"NUM_SPLITS": 4, "HEAD_DIM": d, "BLOCK_S": 4, "BLOCK_D": d}))
            out.append(Variant("paged_prefill_attention", "_prefill_kernel", {**attn, "cu_q_ptr": "i32"},
                               {"HEAD_DIM": d, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": d,
                                "DOT_PRECISION": precision, "UPCAST": False}, ("scale",),
                               num_warps=prefill_num_warps(64, d, 4 if dt == "fp32" else 2)))
    for dt in (["fp32"] if quick else ["fp32", "bf16"]):  # the sampler's logits are float32; bf16 for a caller's
        out.append(Variant("token_bitmask", "_bitmask_kernel",
                           {"logits_ptr": dt, "bitmask_ptr": "i32", "rows_ptr": "i64"}, {"BLOCK": 1024}))
    for dt in (["bf16"] if quick else DTYPES.values()):  # LoRA shrink / expand at rank 16 and 64
        precision = "ieee" if dt == "fp32" else "tf32"
        for r in (16, 64):
            out.append(Variant("lora", "_shrink_kernel", {"x_ptr": dt, "a_ptr": dt, "rows_ptr": "i64",
                                                          "tiles_ptr": "i32", "h_ptr": "fp32"},
                               {"BLOCK_R": r, "BLOCK_K": 128, "BLOCK": 16, "DOT_PRECISION": precision,
                                "UPCAST": False}))
            out.append(Variant("lora", "_expand_kernel", {"h_ptr": "fp32", "b_ptr": dt, "scale_ptr": "fp32",
                                                          "y_ptr": dt, "rows_ptr": "i64", "tiles_ptr": "i32"},
                               {"BLOCK_R": r, "BLOCK_N": 128, "BLOCK": 16, "DOT_PRECISION": precision}))
    return out


def compile_variant(v: Variant, arch: int) -> dict[str, Any]:
    import triton  # why late: triton reads main's environment (TRITON_INTERPRET, fp fusion) at import
    from triton.backends.compiler import GPUTarget  # why late: as above
    from triton.compiler import ASTSource  # why late: as above

    fn = getattr(importlib.import_module(f"engine.triton_kernels.{v.module}"), v.kernel)
    sig: dict[str, str] = {}
    for name in fn.arg_names:
        if name in v.constexprs:
            sig[name] = "constexpr"
        elif name in v.pointers:
            sig[name] = "*" + v.pointers[name]
        else:
            sig[name] = "fp32" if name in v.floats else "i32"
    compiled = triton.compile(ASTSource(fn, sig, constexprs=dict(v.constexprs)), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": v.num_warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = ""
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            dump = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        usage = " ".join(re.findall(r"(?:REG|STACK):\d+", dump))
    return {"shared": compiled.metadata.shared, "usage": usage}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10: 80 (A100), 90 (H100/H200)")
    p.add_argument("--quick", action="store_true", help="bfloat16, head_dim 128 only")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this check compiles")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's default-change warning
    failed = 0
    for v in variants(args.quick):
        label = f"{v.kernel} {v.pointers.get('q_ptr') or v.pointers.get('x_ptr') or v.pointers.get('k_ptr') or ''} " \
                f"{v.constexprs}"
        try:
            info = compile_variant(v, args.arch)
            print(f"ok   {label}  shared={info['shared']} {info['usage']}")
        except Exception as e:  # report every failing variant, not only the first
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
