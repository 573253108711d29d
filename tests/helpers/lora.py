"""PEFT adapters for tests (written by peft itself) and transformers + peft references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_REF: dict[Path, Any] = {}


def write_adapter(
    base: Path,
    path: Path,
    *,
    r: int,
    targets: list[str],
    seed: int,
    alpha: int = 16,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, int] | None = None,
    **extra: Any,
) -> Path:
    """A random LoRA adapter of `base` saved by peft's save_pretrained (B nonzero, so it changes the output)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
        **extra,
    )
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:  # strong enough to move greedy tokens away from the base's
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    pm.save_pretrained(path)
    return path


def peft_model(base: Path, adapter: Path) -> Any:
    """transformers' base with the adapter applied by peft, float32, eos ignored (once per adapter)."""
    import peft
    import transformers

    if adapter not in _REF:
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _REF[adapter] = peft.PeftModel.from_pretrained(model, adapter).eval()
    return _REF[adapter]


def peft_greedy(base: Path, adapter: Path, prompt: list[int], n: int) -> list[int]:
    out = peft_model(base, adapter).generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        repetition_penalty=1.0,
        top_k=None,
        top_p=None,
        temperature=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return list(out[0, len(prompt) :].tolist())
