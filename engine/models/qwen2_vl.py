"""Qwen2-VL: the vision tower (Conv3d patch embedding, 2-D rotary, attention within each image, the 2x2 patch
merger) and the Qwen2 decoder with M-RoPE (positions 3 x N: temporal, height, width; `mrope_section` says which
rotary frequencies each axis drives).

The language model is `CausalLM` (engine/models/decoder.py) with two changes: `forward` takes positions [3, T]
(or [T]: a text-only batch, where the three axes are equal and M-RoPE is plain RoPE) and optional input
embeddings (the image rows replaced by the tower's output). Weight names of both layouts load: the original
(`model.layers.*`, `visual.*`) and transformers 5's (`model.language_model.*`, `model.visual.*`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear, make_linear
from engine.layers.ops import apply_rope
from engine.models import llama
from engine.models.args import ConfigError, ModelArgs
from engine.models.decoder import CausalLM, Checkpoint, WeightGetter
from engine.models.step import Step

ARCHITECTURE = "Qwen2VLForConditionalGeneration"
IMAGE_TOKEN_ID = 151655  # <|image_pad|>, the default when config.json does not say


@dataclass(frozen=True)
class VisionArgs:
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float

    @classmethod
    def from_hf_config(cls, v: dict[str, Any]) -> VisionArgs:
        act = str(v.get("hidden_act", "quick_gelu"))
        if act not in _ACTS:
            raise ConfigError(f"vision_config.hidden_act {act!r} is not supported; supported: {', '.join(_ACTS)}")
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v["depth"]),
            embed_dim=int(v["embed_dim"]),
            num_heads=int(v["num_heads"]),
            mlp_ratio=float(v.get("mlp_ratio", 4)),
            hidden_act=act,
            in_channels=int(v.get("in_channels", 3)),
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: channels x temporal x patch x patch (1176 for Qwen2-VL)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "silu": F.silu}


@dataclass(frozen=True)
class VLConfig:
    text: ModelArgs
    vision: VisionArgs
    mrope_section: list[int]
    image_token_id: int


def parse_vl_config(cfg: dict[str, Any]) -> VLConfig:
    """config.json of a Qwen2VLForConditionalGeneration checkpoint: nested text_config (transformers 5) or flat."""
    text = {
        **{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")},
        **(cfg.get("text_config") or {}),
    }
    rope = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    section = rope.get("mrope_section") or scaling.get("mrope_section")
    theta = text.get("rope_theta") or rope.get("rope_theta") or scaling.get("rope_theta") or 1_000_000.0
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"Qwen2-VL rope_type {rope_type!r} is not supported; only default (M-RoPE) is")
    text.update(
        architectures=["Qwen2ForCausalLM"], rope_parameters={"rope_theta": theta}, rope_scaling=None, rope_theta=theta
    )
    args = llama.parse(text, "Qwen2ForCausalLM")
    if args.sliding_window is not None:
        raise ConfigError("Qwen2-VL with a sliding window is not supported")
    section = [int(s) for s in (section or [16, 24, 24])]
    if len(section) != 3 or sum(section) != args.head_dim // 2:
        raise ConfigError(
            f"mrope_section {section} must be three numbers summing to head_dim / 2 ({args.head_dim // 2})"
        )
    vision = VisionArgs.from_hf_config(cfg["vision_config"])
    if vision.embed_dim % vision.num_heads or (vision.embed_dim // vision.num_heads) % 4:
        raise ConfigError("vision_config: embed_dim / num_heads must be a multiple of 4")
    merger_out = int(cfg["vision_config"].get("hidden_size", args.hidden_size))
    if merger_out != args.hidden_size:
        raise ConfigError(
            f"vision_config.hidden_size {merger_out} differs from the text hidden_size {args.hidden_size}"
        )
    return VLConfig(args, vision, section, int(cfg.get("image_token_id", IMAGE_TOKEN_ID)))


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """The registry's view: the language model's args (the vision tower's are read again at load)."""
    return replace(parse_vl_config(cfg).text, architecture=arch)


def vl_weight_getter(get: WeightGetter, has: Any) -> WeightGetter:
    """Names as CausalLM / VisionTower ask for them -> the checkpoint's (either layout)."""

    def lookup(name: str) -> torch.Tensor:
        if name in has:
            return get(name)
        if name.startswith("model."):
            alt = "model.language_model." + name[len("model.") :]
        elif name.startswith("visual."):
            alt = "model." + name
        else:
            alt = name
        return get(alt if alt in has else name)

    return lookup


class VisionTower:
    """pixel_values [patches, patch_dim] of ONE image + its grid (t, h, w) -> [t*h*w / merge^2, hidden]."""

    def __init__(self, args: VisionArgs, get: WeightGetter) -> None:
        self.args = args
        d = args.embed_dim
        patch_w = get("visual.patch_embed.proj.weight").reshape(d, -1)
        self.dtype, self.device = patch_w.dtype, patch_w.device
        self.patch = make_linear(patch_w)

        def lin(prefix: str) -> Linear:
            return make_linear(get(prefix + ".weight"), get(prefix + ".bias"))

        self.blocks: list[tuple[dict[str, torch.Tensor], dict[str, Linear]]] = []
        for i in range(args.depth):
            p = f"visual.blocks.{i}."
            norms = {n: get(p + n) for n in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias")}
            self.blocks.append((norms, {n: lin(p + n) for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}))
        self.ln_q = (get("visual.merger.ln_q.weight"), get("visual.merger.ln_q.bias"))
        self.merger = (lin("visual.merger.mlp.0"), lin("visual.merger.mlp.2"))
        self.head_dim = d // args.num_heads
        spatial = self.head_dim // 2
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.act = _ACTS[args.hidden_act]

    def _rotary(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.args.spatial_merge_size
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        pos = torch.stack(
            [hpos.reshape(shape).transpose(1, 2).flatten(), wpos.reshape(shape).transpose(1, 2).flatten()], dim=-1
        ).repeat(t, 1)  # [N, 2]
        freqs = pos[..., None].float() * self.inv_freq  # [N, 2, spatial / 2]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw, hw], dim=-1).to(self.device)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def encode(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        a = self.args
        t, h, w = grid
        n, d, heads = t * h * w, a.embed_dim, a.num_heads
        if pixels.shape != (n, a.patch_dim):
            raise ValueError(
                f"pixel_values {tuple(pixels.shape)} do not match grid {grid} (expected ({n}, {a.patch_dim}))"
            )
        x = self.patch(pixels.to(device=self.device, dtype=self.dtype))
        cos, sin = self._rotary(t, h, w)
        frame = h * w
        for b, lin in self.blocks:
            y = F.layer_norm(x, (d,), b["norm1.weight"], b["norm1.bias"], 1e-6)
            q, k, v = lin["attn.qkv"](y).reshape(n, 3, heads, -1).unbind(1)
            q, k = (_rotate(z, cos, sin) for z in (q, k))
            # attention within each frame (an image is one frame): [frames, heads, frame, head_dim]
            q, k, v = (z.reshape(t, frame, heads, -1).transpose(1, 2) for z in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
            o = o.transpose(1, 2).reshape(n, d)
            x = x + lin["attn.proj"](o)
            y = F.layer_norm(x, (d,), b["norm2.weight"], b["norm2.bias"], 1e-6)
            x = x + lin["mlp.fc2"](self.act(lin["mlp.fc1"](y)))
        y = F.layer_norm(x, (d,), *self.ln_q, 1e-6).reshape(-1, d * a.spatial_merge_size**2)
        return self.merger[1](F.gelu(self.merger[0](y)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Qwen2VLCausalLM(CausalLM):
    """The Qwen2 decoder with M-RoPE and image embeddings spliced in; owns the vision tower."""

    def __init__(
        self, vl: VLConfig, get: WeightGetter, has_lm_head: bool, max_positions: int, quantization: str | None = None
    ) -> None:
        super().__init__(vl.text, get, has_lm_head, max_positions, quantization)
        self.args = replace(vl.text, architecture=ARCHITECTURE)
        self.vl = vl
        self.visual = VisionTower(vl.vision, get)
        half = vl.text.head_dim // 2
        axis = torch.cat([torch.full((s,), i, dtype=torch.long) for i, s in enumerate(vl.mrope_section)])
        assert axis.numel() == half
        self._axis_cols = torch.cat([axis, axis]).to(self.device)  # table column -> the axis that drives it

    @classmethod
    def load(cls, ck: Checkpoint) -> CausalLM:
        """Both weight layouts (the original and transformers 5's), the vision tower from vision_config."""
        vl = parse_vl_config(ck.cfg)
        return cls(vl, vl_weight_getter(ck.weights, ck.weights), ck.has_lm_head, ck.max_positions, ck.quantization)

    def mrope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, T] -> the rotary rows [T, head_dim]: each frequency from its section's axis."""
        rows = self.cos_sin[positions]  # [3, T, head_dim]
        cols = self._axis_cols[None, None, :].expand(1, rows.shape[1], rows.shape[2])
        return rows.gather(0, cols)[0]

    def forward(self, step: Step) -> torch.Tensor:
        """positions [T] (text only) or [3, T]; embeds [T, hidden] replaces the token embedding when given."""
        x = self.embed_tokens(step.input_ids) if step.embeds is None else step.embeds
        if step.positions.dim() == 1:
            return self.run_layers(x, step.kv_caches, step.meta, self.rope_for(step.positions))
        rows = self.mrope_rows(step.positions)  # one table: every layer turns by the same M-RoPE rows
        return self.run_layers(x, step.kv_caches, step.meta, lambda q, k, _: (apply_rope(q, rows), apply_rope(k, rows)))


def mrope_positions(
    num_tokens: int, images: list[tuple[int, int, tuple[int, int, int]]], merge: int
) -> tuple[list[list[int]], int]:
    """The prompt's M-RoPE positions [3][num_tokens] and the delta for later tokens (position = index + delta).

    images: (offset, length, grid (t, h, w) in patches), sorted, not overlapping; as transformers'
    Qwen2VLModel.get_rope_index: text continues one past the previous maximum.
    """
    axes: list[list[int]] = [[], [], []]
    cur = idx = 0
    for offset, length, (t, h, w) in images:
        n_text = offset - idx
        for ax in axes:
            ax.extend(range(cur, cur + n_text))
        cur += n_text
        gh, gw = h // merge, w // merge
        assert t * gh * gw == length
        for ti in range(t):
            for hi in range(gh):
                axes[0].extend([cur + ti] * gw)
                axes[1].extend([cur + hi] * gw)
                axes[2].extend(range(cur, cur + gw))
        cur += max(gh, gw)
        idx = offset + length
    for ax in axes:
        ax.extend(range(cur, cur + num_tokens - idx))
    top = max(max(ax) for ax in axes) if num_tokens else -1
    return axes, top + 1 - num_tokens
