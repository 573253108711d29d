"""How far weight-only int8 (`--quantization int8`) moves a model from its bfloat16 self.

    python -m bench.quant_agreement --model DIR [--prompts 64] [--tokens 64] [--prompt-len 32] [--threads 2]
                                    [--pair bf16-int8 | fp32-bf16]

Greedy: both engines continue the same random prompts for --tokens tokens; reported are the share of
tokens equal at the same position, the mean length of the common prefix, and the share of prompts whose
whole continuation is equal. KL: teacher-forced along the bfloat16 continuation, KL(p_bf16 || p_int8) of
the next-token distributions at every generated position (nats), mean and 99th percentile.
--pair fp32-bf16 measures the same between float32 and bfloat16 weights: the scale of bfloat16's own rounding.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.execution.model_runner import ModelRunner
from engine.messages import AddRequest, SamplingParams
from engine.types.sequence import ScheduledSeq, Sequence

PAIRS = {"bf16-int8": (("bfloat16", None), ("bfloat16", "int8")), "fp32-bf16": (("float32", None), ("bfloat16", None))}


def engine(model: str, dtype: str, quantization: str | None, batch: int) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=batch,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
        )
    )


def greedy(core: EngineCore, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(str(i), p, params, 0.0))
    out: list[list[int]] = [[] for _ in prompts]
    while core.has_work:
        for o in core.step():
            out[int(o.request_id)] += o.new_token_ids
    return out


def teacher_forced_logits(runner: ModelRunner, tokens: list[int], first: int) -> torch.Tensor:
    """float32 logits [len(tokens) - first, vocab]: the distributions of tokens[first:], in one prefill."""
    seq = Sequence.new("tf", tokens, SamplingParams(max_tokens=1, prompt_logprobs=0), 0.0)
    bs = runner.block_size
    seq.block_table = list(range(-(-len(tokens) // bs)))
    out = runner.execute([ScheduledSeq(seq, len(tokens))])
    return out.prompt_logits[0][first - 1 : -1].clone()


def kl_per_position(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]], continuations: list[list[int]]
) -> torch.Tensor:
    kls = []
    for p, c in zip(prompts, continuations):
        full = p + c
        ref, got = (teacher_forced_logits(r, full, len(p)) for r in runners)
        logp, logq = ref.log_softmax(-1), got.log_softmax(-1)
        kls.append((logp.exp() * (logp - logq)).sum(-1))
    return torch.cat(kls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair", choices=sorted(PAIRS), default="bf16-int8")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    (d0, q0), (d1, q1) = PAIRS[a.pair]
    cores = (engine(a.model, d0, q0, a.prompts), engine(a.model, d1, q1, a.prompts))
    rng = random.Random(a.seed)
    # token ids the tokenizer defines, past the first 1000 (bytes and common merges) to vary the text
    prompts = [[rng.randrange(1000, cores[0].vocab_size) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    ref, got = (greedy(c, prompts, a.tokens) for c in cores)
    same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
    prefixes = [next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), len(r)) for r, g in zip(ref, got)]
    whole = sum(r == g for r, g in zip(ref, got))
    with torch.inference_mode():
        kl = kl_per_position((cores[0].runner, cores[1].runner), prompts, ref)
    names = [f"{d}{'+' + q if q else ''}" for d, q in PAIRS[a.pair]]
    print(f"{a.model}: {a.prompts} prompts x {a.tokens} tokens, greedy, {names[0]} vs {names[1]}")
    print(f"  tokens equal at the same position: {same / (a.prompts * a.tokens):.3f}")
    print(
        f"  mean common prefix: {sum(prefixes) / len(prefixes):.1f} of {a.tokens} tokens; "
        f"whole continuation equal: {whole}/{a.prompts}"
    )
    print(
        f"  KL({names[0]} || {names[1]}) per next-token distribution: mean {kl.mean():.4f} nats, "
        f"p99 {kl.quantile(0.99):.4f}, max {kl.max():.4f} ({kl.numel()} positions)"
    )
    print(f"  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
