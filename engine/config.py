"""Engine configuration: one frozen dataclass, validated on construction, sent to the child as JSON."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.lora.config import check_lora_settings
from engine.pooling_config import CONVERTS, check_pooler_overrides
from engine.spec_config import parse_spec_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
RUNNERS = ("generate", "pooling")
QUANTIZATIONS = ("int8",)  # engine/layers/linear.py


def parse_bytes(text: str | int) -> int:
    """'2GiB' / '512MiB' / '1.5G' / plain bytes -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. '2GiB' or '512MiB'")
    unit = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a local HF-format folder (hub ids are resolved to a folder before this)
    dtype: str = "auto"
    # "int8": weight-only int8 projections and LM head (per-output-channel symmetric scales), activations in
    # --dtype; CPU only, off by default (bench/README.md, "Weight-only int8": speed, agreement)
    quantization: str | None = None
    # CPU: cut big projections into parts the step's threads share (engine/layers/parallel.py); off by default:
    # on the busy 2-core box it cost ~20% more CPU for no wall time (bench/README.md, "Projection forms")
    split_projections: bool = False
    # CPU: a step of at least this many FLOPs (projections) runs on all of torch's threads, a smaller one on one
    # thread (each op's barrier would wait for a core another process holds: engine/execution/model_runner.py); 0:
    # always all, inf: always one (bench/README.md, "Threads per step")
    threaded_step_flops: float = 4e9
    # CPU: intra-op threads (torch's and the C++ kernels' OpenMP teams); None: the fewest of the affinity mask,
    # the cgroup CPU quota and the physical cores (engine/cpu_threads.py)
    cpu_threads: int | None = None
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache
    num_blocks: int | None = None  # overrides kv_cache_memory
    enable_prefix_caching: bool = True
    # --kv-disk-cache-size: bytes of full KV blocks kept on disk past the pool and restarts (0: off;
    # docs/subsystems/kv-disk-cache.md); the folder: kv_disk_cache_dir, else <cache root>/kv_blocks
    kv_disk_cache_size: int = 0
    kv_disk_cache_dir: str = ""
    # hybrid models (engine/core/state_pool.py): recurrent-state snapshots every this many tokens (rounded up to
    # whole blocks), at each prompt's last full block and at branch points let prefix-cache hits resume there; 0:
    # no snapshots, no prefix hits on hybrid models
    state_snapshot_interval: int = 64
    # bytes of those snapshots, out of kv_cache_memory (None: an eighth of it)
    state_snapshot_memory: int | None = None
    seed: int = 0
    heartbeat_interval: float = 0.5  # seconds between heartbeats while idle
    # build the grammar backend before saying Ready (~1 s holding the GIL for a 150k vocabulary), not at the
    # first constrained request, where it would stall every running request and the heartbeat (the server
    # turns it on: ServerConfig.engine.structured_outputs_warmup)
    structured_outputs_warmup: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    scheduling_policy: str = "fcfs"  # "priority": waiting requests by (priority, arrival); fcfs: by arrival
    runner: str = "generate"  # "pooling": prefill only, one pooled output per request (engine/execution/pooler.py)
    convert: str = "auto"  # runner "pooling": embed | classify | auto (the architecture's; engine/pooling_config.py)
    pooler_config: dict[str, Any] = field(default_factory=dict)  # runner "pooling": --pooler-config's overrides
    # Tensor parallelism (engine/distributed/): ranks over nodes, torchrun's names for the rendezvous.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = (
        0  # this process's node; nodes other than 0 run headless (python -m engine.distributed.rank_worker)
    )
    master_addr: str = "127.0.0.1"  # node 0's address: its rank 0 holds the rendezvous store
    master_port: int = 0  # 0: a free port (one node only)
    distributed_timeout: float = 120.0  # seconds to join the group, and the longest one collective may wait
    # LoRA adapters per request (engine/lora/), vLLM's flags: slots in one step, the largest rank, adapters kept
    # loaded on CPU (None: max_loras), their dtype (auto: the model's)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # --speculative-config, vLLM's keys (engine/spec/config.py); empty: no speculation
    speculative_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"--quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), not {self.quantization!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.state_snapshot_interval < 0 or (self.state_snapshot_memory or 0) < 0:
            raise ValueError("state_snapshot_interval and state_snapshot_memory must not be negative")
        if self.kv_disk_cache_size < 0:
            raise ValueError(f"--kv-disk-cache-size must not be negative, got {self.kv_disk_cache_size}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be fcfs or priority, not {self.scheduling_policy!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"--runner must be generate or pooling, not {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}, not {self.convert!r}")
        check_pooler_overrides(self.pooler_config)
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if not self.threaded_step_flops >= 0:  # NaN too
            raise ValueError(f"threaded_step_flops must be 0 or more, got {self.threaded_step_flops}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")
        self._check_parallel()
        check_lora_settings(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)
        self._check_speculative()

    def _check_speculative(self) -> None:
        if parse_spec_config(self.speculative_config) is None:
            return
        if self.runner != "generate":
            raise ValueError("--speculative-config applies to --runner generate only")

    def _check_parallel(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
        if nodes < 1 or tp % nodes:
            raise ValueError(f"--nnodes must be at least 1 and divide --tensor-parallel-size {tp}, got {nodes}")
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"--node-rank must be in 0..{nodes - 1}, got {self.node_rank}")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in 0..65535, got {self.master_port}")
        if nodes > 1 and self.master_port == 0:
            raise ValueError("--nnodes above 1 needs --master-port: the other nodes must know where to join")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _seconds(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, not {text!r}") from None


@dataclass(frozen=True)
class EngineEnv:
    """The engine's settings that come from SPINDLE_* environment variables (docs/serving.md lists them). `read`
    takes one snapshot; each part reads it as it starts (a test's monkeypatch.setenv holds for what starts next)."""

    cpu_kernels: bool = True  # SPINDLE_CPU_KERNELS=0 (false, no, off): torch's path everywhere, for comparisons
    kernel_choice: str = ""  # SPINDLE_KERNEL_CHOICE: names the chooser forces where offered (engine/cpu_kernels)
    spec_draft_cost: bool = True  # SPINDLE_SPEC_DRAFT_COST=0: a draft model's own cost is not weighed
    gguf_dequantize: bool = False  # SPINDLE_GGUF_DEQUANTIZE=1: GGUF weights dequantized at load, not kept as blocks
    distributed_timeout: float = 120.0  # SPINDLE_DISTRIBUTED_TIMEOUT: seconds a started rank waits to join
    log_level: str = "INFO"  # SPINDLE_LOG_LEVEL
    engine_command: str = ""  # SPINDLE_ENGINE_COMMAND: the engine program the client starts (a fake one in tests)

    def __post_init__(self) -> None:
        if not self.distributed_timeout > 0:
            raise ValueError(f"SPINDLE_DISTRIBUTED_TIMEOUT must be positive, got {self.distributed_timeout}")

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> EngineEnv:
        env = os.environ if environ is None else environ
        return cls(
            cpu_kernels=env.get("SPINDLE_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off"),
            kernel_choice=env.get("SPINDLE_KERNEL_CHOICE", ""),
            spec_draft_cost=env.get("SPINDLE_SPEC_DRAFT_COST", "1") != "0",
            gguf_dequantize=env.get("SPINDLE_GGUF_DEQUANTIZE", "0") not in ("", "0"),
            distributed_timeout=_seconds("SPINDLE_DISTRIBUTED_TIMEOUT", env.get("SPINDLE_DISTRIBUTED_TIMEOUT", "120")),
            log_level=env.get("SPINDLE_LOG_LEVEL", "INFO").upper(),
            engine_command=env.get("SPINDLE_ENGINE_COMMAND", ""),
        )
