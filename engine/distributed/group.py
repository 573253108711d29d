"""One engine's tensor-parallel group: the rendezvous store, the collectives, and the plan broadcast.

Built from torch.distributed's process-group classes directly, not `init_process_group`: no global
state, so a process (a test, a benchmark) can hold several engines one after the other. Two groups:
gloo for the plans (bytes on the CPU) and, on CUDA, NCCL for the activations; on CPU gloo does both.
Every collective has `distributed_timeout`: a rank that stops answering fails the step, never hangs it.
gloo has no bfloat16 / float16 all-reduce (pytorch #111131): those sums go through float32.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import torch
from torch._C._distributed_c10d import BroadcastOptions, GatherOptions, PrefixStore, ProcessGroupGloo, Store, TCPStore

from engine.config import EngineConfig
from engine.distributed.plan import StepPlan, decode, encode

log = logging.getLogger("engine")
CONFIG_KEY = "spindle/engine_config"  # rank 0's EngineConfig as JSON: every other rank runs with exactly it
PLAN_BYTES = 16 << 10  # one broadcast carries a plan up to this size (a decode step of ~500 short sequences)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class CollectiveError(RuntimeError):
    """A collective failed: a rank is gone (connection reset) or did not answer within the timeout."""


def _done(work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(str(e).splitlines()[0][:300]) from e


class JoinError(RuntimeError):
    """A rank could not reach the rendezvous or the group did not form in time; the message names both."""


def timeout_of(config: EngineConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.distributed_timeout)


def master_store(config: EngineConfig) -> TCPStore:
    """Rank 0's rendezvous store (port 0: a free one, read back from `store.port`), holding the config."""
    try:
        store = TCPStore(
            config.master_addr, config.master_port, None, True, timeout=timeout_of(config), wait_for_workers=False
        )
    except (RuntimeError, ValueError) as e:
        raise JoinError(
            f"tensor-parallel rank 0 could not listen on {config.master_addr}:{config.master_port}"
            f" for the other ranks: {e}"
        ) from e
    store.set(CONFIG_KEY, json.dumps(config.to_dict() | {"master_port": store.port}))
    return store


def join_store(addr: str, port: int, rank: str, timeout: float) -> tuple[TCPStore, EngineConfig]:
    """Another rank's connection to rank 0's store, and the config rank 0 runs with."""
    try:
        store = TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout))
        config = EngineConfig(**json.loads(store.get(CONFIG_KEY)))
    except (RuntimeError, ValueError) as e:  # DistNetworkError, DistStoreError are RuntimeErrors
        raise JoinError(
            f"tensor-parallel {rank} could not join the group at {addr}:{port} within {timeout:g} s"
            f" (is node 0 started, and is --master-addr right?): {str(e).splitlines()[0]}"
        ) from e
    return store, config


class TPGroup:
    def __init__(self, store: Store, rank: int, config: EngineConfig, device: torch.device) -> None:
        self.rank, self.size = rank, config.tensor_parallel_size
        timeout = timeout_of(config)
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        # one node on loopback: bind there; several: the address this host resolves to (or GLOO_SOCKET_IFNAME)
        opts._devices = [
            ProcessGroupGloo.create_device(hostname="127.0.0.1")
            if config.master_addr in _LOOPBACK
            else ProcessGroupGloo.create_default_device()
        ]
        where = f"{config.master_addr}:{store.port if isinstance(store, TCPStore) else config.master_port}"
        try:
            self.cpu: Any = ProcessGroupGloo(PrefixStore("spindle/gloo", store), rank, self.size, opts)
            if device.type == "cuda":
                # why late: CPU-only torch builds have no ProcessGroupNCCL
                from torch._C._distributed_c10d import ProcessGroupNCCL

                nccl_opts = ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                self.dev: Any = ProcessGroupNCCL(PrefixStore("spindle/nccl", store), rank, self.size, nccl_opts)
            else:
                self.dev = self.cpu
        except RuntimeError as e:
            raise JoinError(
                f"tensor-parallel rank {rank}: the group of {self.size} ranks at {where} did not form "
                f"within {config.distributed_timeout:g} s: {str(e).splitlines()[0]}"
            ) from e
        self._store = store
        self._through_float32 = device.type != "cuda"  # gloo: no half-precision sums
        self._plan_buf = torch.zeros(PLAN_BYTES, dtype=torch.uint8)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t` (a new tensor, or `t` summed in place)."""
        if self._through_float32 and t.dtype != torch.float32:
            wide = t.float()
            _done(self.dev.allreduce([wide]))
            return wide.to(t.dtype)
        _done(self.dev.allreduce([t]))
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `t` [N, c] side by side [N, size * c]; other ranks: None."""
        t = t.contiguous()
        opts = GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        _done(self.dev.gather(outs, [t], opts))
        return torch.cat(outs[0], dim=1) if self.rank == 0 else None

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank = 0
        _done(self.cpu.broadcast([t], opts))

    def send_plan(self, plan: StepPlan) -> None:
        """Rank 0: the plan to every rank; one broadcast for any plan up to PLAN_BYTES - 8 bytes."""
        data = encode(plan)
        buf = self._plan_buf
        head = PLAN_BYTES - 8
        buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = data[:head]
        buf[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8) if first else buf[8:8]
        self._broadcast(buf)
        if len(data) > head:
            self._broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))

    def recv_plan(self) -> StepPlan:
        buf = self._plan_buf
        self._broadcast(buf)
        size = int(buf[:8].view(torch.int64)[0])
        head = PLAN_BYTES - 8
        data = buf[8 : 8 + min(size, head)].numpy().tobytes()
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return decode(data)

    def close(self) -> None:
        """Drop the groups and the store now: left to interpreter exit, their threads abort the process."""
        for name in ("dev", "cpu", "_store"):
            self.__dict__.pop(name, None)
