"""The runner's logits over the paged KV cache equal transformers' on the same checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.execution.model_runner import ModelRunner
from engine.layers.linear import Int8Linear, KernelLinear
from engine.messages import SamplingParams
from engine.models.weights import ModelLoadError
from engine.types.sequence import ScheduledSeq, Sequence
from tests.helpers.engine import hf_greedy, hf_model

ARCHS = ["qwen2", "llama", "mistral"]
BLOCK = 4
ATOL = 1e-4


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: transformers' logits at every position, no cache."""
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([tokens])).logits[0].float()
    return logits


class Blocks:
    """The scheduler's part in miniature: hands out shuffled block ids so tables are not contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK < num_tokens:
            seq.block_table.append(self.free.pop())


def new_seq(rid: str, prompt: list[int], prompt_logprobs: int | None = None) -> Sequence:
    return Sequence.new(rid, prompt, SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs), 0.0)


def step(runner: ModelRunner, blocks: Blocks, work: list[tuple[Sequence, int]]):  # type: ignore[no-untyped-def]
    """Run one step, then advance num_computed_tokens as the scheduler would."""
    batch = []
    for seq, n in work:
        blocks.grow(seq, seq.num_computed_tokens + n)
        batch.append(ScheduledSeq(seq, n))
    out = runner.execute(batch)
    for seq, n in work:
        seq.num_computed_tokens += n
    return out


def make_runner(path: Path, **kw: Any) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), block_size=BLOCK, num_blocks=kw.pop("num_blocks", 64), **kw))


def prompt(n: int, seed: int, vocab: int = 32_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("any_ckpt", ARCHS, indirect=True)
def test_prefill_matches_transformers(any_ckpt: Path) -> None:
    runner = make_runner(any_ckpt)
    hf = hf_model(any_ckpt)
    tokens = prompt(21, seed=1)
    seq = new_seq("a", tokens, prompt_logprobs=1)
    out = step(runner, Blocks(64), [(seq, len(tokens))])
    ref = hf_logits(hf, tokens)
    assert out.logits.shape == (1, runner.vocab_size) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits[0], ref[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.prompt_logits[0], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("any_ckpt", ARCHS, indirect=True)
def test_chunked_prefill_matches_transformers(any_ckpt: Path) -> None:
    runner = make_runner(any_ckpt)
    hf = hf_model(any_ckpt)
    tokens = prompt(23, seed=2)
    ref = hf_logits(hf, tokens)
    seq, blocks, done = new_seq("a", tokens, prompt_logprobs=0), Blocks(64, seed=3), 0
    for n in (7, 1, 9, 2, 4):  # a one-token chunk takes the decode path
        out = step(runner, blocks, [(seq, n)])
        torch.testing.assert_close(out.prompt_logits[0], ref[done : done + n], atol=ATOL, rtol=0)
        done += n
        assert out.logits.shape[0] == (1 if done == len(tokens) else 0)
    torch.testing.assert_close(out.logits[0], ref[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("any_ckpt", ARCHS, indirect=True)
def test_batched_decode_with_shared_prefix(any_ckpt: Path) -> None:
    """Sequences of different lengths decode in one batch; B reuses A's first two blocks as its prefix."""
    runner = make_runner(any_ckpt)
    hf = hf_model(any_ckpt)
    blocks = Blocks(64, seed=4)
    a = new_seq("a", prompt(13, seed=5))
    c = new_seq("c", prompt(5, seed=6))
    out = step(runner, blocks, [(a, 13), (c, 5)])
    # B's prompt starts with A's first 8 tokens (two full blocks): the prefix cache hands it those blocks.
    b = new_seq("b", a.token_ids[:8] + prompt(6, seed=7))
    b.block_table = a.block_table[:2]
    b.num_computed_tokens = 8
    seqs = [a, c]
    logits = dict(zip(["a", "c"], out.logits))
    for i in range(5):
        for s in seqs:  # greedy next token, so decode follows the model
            s.token_ids.append(int(logits[s.request_id].argmax()))
        work = [(s, 1) for s in seqs]
        if i == 1:  # B's prefill rides in the same step as the decodes
            work.insert(1, (b, 6))
            seqs.insert(1, b)
        out = step(runner, blocks, work)
        logits = {s.request_id: row for (s, _), row in zip(work, out.logits)}
        for s in seqs:
            torch.testing.assert_close(logits[s.request_id], hf_logits(hf, s.token_ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("any_ckpt", ARCHS, indirect=True)
def test_greedy_loop_matches_generate(any_ckpt: Path) -> None:
    runner = make_runner(any_ckpt)
    tokens = prompt(9, seed=8)
    seq, blocks = new_seq("a", tokens), Blocks(64, seed=9)
    out = step(runner, blocks, [(seq, len(tokens))])
    for _ in range(16):
        seq.token_ids.append(int(out.logits[0].argmax()))
        out = step(runner, blocks, [(seq, 1)])
    assert seq.output_token_ids == hf_greedy(any_ckpt, tokens, 16)


def test_kv_cache_sized_from_memory(qwen2_ckpt: Path) -> None:
    # K and V x 2 layers x block 16 x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block.
    runner = ModelRunner(EngineConfig(model=str(qwen2_ckpt), block_size=16, kv_cache_memory=1 << 20))
    assert runner.num_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)
    max_pos = json.loads((qwen2_ckpt / "config.json").read_text())["max_position_embeddings"]
    assert runner.max_model_len == max_pos and runner.model_dtype == "float32"
    assert runner.eos_token_ids == [151645, 151643]
    assert runner.generation_defaults["temperature"] == 0.7


def test_max_model_len_over_the_model_limit_is_refused(qwen2_ckpt: Path) -> None:
    max_pos = json.loads((qwen2_ckpt / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ModelLoadError, match=f"max_position_embeddings {max_pos}"):
        ModelRunner(EngineConfig(model=str(qwen2_ckpt), max_model_len=max_pos + 1, num_blocks=8))
    assert ModelRunner(EngineConfig(model=str(qwen2_ckpt), max_model_len=100, num_blocks=8)).max_model_len == 100


def test_bfloat16_runs_close_to_transformers(llama_ckpt: Path) -> None:
    runner = make_runner(llama_ckpt, dtype="bfloat16")
    assert runner.model_dtype == "bfloat16" and runner.kv_cache.dtype == torch.bfloat16
    hf = hf_model(llama_ckpt)
    tokens = prompt(12, seed=10)
    seq, blocks = new_seq("a", tokens), Blocks(64, seed=11)
    step(runner, blocks, [(seq, 11)])
    out = step(runner, blocks, [(seq, 1)])  # the decode path, with its bias mask in bfloat16
    ref = hf_logits(hf, tokens)[-1]
    assert out.logits.dtype == torch.float32
    # bfloat16 keeps ~3 significant digits: close to the float32 reference, and the same top token.
    torch.testing.assert_close(out.logits[0], ref, atol=0.25, rtol=0.05)
    assert int(out.logits[0].argmax()) == int(ref.argmax())


def test_a_padded_bf16_heads_logits_come_in_the_reused_buffer(tmp_path: Path) -> None:
    from demo.checkpoints import write_random_checkpoint
    from tests.conftest import TINY

    # Qwen2's tokenizer has 151,665 tokens; a head of 151,936 rows (as Qwen2.5's) pads past them
    path = write_random_checkpoint(
        tmp_path / "padded", "qwen2", **TINY, vocab_size=151_936, tie_word_embeddings=True, rope_theta=1_000_000.0
    )
    runner = make_runner(path, dtype="bfloat16")  # its head always writes into the caller's buffer
    assert runner.model.head.vocab == 151_936 > runner.vocab_size
    blocks = Blocks(64, seed=14)
    seqs = [new_seq(str(i), prompt(6, seed=15 + i)) for i in range(2)]
    step(runner, blocks, [(s, 5) for s in seqs])
    first = step(runner, blocks, [(s, 1) for s in seqs]).logits  # the prompts' last rows
    for s in seqs:
        s.token_ids.append(7)
    second = step(runner, blocks, [(s, 1) for s in seqs]).logits
    # one buffer, the head's width (the sampler trims it): no fresh 150k-wide rows each step
    assert first.data_ptr() == second.data_ptr() and second.shape == (2, 151_936)
    hf = hf_model(path)
    ref = hf_logits(hf, seqs[0].token_ids)[-1]
    assert int(second[0, : runner.vocab_size].argmax()) == int(ref[: runner.vocab_size].argmax())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_run_close_to_transformers(llama_ckpt: Path, dtype: str) -> None:
    """--quantization int8: prefill and decode logits within the int8 grid's error of the float32 model."""
    runner = make_runner(llama_ckpt, dtype=dtype, quantization="int8")

    def int8(lin: object) -> bool:  # ATen's int8 kernel, or engine/cpu_kernels' gemm on int8 weights (bf16 only)
        return isinstance(lin, Int8Linear) or (isinstance(lin, KernelLinear) and lin.packed.scale is not None)

    assert all(
        int8(lin) for layer in runner.model.layers for lin in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
    )
    hf = hf_model(llama_ckpt)
    tokens = prompt(12, seed=13)
    seq, blocks = new_seq("a", tokens, prompt_logprobs=0), Blocks(64, seed=14)
    prefill = step(runner, blocks, [(seq, 11)]).prompt_logits[0]
    out = step(runner, blocks, [(seq, 1)])
    ref = hf_logits(hf, tokens)
    for got, want in ((prefill, ref[:11]), (out.logits[0], ref[-1])):
        err = float((got - want).abs().max())
        assert 1e-4 < err < 0.05 * float(want.abs().max()), err  # quantized, but close
    assert int(out.logits[0].argmax()) == int(ref[-1].argmax())


@pytest.mark.parametrize("dtype, threads", [("float32", 1), ("bfloat16", 1), ("float32", 2)])
def test_wide_decode_batch_matches_transformers(qwen2_ckpt: Path, dtype: str, threads: int) -> None:
    """17 sequences decode in one step: the LM head's chunked path (>= 16 rows, several column chunks of
    a 151k vocabulary; with 2 threads, shared by a helper thread), against transformers in float32."""
    torch.set_num_threads(threads)  # the runner sizes its LM head workers from this
    runner = make_runner(qwen2_ckpt, dtype=dtype, num_blocks=128)
    torch.set_num_threads(1)
    assert runner.head_workers == threads
    hf = hf_model(qwen2_ckpt)
    blocks = Blocks(128, seed=20)
    seqs = [new_seq(f"s{i}", prompt(3 + i % 6, seed=30 + i, vocab=151_646)) for i in range(17)]
    step(runner, blocks, [(s, s.num_tokens) for s in seqs])
    for i, s in enumerate(seqs):
        s.token_ids.append(prompt(1, seed=60 + i, vocab=151_646)[0])
    out = step(runner, blocks, [(s, 1) for s in seqs])
    assert out.logits.shape == (17, 151_646) and out.logits.dtype == torch.float32
    for s, row in zip(seqs, out.logits):
        ref = hf_logits(hf, s.token_ids)[-1]
        if dtype == "float32":
            torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
        else:  # bfloat16 keeps ~3 significant digits; its top token is a float32 top token up to that
            torch.testing.assert_close(row, ref, atol=0.25, rtol=0.05)
            assert float(ref[int(row.argmax())]) >= float(ref.max()) - 0.05
    alone = seqs[0]  # one row: with 2 threads it still goes through the shared chunks
    alone.token_ids.append(7)
    out = step(runner, blocks, [(alone, 1)])
    torch.testing.assert_close(
        out.logits[0],
        hf_logits(hf, alone.token_ids)[-1],
        atol=ATOL if dtype == "float32" else 0.25,
        rtol=0 if dtype == "float32" else 0.05,
    )


def fixed_schedule(runner: ModelRunner) -> list[torch.Tensor]:
    """Chunked prefill from mid-block, a mixed step, two decode-only steps; fixed tokens, so any runner
    (or process) produces logits comparable with transformers' on A_FULL / B_FULL."""
    blocks = Blocks(64, seed=12)
    a, b = new_seq("a", A_FULL[:17], prompt_logprobs=0), new_seq("b", B_FULL[:6])
    outs = [step(runner, blocks, [(a, 7)]).prompt_logits[0], step(runner, blocks, [(a, 10)]).prompt_logits[0]]
    a.token_ids.append(A_FULL[17])
    outs.append(step(runner, blocks, [(a, 1), (b, 6)]).logits.clone())  # the next step reuses the buffer
    for i in range(2):
        a.token_ids.append(A_FULL[18 + i])
        b.token_ids.append(B_FULL[6 + i])
        outs.append(step(runner, blocks, [(a, 1), (b, 1)]).logits.clone())
    return outs


A_FULL, B_FULL = prompt(20, seed=13), prompt(8, seed=14)


def kernel_path_child(ckpt: str, out: str) -> None:
    """Entry point of the subprocess: TRITON_INTERPRET must be set before anything imports triton."""
    torch.set_num_threads(1)
    runner = ModelRunner(EngineConfig(model=ckpt, block_size=BLOCK, num_blocks=64), use_triton=True)
    assert runner.use_triton
    torch.save(fixed_schedule(runner), out)


@pytest.mark.parametrize("any_ckpt", ["mistral"], indirect=True)  # its sliding window runs in-kernel
def test_triton_kernel_path_matches_transformers(any_ckpt: Path, tmp_path: Path) -> None:
    """The GPU path (engine.triton_kernels through TritonOps), run on CPU by Triton's interpreter in a fresh process
    (TRITON_INTERPRET is read when triton is imported, which this process has done long ago)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    out = tmp_path / "logits.pt"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_model_runner as t; "
        f"t.kernel_path_child({str(any_ckpt)!r}, {str(out)!r})"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[3],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    hf = hf_model(any_ckpt)
    ref_a, ref_b = hf_logits(hf, A_FULL), hf_logits(hf, B_FULL)
    expected = [ref_a[:7], ref_a[7:17]] + [torch.stack([ref_a[17 + i], ref_b[5 + i]]) for i in range(3)]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
