"""server/engine_pool.py: the engine-choice policy, and the pool over fake engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.client.process_client import EngineDeadError
from engine.messages import AddRequest, EngineStats, SamplingParams, StepOutputs
from server.config import ServerConfig
from server.engine_pool import EngineChooser, EnginePool, open_engine_pool, open_engines, prefix_hashes, sum_stats
from tests.server.fake_engine import FakeEngineClient

BS = 16
SYS_A = list(range(1000, 1000 + 4 * BS))  # four full blocks
SYS_B = list(range(2000, 2000 + 4 * BS))


def stats(running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(running, waiting, 0, 100, 0, 0, 0)


# ---- the policy ---------------------------------------------------------------------------------


def test_prefix_hashes_cover_full_blocks_before_the_last_token() -> None:
    assert prefix_hashes(list(range(BS)), BS, 32) == []  # the last token is always computed
    assert len(prefix_hashes(list(range(BS + 1)), BS, 32)) == 1
    assert len(prefix_hashes(list(range(100 * BS)), BS, 32)) == 32
    a, b = prefix_hashes(SYS_A + [1], BS, 8), prefix_hashes(SYS_A[:BS] + SYS_B[BS:] + [1], BS, 8)
    assert a[0] == b[0] and a[1] != b[1]  # chained: a block's hash names its whole prefix


def test_least_loaded_wins_and_ties_rotate() -> None:
    c = EngineChooser(3, BS)
    assert [c.choose([i]) for i in range(3)] == [0, 1, 2]  # idle and equal: spread
    c.reported(0, stats(5, 5))
    c.done(1)
    c.done(2)
    assert c.choose([7]) in (1, 2)
    c.owned = [0, 9, 9]
    c.reported_load = [20, 0, 0]  # another API process's work counts too: max(reported, ours)
    assert c.choose([8]) in (1, 2)


def test_same_prefix_goes_to_the_engine_that_got_it() -> None:
    c = EngineChooser(2, BS)
    first = c.choose(SYS_A + [1, 2, 3])
    other = c.choose(SYS_B + [1, 2, 3])
    assert other != first  # a new prefix goes to the least loaded engine
    for i in range(6):  # both engines busy with their own prefix; affinity holds within the slack
        assert c.choose(SYS_A + [10 + i]) == first
        assert c.choose(SYS_B + [10 + i]) == other
    assert c.affinity_hits == 12


def test_affinity_yields_when_that_engine_is_much_busier() -> None:
    c = EngineChooser(2, BS, slack=4, slack_ratio=0.5)
    first = c.choose(SYS_A + [1])
    c.reported(first, stats(3, 0))
    assert c.choose(SYS_A + [2]) == first  # 3 (4 with this one) vs 0: within the slack
    c.reported(first, stats(10, 10))
    assert c.choose(SYS_A + [3]) != first


def test_a_shared_header_alone_does_not_pull() -> None:
    """A prefix both engines got (a chat template's header) gives neither an edge: load decides."""
    c = EngineChooser(2, BS)
    header = list(range(BS))
    c.choose(header + SYS_A)
    c.choose(header + SYS_B)
    c.owned = [5, 0]
    assert c.choose(header + [9] * 40) == 1


def test_round_robin_ignores_load_and_prefix() -> None:
    c = EngineChooser(2, BS, policy="round_robin")
    assert [c.choose(SYS_A + [i]) for i in range(4)] == [0, 1, 0, 1]
    assert c.routed == [2, 2]


def test_prefix_map_is_bounded() -> None:
    c = EngineChooser(2, BS, max_entries=10)
    for i in range(20):
        c.choose([i] * (3 * BS + 1))
    assert len(c._prefixes) == 10


def test_sum_stats() -> None:
    s = sum_stats([EngineStats(1, 2, 3, 10, 1, 100, 50), EngineStats(4, 0, 7, 10, 0, 20, 10)])
    assert s == EngineStats(5, 2, 10, 20, 1, 120, 60)


# ---- the pool over fake engines ---------------------------------------------------------------------


def add(rid: str, prompt: list[int], max_tokens: int = 3) -> AddRequest:
    return AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), 0.0)


def fakes(n: int) -> tuple[list[FakeEngineClient], Callable[[int], Any]]:
    engines = [FakeEngineClient(lambda req: [5, 6, 7, 8]) for _ in range(n)]

    def open_one(i: int) -> Any:
        @asynccontextmanager
        async def cm() -> AsyncIterator[FakeEngineClient]:
            yield engines[i]

        return cm()

    return engines, open_one


async def finish_all(pool: EnginePool, ids: set[str]) -> None:
    with anyio.fail_after(5):
        while ids:
            frame = await pool.receive()
            if isinstance(frame, StepOutputs):
                for out in frame.outputs:
                    if out.finish_reason is not None:
                        ids.discard(out.request_id)


@pytest.mark.anyio
async def test_pool_routes_children_together_aborts_to_the_owner_and_counts_finishes() -> None:
    engines, open_one = fakes(2)
    async with open_engine_pool(open_one, 2) as pool:
        assert pool.ready.num_blocks == 200
        prompt = SYS_A + [1]
        for i in range(3):  # n = 3: the same list object, one engine
            pool.add_request(add(f"r-{i}", prompt))
        owner = pool.owner("r-0")
        assert owner is not None and {pool.owner(f"r-{i}") for i in range(3)} == {owner}
        assert len(engines[owner].added) == 3 and not engines[1 - owner].added
        pool.add_request(add("x", SYS_B + [1]))  # equal load would rotate, but this engine is busier
        assert pool.owner("x") == 1 - owner
        pool.abort(["r-2", "unknown"])
        assert engines[owner].aborted == ["r-2"] and not engines[1 - owner].aborted
        await finish_all(pool, {"r-0", "r-1", "x"})
        assert pool.chooser.owned == [0, 0]
        assert pool.owner("r-0") is None


