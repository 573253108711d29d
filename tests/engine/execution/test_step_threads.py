"""engine/execution/model_runner.py step_threads and projection_macs: a CPU step runs on all of torch's threads only
when
its projections' FLOPs reach EngineConfig.threaded_step_flops (at, under and over), else on one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.execution.model_runner import ModelRunner, projection_macs, step_threads
from engine.messages import SamplingParams
from engine.types.sequence import ScheduledSeq, Sequence


def config_macs(path: Path) -> int:
    """Multiply-adds per token from config.json alone (the reference: q, k, v, o, gate, up, down)."""
    c = json.loads((path / "config.json").read_text())
    h, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def test_projection_macs_counts_every_layer_once(qwen2_ckpt: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(qwen2_ckpt), num_blocks=8))
    assert projection_macs(runner.model) == config_macs(qwen2_ckpt)
    assert runner.flops_per_token == 2 * config_macs(qwen2_ckpt)


@pytest.mark.parametrize("tokens, threads", [(9, 1), (10, 2), (11, 2)])
def test_a_step_takes_all_threads_from_the_threshold_on(qwen2_ckpt: Path, tokens: int, threads: int) -> None:
    flops = 2 * config_macs(qwen2_ckpt)
    runner = ModelRunner(EngineConfig(model=str(qwen2_ckpt), num_blocks=8, threaded_step_flops=10 * flops))
    seq = Sequence.new("r", list(range(3, 3 + tokens)), SamplingParams(max_tokens=1), 0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with step_threads(runner, [ScheduledSeq(seq, tokens)]):
            inside = torch.get_num_threads()
        assert inside == threads and torch.get_num_threads() == 2  # restored after the step
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_a_negative_threshold_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="threaded_step_flops"):
        EngineConfig(model="x", threaded_step_flops=value)
