"""The LM head: final hidden rows [N, hidden] -> float32 logits [N, vocab], the weight held as is fastest.

- GPU: `F.linear` on the [vocab, hidden] weight.
- CPU, bfloat16 with engine/cpu_kernels' gemm: the weight packed for it once (as is, or weight-only int8 with
  --quantization int8); the kernel writes the widened float32 logits straight into `out`, its threads sharing
  the vocabulary.
- CPU, bfloat16 with native bf16 but no kernel: the vocabulary in column chunks, each pre-packed for oneDNN
  (engine/layers/linear.py says why packing pays); the embedding table is kept beside it.
- CPU with --quantization int8 and no kernel: as bfloat16, each chunk weight-only int8 (engine/layers/linear.py).
- CPU otherwise: the weight transposed to [hidden, vocab], which makes the small-batch product faster;
  a tied embedding reads its rows from the head's columns, so the table is stored once.

On CPU the product runs in cache-sized column chunks: each chunk's product lands in a small scratch that
stays in L2 and is widened into `out` from there; one [N, vocab] product would stream through memory twice
(written, then read back by .float()) and fault in fresh pages every step. Threads of a pool take chunks as
they come free, so a core that another process holds for a while slows only its own chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemm
from engine.layers.linear import Int8Linear, Linear, PackedLinear, cpu_packs_bf16, packed_weight
from engine.layers.parallel import WORKERS

LOGIT_CHUNK_BYTES = 1 << 19  # one LM head chunk's float32 logits: half of this CPU's per-core L2
LOGIT_CHUNK_MIN_ROWS = 16  # fewer rows on one thread: the product is small, one matmul is as fast
PACKED_CHUNK_COLS = 8192  # vocabulary columns per pre-packed chunk (its float32 logits at 16 rows: 512 KiB)


class LMHead:
    def __init__(self, weight: torch.Tensor, quantization: str | None = None) -> None:
        """weight [vocab, hidden] in the model's dtype; quantization "int8" quantizes it like the projections."""
        self.vocab = int(weight.shape[0])
        self.dtype = weight.dtype
        on_cpu = weight.device.type == "cpu"
        chunked = on_cpu and (quantization is not None or (weight.dtype == torch.bfloat16 and cpu_packs_bf16()))
        self.chunks: list[tuple[int, int, Linear]] = []
        self.transposed: torch.Tensor | None = None  # [hidden, vocab] (CPU, unpacked)
        self.weight: torch.Tensor | None = None  # [vocab, hidden] (GPU)
        self.packed: gemm.PackedWeight | None = None  # (CPU kernel)
        if gemm.usable(weight):
            self.packed = packed_weight(weight, None, quantization)
        elif chunked:
            make: Callable[[torch.Tensor], Linear] = Int8Linear if quantization else PackedLinear
            self.chunks = [(s, min(s + PACKED_CHUNK_COLS, self.vocab), make(weight[s:s + PACKED_CHUNK_COLS]))
                           for s in range(0, self.vocab, PACKED_CHUNK_COLS)]
        elif on_cpu:
            self.transposed = weight.t().contiguous()
        elif quantization is not None:
            raise ValueError(f"--quantization {quantization} runs on CPU only")
        else:
            self.weight = weight
        # whether __call__ can write into a caller's [N, vocab] float32 buffer (CPU)
        self.fills_out = on_cpu

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows [len(ids), hidden] of a tied embedding read from the head, or None when it is not stored so."""
        if self.transposed is None:
            return None
        return self.transposed.index_select(1, ids).t().contiguous()

    def __call__(self, h: torch.Tensor, out: torch.Tensor | None = None, pool: ThreadPoolExecutor | None = None,
                 workers: int = 1) -> torch.Tensor:
        """h [N, hidden] (normed) -> float32 logits [N, vocab], in `out` when given (CPU).

        Rounds exactly as `(h @ head).float()`: the product is in the model's dtype, then widened.
        `pool` with `workers` > 1: that many threads (this one included) share the column chunks (torch's
        forms; the CPU kernel shares them over its own OpenMP threads and takes neither)."""
        if self.weight is not None:
            return F.linear(h, self.weight).float()
        n = h.shape[0]
        if self.packed is not None:
            if out is None:
                out = torch.empty(n, self.vocab, dtype=torch.float32)
            k = h.shape[-1]
            return self.packed(h, WORKERS.threads_for(n * self.vocab * k, self.packed.nbytes), out)
        if out is None or (n < LOGIT_CHUNK_MIN_ROWS and pool is None and not self.chunks):
            if self.transposed is not None:
                return (h @ self.transposed).float()
            out = torch.empty(n, self.vocab, dtype=torch.float32, device=h.device)
        work = self._packed_work(h, out) if self.chunks else self._transposed_work(h, out, workers)
        helpers = [pool.submit(work) for _ in range(workers - 1)] if pool is not None else []
        work()
        for f in helpers:
            f.result()
        return out

    def _packed_work(self, h: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        chunks = iter(self.chunks)  # shared: each next() is atomic under the GIL

        def work() -> None:
            with torch.inference_mode():
                for start, end, lin in chunks:
                    out[:, start:end].copy_(lin(h))
        return work

    def _transposed_work(self, h: torch.Tensor, out: torch.Tensor, workers: int) -> Callable[[], None]:
        assert self.transposed is not None
        head, n, vocab = self.transposed, h.shape[0], self.vocab
        # at least two chunks per worker, so a worker that another process holds back can be covered
        cols = max(min(LOGIT_CHUNK_BYTES // (4 * n), -(-vocab // (2 * max(workers, 1)))), 1024)
        starts = iter(range(0, vocab, cols))

        def work() -> None:
            with torch.inference_mode():
                scratch = torch.empty(n, min(cols, vocab), dtype=h.dtype, device=h.device)
                for start in starts:
                    end = min(start + cols, vocab)
                    out[:, start:end].copy_(torch.mm(h, head[:, start:end], out=scratch[:, :end - start]))
        return work
