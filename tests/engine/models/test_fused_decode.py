"""engine/models/fused_decode.py: a decode step through one C++ call per layer gives bitwise the logits of the
layer-by-layer path, for the dense families it takes (biases, per-head norms, windows, GQA, mixed context
lengths, several threads, weight-only int8, Gemma 2 and 3, GGUF blocks), and models it cannot take never build one."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from demo.checkpoints import write_random_checkpoint
from engine.config import EngineConfig
from engine.cpu_kernels import gemm_amx, quant_dot
from engine.execution.model_runner import ModelRunner
from engine.layers.linear import KernelLinear
from engine.layers.ops import AttnMetadata
from engine.layers.quant_linear import QuantLinear
from engine.messages import SamplingParams
from engine.models import fused_decode
from engine.models.decoder import CausalLM
from engine.types.sequence import ScheduledSeq, Sequence
from tests.engine.gguf.files import gemma3_file, smollm2_file
from tests.engine.models.families import LONGROPE, build_family

pytestmark = pytest.mark.skipif(
    not fused_decode.decoder_layer.available(), reason="no AVX512-BF16 CPU kernels here (CPU or compiler)"
)
BLOCK = 4


@pytest.fixture(autouse=True)
def _our_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused layer runs only where the kernel chooser gives our kernel the step's rows: force it."""
    monkeypatch.setenv("SPINDLE_KERNEL_CHOICE", "spindle")


