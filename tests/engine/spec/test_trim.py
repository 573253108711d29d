"""The blocks that held only rejected draft positions go back to the pool; accepted tokens' blocks stay cached."""

from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.messages import SamplingParams
from engine.types.sequence import Sequence


def test_rejected_positions_release_their_blocks() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_manager=bm)
    seq = Sequence.new("s", list(range(7)), SamplingParams(max_tokens=20), 0.0)
    sched.add(seq)
    [s] = sched.schedule()
    seq.token_ids.append(100)  # the prefill's sampled token
    sched.update([s])
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2
    seq.draft = [101, 102, 103, 104, 105, 106]
    [s] = sched.schedule()
    assert (s.num_new_tokens, s.num_draft) == (7, 6) and len(seq.block_table) == 4  # positions 7..13
    seq.token_ids += [101, 102]  # one draft token accepted, then a different token drawn
    s.num_new_tokens = 2
    sched.update([s])
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3 and bm.num_used_blocks == 3
    assert bm.num_cached_blocks == 2  # blocks 0..7 hold accepted tokens only; the third is not full
