"""Tensor parallelism over torch.distributed: N engine ranks run every step's forward, each on its shard.

Rank 0 is the engine core (`python -m engine`): it owns the scheduler and the pipes, starts the other ranks
of its node (`launch.py`), and broadcasts each step's plan (`plan.py`) before running the forward itself.
Megatron-style layers (`tp_model.py`): QKV and gate/up split by columns, o and down by rows plus an
all-reduce, vocabulary-parallel embedding and LM head with the logits gathered to rank 0 for sampling.
Each rank reads only its slices of the checkpoint (`sharding.py`). `group.py` holds the collectives,
`runner.py` the ModelRunner of every rank, `worker.py` the entry point of ranks other than 0.
"""
