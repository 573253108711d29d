"""Tensor-parallel ranks other than 0: `python -m engine.distributed.rank_worker`.

Two ways in:
  --rank R ...                 a rank started by its node's first process (launch.py); dies with it
  --nnodes N --node-rank K ... a headless node (K > 0, no API server): it joins rank 0's store, runs the
                               node's first rank and starts the node's others
Either way the EngineConfig comes from rank 0's store, so every rank runs exactly rank 0's settings.
Exit 0 when rank 0 says stop; 1 when the group breaks (rank 0 or another rank gone) or cannot form.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from engine.config import EngineEnv
from engine.hugepages import reexec_with_huge_pages
from engine.transport.ipc import die_with_parent

log = logging.getLogger("engine")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engine.distributed.rank_worker")
    ap.add_argument("--rank", type=int, default=None, help="this rank (started by launch.py)")
    ap.add_argument("--nnodes", type=int, default=None, help="headless node: the number of nodes")
    ap.add_argument("--node-rank", type=int, default=None, help="headless node: this node, 1..nnodes-1")
    ap.add_argument("--master-addr", required=True, help="node 0's address")
    ap.add_argument("--master-port", type=int, required=True, help="node 0's rendezvous port")
    ap.add_argument(
        "--timeout",
        type=float,
        default=EngineEnv.read().distributed_timeout,
        help="seconds to join the group (the group's own timeout is rank 0's)",
    )
    args = ap.parse_args(argv)
    if (args.rank is None) == (args.node_rank is None):
        ap.error("pass --rank (a started rank) or --nnodes and --node-rank (a headless node)")
    if args.node_rank is not None and (args.nnodes is None or not 0 < args.node_rank < args.nnodes):
        ap.error("a headless node needs --nnodes and a --node-rank in 1..nnodes-1 (node 0 runs the server)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    started = args.rank is not None
    if started:
        die_with_parent()  # our stdin is the starting process's pipe: its hang-up means it is gone
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops the engine; we follow it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name = f"rank{args.rank}" if started else f"node{args.node_rank}"
    logging.basicConfig(level=EngineEnv.read().log_level, format=f"%(asctime)s engine {name} %(levelname)s %(message)s")
    # why late (torch): the lifeline watch and signal handling are set up before a seconds-long import
    from engine.distributed.group import JoinError, join_store
    from engine.distributed.launch import LocalRanks  # why late: as above
    from engine.distributed.tp_runner import TPModelRunner  # why late: as above

    local: LocalRanks | None = None
    try:
        store, config = join_store(args.master_addr, args.master_port, name, args.timeout)
        per_node = config.tensor_parallel_size // config.nnodes
        rank = args.rank
        if rank is None:
            if args.nnodes != config.nnodes:
                raise JoinError(f"node {args.node_rank}: --nnodes {args.nnodes} but node 0 runs with {config.nnodes}")
            rank = args.node_rank * per_node
            local = LocalRanks(range(rank + 1, rank + per_node), args.master_addr, args.master_port, args.timeout)
        runner = TPModelRunner(config, rank=rank, store=store)
        log.info("tensor-parallel rank %d of %d ready", rank, config.tensor_parallel_size)
        runner.serve_plans()
    except Exception as e:  # noqa: BLE001 - one line naming the rank, then out without interpreter teardown
        log.error("%s", e if isinstance(e, JoinError) else f"{type(e).__name__}: {e}")
        os._exit(1)  # a normal exit could wait on a broken group's threads; our children die with our pipes
    if local is not None:
        local.stop()
    os._exit(0)


if __name__ == "__main__":
    reexec_with_huge_pages()  # engine/hugepages.py: before torch loads in main()
    sys.exit(main())
