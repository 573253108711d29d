"""The ModelRunner of a tensor-parallel rank: its shard of the model, its heads' KV cache, the plan exchange.

Rank 0 (inside EngineCore) broadcasts each step's plan, then runs the step as a plain ModelRunner does;
its model's collectives pull the other ranks along. The other ranks (`serve_plans`) receive the plan,
rebuild the batch and run the same forward; their logits are gathered to rank 0 and dropped there.
While idle, rank 0 broadcasts a tick every `_tick_s`, so a waiting rank never reaches the group's
timeout and a dead rank 0 is noticed within a tick.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch
from torch._C._distributed_c10d import Store

from engine.config import EngineConfig
from engine.distributed.group import CollectiveError, TPGroup, master_store
from engine.distributed.launch import LocalRanks, _fatal
from engine.distributed.plan import GENERATE, POOL, STOP, TICK, StepPlan, batch_of, plan_of
from engine.distributed.sharding import Shard
from engine.execution.model_runner import ModelRunner, RunnerOutput, pick_device
from engine.lora.adapter import ModuleWeights
from engine.lora.manager import LoRAManager
from engine.lora.peft_files import BaseDims
from engine.models.args import ConfigError
from engine.models.decoder import CausalLM
from engine.models.loader import ModelInfo, ModelLoadError, load_model, read_config, resolve_model
from engine.models.pooling_archs import as_decoder_config
from engine.models.registry import parse_config
from engine.types.sequence import ScheduledSeq

log = logging.getLogger("engine")


class TPModelRunner(ModelRunner):
    def __init__(
        self, config: EngineConfig, *, rank: int = 0, store: Store | None = None, use_triton: bool | None = None
    ) -> None:
        size = config.tensor_parallel_size
        self.rank = rank
        self.shard = Shard(rank, size)
        device = pick_device(config.device)
        if device.type == "cpu":
            torch.set_num_threads(1)  # one thread per rank: the ranks are the parallelism
        self.local_ranks: LocalRanks | None = None
        if rank == 0:
            # refuse an unsupported or unsplittable model here, before any other rank starts
            folder = resolve_model(config.model)
            try:
                self.shard.local_args(parse_config(as_decoder_config(read_config(folder))))
            except ConfigError as e:
                raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e
            store = master_store(config)
            per_node = size // config.nnodes
            self.local_ranks = LocalRanks(
                range(1, per_node), config.master_addr, store.port, config.distributed_timeout
            )
        assert store is not None, "ranks other than 0 join rank 0's store"
        try:
            if device.type == "cuda":
                torch.cuda.set_device(rank % (size // config.nnodes))
            self.group = TPGroup(store, rank, config, device)
            self.shard = Shard(rank, size, self.group)
            super().__init__(config, use_triton=use_triton)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()  # one plan and its step's collectives at a time (the ticker's too)
        self._last_plan = time.monotonic()
        self._stopped = threading.Event()
        self._tick_s = min(1.0, config.distributed_timeout / 4)
        if rank == 0:
            log.info(
                "tensor parallel: %d ranks over %d node(s), %d KV head(s) per rank; logits gathered to rank 0",
                size,
                config.nnodes,
                self.model.args.num_kv_heads,
            )
            threading.Thread(target=self._tick, name="tp-tick", daemon=True).start()
            atexit.register(self.close)

    def _load(self, path: Path, config: EngineConfig) -> tuple[CausalLM, ModelInfo]:
        return load_model(
            path,
            config.dtype,
            self.device,
            max_positions=self.max_model_len,
            shard=self.shard,
            quantization=config.quantization,
        )

    def _make_lora(self, config: EngineConfig) -> LoRAManager:
        """Adapters checked against the whole model, each module cut as its base projection is: column-parallel
        members keep their B rows of this rank, row-parallel ones (o, down) their A columns (the partial deltas
        are summed by the projection's all-reduce)."""
        cfg = as_decoder_config(read_config(resolve_model(config.model)))
        rules, fused = self.shard.slice_rules(parse_config(cfg))

        def slicer(name: str, w: ModuleWeights) -> ModuleWeights:
            if name in fused:
                return ModuleWeights(w.a, torch.cat([w.b[a:b] for a, b in fused[name]]), w.scaling)
            dim, start, stop = rules[name]
            if dim == 0:
                return ModuleWeights(w.a, w.b[start:stop].contiguous(), w.scaling)
            return ModuleWeights(w.a[:, start:stop].contiguous(), w.b, w.scaling)

        dtype = self.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        return LoRAManager(
            self.model,
            config.max_loras,
            config.max_lora_rank,
            config.max_cpu_loras,
            dtype,
            base=BaseDims.from_config(cfg),
            slicer=slicer,
        )

    def _send(self, plan: StepPlan) -> None:
        self.group.send_plan(plan)
        self._last_plan = time.monotonic()

    def _tick(self) -> None:
        while not self._stopped.wait(self._tick_s):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last_plan < self._tick_s:
                    continue
                try:
                    self._send(StepPlan(TICK))
                except CollectiveError as e:
                    self._lost(e)

    def execute(self, batch: list[ScheduledSeq]) -> RunnerOutput:
        with self._lock:
            try:
                self._send(plan_of(GENERATE, batch))
                return super().execute(batch)
            except CollectiveError as e:
                self._lost(e)

    def execute_pooling(self, batch: list[ScheduledSeq], all_rows: bool) -> torch.Tensor:
        with self._lock:
            try:
                self._send(plan_of(POOL, batch, all_rows))
                return super().execute_pooling(batch, all_rows)
            except CollectiveError as e:
                self._lost(e)

    def _lost(self, e: CollectiveError) -> NoReturn:
        """A collective failed: a rank is gone (or hung past the timeout). Name it and end the engine."""
        dead = self.local_ranks.dead() if self.local_ranks is not None else []
        if self.local_ranks is not None:
            self.local_ranks.kill()  # a hung rank (the collective timed out) must not outlive us
        _fatal(
            f"a tensor-parallel step failed ({e}): "
            f"{'; '.join(dead) or 'no rank of this node exited, so one is hung or one on another node is gone'}"
        )

    def serve_plans(self) -> None:
        """Ranks other than 0: run every step rank 0 plans until it says stop (or a collective fails)."""
        group = self.group
        while True:
            plan = group.recv_plan()
            if plan.kind == TICK:
                continue
            if plan.kind == STOP:
                return
            batch = batch_of(plan)
            if plan.kind == GENERATE:
                ModelRunner.execute(self, batch)
            else:
                ModelRunner.execute_pooling(self, batch, plan.all_rows)

    def close(self) -> None:
        """Rank 0: tell the ranks to stop (when they still answer), stop the children, drop the group."""
        if self.local_ranks is not None:
            self.local_ranks.closing = True  # from now on a child's exit is expected
        stopped = getattr(self, "_stopped", None)
        if stopped is not None and not stopped.is_set():
            stopped.set()
            if self.rank == 0 and self._lock.acquire(timeout=1.0):
                try:
                    self._send(StepPlan(STOP))
                except CollectiveError:
                    pass  # a rank is gone: the children are stopped below, other nodes see the group break
                finally:
                    self._lock.release()
        if self.local_ranks is not None:
            self.local_ranks.stop()
        group = getattr(self, "group", None)
        if group is not None:
            group.close()
