"""Tensor parallel over the new families: TP=2 gives TP=1's greedy tokens and prompt logprobs for a dense family
with per-head norms (Qwen3), a MoE family (Qwen3-MoE: each expert's intermediate dimension split, one dense
layer) and Phi-3's fused q|k|v and gate|up tensors read slice by slice. Rank 1 is a child process (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.distributed.sharding import Shard
from engine.messages import SamplingParams
from engine.models.loader import read_config
from engine.models.registry import parse_config
from tests.engine.distributed.test_tensor_parallel import run, tp_core
from tests.engine.models.test_families import PROMPTS, hf_greedy
from tests.helpers.engine import tokens

torch.set_num_threads(1)


@pytest.mark.parametrize("family_ckpt", ["qwen3", "qwen3_moe", "phi3"], indirect=True)
def test_tp2_equals_tp1(family_ckpt: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    reqs = [(f"r{i}", p, params, i) for i, p in enumerate(PROMPTS[:3])]
    kw = dict(block_size=4, max_num_batched_tokens=16)  # chunks cut through the prompts
    tp2 = run(tp_core(family_ckpt, 2, **kw), reqs)
    tp1 = run(tp_core(family_ckpt, 1, **kw), reqs)
    for rid, p, _, _ in reqs:
        assert tokens(tp2[rid]) == tokens(tp1[rid]), rid
        lp2, lp1 = tp2[rid][0].prompt_logprobs, tp1[rid][0].prompt_logprobs
        assert lp2 is not None and lp1 is not None and len(lp2) == len(lp1) == len(p)
        for a, b in zip(lp2[1:], lp1[1:]):
            assert a is not None and b is not None and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert tokens(tp2["r0"])[:6] == hf_greedy(family_ckpt, PROMPTS[0])[:6]


@pytest.mark.parametrize("family_ckpt", ["qwen3_moe", "phi3"], indirect=True)
def test_shards_split_experts_and_fused_tensors(family_ckpt: Path) -> None:
    from safetensors import safe_open

    args = parse_config(read_config(family_ckpt))
    with safe_open(next(family_ckpt.glob("*.safetensors")), framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    d, q = args.head_dim, args.num_heads * args.head_dim
    for rank in range(2):
        get = Shard(rank, 2).weights(family_ckpt, args, torch.float32, torch.device("cpu"))
        if args.moe is not None:
            name = "model.layers.0.mlp.experts.5.{}.weight"
            assert torch.equal(get(name.format("up_proj")), full[name.format("up_proj")].chunk(2)[rank])
            assert torch.equal(get(name.format("down_proj")), full[name.format("down_proj")].chunk(2, dim=1)[rank])
            assert torch.equal(get("model.layers.0.mlp.gate.weight"), full["model.layers.0.mlp.gate.weight"])
            dense = "model.layers.1.mlp.gate_proj.weight"  # the dense layer splits its own (larger) dimension
            assert torch.equal(get(dense), full[dense].chunk(2)[rank])
        else:
            qkv = full["model.layers.0.self_attn.qkv_proj.weight"]
            parts = [qkv[:q].chunk(2)[rank], qkv[q : q + 2 * d].chunk(2)[rank], qkv[q + 2 * d :].chunk(2)[rank]]
            assert torch.equal(get("model.layers.0.self_attn.qkv_proj.weight"), torch.cat(parts))
            gate_up = full["model.layers.0.mlp.gate_up_proj.weight"]
            gate, up = gate_up.chunk(2)
            assert torch.equal(
                get("model.layers.0.mlp.gate_up_proj.weight"), torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
            )
