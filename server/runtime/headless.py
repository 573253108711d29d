"""`--headless`: a node other than 0 runs only its tensor-parallel engine ranks, joining node 0's group."""

from __future__ import annotations

import importlib

from server.config import ServerConfig


def run_headless(config: ServerConfig) -> int:
    """The ranks' exit code (engine/distributed/rank_worker.py); no API server on this node."""
    # why by name, here: the engine worker imports torch, and it is outside the server's strict typing
    worker = importlib.import_module("engine.distributed.rank_worker")
    return int(
        worker.main(
            [
                "--nnodes",
                str(config.parallel.nnodes),
                "--node-rank",
                str(config.parallel.node_rank),
                "--master-addr",
                config.parallel.master_addr,
                "--master-port",
                str(config.parallel.master_port),
                "--timeout",
                str(config.parallel.distributed_timeout),
            ]
        )
    )
