"""Pooling for `--runner pooling`: one output per request from the final norm's output (before the LM head).

LAST takes the prompt's last position, CLS its first, MEAN averages every position, ALL keeps one row per
position, STEP keeps the rows at `step_tag_id` tokens (every row without one) and, with `returned_token_ids`,
those columns only. A classifier's `score` head (engine/models/pooling_archs.py) then maps the pooled state to one
logit per label. With chunked prefill a prompt spans several steps: what CLS / MEAN / ALL / STEP need is kept per
request from chunk to chunk (positions a recompute after preemption repeats are skipped). The output is raw:
normalization and activations are the server's, per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.messages import PooledData
from engine.pooling_config import POOLING_TYPES
from engine.types.sequence import ScheduledSeq, Sequence


@dataclass
class _Partial:
    """A request's pooling so far: positions 0..count-1 seen."""

    count: int = 0
    total: torch.Tensor | None = None  # MEAN: the sum; CLS: position 0's row
    rows: list[torch.Tensor] = field(default_factory=list)  # ALL / STEP: the rows, chunk by chunk


class Pooler:
    def __init__(
        self,
        pooling_type: str = "LAST",
        head: torch.Tensor | None = None,
        step_tag_id: int | None = None,
        returned_token_ids: list[int] | None = None,
    ) -> None:
        """head: a classifier's score weight [labels, hidden] (None: the pooled state is the output)."""
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, not {pooling_type!r}")
        self.pooling_type = pooling_type
        self.head = head.float() if head is not None else None
        self.step_tag_id = step_tag_id
        self.returned_token_ids = returned_token_ids
        self._parts: dict[str, _Partial] = {}

    @property
    def needs_all_rows(self) -> bool:
        """LAST reads each finishing sequence's last row only; the others read every row of the step."""
        return self.pooling_type != "LAST"

    def pool(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> list[tuple[Sequence, PooledData]]:
        """hidden: float32 final-norm states, [total rows, H] (needs_all_rows) or [finishing seqs, H] (LAST).

        Returns the sequences whose prompt this step finished, each with its output.
        """
        if self.pooling_type == "LAST":
            done = [s.seq for s in batch if s.samples]
            return [(seq, self._finish(hidden[i])) for i, seq in enumerate(done)]
        out = []
        row = 0
        for s in batch:
            n = s.num_new_tokens
            self._take(s.seq.request_id, s.start, hidden[row : row + n])
            row += n
            if s.samples:
                part = self._parts.pop(s.seq.request_id)
                assert part.count == s.seq.num_prompt_tokens, "pooling missed positions"
                out.append((s.seq, self._finish(self._reduce(part, s.seq))))
        return out

    def forget(self, request_id: str) -> None:
        """An aborted request's partial pooling."""
        self._parts.pop(request_id, None)

    @property
    def num_partial(self) -> int:
        return len(self._parts)

    def _take(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        part = self._parts.setdefault(request_id, _Partial())
        skip = max(part.count - start, 0)  # a recompute after preemption repeats positions already taken
        if skip >= rows.shape[0]:
            return
        new = rows[skip:]
        kind = self.pooling_type
        if kind == "MEAN":
            s = new.sum(dim=0)
            part.total = s if part.total is None else part.total + s
        elif kind == "CLS":
            if part.count == 0:
                part.total = new[0].clone()
        else:
            part.rows.append(new.clone())  # a view would keep the whole step's states alive
        part.count = start + rows.shape[0]

    def _reduce(self, part: _Partial, seq: Sequence) -> torch.Tensor:
        if self.pooling_type == "MEAN":
            assert part.total is not None
            return part.total / part.count
        if self.pooling_type == "CLS":
            assert part.total is not None
            return part.total
        rows = torch.cat(part.rows)
        if self.pooling_type == "STEP" and self.step_tag_id is not None:
            tags = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], device=rows.device) == self.step_tag_id
            rows = rows[tags]
        return rows

    def _finish(self, pooled: torch.Tensor) -> PooledData:
        if self.head is not None:
            pooled = F.linear(pooled, self.head)
        if self.pooling_type == "STEP" and self.returned_token_ids is not None:
            pooled = pooled[..., self.returned_token_ids]
        arr = np.ascontiguousarray(pooled.detach().cpu().numpy(), dtype="<f4")
        return PooledData(arr.tobytes(), list(arr.shape))
