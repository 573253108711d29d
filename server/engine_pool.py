"""Data parallelism (`--data-parallel-size N`): N engine cores behind one client, chosen per request.

`EnginePool` looks like one engine client to AsyncLLM (`add_request`, `abort`, `receive`, `ready`,
`stats`); with `--data-parallel-size 1` the app never builds one, so the single-engine path keeps its
direct reference. Each engine core is its own subprocess with its own KV cache and scheduler
(`max_num_seqs` applies per engine).

Choice (`EngineChooser`): an engine's load is max(running + waiting as it last reported, the requests
this process has there unfinished); the least loaded wins, ties rotating. Prefix affinity: the chooser
keeps an LRU map from the hash chains of a prompt's first full KV blocks (up to 32) to the engine that
last got them; a request goes to the engine holding the deepest match (at least 64 tokens) unless that
engine is much busier than the least loaded one (by more than max(8, half the least one's load)); a
prefix the load sends elsewhere moves there. Children of one `n > 1` spec arrive back to back with the
very same prompt list (`GenerationSpec.prompt_token_ids`) and stay on the engine of the first, so they
share the prompt.
Aborts go to the engine that owns the request.

Engine death: any one engine dying is the whole server's engine death (the project's rule): `receive`
raises `EngineDeadError` naming it, AsyncLLM fails every in-flight request with that error, /health says
503 and the CLI exits non-zero. A supervisor restarts the server with all its engines; serving on fewer
engines would silently halve capacity and leave a broken process looking healthy.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal, Protocol

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from engine.client.process_client import EngineDeadError
from engine.messages import AddRequest, EngineStats, Heartbeat, Ready, StepOutputs
from server.config import ServerConfig
from server.metrics.slots import LoopCounter

Policy = Literal["affinity", "round_robin"]
POLICIES: tuple[Policy, ...] = ("affinity", "round_robin")


class _Client(Protocol):
    ready: Ready
    stats: EngineStats

    def add_request(self, req: AddRequest) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    async def receive(self) -> StepOutputs | Heartbeat: ...


def prefix_hashes(prompt: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's first full blocks (as the engine caches them: the last token is
    always computed, so at most (len - 1) // block_size blocks), at most `max_blocks`."""
    out: list[int] = []
    h = 0
    for i in range(min((len(prompt) - 1) // block_size, max_blocks)):
        h = hash((h, tuple(prompt[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


class EngineChooser:
    """Which engine gets the next request. Pure bookkeeping: no I/O, unit-tested on its own.

    `choose` picks and records; the pool reports `reported(i, stats)` from every frame and `done(i)`
    when a request it sent there finished or was aborted.
    """

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        *,
        policy: Policy = "affinity",
        max_prefix_blocks: int = 32,
        max_entries: int = 65536,
        min_match_tokens: int = 64,
        slack: int = 8,
        slack_ratio: float = 0.5,
    ) -> None:
        if num_engines < 1:
            raise ValueError("num_engines must be at least 1")
        self.num_engines = num_engines
        self.block_size = block_size
        self.policy = policy
        self.max_prefix_blocks = max_prefix_blocks
        self.max_entries = max_entries
        # A match shorter than this does not pull (a chat template's header is shared by every request).
        self.min_match_blocks = max(1, -(-min_match_tokens // block_size))
        # "Much busier": load above the least loaded engine's by more than max(slack, slack_ratio x its load).
        self.slack = slack
        self.slack_ratio = slack_ratio
        self.reported_load = [0] * num_engines  # running + waiting from the engine's last frame
        self.owned = [0] * num_engines  # requests this process sent there and has not seen end
        self.routed = [0] * num_engines  # cumulative
        self.affinity_hits = 0  # cumulative: choices sent where the prompt's deepest known prefix went
        # chain hash -> the engine that last got it: a prefix follows one engine, so each engine's cache holds
        # its share of the prefixes rather than all of them (affinity overruled by load moves the prefix along)
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        self._next = 0  # round-robin position, also the tie-break among equally loaded engines

    def load(self, i: int) -> int:
        return max(self.reported_load[i], self.owned[i])

    def reported(self, i: int, stats: EngineStats) -> None:
        self.reported_load[i] = stats.num_running + stats.num_waiting

    def done(self, i: int) -> None:
        self.owned[i] -= 1

    def choose(self, prompt: Sequence[int]) -> int:
        n = self.num_engines
        start = self._next
        self._next = (start + 1) % n
        if self.policy == "round_robin":
            i = start
        else:
            loads = [self.load(k) for k in range(n)]
            least = min(range(n), key=lambda k: (loads[(start + k) % n], k))
            least = (start + least) % n
            i = least
            hashes = prefix_hashes(prompt, self.block_size, self.max_prefix_blocks)
            depth = self._depths(hashes)
            best = max(range(n), key=lambda k: (depth[k], -loads[k]))
            if (
                depth[best] >= self.min_match_blocks
                and depth[best] > depth[least]
                and loads[best] - loads[least] <= max(self.slack, self.slack_ratio * loads[least])
            ):
                i = best
            if depth[i] and depth[i] == depth[best]:
                self.affinity_hits += 1
            self._remember(hashes, i)
        self.owned[i] += 1
        self.routed[i] += 1
        return i

    def _depths(self, hashes: list[int]) -> list[int]:
        """Per engine, how many of the prompt's first blocks it was the last to get."""
        depth = [0] * self.num_engines
        prefixes = self._prefixes
        for d, h in enumerate(hashes, 1):
            k = prefixes.get(h)
            if k is None:
                break
            depth[k] = d
        return depth

    def _remember(self, hashes: list[int], i: int) -> None:
        prefixes = self._prefixes
        for h in hashes:
            prefixes[h] = i
            prefixes.move_to_end(h)
        while len(prefixes) > self.max_entries:
            prefixes.popitem(last=False)


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The engines' stats as one engine's: counts and cumulative counters summed (KV usage is then
    used / total over all engines, the mean weighted by size); lists of names (LoRA adapters) as their sorted
    union, lists of counts (accepted draft tokens per position) summed position by position."""
    cols: list[Any] = [_merge(col) for col in zip(*(msgspec.structs.astuple(s) for s in stats))]
    return EngineStats(*cols)


def _merge(col: tuple[Any, ...]) -> Any:
    if not col or not isinstance(col[0], list):
        return sum(col)
    if any(isinstance(v, str) for values in col for v in values):
        return sorted(set().union(*col))
    return [sum(values) for values in itertools.zip_longest(*col, fillvalue=0)]


class EnginePool:
    """N engine clients as one (AsyncLLM's EngineClientLike). Built by `open_engine_pool`."""

    def __init__(self, clients: Sequence[_Client], *, policy: Policy = "affinity") -> None:
        self.clients = list(clients)
        first = self.clients[0].ready
        self.ready = msgspec.structs.replace(first, num_blocks=sum(c.ready.num_blocks for c in self.clients))
        self.chooser = EngineChooser(len(self.clients), first.block_size, policy=policy)
        self.engine_stats = [c.stats for c in self.clients]
        self.stats = sum_stats(self.engine_stats)
        self.dead: EngineDeadError | None = None
        # Requests routed per engine, shared over the API processes (`--api-server-count`): each has a
        # `.inc(n)` and a `.get()` summing every process (server/shared_state.py); None: the chooser's own.
        self.shared_routed: Sequence[LoopCounter] | None = None
        self._owner: dict[str, int] = {}  # request id -> engine, until it finishes or is aborted
        self._last_prompt: list[int] | None = None  # the previous add's prompt list and its engine:
        self._last_engine = 0  # n > 1 children share the list object and follow the first
        self._send: MemoryObjectSendStream[tuple[int, StepOutputs | Heartbeat] | BaseException]
        self._recv: MemoryObjectReceiveStream[tuple[int, StepOutputs | Heartbeat] | BaseException]
        self._send, self._recv = anyio.create_memory_object_stream[tuple[int, StepOutputs | Heartbeat] | BaseException](
            16
        )

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def add_request(self, req: AddRequest) -> None:
        if self.dead is not None:
            raise self.dead
        prompt = req.prompt_token_ids
        if prompt is self._last_prompt:  # the next child of the same spec: same engine, shared prompt
            i = self._last_engine
            self.chooser.owned[i] += 1
            self.chooser.routed[i] += 1
        else:
            i = self.chooser.choose(prompt)
            self._last_prompt, self._last_engine = prompt, i
        self.clients[i].add_request(req)  # raises EngineDeadError if that engine is gone
        self._owner[req.request_id] = i
        if self.shared_routed is not None:
            self.shared_routed[i].inc(1)

    def abort(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead is not None:
            return
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.pop(rid, None)
            if i is not None:
                self.chooser.done(i)
                by_engine.setdefault(i, []).append(rid)
        for i, ids in by_engine.items():
            self.clients[i].abort(ids)

    async def receive(self) -> StepOutputs | Heartbeat:
        """The next frame from any engine, its stats replaced by the sum over engines."""
        if self.dead is not None:
            raise self.dead
        try:
            item = await self._recv.receive()
        except anyio.EndOfStream:
            raise self._die("every engine core is gone") from None
        if isinstance(item, BaseException):
            raise self._die(str(item))
        i, frame = item
        stats = frame.stats
        self.engine_stats[i] = stats
        self.chooser.reported(i, stats)
        self.stats = total = sum_stats(self.engine_stats)
        if type(frame) is StepOutputs:
            owner, done = self._owner, self.chooser.done
            for out in frame.outputs:
                if out.finish_reason is not None and owner.pop(out.request_id, None) is not None:
                    done(i)
            return StepOutputs(frame.outputs, frame.timestamp, total)
        return Heartbeat(frame.timestamp, total)

    def _die(self, why: str) -> EngineDeadError:
        if self.dead is None:
            self.dead = EngineDeadError(why)
        return self.dead

    async def _read(self, i: int) -> None:
        """Engine i's frames into the pool's stream; its death (or an unusable frame) as an exception."""
        client, send = self.clients[i], self._send.clone()
        with send:
            try:
                while True:
                    await send.send((i, await client.receive()))
            except EngineDeadError as e:
                await send.send(EngineDeadError(f"engine {i} of {self.num_engines}: {e}"))
            except Exception as e:
                await send.send(EngineDeadError(f"engine {i} of {self.num_engines} unusable: {e!r}"))

    def collect_metrics(self, model_name: str) -> Iterator[Metric]:
        """Per-engine gauges and counters, labelled engine="i" (registered by `register_metrics`)."""
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "spindle_engine_num_requests_running", "Requests in this engine's running set.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "spindle_engine_num_requests_waiting", "Requests waiting in this engine.", labels=labels
        )
        kv = GaugeMetricFamily(
            "spindle_engine_kv_cache_usage_perc",
            "Fraction of this engine's KV blocks held by requests (0..1).",
            labels=labels,
        )
        queries = CounterMetricFamily("spindle_engine_prefix_cache_queries", "Prompt tokens looked up.", labels=labels)
        hits = CounterMetricFamily("spindle_engine_prefix_cache_hits", "Prompt tokens found cached.", labels=labels)
        routed = CounterMetricFamily(
            "spindle_engine_requests_routed", "Engine requests sent to this engine.", labels=labels
        )
        shared = self.shared_routed
        for i, s in enumerate(self.engine_stats):
            key = [model_name, str(i)]
            running.add_metric(key, s.num_running)
            waiting.add_metric(key, s.num_waiting)
            kv.add_metric(key, s.num_used_blocks / max(s.num_total_blocks, 1))
            queries.add_metric(key, s.prefix_cache_queries)
            hits.add_metric(key, s.prefix_cache_hits)
            routed.add_metric(key, self.chooser.routed[i] if shared is None else shared[i].get())
        yield from (running, waiting, kv, queries, hits, routed)

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        registry.register(_PoolMetrics(self, model_name))


class _PoolMetrics(Collector):
    def __init__(self, pool: EnginePool, model_name: str) -> None:
        self.pool = pool
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        return self.pool.collect_metrics(self.model_name)


@asynccontextmanager
async def open_engine_pool(
    open_one: Callable[[int], AbstractAsyncContextManager[Any]], num_engines: int, *, policy: Policy = "affinity"
) -> AsyncIterator[EnginePool]:
    """Start `num_engines` engines at once (`open_one(i)` each), yield the pool once all serve; a failed
    load stops the others and raises that load's error. Every engine stops on exit."""
    clients: list[Any] = [None] * num_engines
    loaded = anyio.Event()
    pool_ready = anyio.Event()
    holder: list[EnginePool] = []
    load_error: list[BaseException] = []
    counter = itertools.count(1)

    async def engine(i: int, tg: anyio.abc.TaskGroup) -> None:
        try:
            async with open_one(i) as client:
                clients[i] = client
                if next(counter) == num_engines:
                    loaded.set()
                await pool_ready.wait()
                await holder[0]._read(i)
                await anyio.sleep_forever()  # a dead engine's process is stopped with the others, on exit
        except Exception as e:
            if holder:
                raise
            load_error.append(e)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i in range(num_engines):
            tg.start_soon(engine, i, tg)
        await loaded.wait()
        pool = EnginePool(clients, policy=policy)
        holder.append(pool)
        pool_ready.set()
        try:
            yield pool
        finally:
            tg.cancel_scope.cancel()
    if load_error:
        raise load_error[0]


def open_engines(
    open_one: Callable[[Any], AbstractAsyncContextManager[Any]],
    config: ServerConfig,
    metrics: Any = None,
    *,
    open_nth: Callable[[int], AbstractAsyncContextManager[Any]] | None = None,
) -> AbstractAsyncContextManager[Any]:
    """The app's engine: `open_one(config)` itself with --data-parallel-size 1 (the direct client, no
    pool in between), else a pool of that many, its per-engine metrics registered on `metrics`.
    `open_nth(i)`, if given, opens engine i instead (an API process's channel to an engine it does not own)."""
    size = config.parallel.data_parallel_size
    opener = open_nth or (lambda i: open_one(config))
    if size == 1:
        return opener(0) if open_nth is not None else open_one(config)

    @asynccontextmanager
    async def pool() -> AsyncIterator[EnginePool]:
        async with open_engine_pool(opener, size, policy=config.parallel.data_parallel_policy) as p:
            if metrics is not None:
                p.register_metrics(metrics.registry, config.model.model_name)
            yield p

    return pool()
