"""The engine-core process: its device, seed and KV cache, and how long the API process waits on it before it
counts as failed, gone or hung (server/app.py, server/worker_context.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.spec_config import parse_spec_config
from server.config.values import check_at_least_one, check_positive, check_unset_or_at_least_one


@dataclass(frozen=True)
class EngineCoreConfig:
    device: str = "auto"
    seed: int = 0
    kv_cache_memory: int = 1 << 30
    num_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_disk_cache_size: float = 4.0  # GiB of full KV blocks kept on disk past the pool and restarts (at most a tenth
    # of the free disk: engine/core/kv_offload.py fitted_bound); 0: off
    structured_outputs_warmup: bool = True  # the engine builds its grammar backend before it says Ready
    engine_ready_timeout: float = 600.0
    engine_heartbeat_timeout: float = 10.0  # seconds without any frame: the engine is stopped or gone
    engine_step_timeout: float = 600.0  # seconds one step may run before the engine counts as hung; 0: off
    speculative_config: dict[str, Any] = field(default_factory=dict)  # JSON, vLLM's keys: engine/spec/config.py
    cpu_threads: int | None = None  # None: fitted to the affinity mask, CPU quota and cores (engine/cpu_threads.py)
    # hybrid models' recurrent-state snapshots for prefix hits (engine/core/state_pool.py): every this many tokens
    # (rounded up to whole blocks; 0: none, no prefix hits on hybrid models), in this many bytes (None: an eighth of
    # kv_cache_memory, out of it; at most half of it, the state pool's slots and the KV blocks share the rest)
    state_snapshot_interval: int = 64
    state_snapshot_memory: int | None = None

    def __post_init__(self) -> None:
        check_at_least_one(self, ("block_size", "kv_cache_memory"))
        check_unset_or_at_least_one(self, ("num_blocks",))
        check_positive(self, ("engine_ready_timeout", "engine_heartbeat_timeout"))
        if self.kv_disk_cache_size < 0:
            raise ValueError(f"--kv-disk-cache-size must be 0 (off) or more GiB, got {self.kv_disk_cache_size}")
        if self.engine_step_timeout < 0:
            raise ValueError(f"SPINDLE_ENGINE_STEP_TIMEOUT must be 0 (off) or positive, got {self.engine_step_timeout}")
        self._check_snapshots()
        parse_spec_config(self.speculative_config)  # a bad one stops start-up, naming --speculative-config

    def _check_snapshots(self) -> None:
        if self.state_snapshot_interval < 0:
            raise ValueError(
                f"--state-snapshot-interval must be 0 (no snapshots) or more tokens, got {self.state_snapshot_interval}"
            )
        memory = self.state_snapshot_memory
        if memory is not None and memory < 0:
            raise ValueError(f"--state-snapshot-memory must be 0 or more bytes, got {memory}")
        if memory is not None and self.num_blocks is None and memory > self.kv_cache_memory // 2:
            raise ValueError(
                f"--state-snapshot-memory ({memory} bytes) must be at most half of --kv-cache-memory "
                f"({self.kv_cache_memory} bytes): the snapshots come out of it, beside the state pool and the KV blocks"
            )
