"""One step's token -> adapter slot mapping, built once by the runner and read by every LoRA layer.

As Punica's: the rows of the flat batch that use an adapter, sorted by slot into segments (rows of one
adapter together), so each layer runs one shrink (x @ A) and one expand (@ B) per segment. Rows of the base
model are in no segment. `tiles` cuts the segments into pieces of at most TILE rows for the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 16  # rows per Triton program (engine/triton_kernels/lora.py): tl.dot's smallest side


@dataclass(frozen=True)
class Segment:
    slot: int
    rank: int  # the slot's adapter's largest rank: columns past it are zero
    rows: torch.Tensor  # [n] long: the flat batch's rows using this adapter


@dataclass(frozen=True)
class LoRAMapping:
    segments: tuple[Segment, ...]
    rows: torch.Tensor  # [N] long: every adapter row, sorted by slot (the segments' rows, concatenated)
    # the Triton kernels' work list: [num tiles, 3] int32 (slot, first index into rows, row count <= TILE)
    tiles: torch.Tensor
    max_rank: int


def build_mapping(
    row_slots: list[tuple[int, int, int]], ranks: dict[int, int], device: torch.device
) -> LoRAMapping | None:
    """row_slots: (first row, rows, slot or -1) per sequence of the batch; ranks: slot -> rank.
    None when no row uses an adapter (the base-only fast path: the LoRA layers call the base alone)."""
    by_slot: dict[int, list[int]] = {}
    for first, n, slot in row_slots:
        if slot >= 0 and n > 0:
            by_slot.setdefault(slot, []).extend(range(first, first + n))
    if not by_slot:
        return None
    order = sorted(by_slot)
    flat: list[int] = []
    tiles: list[tuple[int, int, int]] = []
    for slot in order:
        start, n = len(flat), len(by_slot[slot])
        flat += by_slot[slot]
        tiles += [(slot, start + t, min(TILE, n - t)) for t in range(0, n, TILE)]
    rows = torch.tensor(flat, dtype=torch.long, device=device)
    segments, start = [], 0
    for slot in order:
        n = len(by_slot[slot])
        segments.append(Segment(slot, ranks[slot], rows[start : start + n]))
        start += n
    return LoRAMapping(
        tuple(segments),
        rows,
        torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 3),
        max(ranks[s] for s in order),
    )


class LoRAContext:
    """What every LoRA layer of one model reads: the step's mapping (None: base only) and the path (torch or
    Triton). The runner sets the mapping before the forward pass and clears it after."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None
        self.use_triton = False
