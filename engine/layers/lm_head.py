"""The LM head: final hidden rows [N, hidden] -> float32 logits [N, vocab], the weight held as is fastest.

- GPU: `F.linear` on the [vocab, hidden] weight.
- CPU, bfloat16 (or --quantization int8): one of these forms, chosen by measurement per CPU (engine/cpu_kernels/
  chooser.py: the form that wins the most row classes; a decode step's rows decide a tie):
  "spindle": engine/cpu_kernels' gemm, the weight packed for it once (as is, or weight-only int8); the kernel
  writes the widened float32 logits straight into `out`, its threads sharing the vocabulary.
  "onednn" ("int8pack" with int8): the vocabulary in column chunks, each pre-packed for oneDNN (weight-only int8
  through ATen's kernel), engine/layers/linear.py says why packing pays; the embedding table is kept beside it.
  "amx": AMX tiles of our own (engine/cpu_kernels/gemm_amx.py), the float32 logits written straight into `out`.
  "torch": the weight transposed to [hidden, vocab], which makes the small-batch product faster; a tied
  embedding reads its rows from the head's columns, so the table is stored once.
- CPU otherwise (float32): the "torch" form.

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

from engine.cpu_kernels import chooser, gemm, gemm_amx
from engine.layers.linear import AmxLinear, Int8Linear, Linear, PackedLinear, cpu_packs_bf16, packed_weight
from engine.layers.parallel import WORKERS

LOGIT_CHUNK_BYTES = 1 << 19  # one LM head chunk's float32 logits: half of this CPU's per-core L2
LOGIT_CHUNK_MIN_ROWS = 16  # fewer rows on one thread: the product is small, one matmul is as fast
PACKED_CHUNK_COLS = 8192  # vocabulary columns per pre-packed chunk (its float32 logits at 16 rows: 512 KiB)


def head_forms(weight: torch.Tensor, quantization: str | None) -> tuple[str, ...]:
    """The CPU forms this head weight can take (chooser candidate names)."""
    forms = ["spindle"] if gemm.usable(weight) else []
    if quantization is not None:
        forms.append("int8pack")
    elif weight.dtype == torch.bfloat16 and cpu_packs_bf16():
        forms.append("onednn")
    if quantization is None and gemm_amx.takes(weight):
        forms.append("amx")
    if quantization is None:
        forms.append("torch")
    return tuple(forms)


HEAD_TIMED_ROWS = 64  # the head sees more rows only for prompt logprobs: their class is timed at this many


def _head_bench(heads: dict[str, LMHead], weight: torch.Tensor, quantization: str | None, name: str) -> chooser.Bench:
    def at(rows: int) -> Callable[[], object]:
        rows = min(rows, HEAD_TIMED_ROWS)
        if name not in heads:
            heads[name] = LMHead(weight, quantization, form=name)
        head = heads[name]
        h = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(weight.dtype)
        out = torch.empty(rows, head.vocab, dtype=torch.float32)
        return lambda: head(h, out, WORKERS.pool, WORKERS.threads)

    return at


def choose_head(weight: torch.Tensor, quantization: str | None) -> LMHead:
    """The head in the form that wins on this machine (engine/cpu_kernels/chooser.py); off CPU, LMHead's own."""
    if weight.device.type != "cpu" or len(forms := head_forms(weight, quantization)) < 2:
        return LMHead(weight, quantization)
    heads: dict[str, LMHead] = {}
    try:
        held, _ = chooser.choose_held(
            f"lm_head-{quantization or str(weight.dtype).removeprefix('torch.')}",
            tuple(weight.shape),
            {f: _head_bench(heads, weight, quantization, f) for f in forms},
            {f: f for f in forms},
        )
    except chooser.ChooserError:
        held = forms[-1]
    return heads.get(held) or LMHead(weight, quantization, form=held)


class LMHead:
    def __init__(self, weight: torch.Tensor, quantization: str | None = None, form: str | None = None) -> None:
        """weight [vocab, hidden] in the model's dtype; quantization "int8" quantizes it like the projections.
        On CPU `form` (head_forms()) is what choose_head() measured fastest; None: the first that applies."""
        self.vocab = int(weight.shape[0])
        self.dtype = weight.dtype
        on_cpu = weight.device.type == "cpu"
        if on_cpu and form is None:
            form = head_forms(weight, quantization)[0]
        self.form = form
        self.chunks: list[tuple[int, int, Linear]] = []
        self.transposed: torch.Tensor | None = None  # [hidden, vocab] (CPU, unpacked)
        self.weight: torch.Tensor | None = None  # [vocab, hidden] (GPU)
        self.packed: gemm.PackedWeight | None = None  # (CPU kernel)
        self.amx: AmxLinear | None = None  # (AMX tiles of our own)
        if form == "spindle":
            self.packed = packed_weight(weight, None, quantization)
        elif form == "amx":
            self.amx = AmxLinear(weight)
        elif form in ("onednn", "int8pack"):
            make: Callable[[torch.Tensor], Linear] = Int8Linear if quantization else PackedLinear
            self.chunks = [
                (s, min(s + PACKED_CHUNK_COLS, self.vocab), make(weight[s : s + PACKED_CHUNK_COLS]))
                for s in range(0, self.vocab, PACKED_CHUNK_COLS)
            ]
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

    def __call__(
        self, h: torch.Tensor, out: torch.Tensor | None = None, pool: ThreadPoolExecutor | None = None, workers: int = 1
    ) -> torch.Tensor:
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
        if self.amx is not None:
            out = torch.empty(n, self.vocab, dtype=torch.float32) if out is None else out[:n]
            threads = WORKERS.threads_for(n * self.vocab * h.shape[-1], 2 * self.vocab * h.shape[-1])
            return gemm_amx.matmul(h.contiguous(), self.amx.weight, self.vocab, None, threads, out)
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
                    out[:, start:end].copy_(torch.mm(h, head[:, start:end], out=scratch[:, : end - start]))

        return work
