"""FakeEngineClient: a stand-in for engine.client.process_client.EngineClient that replays scripted token ids.

Each added request gets `script(req)` as its output ids, `tokens_per_step` per step, then finishes
with "length" (or "stop" when an id is in eos_token_ids / params.stop_token_ids). It is self-driving:
`receive()` produces the next step whenever requests are running. Tests can also kill it (`die()`)
or make it refuse a request (`refuse`).

With `heartbeats=True` it also sends Heartbeat frames carrying `stats`, as the real engine's heartbeat
thread does: one after every step (so they interleave with a stream's steps), and one whenever it has
been idle for `heartbeat_interval` seconds. Tests wait for them with `wait_heartbeats(n)`, an event,
never a sleep.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from engine.client.process_client import EngineDeadError
from engine.messages import AddRequest, EngineStats, Heartbeat, Ready, RequestOutput, StepOutputs, TokenLogprobs

_STATS = EngineStats(0, 0, 0, 100, 0, 0, 0)


class FakeEngineClient:
    def __init__(
        self,
        script: Callable[[AddRequest], list[int]],
        *,
        vocab_size: int = 151_646,
        max_model_len: int = 256,
        eos_token_ids: tuple[int, ...] = (151645,),
        tokens_per_step: int = 1,
        refuse: Callable[[AddRequest], str | None] | None = None,
        gate: bool = False,
        heartbeats: bool = False,
        heartbeat_interval: float = 0.01,
    ) -> None:
        self.ready = Ready(
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=list(eos_token_ids),
            num_blocks=100,
            block_size=16,
            model_dtype="float32",
        )
        self.stats = _STATS
        self.pid = 0
        self.script = script
        self.refuse = refuse
        self.tokens_per_step = tokens_per_step
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.running: dict[str, tuple[AddRequest, list[int], int]] = {}
        self.steps = 0
        self._wake = anyio.Event()
        self._dead: str | None = None
        self.gate = gate  # when True, each step waits for `allow_step()`
        self._allowed = 0
        self._step_event = anyio.Event()
        self.heartbeats = heartbeats
        self.heartbeat_interval = heartbeat_interval
        self.heartbeats_sent = 0
        self._beat_due = False  # a heartbeat follows every step
        self._beat_sent = anyio.Event()  # set (and replaced) each time a heartbeat is handed out

    def add_request(self, req: AddRequest) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        self.added.append(req)
        self.running[req.request_id] = (req, self.script(req), 0)
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        if self._dead:
            return  # as the real client: aborts to a dead engine are moot
        self.aborted.extend(request_ids)
        for rid in request_ids:
            self.running.pop(rid, None)

    def die(self, why: str = "the fake engine was killed") -> None:
        self._dead = why
        self._wake.set()
        self._step_event.set()

    def allow_step(self, n: int = 1) -> None:
        self._allowed += n
        self._step_event.set()

    async def receive(self) -> StepOutputs | Heartbeat:
        if self._beat_due and not self._dead:
            self._beat_due = False
            await anyio.lowlevel.checkpoint()
            return self._heartbeat()
        while True:
            if self._dead:
                raise EngineDeadError(self._dead)
            if self.running and (not self.gate or self._allowed > 0):
                break
            if self.gate and self.running:
                self._step_event = event = anyio.Event()
            else:
                self._wake = event = anyio.Event()
            if not self.heartbeats:
                await event.wait()
                continue
            with anyio.move_on_after(self.heartbeat_interval):
                await event.wait()
            if not event.is_set() and not self._dead:  # idle for an interval: the heartbeat thread speaks
                return self._heartbeat()
        if self.gate:
            self._allowed -= 1
        await anyio.lowlevel.checkpoint()
        self._beat_due = self.heartbeats
        return StepOutputs(self._step(), time.time(), self.stats)

    def _heartbeat(self) -> Heartbeat:
        beat = Heartbeat(time.time(), self.stats, 0.0)
        self.heartbeats_sent += 1
        sent, self._beat_sent = self._beat_sent, anyio.Event()
        sent.set()
        return beat

    async def wait_heartbeats(self, n: int) -> None:
        """Return once `n` heartbeats in all have been handed to the reader (which records a frame's stats
        before it next waits, so they are recorded by the time this task runs)."""
        while self.heartbeats_sent < n:
            await self._beat_sent.wait()

    def _step(self) -> list[RequestOutput]:
        self.steps += 1
        outputs = []
        for rid, (req, ids, pos) in list(self.running.items()):
            why = self.refuse(req) if self.refuse else None
            if why is not None:
                outputs.append(RequestOutput(rid, [], "error", error=why))
                del self.running[rid]
                continue
            new: list[int] = []
            finish: str | None = None
            stop_id: int | None = None
            limit = min(len(ids), req.params.max_tokens)
            while len(new) < self.tokens_per_step and pos < limit:
                tid = ids[pos]
                pos += 1
                new.append(tid)
                if tid in req.params.stop_token_ids:
                    finish, stop_id = "stop", tid
                    break
                if tid in self.ready.eos_token_ids and not req.params.ignore_eos:
                    finish = "stop"
                    break
            if finish is None and pos >= limit:
                finish = "length"
            lps = None
            if req.params.logprobs is not None:  # made-up but well-formed: the sampled id ranks first
                k = req.params.logprobs
                lps = [
                    TokenLogprobs(
                        t,
                        -0.5,
                        1,
                        [t, *range(100, 100 + k)][: max(k, 0)],
                        [-0.5, *(-1.0 - j for j in range(k))][: max(k, 0)],
                    )
                    for t in new
                ]
            outputs.append(
                RequestOutput(rid, new, finish, stop_token_id=stop_id, logprobs=lps, arrival_time=req.arrival_time)
            )
            if finish is None:
                self.running[rid] = (req, ids, pos)
            else:
                del self.running[rid]
        return outputs


def fake_engine_factory(client: FakeEngineClient) -> Callable[[Any], Any]:
    @asynccontextmanager
    async def factory(config: Any) -> AsyncIterator[FakeEngineClient]:
        yield client

    return factory
