"""One decode step's projections over GGUF blocks kept quantized, per type and per candidate, against bf16.

    python -m bench.quant_gemm [--model smollm2 gemma3] [--types Q4_1 Q8_0 Q4_K] [--rows 1 16] [--threads 1]
                               [--tries 5] [--shape 896x4864 ...]

Every projection of every layer (fused q|k|v, o, fused gate|up, down) at SmolLM2-135M's and Gemma-3-270M's
shapes, random blocks of each type (engine/cpu_kernels/quant_gemm.random_blocks): "ggml" (the blocks dequantized
in registers, engine/cpu_kernels/quant_gemm.py), "dequant" (a tile of rows dequantized to bf16, then torch's
GEMM: engine/layers/quant_linear.py), "dot" and "dot_tiles" (the blocks repacked for bf16 dot products,
engine/cpu_kernels/quant_dot.py, where the type has a packed form; "dot_tiles" through AMX tiles where they run),
and the winner engine/cpu_kernels/chooser.py picks per row class (its timing is cached), against bf16 weights
through spindle's bf16 kernel (engine/layers/linear.py's KernelLinear). --shape OUTxIN times those single
projections (one "layer") instead of the models' steps. Where a type's block does not divide a projection's input
(K-quants' 256 into 576 or 640), that projection holds Q5_0 instead, as the real Q4_K_M file does (so "Q4_K" on
these shapes is a mix; the bytes counted are the mix's). Activations are bf16. Times are the process's CPU time
per step, best of --tries, the forms interleaved (a shared machine still gives fair ratios); GB/s is over the
bytes each form streams (the blocks, or the bf16 weights).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import gguf
import torch

from engine.cpu_kernels import chooser, gemm, quant_dot, quant_gemm
from engine.gguf.tensor import GGMLWeight
from engine.layers.linear import KernelLinear, Linear
from engine.layers.quant_linear import QuantLinear

# hidden, heads, kv heads, head_dim, intermediate, layers (the two real GGUF files' shapes)
MODELS = {"smollm2": (576, 9, 3, 64, 1536, 30), "gemma3": (640, 4, 1, 256, 2048, 18)}
SHAPES: dict[str, list[tuple[int, int]]] = {}  # --shape: "OUTxIN ..." -> those projections, one layer of them
Form = list[Callable[[torch.Tensor], torch.Tensor]]


def shapes(model: str) -> list[tuple[int, int]]:
    """[out, in] of one layer's projections."""
    if model in SHAPES:
        return SHAPES[model]
    h, heads, kv, d, inter, _ = MODELS[model]
    return [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]


class Forced:
    """A QuantLinear's one candidate, whatever the chooser says."""

    def __init__(self, weight: GGMLWeight, candidate: str) -> None:
        # a QuantLinear of its own, no choice made: "dot" and "dot_tiles" pack it (the blocks then let go)
        lin = QuantLinear(weight, None)
        if candidate in ("dot", "dot_tiles"):
            lin.pack()
        runs = {"dequant": lin.dequant_into, "dot_tiles": lin.tiles_into}
        self.lin, self.run = lin, runs.get(candidate, lin.ggml_into)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.lin.out_features, dtype=x.dtype)
        self.run(x, out)
        return out


def block_type(type_name: str, in_features: int) -> int:
    """The type a projection of this input width holds: `type_name`, else Q5_0 where its block does not divide."""
    ggml_type = int(gguf.GGMLQuantizationType[type_name])
    return ggml_type if in_features % quant_gemm.block_shape(ggml_type)[0] == 0 else int(gguf.GGMLQuantizationType.Q5_0)


def layers(model: str) -> int:
    return 1 if model in SHAPES else MODELS[model][5]


def quant_forms(model: str, type_name: str, g: torch.Generator) -> tuple[dict[str, Form], int]:
    ggml_type = int(gguf.GGMLQuantizationType[type_name])
    weights = [
        GGMLWeight(block_type(type_name, i), (o, i), quant_gemm.random_blocks(block_type(type_name, i), o, i, g))
        for _ in range(layers(model))
        for o, i in shapes(model)
    ]
    lins = [QuantLinear(w, None, torch.bfloat16) for w in weights]
    candidates = ["dequant"] + ["ggml"] * quant_gemm.supports(ggml_type)
    if all(quant_dot.supports(w.ggml_type) for w in weights):
        candidates += ["dot"] + ["dot_tiles"] * quant_dot.tiles_usable()
    forms: dict[str, Form] = {f"{type_name} chosen": list(lins)}
    for c in candidates:
        forms[f"{type_name} {c}"] = [Forced(w, c) for w in weights]
    return forms, sum(lin.nbytes for lin in lins)


def bf16_form(model: str, g: torch.Generator) -> tuple[Form, int]:
    weights = [
        (torch.randn(o, i, generator=g) / i**0.5).bfloat16() for _ in range(layers(model)) for o, i in shapes(model)
    ]
    lins: list[Linear] = [KernelLinear(w) if gemm.usable(w) else Linear(w) for w in weights]
    return list(lins), sum(w.nbytes for w in weights)


def run_model(model: str, types: list[str], rows_list: list[int], tries: int) -> None:
    g = torch.Generator().manual_seed(0)
    forms: dict[str, Form] = {}
    nbytes: dict[str, int] = {}
    forms["bf16 kernel"], nbytes["bf16 kernel"] = bf16_form(model, g)
    for t in types:
        mixed = sorted({gguf.GGMLQuantizationType(block_type(t, i)).name for _, i in shapes(model)})
        if len(mixed) > 1:
            print(f"{model}: {t} means {' + '.join(mixed)} (Q5_0 where {t}'s block does not divide the input)")
        got, size = quant_forms(model, t, g)
        forms.update(got)
        nbytes.update(dict.fromkeys(got, size))
    print(f"{model}: {layers(model)} layers x {len(shapes(model))} projections, CPU ms per step (best of {tries})")
    for rows in rows_list:
        xs = [torch.randn(rows, i, generator=g).bfloat16() for _ in range(layers(model)) for _, i in shapes(model)]
        best = dict.fromkeys(forms, float("inf"))
        for _ in range(tries + 1):  # the first round warms up
            for name, lins in forms.items():
                c0 = time.process_time()
                for lin, x in zip(lins, xs):
                    lin(x)
                best[name] = min(best[name], time.process_time() - c0)
        for name, secs in best.items():
            print(
                f"  rows {rows:>3}  {name:<14} {secs * 1e3:7.2f} ms  {nbytes[name] / secs / 1e9:5.1f} GB/s  "
                f"({nbytes[name] / 1e6:.0f} MB)"
            )
    for kind, shape, winners in chooser.choices_made():
        print(f"  chooser {kind} {'x'.join(map(str, shape))} by rows {chooser.describe_classes()}: {' '.join(winners)}")
    chooser.forget()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=sorted(MODELS, reverse=True))
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--shape", nargs="+", default=[], help="OUTxIN projections to time instead of --model's")
    a = ap.parse_args()
    if a.shape:
        SHAPES[" ".join(a.shape)] = [(int(o), int(i)) for o, i in (s.lower().split("x") for s in a.shape)]
    torch.set_num_threads(a.threads)
    from engine.layers.parallel import WORKERS  # why: configured once, as the runner does

    WORKERS.configure(a.threads)
    with torch.inference_mode():
        for model in list(SHAPES) or a.model:
            run_model(model, a.types, a.rows, a.tries)


if __name__ == "__main__":
    main()
