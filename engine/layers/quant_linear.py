"""Projections and embeddings over GGUF weights kept as the file's quantized blocks (engine/gguf/tensor.py's
GGMLWeight): `lin = make_quant_linear(weight, bias, dtype); y = lin(x)`, `emb = QuantEmbedding(weight, dtype)`.

On CPU the blocks are all the memory a weight takes. Two ways to compute a product, chosen per row-count class
by measurement (engine/cpu_kernels/chooser.py):
- "ggml": engine/cpu_kernels/quant_gemm.py reads the blocks and dequantizes them in registers (a decode step
  streams 4-bit blocks: ~3.5x fewer bytes than bf16);
- "dequant": a tile of output rows at a time is dequantized to the activations' dtype and multiplied by torch
  (oneDNN: AMX tiles for a prefill's many rows); the tiles are shared over the step's threads. Never a dense copy
  of the whole weight. It is the only way for a type the kernel refuses (gguf's dequantizer then makes the tiles).
- "dot" and "dot_dequant" (Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K blocks, bfloat16 activations): the same two over
  the blocks repacked for bf16 dot products (engine/cpu_kernels/quant_dot.py; the file's bytes, K-quants up to 4%
  more). Only one layout is held: the chooser keeps the one whose candidates lose least over all row classes
  (chooser.choose_held).
- "dot_tiles" (where AMX tiles run): "dot"'s packed blocks through AMX tiles, each decoded chunk shared by every
  row of the batch. Tiles run from the fewest rows of a class it won (`tiles_from`, in the kernel's type code, so
  the fused decode layer runs what the layer-by-layer path runs).
Neither quantizes the activations: sums are float32, so with float32 activations the result is the
dequantized model's up to summation order (with bfloat16 ones, "dequant" rounds a tile's weights to bfloat16 for
torch's GEMM, where "ggml" keeps them float32). Off CPU, the weight is dequantized at load.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.cpu_kernels import chooser, quant_dot, quant_gemm
from engine.gguf.header import type_name
from engine.gguf.tensor import GGMLWeight, dequantize_blocks
from engine.layers.linear import QUANTIZED_MAKERS, Linear
from engine.layers.parallel import QUANT_WORK, WORKERS

DEQUANT_TILE_BYTES = 512 << 10  # a dequantized tile stays in L2 while torch's GEMM reads it
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# "ggml" is a candidate up to this many rows: above, its tiles of 16 rows dequantize every block again and again
# (6x torch's GEMM on a dequantized tile at 256 rows), and timing it would cost seconds at load. "dequant" from
# DEQUANT_FEWEST_ROWS: below, it dequantizes the whole weight for a few rows, which the products in registers
# already cost at one row; timed under load (its chunks dodge a busy core, an OpenMP team waits for it) it won
# classes of 2-16 rows and made a speculative verification of 6 rows twice as slow (bench/README.md).
GGML_MOST_ROWS = 64
DEQUANT_FEWEST_ROWS = 17
CHOOSER_BYTES = 4 << 20  # the chooser times about this much of a weight's blocks
FORM_OF = {"ggml": "blocks", "dequant": "blocks", "dot": "packed", "dot_tiles": "packed", "dot_dequant": "packed"}
IN_REGISTERS = ("ggml", "dot", "dot_tiles")  # the candidates that read the blocks in the product itself


def dequantize_rows(weight: GGMLWeight, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, end) of the weight, dense [end - start, in] in `dtype`: by the kernel where it takes the type,
    else by gguf's reference dequantizer."""
    data = weight.data[start:end]
    if dtype in KERNEL_DTYPES and quant_gemm.supports(weight.ggml_type):
        return quant_gemm.dequantize(data, weight.ggml_type, weight.shape[1], dtype)
    return dequantize_blocks(data.numpy(), weight.ggml_type, dtype).reshape(end - start, weight.shape[1])


