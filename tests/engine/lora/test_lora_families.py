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


def test_phi3_fused_targets_equal_merged_weights(tmp_path: Path) -> None:
    """Phi-3 fuses q|k|v and gate|up in its checkpoint and its adapters target the fused names. Reference: the
    same engine on a checkpoint whose weights have the adapter merged in (W + scaling * B @ A), as peft's
    merge_and_unload writes it (Phi-3's base itself drifts from transformers after a few tokens here, so peft's
    generate is no reference for it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = build_family(tmp_path, "phi3")
    adapter = write_adapter(
        ckpt, tmp_path / "adapter", r=8, targets=["qkv_proj", "o_proj", "gate_up_proj"], seed=3, alpha=8
    )
    merged = Path(shutil.copytree(ckpt, tmp_path / "merged"))
    (weights_file,) = merged.glob("*.safetensors")
    weights = load_file(weights_file)
    lora = load_file(adapter / "adapter_model.safetensors")
    for key, a in lora.items():
        if ".lora_A." in key:
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = lora[key.replace("lora_A", "lora_B")]
            weights[name] = weights[name] + (8 / 8) * (b @ a)  # scaling lora_alpha / r = 8 / 8
    save_file(weights, weights_file, metadata={"format": "pt"})
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    core = make_core(ckpt, enable_lora=True)
    core.add_request(AddRequest("x", prompt, greedy(8), 0.0, lora=LoRARequest("a", str(adapter), digest(adapter))))
    out: list[int] = []
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            out += o.new_token_ids
    ref = make_core(merged)
    ref.add_request(AddRequest("x", prompt, greedy(8), 0.0))
    want: list[int] = []
    while ref.has_work:
        for o in ref.step():
            want += o.new_token_ids
    assert out == want
