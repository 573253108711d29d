"""LoRA serving throughput (engine only, no HTTP): output tok/s at concurrency 16 and 64 for the base alone,
one adapter, and 4 adapters round-robin, with ratios to the base in the same run (the issue's target: 4 adapters
mixed >= 0.75x base; vLLM's users report ~0.5x). Adapters: random adapters in PEFT's layout, every projection
targeted. One engine (--enable-lora, --max-loras 4) runs every workload; "base, no LoRA" is an
engine without --enable-lora, for the cost of the wrapped layers' fast path.

    python -m bench.lora [--model DIR] [--rank 16] [--new 64] [--prompt 32] [--repeats 3] [--dtype auto]
                         [--device auto]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.lora.peft_files import CONFIG_FILE, PARENT, WEIGHTS_FILE, BaseDims, digest
from engine.messages import AddRequest, LoRARequest, SamplingParams
from engine.models.checkpoint_meta import read_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model: str, root: Path, count: int, rank: int) -> list[LoRARequest]:
    """`count` random adapters of `model` in PEFT's layout (adapter_config.json + adapter_model.safetensors, as
    peft's save_pretrained writes them; written here so a GPU machine without peft runs this too)."""
    from safetensors.torch import save_file  # why late: only the adapters' files need it

    dims = BaseDims.from_config(read_config(Path(model)))
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(dims.num_layers):
            for name in TARGETS:
                d_in, d_out = dims.members[name]
                key = f"base_model.model.model.layers.{layer}.{PARENT[name]}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) / rank**0.5
        path = root / f"adapter{i}"
        path.mkdir()
        save_file(tensors, path / WEIGHTS_FILE)
        (path / CONFIG_FILE).write_text(
            json.dumps(
                {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}
            )
        )
        out.append(LoRARequest(f"adapter{i}", str(path), digest(path)))
    return out


def run(core: EngineCore, loras: list[LoRARequest | None], batch: int, prompt: int, new: int, tag: str) -> float:
    """Output tok/s of `batch` concurrent requests (adapters round-robin from `loras`), prefill included."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(core.vocab_size) for _ in range(prompt)]
        core.add_request(AddRequest(f"{tag}-{batch}-{i}", ids, params, 0.0, lora=loras[i % len(loras)]))
    generated, t0 = 0, time.perf_counter()
    while core.has_work:
        generated += sum(len(o.new_token_ids) for o in core.step())
    return generated / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs per cell, interleaved; the best is kept")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (the Triton shrink / expand kernels)")
    args = p.parse_args()
    if args.model is None:
        from demo.checkpoints import demo_checkpoint_path  # why late: builds the demo once

        args.model = str(demo_checkpoint_path())
    kw = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(args.model, Path(tmp), 4, args.rank)
        plain = EngineCore(EngineConfig(**kw))  # type: ignore[arg-type]
        lora = EngineCore(
            EngineConfig(
                **kw,
                enable_lora=True,
                max_loras=4,  # type: ignore[arg-type]
                max_lora_rank=max(16, args.rank),
            )
        )
        workloads: dict[str, tuple[EngineCore, list[LoRARequest | None]]] = {
            "base, no LoRA": (plain, [None]),
            "base (--enable-lora)": (lora, [None]),
            "1 adapter": (lora, [adapters[0]]),
            "4 adapters round-robin": (lora, list(adapters)),
        }
        for core, loras in workloads.values():  # warm-up: adapters loaded, buffers faulted in
            run(core, loras, 4, 8, 4, "warm")
        best: dict[tuple[str, int], float] = {}
        for r in range(args.repeats):
            for batch in (16, 64):
                for name, (core, loras) in workloads.items():
                    tps = run(core, loras, batch, args.prompt, args.new, f"r{r}")
                    best[name, batch] = max(best.get((name, batch), 0.0), tps)
    print(
        f"model {args.model}, rank {args.rank}, prompt {args.prompt}, new {args.new}, "
        f"torch threads {torch.get_num_threads()}, best of {args.repeats}"
    )
    print(f"{'workload':<26}{'c=16 tok/s':>12}{'ratio':>8}{'c=64 tok/s':>12}{'ratio':>8}")
    for name in workloads:
        cells = "".join(
            f"{best[name, b]:>12.0f}{best[name, b] / best['base (--enable-lora)', b]:>8.2f}" for b in (16, 64)
        )
        print(f"{name:<26}{cells}")


if __name__ == "__main__":
    main()
