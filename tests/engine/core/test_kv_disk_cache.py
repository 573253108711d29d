"""EngineCore with --kv-disk-cache-size: a prompt's prefix comes back from disk after eviction from the pool and after
a restart, its output unchanged and its cached tokens counted; LoRA-keyed blocks never cross adapters."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from engine.core.engine_core import EngineCore
from engine.lora.peft_files import digest
from engine.messages import AddRequest, LoRARequest
from tests.helpers.engine import greedy, hf_greedy, make_core, run, tokens
from tests.helpers.lora import write_adapter

SIZE = 256 << 20


def disk_core(ckpt: Path, folder: Path, **kw: Any) -> EngineCore:
    return make_core(ckpt, kv_disk_cache_size=SIZE, kv_disk_cache_dir=str(folder), **kw)


def flush(core: EngineCore) -> None:
    assert core.block_manager.disk is not None
    core.block_manager.disk.store.flush()


def prompt(vocab: int, seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_prefix_back_from_disk_after_eviction_and_restart(qwen2_ckpt: Path, tmp_path: Path) -> None:
    core = disk_core(qwen2_ckpt, tmp_path, num_blocks=12, block_size=8)  # 96 token slots: one prompt at a time
    p = prompt(core.vocab_size, 7, 70)
    first = run(core, [("a", p, greedy(4), 0)])["a"]
    other = prompt(core.vocab_size, 8, 70)
    run(core, [("evict", other, greedy(4), 0)])  # takes every block: p's blocks leave the pool
    flush(core)
    assert core.block_manager.disk is not None and core.block_manager.disk.loaded == 0
    again = run(core, [("b", p, greedy(4), 0)])["b"]
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 64
    assert core.block_manager.disk.loaded >= 6  # the tail's blocks are evicted first: the head's two stayed
    ref = hf_greedy(qwen2_ckpt, p, 4)
    assert tokens(first) == tokens(again) == ref
    flush(core)
    restarted = disk_core(qwen2_ckpt, tmp_path, num_blocks=12, block_size=8)
    after = run(restarted, [("c", p, greedy(4), 0)])["c"]
    assert after[0].num_cached_tokens == 64 and tokens(after) == ref
    assert restarted.block_manager.disk is not None and restarted.block_manager.disk.loaded == 8


def test_no_disk_hits_under_other_settings(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """Another block size (another layout on disk) finds nothing; off (size 0) writes nothing."""
    core = disk_core(qwen2_ckpt, tmp_path, num_blocks=64, block_size=8)
    p = prompt(core.vocab_size, 9, 40)
    run(core, [("a", p, greedy(2), 0)])
    flush(core)
    written = len(list(tmp_path.iterdir()))
    assert written >= 4
    other = disk_core(qwen2_ckpt, tmp_path, num_blocks=64, block_size=16)
    assert run(other, [("b", p, greedy(2), 0)])["b"][0].num_cached_tokens == 0
    off = make_core(qwen2_ckpt, kv_disk_cache_dir=str(tmp_path / "off"))
    assert off.block_manager.disk is None


def test_lora_blocks_never_cross_adapters(qwen2_ckpt: Path, tmp_path: Path) -> None:
    ad = write_adapter(qwen2_ckpt, tmp_path / "ad", r=8, targets=["k_proj", "v_proj"], seed=4)
    lora = LoRARequest("ad", str(ad), digest(ad))
    kw: dict[str, Any] = dict(enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64, block_size=8)
    core = disk_core(qwen2_ckpt, tmp_path / "kv", **kw)
    p = prompt(core.vocab_size, 10, 50)
    base = run(core, [("base", p, greedy(3), 0)])["base"]
    flush(core)
    restarted = disk_core(qwen2_ckpt, tmp_path / "kv", **kw)  # the base model's blocks are on disk only
    restarted.add_request(AddRequest("lora", p, greedy(3), 0.0, lora=lora))
    outs = []
    while restarted.has_work:
        outs += restarted.step()
    assert outs[0].num_cached_tokens == 0  # the adapter's chain is rooted in its digest: no base block matches
    flush(restarted)
    again = disk_core(qwen2_ckpt, tmp_path / "kv", **kw)
    again.add_request(AddRequest("lora2", p, greedy(3), 0.0, lora=lora))
    outs2 = []
    while again.has_work:
        outs2 += again.step()
    assert outs2[0].num_cached_tokens == 48 and tokens(outs2) == tokens(outs)
    back = run(again, [("base2", p, greedy(3), 0)])["base2"]
    assert back[0].num_cached_tokens == 48 and tokens(back) == tokens(base)


def test_hybrid_models_keep_no_disk_store(tmp_path: Path) -> None:
    """A hybrid model's prefix hit also restores a recurrent-state snapshot the store does not hold: no store."""
    from tests.engine.models.hybrid_families import build_hybrid

    ckpt = build_hybrid(tmp_path / "hybrids", "lfm2")
    core = disk_core(ckpt, tmp_path / "kv", num_blocks=64, block_size=8)
    assert core.block_manager.disk is None
    run(core, [("a", prompt(core.vocab_size, 11, 40), greedy(2), 0)])
    assert not any((tmp_path / "kv").glob("*.kvb"))
