"""Tensor parallel (engine/distributed/): TP=2 gives TP=1's greedy tokens and logprobs, and transformers' tokens.

Rank 0 runs in this process (EngineCore), rank 1 is its child process; gloo over loopback. Checkpoints are
the session's tiny ones: Qwen2-shaped with 2 KV heads (one per rank) and a Llama-shaped one with a single
KV head (replicated on both ranks).
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.distributed.group import JoinError
from engine.distributed.sharding import Shard
from engine.messages import AddRequest, RequestOutput, SamplingParams
from engine.models.loader import read_config
from engine.models.registry import parse_config
from engine.models.weights import ModelLoadError
from tests.helpers.engine import hf_greedy, make_core, tokens
from tests.helpers.engine import run as run_core

TINY_KV1 = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
    seed=4321,
)
REGIMES = {
    "batch": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),  # the 33-token prompt runs in three chunks
    "preemption": dict(num_blocks=12, block_size=8),
}


@pytest.fixture(scope="module")
def llama_kv1_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from demo.checkpoints import write_random_checkpoint

    return write_random_checkpoint(
        tmp_path_factory.mktemp("tp") / "llama-kv1",
        "llama",
        **TINY_KV1,  # type: ignore[arg-type]
        vocab_size=32_000,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tp_core(ckpt: Path, tp: int, **kw: object) -> EngineCore:
    return make_core(ckpt, tensor_parallel_size=tp, distributed_timeout=30, **kw)


def run(core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams, int]]) -> dict[str, list[RequestOutput]]:
    """tests/engine/core/test_engine_core.py's `run`, then the core's ranks are stopped."""
    try:
        return run_core(core, reqs)
    finally:
        close = getattr(core.runner, "close", None)
        if close is not None:
            close()


def prompts(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["qwen2", "llama_kv1"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_tp2_equals_tp1_and_transformers(request: pytest.FixtureRequest, arch: str, regime: str) -> None:
    ckpt: Path = request.getfixturevalue(f"{arch}_ckpt")
    ps = prompts(32_000, seed=len(arch) + len(regime), lengths=[3, 33, 17, 9])
    n = 10
    reqs = [
        (
            f"r{i}",
            p,
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            2 * i if regime == "chunked_prefill" else 0,
        )
        for i, p in enumerate(ps)
    ]
    core = tp_core(ckpt, 2, **REGIMES[regime])
    tp2 = run(core, reqs)
    if regime == "preemption":
        assert core.stats().num_preemptions > 0, "the tiny cache should have forced preemption"
    tp1 = run(tp_core(ckpt, 1, **REGIMES[regime]), reqs)
    for rid, _, _, _ in reqs:
        assert tokens(tp2[rid]) == tokens(tp1[rid]), (rid, regime)
    assert tokens(tp2["r1"]) == hf_greedy(ckpt, ps[1], n)  # the chunked / preempted long prompt


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_logprobs_tp2_agree_with_tp1(qwen2_ckpt: Path, dtype: str, tol: float) -> None:
    p = prompts(32_000, seed=11, lengths=[24])[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    reqs = [("lp", p, params, 0)]
    tp2 = run(tp_core(qwen2_ckpt, 2, dtype=dtype, max_num_batched_tokens=16), reqs)["lp"]
    tp1 = run(tp_core(qwen2_ckpt, 1, dtype=dtype, max_num_batched_tokens=16), reqs)["lp"]
    assert tokens(tp2) == tokens(tp1)  # greedy equality: short output, in bfloat16 too
    plp2, plp1 = tp2[0].prompt_logprobs, tp1[0].prompt_logprobs
    assert plp2 is not None and plp1 is not None and len(plp2) == len(plp1) == len(p)
    for a, b in zip(plp2[1:], plp1[1:]):
        assert a is not None and b is not None and a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=tol)
    for a_out, b_out in zip(tp2, tp1):
        assert a_out.logprobs is not None and b_out.logprobs is not None
        a, b = a_out.logprobs[0], b_out.logprobs[0]
        # the same value at every rank; below the first, the id may differ where candidates tie within rounding
        # (bfloat16's all-reduce rounds differently from one rank's sum)
        assert a.top_ids[0] == b.top_ids[0] and a.top_logprobs == pytest.approx(b.top_logprobs, abs=tol)
        assert a.top_ids == b.top_ids or dtype == "bfloat16"
        assert a.logprob == pytest.approx(b.logprob, abs=tol)


def test_two_nodes_on_one_machine(qwen2_ckpt: Path) -> None:
    """Node 1 runs headless (no server); node 0's engine core is rank 0."""
    port = free_port()
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.distributed.rank_worker",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--timeout",
            "60",
        ]
    )
    try:
        reqs = [("a", prompts(32_000, 3, [12])[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), 0)]
        two_nodes = run(tp_core(qwen2_ckpt, 2, nnodes=2, master_port=port), reqs)
        assert node1.wait(20) == 0  # told to stop by rank 0
        assert tokens(two_nodes["a"]) == tokens(run(tp_core(qwen2_ckpt, 1), reqs)["a"])
    finally:
        node1.kill()
        node1.wait()


def test_a_node_that_cannot_join_names_itself_and_the_address() -> None:
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.distributed.rank_worker",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "node1 could not join the group at 127.0.0.1:" + str(port) in out.stderr
    assert time.monotonic() - t0 < 30


def test_rank0_fails_startup_when_a_node_never_joins(qwen2_ckpt: Path) -> None:
    port = free_port()
    with pytest.raises(JoinError, match=rf"rank 0: the group of 2 ranks at 127\.0\.0\.1:{port} did not form"):
        EngineCore(
            EngineConfig(
                model=str(qwen2_ckpt),
                num_blocks=16,
                tensor_parallel_size=2,
                nnodes=2,
                master_port=port,
                distributed_timeout=2,
            )
        )


