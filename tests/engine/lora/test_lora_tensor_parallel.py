"""LoRA under tensor parallel: TP = 2 (rank 1 a child process, gloo) gives each request peft's greedy tokens, as
TP = 1 does, in a batch mixing the base and two adapters (column-parallel members cut by B's rows, row-parallel
ones by A's columns), under chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.lora.peft_files import digest
from engine.messages import AddRequest, LoRARequest
from tests.helpers.engine import greedy, hf_greedy, make_core
from tests.helpers.lora import peft_greedy, write_adapter

EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_with_adapters_equals_peft(qwen2_ckpt: Path, tmp_path: Path, tp: int) -> None:
    adapters = {
        "a": write_adapter(qwen2_ckpt, tmp_path / "a", r=8, targets=EVERY, seed=21),
        "b": write_adapter(qwen2_ckpt, tmp_path / "b", r=16, targets=["k_proj", "o_proj", "down_proj"], seed=22),
    }
    core = make_core(
        qwen2_ckpt,
        tensor_parallel_size=tp,
        distributed_timeout=30,
        enable_lora=True,
        max_loras=2,
        max_num_batched_tokens=16,
    )
    prompts = {
        "base": [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28],
        "a": [27, 18, 28, 18, 28, 45, 90, 45],
        "b": [16, 18, 3, 39, 88, 74, 98, 94, 84, 77],
    }
    try:
        for i, (rid, prompt) in enumerate(prompts.items()):
            path = adapters.get(rid)
            lora = None if path is None else LoRARequest(rid, str(path), digest(path))
            core.add_request(AddRequest(rid, prompt, greedy(6), float(i), lora=lora))
        outs: dict[str, list[int]] = {rid: [] for rid in prompts}
        while core.has_work:
            for o in core.step():
                assert o.error is None, o.error
                outs[o.request_id] += o.new_token_ids
    finally:
        close = getattr(core.runner, "close", None)
        if close is not None:
            close()
    assert outs["base"] == hf_greedy(qwen2_ckpt, prompts["base"], 6)
    for rid in ("a", "b"):
        assert outs[rid] == peft_greedy(qwen2_ckpt, adapters[rid], prompts[rid], 6), rid