class QuantLinear(Linear):
    """y = x @ W.T + bias with W a GGMLWeight on CPU; x float32 or bfloat16 (others through "dequant"); y in x's
    dtype. The candidate per chooser.ROW_CLASSES is chosen for `dtype` at load, for another dtype at its first
    product (`choice(dtype)`)."""

    def __init__(self, weight: GGMLWeight, bias: torch.Tensor | None, dtype: torch.dtype | None = None) -> None:
        self.ggml, self.dtype = weight, dtype or (bias.dtype if bias is not None else torch.float32)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.kernel = quant_gemm.supports(weight.ggml_type)
        self.nbytes = weight.nbytes
        self.packed: torch.Tensor | None = None  # quant_dot's form of the blocks, where it is the layout held
        self.made_from: weakref.ref[torch.Tensor] | None = None  # the file's blocks, where a tied table shares them
        self.tiles_from = 0  # bf16 products of this many rows or more run through AMX tiles (0: none)
        self._choices: dict[torch.dtype, tuple[str, ...]] = {}
        # the per-step path (a decode step makes ~100 of these calls): the C function and its fixed arguments
        self._raw = quant_gemm.raw_product() if self.kernel else None
        self._args = (weight.ggml_type, weight.data.data_ptr(), weight.data.shape[1], self.out_features)
        self._macs = self.out_features * self.in_features
        self._ggml_rows: dict[torch.dtype, list[bool]] = {}  # rows 0..GGML_MOST_ROWS -> "ggml" chosen
        if dtype is not None:
            self.choice(dtype)

    def choice(self, dtype: torch.dtype) -> tuple[str, ...]:
        """ "ggml" or "dequant" per row class for activations of `dtype` (measured once: chooser.choose)."""
        got = self._choices.get(dtype)
        if got is None:
            got = self._choices[dtype] = self._choose(dtype)
        return got

    def _choose(self, dtype: torch.dtype) -> tuple[str, ...]:
        if not self.kernel or dtype not in KERNEL_DTYPES or self.packed is not None:
            return ("dequant",) * len(chooser.ROW_CLASSES)  # (packed by bf16's choice: its rows dequantized)
        kind = f"ggml_{type_name(self.ggml.ggml_type)}_{str(dtype).removeprefix('torch.')}"
        shape = (self.out_features, self.in_features)

        @functools.cache
        def probe(packed: bool) -> QuantLinear:
            # about CHOOSER_BYTES of blocks, past L2 as a step streams its weights: a big weight (an LM head) on its
            # first rows, a small one repeated (the candidates' costs scale with the rows); made when first timed,
            # so a forced or cached choice copies nothing
            data = self.ggml.data
            if self.nbytes > CHOOSER_BYTES:
                data = data[: max(64, CHOOSER_BYTES // data.shape[1])]
            elif self.nbytes < CHOOSER_BYTES // 2:
                data = data.repeat(CHOOSER_BYTES // self.nbytes, 1)
            lin = QuantLinear(GGMLWeight(self.ggml.ggml_type, (data.shape[0], self.in_features), data), None)
            if packed:
                lin.pack()
            return lin

        def timed(candidate: str, rows_range: tuple[int, int]) -> chooser.Bench:
            def at(rows: int) -> Callable[[], object]:
                lin = probe(FORM_OF[candidate] == "packed")
                run = {"dot_tiles": lin.tiles_into, "ggml": lin.ggml_into, "dot": lin.ggml_into}.get(
                    candidate, lin.dequant_into
                )
                return lin.bench(run, dtype, rows_range)(rows)

            return at

        blocks = {
            "ggml": timed("ggml", (1, GGML_MOST_ROWS)),
            "dequant": timed("dequant", (DEQUANT_FEWEST_ROWS, 1 << 30)),
        }
        if dtype is not torch.bfloat16 or not quant_dot.supports(self.ggml.ggml_type):
            return chooser.choose(kind, shape, blocks)
        dots = {
            "dot": timed("dot", (1, GGML_MOST_ROWS)),
            "dot_dequant": timed("dot_dequant", (DEQUANT_FEWEST_ROWS, 1 << 30)),
        }
        if quant_dot.tiles_usable():
            # a tile holds 16 rows: one row pays for sixteen (2x "dot" where measured), so never a candidate at 1,
            # where a timing on a busy machine could otherwise keep it for every decode step
            dots["dot_tiles"] = timed("dot_tiles", (2, GGML_MOST_ROWS))
        held, winners = chooser.choose_held(kind, shape, blocks | dots, FORM_OF)
        if held == "packed":
            self.pack()
            tiled = [lo for (lo, _), w in zip(chooser.ROW_CLASSES, winners, strict=True) if w == "dot_tiles"]
            self.tiles_from = tiled[0] if tiled else 0
            self._args = (quant_dot.PACKED + self.ggml.ggml_type + (self.tiles_from << quant_dot.TILES_SHIFT),) + (
                self._args[1:]
            )
        return winners

    def pack(self) -> None:
        """Hold quant_dot's packed form of the blocks instead of the file's (their bytes): "dot" and
        "dot_dequant" compute from it, the file's form is let go."""
        if self.packed is None:
            t = self.ggml.ggml_type
            self.packed = quant_dot.pack(self.ggml.data, t, self.in_features)
            rb = self.ggml.data.shape[1]  # the file's form let go: no rows of blocks left
            self.ggml = GGMLWeight(t, (0, self.in_features), torch.empty(0, rb, dtype=torch.uint8))
            self._raw = quant_gemm.raw_product()
            self._args = (
                quant_dot.PACKED + t,
                self.packed.data_ptr(),
                self.packed.numel() // max(1, self.out_features),
                self.out_features,
            )

    def kernel_view(self) -> tuple[int, torch.Tensor, int]:
        """(type code, bytes, row bytes) for spindle_quant_gemm: the file's blocks, or quant_dot.PACKED + type and
        the packed form (its row bytes only a size hint)."""
        code, _, row_bytes, _ = self._args
        return code, (self.ggml.data if self.packed is None else self.packed), row_bytes

    def bench(
        self, run: Callable[[torch.Tensor, torch.Tensor], None], dtype: torch.dtype, rows_range: tuple[int, int]
    ) -> chooser.Bench:
        """chooser.choose's timing of `run` (one of this weight's candidates): rows -> one product of that many
        random rows; raises outside `rows_range`, which the chooser takes as "not a candidate there"."""

        def at(rows: int) -> Callable[[], object]:
            if not rows_range[0] <= rows <= rows_range[1]:  # (the chooser skips a candidate that raises)
                raise ValueError(f"not a candidate at {rows} rows")
            x = torch.randn(rows, self.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            out = torch.empty(rows, self.out_features, dtype=dtype)
            return lambda: run(x, out)

        return at

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        m, dtype = x2.shape[0], x2.dtype
        if (
            self._raw is not None
            and self.bias is None
            and m <= GGML_MOST_ROWS
            and dtype in KERNEL_DTYPES
            and self._ggml_at(dtype)[m]
            and x2.is_contiguous()
            and x2.shape[1] == self.in_features
        ):
            ggml_type, w, rb, n = self._args
            out = torch.empty((m, n), dtype=dtype)
            bf16 = dtype is torch.bfloat16
            if self._raw(
                ggml_type,
                x2.data_ptr(),
                bf16,
                self.in_features,
                m,
                self.in_features,
                w,
                rb,
                n,
                out.data_ptr(),
                bf16,
                n,
                WORKERS.threads_for(QUANT_WORK * m * self._macs, self.nbytes),
            ):
                raise ValueError(f"the quantized kernel refused {type_name(ggml_type)}")
        else:
            out = torch.empty(m, self.out_features, dtype=dtype)
            self.into(x2.reshape(-1, self.in_features), out)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def runs_kernel(self, rows: int) -> bool:
        """Whether a bf16 call of `rows` rows runs the block kernel (engine/models/fused_decode.py asks)."""
        return self._raw is not None and 0 < rows <= GGML_MOST_ROWS and self._ggml_at(torch.bfloat16)[rows]

    def _ggml_at(self, dtype: torch.dtype) -> list[bool]:
        got = self._ggml_rows.get(dtype)
        if got is None:
            picked = self.choice(dtype)
            got = [picked[chooser.row_class(r)] in IN_REGISTERS for r in range(GGML_MOST_ROWS + 1)]
            self._ggml_rows[dtype] = got
        return got

    def into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, out_features] (a view with unit column stride may do) = x2 [M, in_features] @ W.T + bias, in
        x2's dtype: float32 sums, the bias added, one rounding."""
        if self.choice(x2.dtype)[chooser.row_class(x2.shape[0])] not in IN_REGISTERS:
            self.dequant_into(x2, out, self.bias)
        elif self.bias is None:
            self.ggml_into(x2, out)
        elif out.dtype is torch.float32:
            self.ggml_into(x2, out)
            out.add_(self.bias)
        else:
            wide = torch.empty(out.shape, dtype=torch.float32)
            self.ggml_into(x2, wide)
            out.copy_(wide.add_(self.bias.float()))

    def ggml_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        threads = WORKERS.threads_for(QUANT_WORK * x2.shape[0] * self._macs, self.nbytes)
        if self.packed is not None:
            quant_dot.matmul(x2, self.packed, self.ggml.ggml_type, self.out_features, out, threads, self.tiles_from)
        else:
            quant_gemm.matmul(x2, self.ggml.data, self.ggml.ggml_type, out, threads)

    def tiles_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """The packed blocks' product through AMX tiles at any row count (the chooser times it so)."""
        assert self.packed is not None
        threads = WORKERS.threads_for(QUANT_WORK * x2.shape[0] * self._macs, self.nbytes)
        quant_dot.matmul(x2.contiguous(), self.packed, self.ggml.ggml_type, self.out_features, out, threads, 1)

    def dequant_into(self, x2: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """A tile of output rows at a time: dequantized to x's dtype, multiplied by torch, on every thread."""
        tile = max(16, DEQUANT_TILE_BYTES // (self.in_features * x2.element_size()) // 16 * 16)
        tiles = iter(range(0, self.out_features, tile))
        b = None if bias is None else bias.to(x2.dtype)

        def work() -> None:
            for start in tiles:
                end = min(start + tile, self.out_features)
                w = self.rows(start, end, x2.dtype)
                out[:, start:end] = F.linear(x2, w, None if b is None else b[start:end])

        if x2.shape[0]:
            WORKERS.run(work)

    def rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of the weight, dense in `dtype`, from whichever form is held."""
        if self.packed is None:
            return dequantize_rows(self.ggml, start, end, dtype)
        t, n = self.ggml.ggml_type, self.out_features
        if dtype in KERNEL_DTYPES:
            return quant_dot.dequantize(self.packed, t, n, self.in_features, start, end, dtype)
        return quant_dot.dequantize(self.packed, t, n, self.in_features, start, end, torch.float32).to(dtype)

    def dense_weight(self) -> torch.Tensor:
        return self.rows(0, self.out_features, self.dtype)


class QuantPartsLinear(Linear):
    """A fused projection whose parts differ in type (q|k|v, gate|up): each part's product into its columns."""

    def __init__(self, parts: Sequence[GGMLWeight], bias: torch.Tensor | None, dtype: torch.dtype | None) -> None:
        if not parts or any(p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError("fused parts need one input width")
        self.parts: list[tuple[int, int, QuantLinear]] = []
        start = 0
        for p in parts:
            end = start + p.shape[0]
            self.parts.append((start, end, QuantLinear(p, None if bias is None else bias[start:end], dtype)))
            start = end
        self.out_features, self.in_features = start, parts[0].shape[1]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype)
        for start, end, lin in self.parts:
            lin.into(x2, out[:, start:end])
        return out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([lin.dense_weight() for _, _, lin in self.parts])


def make_quant_linear(
    weight: GGMLWeight | Sequence[GGMLWeight], bias: torch.Tensor | None, dtype: torch.dtype | None = None
) -> Linear:
    """The Linear for a GGUF weight (or fused parts of differing types): kept quantized on CPU, its kernels
    chosen for activations of `dtype` (None: at the first product of each dtype); off CPU dequantized at load to
    `dtype` (default: the bias's, else float32), a plain Linear on the weight's device."""
    parts = [weight] if isinstance(weight, GGMLWeight) else list(weight)
    if any(p.data.device.type != "cpu" for p in parts):
        to = dtype or (bias.dtype if bias is not None else torch.float32)
        dense = torch.cat([p.dequantize(to).to(p.data.device) for p in parts])
        return Linear(dense, None if bias is None else bias.to(dense.device, to))
    lin: QuantLinear | QuantPartsLinear = (
        QuantLinear(parts[0], bias, dtype) if len(parts) == 1 else QuantPartsLinear(parts, bias, dtype)
    )
    if dtype is None:  # chosen before the engine says Ready (unchosen()), not by the first request's step
        _UNCHOSEN.update([lin] if isinstance(lin, QuantLinear) else [q for _, _, q in lin.parts])
    return lin


_UNCHOSEN: weakref.WeakSet[QuantLinear] = weakref.WeakSet()  # made without an activation dtype


def unchosen(dtype: torch.dtype) -> list[QuantLinear]:
    """The live projections whose kernels for activations of `dtype` are not chosen yet (make_quant_linear's
    without a dtype: a GGUF model's, chosen at their first product unless start-up asks first)."""
    return [lin for lin in list(_UNCHOSEN) if dtype not in lin._choices]


def _from_make_linear(weight: GGMLWeight | Sequence[GGMLWeight], bias: torch.Tensor | None) -> Linear:
    return make_quant_linear(weight, bias)


QUANTIZED_MAKERS.append(_from_make_linear)  # engine/layers/linear.py's make_linear hands GGUF weights here


class QuantEmbedding:
    """An embedding table kept as blocks: `emb(ids)` gives the rows of `ids` dequantized to `dtype` (exactly
    gguf's weights, rounded once to `dtype`); only the rows asked for are dequantized. With `source`, a tied LM
    head's QuantLinear holding the table packed (quant_dot), the rows come from that form and the file's blocks are
    not kept a second time."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype, source: QuantLinear | None = None) -> None:
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.source = source if source is not None and source.packed is not None else None
        self.weight: GGMLWeight | None = weight if self.source is None else None
        self.nbytes = weight.nbytes if self.source is None else 0  # (the head counts the packed table)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.long)
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        unique, inverse = torch.unique(flat, return_inverse=True)
        dense = self._rows(unique.cpu()).to(ids.device)
        return dense.index_select(0, inverse.to(dense.device)).view(*ids.shape, self.embedding_dim)

    def _rows(self, unique: torch.Tensor) -> torch.Tensor:
        packed = None if self.source is None else self.source.packed
        if self.source is not None and packed is not None:
            t, n = self.source.ggml.ggml_type, self.source.out_features
            if self.dtype in KERNEL_DTYPES:
                return quant_dot.gather(packed, t, n, self.embedding_dim, unique, self.dtype)
            return quant_dot.gather(packed, t, n, self.embedding_dim, unique, torch.float32).to(self.dtype)
        assert self.weight is not None
        rows = self.weight.data.index_select(0, unique.to(self.weight.data.device)).cpu().contiguous()
        part = GGMLWeight(self.weight.ggml_type, (rows.shape[0], self.embedding_dim), rows)
        return dequantize_rows(part, 0, rows.shape[0], self.dtype)

    def dense_weight(self) -> torch.Tensor:
        if self.weight is None:
            return self._rows(torch.arange(self.num_embeddings))
        return dequantize_rows(self.weight, 0, self.num_embeddings, self.dtype)
