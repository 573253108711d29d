"""Whisper (`WhisperForConditionalGeneration`): the audio encoder and the decoder with cross-attention.

The encoder (two convolutions, sinusoidal-position layers, pre-LayerNorm) turns log-mel features [mels, 3000] of
one 30 s window into 1500 frames; it runs once per request (engine/multimodal/audio_runner.py caches its output by the
features' hash). Each decoder layer's cross-attention K/V over those frames are computed once per request and
kept on the request's `SeqAudio`; the decoder's self-attention runs over the paged KV cache like any decoder's,
so Whisper requests batch with each other under the same scheduler. Learned absolute positions (up to
`max_target_positions`, 448), LayerNorm with biases, GELU, the output projection tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear, make_linear
from engine.layers.lm_head import LMHead
from engine.layers.ops import TorchOps, TritonOps
from engine.models.args import ConfigError, ModelArgs
from engine.models.decoder import CausalLM, Checkpoint, WeightGetter
from engine.models.step import CrossBatch, CrossKV, Step

ARCHITECTURE = "WhisperForConditionalGeneration"
_EPS = 1e-5


@dataclass(frozen=True)
class WhisperArgs:
    d_model: int
    encoder_layers: int
    encoder_heads: int
    decoder_layers: int
    decoder_heads: int
    num_mel_bins: int
    max_source_positions: int  # encoder frames per window (1500: 3000 mel frames after the stride-2 conv)
    max_target_positions: int  # decoder positions (448)
    vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> WhisperArgs:
        act = str(cfg.get("activation_function", "gelu"))
        if act != "gelu":
            raise ConfigError(f"activation_function {act!r} is not supported for Whisper; only gelu is")
        if cfg.get("scale_embedding"):
            raise ConfigError("scale_embedding true is not supported for Whisper")
        args = cls(
            d_model=int(cfg["d_model"]),
            encoder_layers=int(cfg["encoder_layers"]),
            encoder_heads=int(cfg["encoder_attention_heads"]),
            decoder_layers=int(cfg["decoder_layers"]),
            decoder_heads=int(cfg["decoder_attention_heads"]),
            num_mel_bins=int(cfg.get("num_mel_bins", 80)),
            max_source_positions=int(cfg.get("max_source_positions", 1500)),
            max_target_positions=int(cfg.get("max_target_positions", 448)),
            vocab_size=int(cfg["vocab_size"]),
        )
        for name, heads in (("encoder", args.encoder_heads), ("decoder", args.decoder_heads)):
            if args.d_model % heads:
                raise ConfigError(f"d_model {args.d_model} is not a multiple of {name}_attention_heads {heads}")
        return args


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """The registry's view: the decoder's shape (the KV cache is sized from it); the encoder is read at load.
    hidden_act stays the default: Whisper's own GELU is not a ModelArgs activation, this model applies it."""
    w = WhisperArgs.from_hf_config(cfg)
    return ModelArgs(
        architecture=arch,
        hidden_size=w.d_model,
        num_layers=w.decoder_layers,
        num_heads=w.decoder_heads,
        num_kv_heads=w.decoder_heads,
        head_dim=w.d_model // w.decoder_heads,
        intermediate_size=int(cfg.get("decoder_ffn_dim", 4 * w.d_model)),
        vocab_size=w.vocab_size,
        rms_norm_eps=_EPS,
        rope_theta=0.0,
        rope_scaling=None,
        max_position_embeddings=w.max_target_positions,
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    )


class _Attn:
    """q / k / v / out projections of one attention block (k has no bias in Whisper)."""

    def __init__(self, get: WeightGetter, p: str) -> None:
        self.q = make_linear(get(f"{p}.q_proj.weight"), get(f"{p}.q_proj.bias"))
        self.k = make_linear(get(f"{p}.k_proj.weight"))
        self.v = make_linear(get(f"{p}.v_proj.weight"), get(f"{p}.v_proj.bias"))
        self.out = make_linear(get(f"{p}.out_proj.weight"), get(f"{p}.out_proj.bias"))


class _Block:
    """One encoder or decoder layer's weights."""

    def __init__(self, get: WeightGetter, p: str, cross: bool) -> None:
        def ln(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(f"{p}.{name}.weight"), get(f"{p}.{name}.bias")

        self.ln_self = ln("self_attn_layer_norm")
        self.self_attn = _Attn(get, f"{p}.self_attn")
        self.ln_cross = ln("encoder_attn_layer_norm") if cross else None
        self.cross_attn = _Attn(get, f"{p}.encoder_attn") if cross else None
        self.ln_ff = ln("final_layer_norm")
        self.fc1: Linear = make_linear(get(f"{p}.fc1.weight"), get(f"{p}.fc1.bias"))
        self.fc2: Linear = make_linear(get(f"{p}.fc2.weight"), get(f"{p}.fc2.bias"))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(_layer_norm(x, self.ln_ff))))


def _layer_norm(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], _EPS)


