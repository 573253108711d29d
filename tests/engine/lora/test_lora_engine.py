"""EngineCore with LoRA adapters: each request's greedy tokens equal transformers + peft for its adapter, in
batches mixing the base and several adapters, under chunked prefill and preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.lora.peft_files import digest
from engine.messages import AddRequest, LoRARequest
from tests.helpers.engine import greedy, hf_greedy, make_core, tokens
from tests.helpers.lora import peft_greedy, write_adapter


@pytest.fixture(scope="module")
def adapters(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn8": write_adapter(qwen2_ckpt, root / "attn8", r=8, targets=["q_proj", "v_proj"], seed=1),
        "all16": write_adapter(
            qwen2_ckpt,
            root / "all16",
            r=16,
            alpha=32,
            seed=2,
            targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "mlp_rs": write_adapter(
            qwen2_ckpt,
            root / "mlp_rs",
            r=8,
            targets=["down_proj", "up_proj"],
            seed=3,
            use_rslora=True,
            rank_pattern={"down_proj": 4},
            alpha_pattern={"up_proj": 4},
        ),
    }


def lora(name: str, path: Path) -> LoRARequest:
    return LoRARequest(name, str(path), digest(path))


def run_mixed(core: object, reqs: list[tuple[str, list[int], int, LoRARequest | None]]) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {rid: [] for rid, *_ in reqs}
    for i, (rid, prompt, n, ad) in enumerate(reqs):
        core.add_request(AddRequest(rid, prompt, greedy(n), float(i), lora=ad))  # type: ignore[attr-defined]
    steps = 0
    while core.has_work:  # type: ignore[attr-defined]
        for o in core.step():  # type: ignore[attr-defined]
            assert o.error is None, o.error
            outs[o.request_id] += o.new_token_ids
        steps += 1
        assert steps < 5000
    return outs


REGIMES = {
    "together": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_blocks": 14, "block_size": 8},
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_mixed_batch_equals_peft(qwen2_ckpt: Path, adapters: dict[str, Path], regime: str) -> None:
    core = make_core(qwen2_ckpt, enable_lora=True, max_loras=3, max_lora_rank=16, **REGIMES[regime])
    rng = random.Random(7)
    names = [None, "attn8", "all16", "mlp_rs", None, "all16"]
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(5, 30))] for _ in names]
    reqs = [
        (f"r{i}", p, 6, None if a is None else lora(a, adapters[a])) for i, (p, a) in enumerate(zip(prompts, names))
    ]
    outs = run_mixed(core, reqs)
    for (rid, p, n, _), a in zip(reqs, names):
        want = hf_greedy(qwen2_ckpt, p, n) if a is None else peft_greedy(qwen2_ckpt, adapters[a], p, n)
        assert outs[rid] == want, (rid, a, regime)
    assert len({tuple(outs[f"r{i}"]) for i in (0, 1, 2, 3)}) == 4  # the adapters do change the output
    if regime == "preemption":
        assert core.scheduler.num_preemptions > 0


def test_adapters_beyond_max_loras_wait_for_a_slot(qwen2_ckpt: Path, adapters: dict[str, Path]) -> None:
    core = make_core(qwen2_ckpt, enable_lora=True, max_loras=1, max_cpu_loras=1)
    p = [5, 6, 7, 8, 9]
    reqs = [(f"r{i}", p, 4, lora(a, adapters[a])) for i, a in enumerate(["attn8", "all16", "attn8", "mlp_rs"])]
    running_max = 0
    for i, (rid, prompt, n, ad) in enumerate(reqs):
        core.add_request(AddRequest(rid, prompt, greedy(n), float(i), lora=ad))
    outs: dict[str, list[int]] = {r[0]: [] for r in reqs}
    while core.has_work:
        for o in core.step():
            outs[o.request_id] += o.new_token_ids
        running_max = max(running_max, len(core.scheduler.running_adapters()))
    assert running_max == 1
    for rid, prompt, n, ad in reqs:
        assert ad is not None
        assert outs[rid] == peft_greedy(qwen2_ckpt, Path(ad.path), prompt, n), rid
    assert core.runner.lora is not None and core.runner.lora.loads >= 3  # evicted on CPU, reloaded on demand


def test_prefix_cache_keyed_by_adapter(qwen2_ckpt: Path, adapters: dict[str, Path]) -> None:
    core = make_core(qwen2_ckpt, enable_lora=True, max_loras=2, block_size=4)
    p = list(range(40, 60))
    first = run_mixed(core, [("a", p, 3, lora("x", adapters["attn8"]))])
    hits = core.block_manager.prefix_cache_hits
    other = run_mixed(core, [("b", p, 3, lora("x", adapters["all16"]))])  # same name, other weights
    assert core.block_manager.prefix_cache_hits == hits  # no KV from the other adapter
    assert other["b"] == peft_greedy(qwen2_ckpt, adapters["all16"], p, 3)
    again = run_mixed(core, [("c", p, 3, lora("y", adapters["attn8"]))])  # same content, any name
    assert core.block_manager.prefix_cache_hits > hits and again["c"] == first["a"]
    base = run_mixed(core, [("d", p, 3, None)])
    assert base["d"] == hf_greedy(qwen2_ckpt, p, 3)


def test_bad_requests_are_refused(qwen2_ckpt: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    plain = make_core(qwen2_ckpt)
    plain.add_request(AddRequest("a", [1, 2], greedy(2), 0.0, lora=lora("x", adapters["attn8"])))
    (out,) = plain.step()
    assert out.finish_reason == "error" and "--enable-lora" in (out.error or "")
    core = make_core(qwen2_ckpt, enable_lora=True, max_lora_rank=8)
    core.add_request(AddRequest("b", [1, 2], greedy(2), 0.0, lora=lora("x", adapters["all16"])))
    core.add_request(AddRequest("c", [1, 2], greedy(2), 0.0, lora=LoRARequest("y", str(adapters["attn8"]), "0" * 64)))
    outs = {o.request_id: o for o in core.step()}
    assert "above --max-lora-rank 8" in (outs["b"].error or "")
    assert "changed since" in (outs["c"].error or "")
    assert tokens([o for o in outs.values() if o.new_token_ids]) == []