def test_shards_hold_only_their_slices(qwen2_ckpt: Path, llama_kv1_ckpt: Path) -> None:
    from safetensors import safe_open

    for ckpt in (qwen2_ckpt, llama_kv1_ckpt):
        args = parse_config(read_config(ckpt))
        with safe_open(next(ckpt.glob("*.safetensors")), framework="pt") as f:
            full = {name: f.get_tensor(name) for name in f.keys()}
        for rank in range(2):
            get = Shard(rank, 2).weights(ckpt, args, torch.float32, torch.device("cpu"))
            assert get.progress.quiet == (rank != 0)  # the load is logged once, by rank 0
            q = get("model.layers.0.self_attn.q_proj.weight")
            assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"].chunk(2)[rank])
            k = get("model.layers.0.self_attn.k_proj.weight")
            kv = full["model.layers.0.self_attn.k_proj.weight"]
            # two KV heads: one each; one KV head: both ranks hold it
            assert torch.equal(k, kv.chunk(2)[rank] if args.num_kv_heads == 2 else kv)
            down = get("model.layers.1.mlp.down_proj.weight")
            assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"].chunk(2, dim=1)[rank])
            embed = get("model.embed_tokens.weight")
            assert embed.shape[0] == -(-args.vocab_size // 2)


def test_unsplittable_model_is_refused(qwen2_ckpt: Path) -> None:
    args = parse_config(read_config(qwen2_ckpt))
    with pytest.raises(ModelLoadError, match="must divide the model's attention heads"):
        Shard(0, 3).local_args(args)
    assert Shard(1, 4).kv_heads(args) == (0, 1)  # 2 KV heads over 4 ranks: ranks 0, 1 share head 0


@pytest.mark.parametrize(
    "bad,why",
    [
        (dict(tensor_parallel_size=0), "tensor-parallel-size"),
        (dict(tensor_parallel_size=2, nnodes=3), "nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node-rank"),
        (dict(tensor_parallel_size=2, nnodes=2), "master-port"),
    ],
)
def test_config_is_validated(bad: dict[str, int], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        EngineConfig(model="x", **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_pooling_runner_tp2_equals_tp1(qwen2_ckpt: Path, pooling_type: str) -> None:
    ps = prompts(32_000, seed=5, lengths=[7, 30])
    reqs = [(f"e{i}", p, SamplingParams(max_tokens=1), 0) for i, p in enumerate(ps)]
    kw = dict(runner="pooling", pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=16)
    tp2 = run(tp_core(qwen2_ckpt, 2, **kw), reqs)
    tp1 = run(tp_core(qwen2_ckpt, 1, **kw), reqs)
    for rid, *_ in reqs:
        a, b = tp2[rid][-1].pooled, tp1[rid][-1].pooled
        assert a is not None and b is not None and a.shape == b.shape
        torch.testing.assert_close(
            torch.frombuffer(bytearray(a.data), dtype=torch.float32),
            torch.frombuffer(bytearray(b.data), dtype=torch.float32),
            atol=1e-5,
            rtol=0,
        )


def test_prefix_cache_stop_tokens_aborts_and_grammars_under_tp2(qwen2_ckpt: Path) -> None:
    """The engine-level features on top of the split model: the same outputs as TP=1 for a shared prefix served
    from the cache, a stop token, an abort mid-decode and a constrained request; the cache hits under TP too."""
    from engine.messages import StructuredOutputs

    base = prompts(32_000, seed=5, lengths=[40])[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def scenario(tp: int) -> tuple[dict[str, list[int]], int, list[str | None]]:
        core = tp_core(qwen2_ckpt, tp, block_size=8)
        outs: dict[str, list[RequestOutput]] = {}
        try:
            core.add_request(AddRequest("first", base, greedy, arrival_time=0.0))
            for _ in range(30):
                for o in core.step():
                    outs.setdefault(o.request_id, []).append(o)
                if not core.has_work:
                    break
            first = tokens(outs["first"])
            stop = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[first[2]])
            choice = SamplingParams(
                max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputs("choice", '["yes", "no"]')
            )
            core.add_request(AddRequest("cached", base + [7, 8], greedy, arrival_time=1.0))
            core.add_request(AddRequest("stop", base, stop, arrival_time=1.0))
            core.add_request(
                AddRequest(
                    "aborted",
                    base[:20],
                    SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                    arrival_time=1.0,
                )
            )
            core.add_request(AddRequest("choice", base[:9], choice, arrival_time=1.0))
            for step in range(200):
                if step == 3:
                    core.abort(["aborted"])
                for o in core.step():
                    outs.setdefault(o.request_id, []).append(o)
                if not core.has_work:
                    break
            hits = core.stats().prefix_cache_hits
        finally:
            close = getattr(core.runner, "close", None)
            if close is not None:
                close()
        finishes = [outs[r][-1].finish_reason for r in ("cached", "stop", "aborted", "choice")]
        return {r: tokens(o) for r, o in outs.items()}, hits, finishes

    tp2, hits2, fin2 = scenario(2)
    tp1, hits1, fin1 = scenario(1)
    assert tp2 == tp1 and fin2 == fin1 == ["length", "stop", "abort", "stop"]
    assert hits2 == hits1 > 0
    first = tp2["first"]
    assert tp2["stop"] == first[: first.index(first[2]) + 1] and len(tp2["aborted"]) < 50  # ends at the stop token
