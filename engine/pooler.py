"""Pooling for `--runner pooling`: one embedding per request from the final norm's output (before the LM head).

LAST takes the prompt's last token; MEAN averages every prompt position, summed chunk by chunk, since with
chunked prefill a long prompt spans several steps. The runner hands over the final-norm hidden states of the
rows `needs_all_rows` asks for (all rows for MEAN, the rows that finish a prompt for LAST), in batch order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.sequence import ScheduledSeq, Sequence


class Pooler:
    def __init__(self, pooling_type: str = "LAST", normalize: bool = True) -> None:
        if pooling_type not in ("LAST", "MEAN"):
            raise ValueError(f"pooling_type must be LAST or MEAN, not {pooling_type!r}")
        self.pooling_type = pooling_type
        self.normalize = normalize
        # MEAN: request id -> (sum of the positions seen so far, how many: positions 0..count-1)
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def needs_all_rows(self) -> bool:
        """MEAN reads every row of the step; LAST only each finishing sequence's last row."""
        return self.pooling_type == "MEAN"

    def pool(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> list[tuple[Sequence, list[float]]]:
        """hidden: float32 final-norm states, [total rows, H] (MEAN) or [finishing seqs, H] (LAST).

        Returns the sequences whose prompt this step finished, each with its embedding.
        """
        if self.pooling_type == "LAST":
            done = [s.seq for s in batch if s.samples]
            return list(zip(done, self._finish(hidden[:len(done)])))
        done, vectors = [], []
        row = 0
        for s in batch:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            total, count = self._sums.get(seq.request_id, (None, 0))
            # a recompute after preemption repeats positions already summed: skip those
            skip = max(count - start, 0)
            if skip < n:
                part = hidden[row + skip:row + n].sum(dim=0)
                total = part if total is None else total + part
                count = start + n
            row += n
            if s.samples:
                self._sums.pop(seq.request_id, None)
                assert total is not None and count == seq.num_prompt_tokens, "MEAN pooling missed positions"
                done.append(seq)
                vectors.append(total / count)
            else:
                assert total is not None
                self._sums[seq.request_id] = (total, count)
        return list(zip(done, self._finish(torch.stack(vectors)))) if done else []

    def forget(self, request_id: str) -> None:
        """An aborted request's partial sum."""
        self._sums.pop(request_id, None)

    def _finish(self, vectors: torch.Tensor) -> list[list[float]]:
        if self.normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        out: list[list[float]] = vectors.tolist()
        return out
