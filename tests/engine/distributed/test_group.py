"""TPGroup's collectives between this process (rank 0) and a child (rank 1): plans of any size, half-precision
sums through float32 (gloo has none), the logits gather."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from engine.config import EngineConfig
from engine.distributed.group import PLAN_BYTES, TPGroup
from engine.distributed.plan import GENERATE, TICK, PlannedSeq, StepPlan

RANK1 = textwrap.dedent("""
    import datetime, sys, torch
    from torch._C._distributed_c10d import TCPStore
    from engine.config import EngineConfig
    from engine.distributed.group import TPGroup
    store = TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=datetime.timedelta(seconds=20))
    group = TPGroup(store, 1, EngineConfig(model="x", tensor_parallel_size=2, distributed_timeout=20),
                    torch.device("cpu"))
    for _ in range(2):  # echo two plans back through the store
        store.set(f"plan{_}", repr(group.recv_plan()))
    for dtype in (torch.float32, torch.bfloat16):
        group.all_reduce(torch.full((3, 4), 2.5, dtype=dtype))
        assert group.gather_columns(torch.ones(2, 3)) is None
    group.close()
""")


@pytest.fixture(scope="module")
def pair() -> tuple[TPGroup, TCPStore, subprocess.Popen[bytes]]:
    store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
    child = subprocess.Popen([sys.executable, "-c", RANK1, str(store.port)])
    group = TPGroup(
        store, 0, EngineConfig(model="x", tensor_parallel_size=2, distributed_timeout=20), torch.device("cpu")
    )
    return group, store, child


def test_collectives_with_a_child_rank(pair: tuple[TPGroup, TCPStore, subprocess.Popen[bytes]]) -> None:
    group, store, child = pair
    tokens = 40_000  # past PLAN_BYTES: a second broadcast carries the rest
    big = StepPlan(GENERATE, [PlannedSeq(list(range(tokens)), 7, list(range(tokens // 16 + 1)), True, False)])
    assert len(repr(big)) > PLAN_BYTES
    group.send_plan(StepPlan(TICK))
    group.send_plan(big)
    assert store.get("plan0").decode() == repr(StepPlan(TICK))
    assert store.get("plan1").decode() == repr(big)
    for dtype in (torch.float32, torch.bfloat16):
        summed = group.all_reduce(torch.full((3, 4), 1.5, dtype=dtype))
        assert summed.dtype == dtype and torch.equal(summed, torch.full((3, 4), 4.0, dtype=dtype))
        cols = group.gather_columns(torch.zeros(2, 3))
        assert cols is not None and torch.equal(cols, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], dim=1))
    assert child.wait(20) == 0
    group.close()
