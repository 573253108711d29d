"""Random-weight Hugging Face checkpoints with real tokenizers: the demo model and test fixtures.

Built with transformers' own model classes and `save_pretrained`, so the files are exactly what a
real checkpoint looks like and transformers can serve as the reference implementation.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from demo.shapes import SHAPES, write_shaped_checkpoint
from demo.tokenizers import write_tokenizer
from engine.cache_root import cache_root

Arch = Literal[
    "qwen2",
    "llama",
    "mistral",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "smollm3",
    "olmo2",
    "olmo3",
    "gemma4",
]

_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
}
# The tokenizer each family's checkpoint gets. Gemma's own (SentencePiece, 256k) is not available offline:
# Gemma checkpoints get Qwen2.5's; Phi-3 gets the Llama/Mistral SentencePiece one (32,000 ids, as Phi-3's).
TOKENIZERS = {
    "qwen2": "qwen2",
    "llama": "llama",
    "mistral": "mistral",
    "qwen3": "qwen2.5",
    "qwen3_moe": "qwen2.5",
    "gemma2": "qwen2.5",
    "gemma3": "qwen2.5",
    "phi3": "llama",
    "mixtral": "mistral",
    "smollm3": "qwen2.5",
    "olmo2": "qwen2.5",
    "olmo3": "qwen2.5",
    "gemma4": "qwen2.5",
}
_QWEN_TOKENS = ("qwen2", "qwen2.5")
# Sampling defaults in the style of each family's instruct generation_config.json.
_SAMPLING = {
    "qwen2": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    "llama": {"temperature": 0.6, "top_p": 0.9},
    "mistral": {},
    "qwen3": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
}

DEMO = dict(
    arch="qwen2",
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=384,
    vocab_size=151_936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=4096,
    seed=0,
    tokenizer_family="qwen2.5",
)
_SMALL = dict(
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=384,
    rope_theta=1_000_000.0,
    max_position_embeddings=4096,
    seed=0,
)
_QWEN_VOCAB = dict(vocab_size=151_936, tie_word_embeddings=True, tokenizer_family="qwen2.5")
_SP_VOCAB = dict(vocab_size=32_000, tie_word_embeddings=False)
_EXPERTS = dict(num_experts_per_tok=2, norm_topk_prob=True)
# `spindle make-demo --arch NAME`: each family at the demo's size, with its features switched on (experts, windows
# on some layers, soft-caps, longrope) and a real tokenizer (Gemma's is not available offline: Qwen2.5's instead).
FAMILY_DEMOS: dict[str, dict[str, Any]] = {
    "qwen2": DEMO,
    "llama": dict(_SMALL, arch="llama", **_SP_VOCAB, rope_theta=500_000.0),
    "mistral": dict(_SMALL, arch="mistral", **_SP_VOCAB, sliding_window=256),
    "qwen3": dict(_SMALL, arch="qwen3", **_QWEN_VOCAB),
    "qwen3_moe": dict(
        _SMALL, arch="qwen3_moe", **_QWEN_VOCAB, extra=dict(num_experts=8, moe_intermediate_size=192, **_EXPERTS)
    ),
    "mixtral": dict(_SMALL, arch="mixtral", **_SP_VOCAB, extra=dict(num_local_experts=8, num_experts_per_tok=2)),
    "gemma2": dict(
        _SMALL,
        arch="gemma2",
        **_QWEN_VOCAB,
        rope_theta=10_000.0,
        sliding_window=256,
        extra=dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64),
    ),
    "gemma3": dict(
        _SMALL,
        arch="gemma3",
        **_QWEN_VOCAB,
        sliding_window=256,
        extra=dict(
            query_pre_attn_scalar=64, rope_local_base_freq=10_000.0, layer_types=["sliding_attention", "full_attention"]
        ),
    ),
    "phi3": dict(
        _SMALL,
        arch="phi3",
        **_SP_VOCAB,
        rope_theta=10_000.0,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 32,
            "long_factor": [1.0 + i / 8 for i in range(32)],
        },
        extra=dict(original_max_position_embeddings=1024),
    ),
}
# Versioned: a demo cached by an older build (Qwen2's 151,646-token tokenizer, ChatML without tools) is rebuilt.
_DEMO_NAME = "demo-qwen2.5-v2"


def _reinit(model: torch.nn.Module, hidden_size: int, seed: int) -> None:
    """Scale weights so activations keep unit size and logits spread (std ~2.5), not near-uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                std = 2.5 / math.sqrt(hidden_size)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name:  # not exactly one, so a norm weight that is not loaded shows
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # fan-in is the last dim, also of transformers 5's stacked experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():  # Gemma 4's per-layer output scale, saved but not a parameter
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.1 * torch.randn(b.shape, generator=g))


