"""The engine's adapters: LoRA layers installed on the model, GPU slots, and an LRU of adapters loaded on CPU.

`--max-loras` slots hold the adapters a step may use (the scheduler admits no more distinct adapters than
slots: engine/core/scheduler.py); `--max-cpu-loras` adapters stay loaded on CPU, the least recently used evicted
and reloaded from their folder on demand. An adapter is known by its content digest (engine/lora/peft_files.py),
so a name reloaded with new weights is a new adapter here and in the prefix cache.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.lora.adapter import LoadedAdapter, ModuleWeights, load_adapter
from engine.lora.layer import LoRALinear
from engine.lora.mapping import LoRAContext, LoRAMapping, build_mapping
from engine.lora.peft_files import BaseDims
from engine.lora.request import LoRARequest
from engine.models.checkpoint_meta import ModelLoadError
from engine.models.decoder import CausalLM, GatedMLP

log = logging.getLogger("engine")
Slicer = Callable[[str, ModuleWeights], ModuleWeights]  # (member name, whole weights) -> this rank's part


def sliced(adapter: LoadedAdapter, slicer: Slicer) -> LoadedAdapter:
    return LoadedAdapter(
        adapter.spec,
        {key: {name: slicer(name, w) for name, w in members.items()} for key, members in adapter.weights.items()},
    )


def install(model: CausalLM, max_loras: int, max_rank: int, dtype: torch.dtype, ctx: LoRAContext) -> BaseDims:
    """Wrap every layer's q|k|v, o, gate|up and down in a LoRALinear; the base dims adapters must fit."""
    if getattr(model, "kv_shapes", None) is not None:  # Gemma 4: two head shapes, layers without k / v
        raise ModelLoadError(
            f"--enable-lora serves models whose layers share one attention shape; {model.args.architecture} does not"
        )
    q, kv = model.q_size, model.kv_size
    dev = model.device
    # a MoE model's MLPs take no adapter, its dense layers neither (as engine/lora/peft_files.py BaseDims says)
    dense = all(isinstance(layer.mlp, GatedMLP) for layer in model.layers)
    inter: int | None = None
    for layer in model.layers:
        hidden = layer.qkv.in_features
        layer.qkv = LoRALinear(
            layer.qkv,
            [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv), ("qkv_proj", 0, q + 2 * kv)],
            max_loras,
            max_rank,
            dtype,
            dev,
            ctx,
        )
        layer.o = LoRALinear(layer.o, [("o_proj", 0, hidden)], max_loras, max_rank, dtype, dev, ctx)
        mlp = layer.mlp
        if dense and isinstance(mlp, GatedMLP):
            i = inter = mlp.down.in_features
            mlp.gate_up = LoRALinear(
                mlp.gate_up,
                [("gate_proj", 0, i), ("up_proj", i, 2 * i), ("gate_up_proj", 0, 2 * i)],
                max_loras,
                max_rank,
                dtype,
                dev,
                ctx,
            )
            mlp.down = LoRALinear(mlp.down, [("down_proj", 0, hidden)], max_loras, max_rank, dtype, dev, ctx)
    hidden = model.args.hidden_size
    return BaseDims.of(len(model.layers), hidden, q, kv, inter)


class LoRAManager:
    def __init__(
        self,
        model: CausalLM,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None,
        dtype: torch.dtype,
        live_digests: Callable[[], set[str]] = set,
        *,
        base: BaseDims | None = None,
        slicer: Slicer | None = None,
    ) -> None:
        """live_digests: the adapters of the engine's live requests (kept on CPU whatever the LRU says).
        Tensor parallel: `base` the whole model's sizes (adapters are checked against them) and `slicer` cuts
        each module's A / B to this rank's part (engine/distributed/tp_runner.py)."""
        self.live_digests = live_digests
        self.ctx = LoRAContext()
        self.model, self.max_rank, self.dtype, self.slicer = model, max_rank, dtype, slicer
        local = install(model, max_loras, max_rank, dtype, self.ctx)
        self.base = base or local
        self.max_cpu = max_cpu_loras or max_loras
        self.cpu: OrderedDict[str, LoadedAdapter] = OrderedDict()  # digest -> adapter, least recent first
        self.slots: list[str | None] = [None] * max_loras  # digest per slot
        self._ranks: dict[int, int] = {}
        self.loads = 0  # adapters read from disk (tests watch the LRU reload)

    def register(self, req: LoRARequest) -> LoadedAdapter:
        """The request's adapter on CPU, loaded (and checked) if it is not: AdapterError if it cannot serve."""
        adapter = self.cpu.get(req.digest)
        if adapter is None:
            adapter = load_adapter(req.path, self.base, self.max_rank, self.dtype, expect_digest=req.digest)
            if self.slicer is not None:
                adapter = sliced(adapter, self.slicer)
            self.loads += 1
            self.cpu[req.digest] = adapter
            log.info("engine loaded LoRA adapter %s (rank %d) from %s", req.name, adapter.spec.rank, req.path)
        self.cpu.move_to_end(req.digest)
        if len(self.cpu) > self.max_cpu:
            live = self.live_digests()
            # the least recently used that no live request needs (those are never read from disk twice)
            extra = len(self.cpu) - self.max_cpu
            for digest in [d for d in self.cpu if d not in live and d != req.digest][:extra]:
                del self.cpu[digest]
        return adapter

    def _layers(self) -> list[tuple[int, str, LoRALinear]]:
        out = []
        for i, layer in enumerate(self.model.layers):
            out += [(i, "qkv", layer.qkv), (i, "o", layer.o)]
            if isinstance(layer.mlp, GatedMLP):
                out += [(i, "gate_up", layer.mlp.gate_up), (i, "down", layer.mlp.down)]
        return [(i, name, lin) for i, name, lin in out if isinstance(lin, LoRALinear)]

    def _slot_for(self, req: LoRARequest, needed: set[str]) -> int:
        if req.digest in self.slots:
            return self.slots.index(req.digest)
        slot = next(s for s, d in enumerate(self.slots) if d is None or d not in needed)
        adapter = self.register(req)
        for i, name, lin in self._layers():
            lin.load(slot, adapter.weights.get((i, name)))
        self.slots[slot] = req.digest
        self._ranks[slot] = adapter.spec.rank
        return slot

    def prepare(self, seqs: list[tuple[int, int, LoRARequest | None]], device: torch.device) -> LoRAMapping | None:
        """A step's mapping from (first row, rows, adapter) per sequence; adapters not in a slot are put in one
        (the scheduler keeps a step's distinct adapters within the slots)."""
        needed = {req.digest for _, _, req in seqs if req is not None}
        if len(needed) > len(self.slots):
            raise RuntimeError(f"{len(needed)} adapters in one step but {len(self.slots)} slots")
        slots = {d: self._slot_for(req, needed) for _, _, req in seqs if req is not None for d in (req.digest,)}
        rows = [(first, n, -1 if req is None else slots[req.digest]) for first, n, req in seqs]
        return build_mapping(rows, self._ranks, device)