class WhisperModel(CausalLM):
    """Encoder, cross-attention K/V, and the decoder over the paged KV cache (the runner's CausalLM interface)."""

    def __init__(self, w: WhisperArgs, args: ModelArgs, get: WeightGetter) -> None:  # noqa: D107
        # CausalLM's own __init__ builds a rope decoder; this one sets the same interface from Whisper's weights
        self.args, self.w = args, w
        self.ops: type[TorchOps] | type[TritonOps] = TorchOps
        embed = get("model.decoder.embed_tokens.weight")
        self.dtype, self.device = embed.dtype, embed.device
        self.embed: torch.Tensor | None = embed
        self.embed_scale = None
        self.tied = True
        self.head = LMHead(embed)
        self.layer_windows: list[int | None] = [None] * w.decoder_layers
        self.heads, self.head_dim = w.decoder_heads, w.d_model // w.decoder_heads
        self.scale = self.head_dim**-0.5
        self.dec_pos = get("model.decoder.embed_positions.weight")
        self.dec_layers = [_Block(get, f"model.decoder.layers.{i}", True) for i in range(w.decoder_layers)]
        self.dec_norm = (get("model.decoder.layer_norm.weight"), get("model.decoder.layer_norm.bias"))
        self.conv1 = (get("model.encoder.conv1.weight"), get("model.encoder.conv1.bias"))
        self.conv2 = (get("model.encoder.conv2.weight"), get("model.encoder.conv2.bias"))
        self.enc_pos = get("model.encoder.embed_positions.weight")
        self.enc_layers = [_Block(get, f"model.encoder.layers.{i}", False) for i in range(w.encoder_layers)]
        self.enc_norm = (get("model.encoder.layer_norm.weight"), get("model.encoder.layer_norm.bias"))

    @classmethod
    def load(cls, ck: Checkpoint) -> CausalLM:
        if ck.quantization is not None:
            raise ConfigError(f"--quantization {ck.quantization} is not supported for Whisper checkpoints")
        return cls(WhisperArgs.from_hf_config(ck.cfg), ck.args, ck.weights)

    def use_triton(self) -> None:
        """The decoder's self-attention through the Triton paged kernels (the rest is plain torch)."""
        self.ops = TritonOps

    @property
    def num_frames(self) -> int:
        """Mel frames one window's features must have: 2 per encoder position (the stride-2 convolution)."""
        return 2 * self.w.max_source_positions

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel features [B, mels, 3000] -> encoder output [B, 1500, d_model]."""
        x = features.to(device=self.device, dtype=self.dtype)
        x = F.gelu(F.conv1d(x, *self.conv1, padding=1))
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1)).transpose(1, 2)
        x = x + self.enc_pos[: x.shape[1]]
        b, t, d = x.shape
        heads = self.w.encoder_heads
        for layer in self.enc_layers:
            h = _layer_norm(x, layer.ln_self)
            a = layer.self_attn
            q, k, v = (f(h).view(b, t, heads, -1).transpose(1, 2) for f in (a.q, a.k, a.v))
            o = F.scaled_dot_product_attention(q, k, v, scale=(d // heads) ** -0.5)
            x = x + a.out(o.transpose(1, 2).reshape(b, t, d))
            x = x + layer.mlp(x)
        return _layer_norm(x, self.enc_norm)

    def cross_kv(self, encoded: torch.Tensor) -> list[CrossKV]:
        """Encoder outputs [B, frames, d] -> each request's cross-attention K/V for every decoder layer."""
        b, t, _ = encoded.shape
        per_layer = []
        for layer in self.dec_layers:
            a = layer.cross_attn
            assert a is not None
            k = a.k(encoded).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            v = a.v(encoded).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            per_layer.append((k, v))
        return [CrossKV([(k[i].contiguous(), v[i].contiguous()) for k, v in per_layer]) for i in range(b)]

    def forward(self, step: Step) -> torch.Tensor:
        """The decoder over the flat batch -> hidden states [T, d] before the final LayerNorm."""
        cross, meta = step.cross, step.meta
        if cross is None:
            raise ValueError("a Whisper decoder step needs every request's audio (cross-attention K/V)")
        assert self.embed is not None
        x = F.embedding(step.input_ids, self.embed) + self.dec_pos[step.positions]
        t = x.shape[0]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.dec_layers, step.kv_caches)):
            h = _layer_norm(x, layer.ln_self)
            a = layer.self_attn
            q = a.q(h).view(t, self.heads, self.head_dim)
            k = a.k(h).view(t, self.heads, self.head_dim)
            self.ops.write_kv(k, a.v(h).view(t, self.heads, self.head_dim), k_cache, v_cache, meta.slot_mapping)
            o = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
            x = x + a.out(o.reshape(t, -1))
            assert layer.ln_cross is not None and layer.cross_attn is not None
            x = x + self._cross(i, layer.cross_attn, _layer_norm(x, layer.ln_cross), cross)
            x = x + layer.mlp(x)
        return x

    def _cross(self, i: int, a: _Attn, h: torch.Tensor, cross: CrossBatch) -> torch.Tensor:
        """Layer i's cross-attention: each sequence's rows attend to its own encoder frames."""
        q = a.q(h).view(h.shape[0], self.heads, self.head_dim)
        out = torch.empty_like(q)
        for start, n, kv in cross.spans:
            k, v = kv.layers[i]
            qs = q[start : start + n].transpose(0, 1)  # [heads, n, head_dim]
            o = F.scaled_dot_product_attention(qs, k, v, scale=self.scale)
            out[start : start + n] = o.transpose(0, 1)
        return a.out(out.reshape(h.shape[0], -1))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return _layer_norm(hidden, self.dec_norm)