def write_random_checkpoint(
    path: str | Path,
    arch: Arch,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    rope_theta: float,
    max_position_embeddings: int,
    seed: int,
    head_dim: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    dtype: str = "float32",
    shards: int = 1,
    tokenizer: bool = True,
    tokenizer_family: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint folder at `path` (which must not exist yet) atomically; returns it.

    tokenizer_family: the tokenizer written (default: the arch's, TOKENIZERS; "qwen2.5" for Qwen2.5's added
    tokens and tool-calling template). extra: more config fields (experts, layer_types, soft-caps ...)."""
    import transformers  # why late: the engine imports this module, only builders need transformers

    path = _fresh(path)
    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[arch])
    tok = tokenizer_family or TOKENIZERS[arch]
    bos, eos = (151643, [151645, 151643]) if tok in _QWEN_TOKENS else (1, [2])
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos[0],
        architectures=[model_cls.__name__],
    )
    kwargs.update(_arch_fields(arch, rope_scaling, sliding_window))
    config = config_cls(**kwargs, **(extra or {}))
    model = _seeded(model_cls, config, seed, _reinit, hidden_size).to(getattr(torch, dtype))
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": True, **_SAMPLING.get(arch, {})}
    if tok in _QWEN_TOKENS:
        gen["pad_token_id"] = 151643
    return _write_atomically(path, lambda tmp: _save(tmp, model, shards, gen, tok if tokenizer else None))


def _arch_fields(arch: Arch, rope_scaling: dict[str, Any] | None, sliding_window: int | None) -> dict[str, Any]:
    """Config fields only some families or shapes carry."""
    fields: dict[str, Any] = {}
    if arch in ("gemma2", "gemma3", "phi3", "olmo2", "olmo3", "gemma4"):  # default pad ids may lie past the vocabulary
        fields["pad_token_id"] = 0
    if rope_scaling is not None:
        fields["rope_scaling"] = rope_scaling
    if sliding_window is not None or arch in ("mistral", "gemma2", "gemma3"):
        fields["sliding_window"] = sliding_window
    return fields


def _seeded(
    model_cls: Any, config: Any, seed: int, reinit: Callable[[torch.nn.Module, int, int], None], hidden_size: int
) -> Any:
    """`model_cls(config)` built under `seed`, its weights then rescaled by `reinit`."""
    torch.manual_seed(seed)
    model = model_cls(config)
    reinit(model, hidden_size, seed)
    return model


def _save(tmp: Path, model: Any, shards: int, gen: dict[str, Any], tokenizer_family: str | None) -> None:
    """The weights in `shards` safetensors files, generation_config.json and (named) the tokenizer's files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_size = max(1, math.ceil(total / shards) + 1) if shards > 1 else "50GB"
    model.save_pretrained(tmp, max_shard_size=shard_size)
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer_family is not None:
        write_tokenizer(tokenizer_family, tmp)  # type: ignore[arg-type]


def _fresh(path: str | Path) -> Path:
    """`path` as a Path; FileExistsError when something is there already."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; pick a new folder or delete it first")
    return path


def _write_atomically(path: Path, fill: Callable[[Path], None]) -> Path:
    """`fill` a temporary folder beside `path`, then rename it to `path`: readers see no folder or a whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        fill(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def make_demo(path: str | Path, arch: str = "qwen2") -> Path:
    """The demo checkpoint at `path`: random weights, Qwen2.5's real tokenizer (151,665 tokens, the embedding
    padded to 151,936 as Qwen2.5's is) and its chat template, which renders tools, tool calls and tool results.

    arch: another family at the same size (FAMILY_DEMOS), e.g. "qwen3_moe", "gemma3"."""
    if arch not in FAMILY_DEMOS:
        raise ValueError(f"--arch {arch!r} is not a demo family; choose one of {', '.join(FAMILY_DEMOS)}")
    return write_random_checkpoint(path, **FAMILY_DEMOS[arch])


def demo_checkpoint_path() -> Path:
    """The demo checkpoint in the cache, built on first use (about 80 MB, a few seconds) in a child process:
    transformers' model classes import torch._dynamo and with it triton, whose nanobind extension prints a wall of
    "nanobind: leaked ..." when the interpreter that imported it exits; the caller (the API server) stays clear
    of them, and the child leaves with os._exit once the folder is written."""
    path = cache_root() / _DEMO_NAME
    if path.is_dir():
        return path
    done = subprocess.run([sys.executable, "-m", "demo.checkpoints", str(path)], stdout=subprocess.DEVNULL)
    if path.is_dir():  # built, or another process finished it first
        return path
    raise OSError(f"building the demo checkpoint into {path} failed (exit status {done.returncode}; see above)")


# Qwen2-VL's own chat template: image parts render as <|vision_start|><|image_pad|><|vision_end|>, which the
# server expands to the image's token count (grid t*h*w / merge^2), as transformers' Qwen2VLProcessor does.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
VL_DEMO = dict(
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=384,
    mrope_section=[8, 12, 12],
    vision_depth=2,
    vision_embed_dim=64,
    vision_num_heads=2,
    seed=0,
)


def _reinit_vl(model: torch.nn.Module, hidden_size: int, seed: int) -> None:
    """As _reinit, for every tensor shape of Qwen2-VL (Conv3d patch weights, LayerNorms with biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (2.5 / math.sqrt(hidden_size)))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # RMSNorm / LayerNorm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))


def write_random_vl_checkpoint(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    mrope_section: list[int] | None = None,
    vision_depth: int = 2,
    vision_embed_dim: int = 32,
    vision_num_heads: int = 2,
    vocab_size: int = 151_936,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1_000_000.0,
    seed: int = 0,
    max_pixels: int = 28 * 28 * 1280,
) -> Path:
    """A random-weight Qwen2VLForConditionalGeneration checkpoint at `path` (must not exist), atomically: config
    with vision_config, safetensors, Qwen2.5's tokenizer (<|vision_start|> 151652 ... <|image_pad|> 151655) with
    Qwen2-VL's chat template, and preprocessor_config.json for the Qwen2-VL image processor."""
    import transformers  # why late: the engine imports this module, only builders need transformers

    path = _fresh(path)
    section = mrope_section or _mrope_section(head_dim)
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": rope_theta},
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        vision_config=_vision_config(vision_depth, vision_embed_dim, vision_num_heads, hidden_size),
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=True,
        architectures=["Qwen2VLForConditionalGeneration"],
    )
    model = _seeded(transformers.Qwen2VLForConditionalGeneration, config, seed, _reinit_vl, hidden_size)
    return _write_atomically(path, lambda tmp: _save_vl(tmp, model, max_pixels))


def _mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's (temporal, height, width) split of head_dim // 2 rotary pairs."""
    return [
        head_dim // 8,
        (head_dim // 2 - head_dim // 8) // 2,
        head_dim // 2 - head_dim // 8 - (head_dim // 2 - head_dim // 8) // 2,
    ]


def _vision_config(depth: int, embed_dim: int, num_heads: int, hidden_size: int) -> dict[str, Any]:
    """Qwen2-VL's vision tower: 14-pixel patches, 2 frames a patch, 2x2 patches merged into one token."""
    return dict(
        depth=depth,
        embed_dim=embed_dim,
        num_heads=num_heads,
        mlp_ratio=2,
        hidden_size=hidden_size,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )


def _save_vl(tmp: Path, model: Any, max_pixels: int) -> None:
    """The weights, generation_config.json, Qwen2.5's tokenizer with Qwen2-VL's chat template, and the image
    processor's preprocessor_config.json."""
    model.save_pretrained(tmp)
    gen = {
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "do_sample": True,
        **_SAMPLING["qwen2"],
    }
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer("qwen2.5", tmp)
    tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = QWEN2_VL_CHAT_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    (tmp / "preprocessor_config.json").write_text(json.dumps({**VL_PREPROCESSOR, "max_pixels": max_pixels}, indent=2))


def make_vision_demo(path: str | Path) -> Path:
    """`spindle make-demo --vision PATH`: a random-weight Qwen2-VL checkpoint (about 85 MB)."""
    return write_random_vl_checkpoint(path, **VL_DEMO)  # type: ignore[arg-type]


MAKE_DEMO_USAGE = (
    f"usage: spindle make-demo [--vision | --whisper | --arch {{{','.join(FAMILY_DEMOS)}}} "
    f"| --shape {{{','.join(SHAPES)}}}] PATH"
)


def make_demo_command(args: list[str]) -> int:
    """`spindle make-demo [--vision | --whisper | --arch NAME | --shape NAME] PATH`: prints the folder written; 2
    with the usage
    on a bad line. --shape: random weights of a real model's shape, bf16, for benchmarks (demo/shapes.py)."""
    if len(args) == 3 and args[0] == "--shape" and args[1] in SHAPES:
        print(write_shaped_checkpoint(args[2], dict(SHAPES[args[1]])))
        return 0
    if len(args) == 1 and not args[0].startswith("-"):
        print(make_demo(args[0]))
        return 0
    if len(args) == 2 and args[0] == "--whisper":
        from demo.whisper import make_whisper_demo  # why late: needs openai-whisper's vocabulary

        print(make_whisper_demo(args[1]))
        return 0
    if len(args) == 2 and args[0] == "--vision":
        print(make_vision_demo(args[1]))
        return 0
    if len(args) == 3 and args[0] == "--arch" and args[1] in FAMILY_DEMOS:
        print(make_demo(args[2], args[1]))
        return 0
    print(MAKE_DEMO_USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":  # demo_checkpoint_path's child: build, then leave without the interpreter's teardown
    try:
        make_demo(sys.argv[1])
    except OSError as e:
        print(f"demo checkpoint: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if Path(sys.argv[1]).is_dir() else 1)
