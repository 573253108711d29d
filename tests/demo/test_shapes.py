"""Demo checkpoints of real models' shapes: exactly transformers' tensors, loadable by both implementations."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from demo import llama3_tokenizer
from demo.shapes import SHAPES, tensor_shapes, write_shaped_checkpoint
from engine.models.loader import load_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


# a hybrid's two layers: one of each kind, and its recurrent dimensions scaled down
_SMALL_HYBRID: dict[str, dict[str, Any]] = {
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
}


def small(name: str) -> dict[str, Any]:
    """The named shape scaled down (same family, same flags), with shards forced by a tiny shard size."""
    return dict(
        SHAPES[name],
        **_SMALL_HYBRID.get(SHAPES[name]["model_type"], {}),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        max_position_embeddings=512,
    )


@pytest.mark.parametrize(
    "name, params", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304), ("llama-3.2-1b", 1_235_814_400)]
)
def test_shapes_are_the_real_models(name: str, params: int) -> None:
    """Parameter counts as published, and every tensor name and shape as transformers builds the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = dict(tensor_shapes(SHAPES[name]))
    assert sum(math.prod(s) for s in ours.values()) == params
    cfg = AutoConfig.for_model(**SHAPES[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shaped_checkpoint_loads_in_both_implementations(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    import demo.shapes as demo_shapes

    monkeypatch.setattr(demo_shapes, "SHARD_BYTES", 64 << 10)  # several shards and an index
    path = write_shaped_checkpoint(tmp_path / name, small(name), seed=3, tokenizer=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert (
        len(set(index["weight_map"].values())) >= 3
        and set(index["weight_map"]) == dict(tensor_shapes(small(name))).keys()
    )
    for f in set(index["weight_map"].values()):
        with safe_open(path / f, framework="pt") as h:
            assert all(h.get_tensor(k).dtype == torch.bfloat16 for k in h.keys())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"]
    model, info = load_model(path, "float32", "cpu")
    assert info.num_layers == 2 and model.tied
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    ids = torch.tensor([[1, 5, 900, 17, 3, 999, 42]])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    if cfg["model_type"] in _SMALL_HYBRID:  # a hybrid's step needs the core's state pool: its greedy tokens
        _greedy_matches(path, hf, ids)
        return
    # the engine's prefill of the same ids (the runner's paths are covered elsewhere; here only the weights)
    from engine.config import EngineConfig
    from engine.execution.model_runner import ModelRunner
    from engine.messages import SamplingParams
    from engine.types.sequence import ScheduledSeq, Sequence

    runner = ModelRunner(EngineConfig(model=str(path), dtype="float32", num_blocks=8, block_size=4))
    seq = Sequence.new("a", ids[0].tolist(), SamplingParams(max_tokens=1, prompt_logprobs=0), 0.0)
    seq.block_table = [0, 1]
    out = runner.execute([ScheduledSeq(seq, 7)])
    torch.testing.assert_close(out.prompt_logits[0], ref, atol=1e-4, rtol=0)
    assert float(ref.std()) > 0.5  # logits spread, as the demo's reinit intends


def _greedy_matches(path: Path, hf: Any, ids: torch.Tensor) -> None:
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.messages import AddRequest, SamplingParams

    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_blocks=32, block_size=4))
    core.add_request(AddRequest("a", ids[0].tolist(), SamplingParams(max_tokens=4, temperature=0.0), 0.0))
    got: list[int] = []
    while core.has_work:
        got += [t for out in core.step() for t in out.new_token_ids]
    assert got == ref


def test_llama3_tokenizer_keeps_llama3_ids(tmp_path: Path) -> None:
    """cl100k_base's ranks are Llama 3's first 100,256 ids; the special tokens sit at Llama 3's ids."""
    from transformers import AutoTokenizer

    llama3_tokenizer.write(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == llama3_tokenizer.VOCAB_SIZE == SHAPES["llama-3.2-1b"]["vocab_size"]
    assert tok("Hello world").input_ids == [128000, 9906, 1917]  # as Llama 3's own tokenizer
    assert tok.convert_tokens_to_ids(
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_247|>"]
    ) == [128006, 128007, 128009, 128255]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.decode([9906, 1917, 128009], skip_special_tokens=True) == "Hello world"