@pytest.mark.anyio
async def test_pool_sums_stats_into_every_frame() -> None:
    engines, open_one = fakes(2)
    engines[0].stats = EngineStats(1, 0, 10, 100, 0, 64, 32)
    engines[1].stats = EngineStats(2, 1, 30, 100, 0, 16, 0)
    async with open_engine_pool(open_one, 2) as pool:
        pool.add_request(add("a", [1, 2, 3]))
        pool.add_request(add("b", [4, 5, 6]))
        seen = set()
        with anyio.fail_after(5):
            while len(seen) < 2:
                frame = await pool.receive()
                seen.update(o.request_id for o in getattr(frame, "outputs", []))
        assert frame.stats == EngineStats(3, 1, 40, 200, 0, 80, 32)
        registry = CollectorRegistry()
        pool.register_metrics(registry, "tiny")
        text = generate_latest(registry).decode()
        assert 'spindle_engine_prefix_cache_hits_total{engine="0",model_name="tiny"} 32.0' in text
        assert 'spindle_engine_requests_routed_total{engine="1",model_name="tiny"} 1.0' in text


@pytest.mark.anyio
async def test_one_engine_dying_is_the_pools_death() -> None:
    engines, open_one = fakes(2)
    async with open_engine_pool(open_one, 2) as pool:
        pool.add_request(add("a", [1, 2, 3]))
        engines[1].die("gone")
        with anyio.fail_after(5), pytest.raises(EngineDeadError, match="engine 1 of 2"):
            while True:
                await pool.receive()
        with pytest.raises(EngineDeadError):
            pool.add_request(add("b", [1]))
        pool.abort(["a"])  # moot once dead, and no error


@pytest.mark.anyio
async def test_a_failed_load_stops_the_others_and_raises_its_error() -> None:
    stopped: list[int] = []

    def open_one(i: int) -> Any:
        @asynccontextmanager
        async def cm() -> AsyncIterator[FakeEngineClient]:
            if i == 1:
                await anyio.sleep(0.01)
                raise RuntimeError("no such checkpoint")
            try:
                yield FakeEngineClient(lambda req: [1])
            finally:
                stopped.append(i)

        return cm()

    with anyio.fail_after(5), pytest.raises(RuntimeError, match="no such checkpoint"):
        async with open_engine_pool(open_one, 2):
            pytest.fail("the pool must not serve")
    assert stopped == [0]


@pytest.mark.anyio
async def test_size_one_is_the_engine_itself() -> None:
    engine = FakeEngineClient(lambda req: [1])

    @asynccontextmanager
    async def one(config: Any) -> AsyncIterator[FakeEngineClient]:
        yield engine

    async with open_engines(one, ServerConfig()) as client:
        assert client is engine


@pytest.mark.anyio
async def test_open_nth_opens_each_engine_by_index_and_routed_counts_can_be_shared() -> None:
    """An API process of several (--api-server-count): engine i is its channel i; routed counts are shared."""
    engines, open_one = fakes(2)
    opened: list[int] = []

    def open_nth(i: int) -> Any:
        opened.append(i)
        return open_one(i)

    config = ServerConfig.from_settings(data_parallel_size=2, data_parallel_policy="affinity", served_model_name="tiny")

    class Shared:
        def __init__(self) -> None:
            self.value = 10.0  # what the other processes sent there

        def inc(self, n: float) -> None:
            self.value += n

        def get(self) -> float:
            return self.value

    async with open_engines(lambda config: pytest.fail("not opened by config"), config, open_nth=open_nth) as pool:
        assert sorted(opened) == [0, 1] and pool.clients == engines
        pool.shared_routed = [Shared(), Shared()]
        pool.add_request(add("a", [1, 2, 3]))
        registry = CollectorRegistry()
        pool.register_metrics(registry, "tiny")
        text = generate_latest(registry).decode()
        assert sum(s.value for s in pool.shared_routed) == 21
        assert 'spindle_engine_requests_routed_total{engine="0",model_name="tiny"} 11.0' in text


def test_config_checks_the_data_parallel_flags() -> None:
    from server.cli import config_from_args

    config = config_from_args(["--data-parallel-size", "2", "--data-parallel-policy", "round_robin"])
    assert (config.parallel.data_parallel_size, config.parallel.data_parallel_policy) == (2, "round_robin")
    config = config_from_args(["--data-parallel-size", "2", "--api-server-count", "3"])  # N API processes x M engines
    assert (config.parallel.data_parallel_size, config.parallel.api_server_count) == (2, 3)
    for argv, words in (
        (["--data-parallel-size", "0"], "at least 1"),
        (["--data-parallel-policy", "random"], "affinity or round_robin"),
        (["--data-parallel-size", "2", "--master-port", "29500"], "this node only"),
    ):
        with pytest.raises(ValueError, match=words):
            config_from_args(argv)
