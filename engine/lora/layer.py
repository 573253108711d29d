"""LoRALinear: a base projection (engine/layers/linear.py, untouched) plus per-slot adapter weights.

Installed on the model's fused projections by engine/lora/manager.py. A fused projection holds several
members (q|k|v, gate|up), each an output column range with its own A and B per slot (PEFT adapts q_proj and
v_proj separately). Per step: y = base(x); then, for the rows of each adapter (engine/lora/mapping.py),
y[rows, member columns] += (x[rows] @ A.T) @ (B * scaling).T. With no adapter in the step the base runs alone.
"""

from __future__ import annotations

import torch

from engine.layers.linear import Linear
from engine.lora.adapter import ModuleWeights
from engine.lora.mapping import LoRAContext, LoRAMapping


class LoRALinear(Linear):
    def __init__(
        self,
        base: Linear,
        members: list[tuple[str, int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        ctx: LoRAContext,
    ) -> None:
        """members: (name, first column, end column) of the base's output, e.g. q_proj, k_proj, v_proj."""
        # no Linear.__init__: the base keeps the weight in whatever form it chose
        self.base, self.ctx, self.dtype = base, ctx, dtype
        self.out_features, self.in_features = base.out_features, base.in_features
        self.bias = None
        self.members = members
        self.a = [torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device) for _ in members]
        self.b = [torch.zeros(max_loras, c1 - c0, max_rank, dtype=dtype, device=device) for _, c0, c1 in members]
        self.scaling = torch.zeros(len(members), max_loras, dtype=torch.float32, device=device)
        self.has = [[False] * max_loras for _ in members]  # member j is adapted by the slot's adapter
        # the torch path's form, per slot: the adapted members' A stacked [sum r, in] and their B with the scaling
        # folded in, block-diagonal [out, sum r]: one shrink and one expand per adapter segment
        self.a_cat: list[torch.Tensor | None] = [None] * max_loras
        self.b_cat: list[torch.Tensor | None] = [None] * max_loras

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = self.ctx.mapping
        if mapping is None:
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if self.ctx.use_triton:
            self._apply_triton(x2, y2, mapping)
        else:
            self._apply_torch(x2, y2, mapping)
        return y

    def dense_weight(self) -> torch.Tensor:
        return self.base.dense_weight()

    def load(self, slot: int, weights: dict[str, ModuleWeights] | None) -> None:
        """Put one adapter's weights for this projection in `slot` (None: it adapts nothing here)."""
        for j, (name, _c0, _c1) in enumerate(self.members):
            self.a[j][slot].zero_()
            self.b[j][slot].zero_()
            w = weights.get(name) if weights is not None else None
            self.has[j][slot] = w is not None
            self.scaling[j, slot] = w.scaling if w is not None else 0.0
            if w is not None:
                r = w.a.shape[0]
                self.a[j][slot, :r].copy_(w.a)
                self.b[j][slot, :, :r].copy_(w.b)
        self._pack(slot, weights or {})

    def _pack(self, slot: int, weights: dict[str, ModuleWeights]) -> None:
        used = [(c0, c1, weights[name]) for name, c0, c1 in self.members if name in weights]
        if not used:
            self.a_cat[slot] = self.b_cat[slot] = None
            return
        dev = self.a[0].device
        self.a_cat[slot] = torch.cat([w.a for _, _, w in used]).to(dev)
        b = torch.zeros(self.out_features, sum(w.a.shape[0] for _, _, w in used), dtype=self.dtype, device=dev)
        k = 0
        for c0, c1, w in used:
            r = w.a.shape[0]
            b[c0:c1, k : k + r] = (w.b.float() * w.scaling).to(self.dtype)
            k += r
        self.b_cat[slot] = b

    def _apply_torch(self, x2: torch.Tensor, y2: torch.Tensor, mapping: LoRAMapping) -> None:
        """Punica's SGMV as batched torch ops: per adapter segment one gather, one shrink over every adapted member
        (A stacked), one expand (B block-diagonal, scaled) and one scatter-add."""
        for seg in mapping.segments:
            a, b = self.a_cat[seg.slot], self.b_cat[seg.slot]
            if a is None or b is None:
                continue
            whole = seg.rows.shape[0] == x2.shape[0]  # every row under this adapter: no gather, no scatter
            xs = (x2 if whole else x2.index_select(0, seg.rows)).to(self.dtype)
            delta = ((xs @ a.T) @ b.T).to(y2.dtype)
            if whole:
                y2 += delta
            else:
                y2.index_add_(0, seg.rows, delta)

    def _apply_triton(self, x2: torch.Tensor, y2: torch.Tensor, mapping: LoRAMapping) -> None:
        """The same through engine/triton_kernels/lora.py: one shrink and one expand launch per adapted member."""
        from engine.triton_kernels import lora_expand, lora_shrink  # why late: kernel modules read TRITON_INTERPRET

        for j, (_name, c0, c1) in enumerate(self.members):
            if not any(self.has[j][seg.slot] for seg in mapping.segments):
                continue
            h = lora_shrink(x2, self.a[j], mapping.rows, mapping.tiles, mapping.max_rank)
            lora_expand(h, self.b[j], self.scaling[j], y2[:, c0:c1], mapping.rows, mapping.tiles)
