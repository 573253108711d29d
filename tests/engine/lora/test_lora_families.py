"""LoRA on other families' decoders: per-head q/k norms (Qwen3), Gemma 2's norms and soft-caps, a MoE model
(attention adapters; its MLPs take none), an untied head (Llama); greedy equals transformers + peft, mixed with
the base."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.lora.peft_files import digest
from engine.messages import AddRequest, LoRARequest
from tests.engine.models.families import build_family
from tests.helpers.engine import greedy, hf_greedy, make_core
from tests.helpers.lora import peft_greedy, write_adapter

TARGETS = {"qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"]}
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "qwen3_moe"])
def test_family_with_adapter_equals_peft(arch: str, tmp_path: Path, llama_ckpt: Path) -> None:
    ckpt = llama_ckpt if arch == "llama" else build_family(tmp_path, arch)
    adapter = write_adapter(ckpt, tmp_path / "adapter", r=8, targets=TARGETS.get(arch, EVERY), seed=3)
    core = make_core(ckpt, enable_lora=True)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    lora = LoRARequest("a", str(adapter), digest(adapter))
    core.add_request(AddRequest("lora", prompt, greedy(5), 0.0, lora=lora))
    core.add_request(AddRequest("base", prompt, greedy(5), 0.0))
    outs: dict[str, list[int]] = {"lora": [], "base": []}
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            outs[o.request_id] += o.new_token_ids
    assert outs["lora"] == peft_greedy(ckpt, adapter, prompt, 5)
    assert outs["base"] == hf_greedy(ckpt, prompt, 5)


def test_moe_mlp_adapters_are_refused(tmp_path: Path) -> None:
    ckpt = build_family(tmp_path, "qwen3_moe")
    adapter = write_adapter(ckpt, tmp_path / "adapter", r=8, targets=EVERY, seed=3)
    core = make_core(ckpt, enable_lora=True)
    core.add_request(AddRequest("x", [1, 2, 3], greedy(2), 0.0, lora=LoRARequest("a", str(adapter), digest(adapter))))
    (out,) = core.step()
    assert out.finish_reason == "error" and "unknown target module in weights" in (out.error or "")
