"""Parallelism and the processes one command starts: tensor-parallel ranks over nodes (engine/distributed/), data
parallel engine cores (server/engine_pool.py), API processes (server/runtime/launcher.py), and the roles
that run no API server (--headless) or no engine (`spindle render`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DataParallelPolicy = Literal["affinity", "round_robin"]


@dataclass(frozen=True)
class ParallelConfig:
    # Tensor parallelism (engine/distributed/): torchrun's names; nodes other than 0 run --headless.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node only)
    headless: bool = False  # this node only runs engine ranks, no API server (node_rank > 0)
    distributed_timeout: float = 120.0  # seconds to join the group, and the longest one collective may wait
    # Data parallel (server/engine_pool.py): engine cores, each with its own KV cache and max_num_seqs
    data_parallel_size: int = 1
    data_parallel_policy: DataParallelPolicy = "affinity"  # "round_robin": no load or prefix look (benchmarks)
    api_server_count: int = 1  # API processes sharing one listening socket and one engine (server/runtime/launcher.py)
    # `spindle render` (server/render_app.py): tokenizer, templates and render routes only; no engine, no torch
    render_only: bool = False

    def __post_init__(self) -> None:
        self._check_data_parallel()
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {self.api_server_count}")
        if self.api_server_count > 1 and (self.render_only or self.headless):
            raise ValueError("--api-server-count above 1 needs a full server (not spindle render or --headless)")
        if self.headless != (self.node_rank > 0):
            raise ValueError(
                "--headless is for nodes other than 0 (--node-rank 1 and up), and those run only "
                f"headless; got --node-rank {self.node_rank}{' --headless' if self.headless else ''}"
            )
        if self.render_only and self.headless:
            raise ValueError("spindle render runs no engine ranks: --headless does not apply")

    def _check_data_parallel(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_policy not in get_args(DataParallelPolicy):
            raise ValueError(
                f"--data-parallel-policy must be affinity or round_robin; got {self.data_parallel_policy!r}"
            )
        if self.data_parallel_size > 1 and (self.nnodes > 1 or self.master_port):
            raise ValueError(
                "--data-parallel-size above 1 runs its engines on this node only, each picking a free "
                "rendezvous port: leave --nnodes and --master-port unset"
            )
