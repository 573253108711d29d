"""An EngineCore in this process, stepped by hand, and transformers' greedy output to compare it with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, RequestOutput, SamplingParams


def make_core(ckpt: Path, **kw: Any) -> EngineCore:
    """An engine core over `ckpt` with 256 KV blocks unless `kw` says otherwise."""
    kw.setdefault("num_blocks", 256)
    return EngineCore(EngineConfig(model=str(ckpt), **kw))


def run(core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams, int]]) -> dict[str, list[RequestOutput]]:
    """Feed requests (id, prompt, params, step) at their step numbers; step until everything finished."""
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, *_ in reqs}
    pending = sorted(reqs, key=lambda r: r[3])
    step = 0
    while pending or core.has_work:
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            core.add_request(AddRequest(rid, prompt, params, arrival_time=float(step)))
        for o in core.step():
            outs[o.request_id].append(o)
        step += 1
        assert step < 10_000, "engine did not finish"
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


_HF: dict[tuple[Path, str], Any] = {}


def hf_model(ckpt: Path, model_class: str = "AutoModelForCausalLM") -> Any:
    """transformers' model for `ckpt` in float32, loaded once per session, its eos ignored."""
    import transformers

    if (ckpt, model_class) not in _HF:
        model = getattr(transformers, model_class).from_pretrained(ckpt, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _HF[ckpt, model_class] = model.eval()
    return _HF[ckpt, model_class]


def hf_greedy(
    ckpt: Path, prompt: list[int], n: int, model_class: str = "AutoModelForCausalLM", **inputs: Any
) -> list[int]:
    """transformers' n greedy tokens after `prompt` (`inputs`: more model inputs, e.g. pixel values)."""
    # plain greedy: the checkpoint's generation_config (repetition_penalty etc.) must not apply
    out = hf_model(ckpt, model_class).generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        repetition_penalty=1.0,
        top_k=None,
        top_p=None,
        temperature=None,
        eos_token_id=None,
        pad_token_id=0,
        **inputs,
    )
    return list(out[0, len(prompt) :].tolist())