SHAPES: dict[str, dict[str, Any]] = {  # head_dim 32 or 64: what the fused attention takes
    "qwen2": dict(vocab_size=151_646, tie_word_embeddings=True),  # q|k|v bias
    "qwen3": dict(vocab_size=151_646, tie_word_embeddings=True),  # per-head q and k norms
    "llama": dict(vocab_size=32_000, tie_word_embeddings=False),
    "mistral": dict(vocab_size=32_000, tie_word_embeddings=False, sliding_window=6),  # a window the contexts pass
    "gemma2": dict(  # (1 + w) norms closing each sub-block, soft-capped attention, alternate windows
        vocab_size=151_646,
        tie_word_embeddings=True,
        sliding_window=6,
        extra=dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0, query_pre_attn_scalar=24),
    ),
    # Gemma 3's: (1 + w) norms closing each sub-block, q/k norms, GELU-tanh, windowed layers on their own rope
    # base, soft-capped logits, embeddings scaled
    "gemma3": dict(
        vocab_size=151_646,
        tie_word_embeddings=True,
        sliding_window=6,
        extra=dict(
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_local_base_freq=100.0,
            final_logit_softcapping=5.0,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = str(request.param)
    return write_random_checkpoint(
        tmp_path_factory.mktemp("fused") / arch,
        arch,
        hidden_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32 if arch != "llama" else 64,
        intermediate_size=192,
        rope_theta=10_000.0,
        max_position_embeddings=256,
        seed=7,
        **SHAPES[arch],
    )  # type: ignore[arg-type]


def decode_logits(
    path: Path,
    fused: bool,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
    quantization: str | None = None,
    count: int = 5,
) -> list[torch.Tensor]:
    """`count` sequences of jumbled lengths: a prefill step, then six decode steps; the logits of each decode step."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(CausalLM, "fused_decode", lambda model: None)
        torch.set_num_threads(threads)
        runner = ModelRunner(
            EngineConfig(model=str(path), dtype="bfloat16", block_size=BLOCK, num_blocks=512, quantization=quantization)
        )
        free = list(range(512))
        random.Random(1).shuffle(free)
        rng = random.Random(2)
        seqs = [
            Sequence.new(f"s{i}", [rng.randrange(3, 30_000) for _ in range(n)], SamplingParams(max_tokens=8), 0.0)
            for i, n in enumerate(([5, 1, 13, 4, 9] * 8)[:count])
        ]
        out: list[torch.Tensor] = []
        for step in range(7):
            batch = []
            for s in seqs:
                n = len(s.token_ids) - s.num_computed_tokens if step == 0 else 1
                while len(s.block_table) * BLOCK < s.num_computed_tokens + n:
                    s.block_table.append(free.pop())
                batch.append(ScheduledSeq(s, n))
            logits = runner.execute(batch).logits.clone()
            for s, sched in zip(seqs, batch):
                s.num_computed_tokens += sched.num_new_tokens
                s.token_ids.append(rng.randrange(3, 30_000))  # the same tokens in both runs, whatever they predict
            if step:
                out.append(logits)
        assert (runner.model.fused is not None) == fused  # the path under test really ran
        return out


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_is_bitwise_the_layer_by_layer_path(
    ckpt: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = decode_logits(ckpt, True, threads, monkeypatch)
    plain = decode_logits(ckpt, False, threads, monkeypatch)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


# 5 rows: gate|up and SiLU in one call (wide tiles); 20: the same as two 16-row tiles; 40: the two calls
@pytest.mark.parametrize("count", [20, 40])
def test_fused_decode_is_bitwise_at_more_rows(ckpt: Path, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = decode_logits(ckpt, True, 2, monkeypatch, count=count)
    plain = decode_logits(ckpt, False, 2, monkeypatch, count=count)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


def test_int8_fused_decode_is_bitwise_its_layer_by_layer_path(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = decode_logits(ckpt, True, 2, monkeypatch, "int8")
    plain = decode_logits(ckpt, False, 2, monkeypatch, "int8")
    bf16 = decode_logits(ckpt, True, 2, monkeypatch)
    for a, b, c in zip(fused, plain, bf16):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)  # the int8 weights really ran


@pytest.mark.parametrize("arch", ["olmo2", "phi3", "qwen3_moe"])
def test_models_it_cannot_take_build_none(arch: str, tmp_path: Path) -> None:
    """OLMo's norms (no input norm), Phi-3's partial rotary, MoE layers: the layer-by-layer path."""
    extra: dict[str, Any] = {}
    if arch == "phi3":  # heads 32 wide (Phi-3 takes hidden / heads); longrope's factors: one per rotated pair
        extra = dict(hidden_size=128, rope_scaling=dict(LONGROPE, short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    path = build_family(tmp_path, arch, head_dim=32, **extra)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", block_size=BLOCK, num_blocks=16))
    assert runner.model.fused_decode() is None


def test_float32_and_lora_build_none(ckpt: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(ckpt), dtype="float32", block_size=BLOCK, num_blocks=16))
    assert runner.model.fused_decode() is None
    lora = ModelRunner(
        EngineConfig(model=str(ckpt), dtype="bfloat16", block_size=BLOCK, num_blocks=16, enable_lora=True)
    )
    assert lora.model.fused_decode() is None


def test_a_decode_step_goes_fused_only_where_the_chooser_gave_our_kernel_its_rows() -> None:
    """The kernel chooser gave rows 5 and more to torch's GEMM (unpacked tiles): those steps go layer by layer."""
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    lin = KernelLinear(w, None, None, winners=("spindle", "spindle", "spindle-unpack", "spindle-unpack", "spindle"))
    fused = object.__new__(fused_decode.FusedDecode)
    fused.projections = [lin] * 4

    def meta(rows: int) -> AttnMetadata:
        return cast(AttnMetadata, SimpleNamespace(paged=None, decodes=[0] * rows, prefills=[]))

    assert fused.takes(meta(1), 1) and fused.takes(meta(4), 4)
    assert not fused.takes(meta(5), 5) and not fused.takes(meta(64), 64)


@pytest.mark.parametrize(("choice", "count"), [("ggml", 1), ("dot,ggml", 5), ("dot_tiles,ggml", 20)])
def test_fused_decode_over_gguf_blocks_is_bitwise_the_layer_by_layer_path(
    choice: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's Q4_1 blocks (Q8_0 embeddings) through the block kernel from C++, the file's blocks or (dot) the
    Q4_1 ones packed for bf16 dot products (dot_tiles: through AMX tiles): bitwise the Python path's."""
    if choice.startswith("dot_tiles") and not quant_dot.tiles_usable():
        pytest.skip("no AMX tiles on this CPU")
    monkeypatch.setenv("SPINDLE_KERNEL_CHOICE", choice)
    packed: list[int] = []
    pack = QuantLinear.pack
    monkeypatch.setattr(QuantLinear, "pack", lambda lin: (packed.append(lin.out_features), pack(lin))[1])
    path = smollm2_file()
    fused = decode_logits(path, True, 2, monkeypatch, count=count)
    plain = decode_logits(path, False, 2, monkeypatch, count=count)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    # the packed layout really held: every Q4_1 projection of both models (4 per layer, 30 layers) and the Q8_0 head
    assert len(packed) == (2 * (4 * 30 + 1) if choice.startswith("dot") else 0)


@pytest.mark.parametrize(("choice", "count"), [("ggml", 1), ("dot,ggml", 5)])
def test_fused_decode_over_gemma3_blocks_is_bitwise_the_layer_by_layer_path(
    choice: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma-3-270M's Q4_K_M file (Q4_K, Q5_0, Q6_K and Q8_0 blocks, 18 layers, local and global rope) in bf16:
    the fused layer over the file's blocks, or blocks packed for bf16 dot products, is bitwise the Python path."""
    monkeypatch.setenv("SPINDLE_KERNEL_CHOICE", choice)
    path = gemma3_file()
    fused = decode_logits(path, True, 2, monkeypatch, count=count)
    plain = decode_logits(path, False, 2, monkeypatch, count=count)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.skipif(not gemm_amx.available(), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("count", [1, 20])
def test_fused_decode_over_amx_tiles_is_bitwise_the_layer_by_layer_path(
    ckpt: Path, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPINDLE_KERNEL_CHOICE", "amx")
    fused = decode_logits(ckpt, True, 2, monkeypatch, count=count)
    plain = decode_logits(ckpt, False, 2, monkeypatch, count=count)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
