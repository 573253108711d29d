"""Fused MoE experts for the GPU path: the (token, expert) pairs grouped by expert in blocks of BLOCK_M rows, then
two kernels over those blocks: gate|up projection + activation + product, and down projection x routing weight.

The torch reference is engine/layers/moe.py's `grouped_experts` (the CPU path); the two agree to rounding.
`align` pads each expert's group to whole blocks, so every block belongs to one expert and reads that expert's
weights once for all its rows; experts that received no token get no block at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (rows [P]: pair index t * k + j, grouped by expert, each group padded to a multiple of
    block_m with the sentinel T * k; experts [P / block_m]: the expert of each block)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    expert = flat[order]
    within = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.long, device=ids.device)
    rows[starts[expert] + within] = order
    experts = torch.repeat_interleave(torch.arange(num_experts, device=ids.device), padded // block_m)
    return rows, experts


@triton.jit
def _act(g: tl.tensor, ACT: tl.constexpr) -> tl.tensor:
    if ACT == 0:
        return g * tl.sigmoid(g)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # gelu, tanh approximation; tanh = 2 sigmoid(2x) - 1
    return 0.5 * g * (2.0 * tl.sigmoid(2.0 * inner))


@triton.jit
def _dot(a: tl.tensor, b: tl.tensor, PRECISION: tl.constexpr, UPCAST: tl.constexpr) -> tl.tensor:
    if UPCAST:  # Triton's interpreter multiplies bfloat16 blocks wrongly; the same products in float32 are exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _block(rows_ptr, experts_ptr, num_pairs, n_limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block: its pair rows, which of them are real (not padding), their expert, and its output
    columns with their mask."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_pairs
    e = tl.load(experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, valid, e, offs_n, offs_n < n_limit


@triton.jit
def _k_slice(ptr, rows, stride, valid, k0, k_limit, BLOCK_K: tl.constexpr):
    """Columns k0.. of the given rows (zeros past k_limit and on padding rows), their offsets and mask."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_limit
    a = tl.load(ptr + rows[:, None] * stride + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
    return a, offs_k, k_ok


@triton.jit
def _gate_up_kernel(
        x_ptr, w_ptr, out_ptr, rows_ptr, experts_ptr, num_pairs, top_k, hidden, inter, stride_x, stride_we, stride_wn,
        stride_out, ACT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = act(x[token] . W[e, n]) * (x[token] . W[e, inter + n]) for one block of one expert's pairs."""
    rows, valid, e, offs_n, n_ok = _block(rows_ptr, experts_ptr, num_pairs, inter, BLOCK_M, BLOCK_N)
    tokens = rows // top_k
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a, offs_k, k_ok = _k_slice(x_ptr, tokens, stride_x, valid, k0, hidden, BLOCK_K)
        w = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        wg = tl.load(w, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w + inter * stride_wn, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g += _dot(a, wg, PRECISION, UPCAST)
        acc_u += _dot(a, wu, PRECISION, UPCAST)
    dtype = out_ptr.dtype.element_ty  # each product rounded to the model dtype first, as torch's are
    h = _act(acc_g.to(dtype).to(tl.float32), ACT) * acc_u.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
        h_ptr, w_ptr, weights_ptr, out_ptr, rows_ptr, experts_ptr, num_pairs, inter, hidden, stride_h, stride_we,
        stride_wn, stride_out, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = (h[pair] . W[e, n]) * routing weight[pair], in float32 (summed over a token's pairs later)."""
    rows, valid, e, offs_n, n_ok = _block(rows_ptr, experts_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a, offs_k, k_ok = _k_slice(h_ptr, rows, stride_h, valid, k0, inter, BLOCK_K)
        w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += _dot(a, w, PRECISION, UPCAST)
    product = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # the expert's output in the model dtype, as torch's
    scale = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], product * scale[:, None],
             mask=valid[:, None] & n_ok[None, :])


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              activation: str = "silu", block_m: int = 16) -> torch.Tensor:
    """x [T, hidden]; gate_up [E, 2 I, hidden]; down [E, hidden, I]; weights / ids [T, k] -> [T, hidden]."""
    t, k = ids.shape
    hidden, inter = x.shape[1], down.shape[2]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    rows, experts = align(ids, gate_up.shape[0], block_m)
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(t * k, hidden, dtype=torch.float32, device=x.device)
    blocks = experts.numel()
    # float32 products exact as torch's (no TF32); half precision inputs take the default
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.device.type == "cpu"  # the interpreter (tests)
    if blocks:
        bn, bk = 32, 32
        blocking = dict(PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk)
        _gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
            x, gate_up, h, rows, experts, t * k, k, hidden, inter, x.stride(0), gate_up.stride(0),
            gate_up.stride(1), h.stride(0), ACT=ACTIVATIONS[activation], **blocking)
        _down_kernel[(blocks, triton.cdiv(hidden, bn))](
            h, down, weights.flatten().contiguous(), out, rows, experts, t * k, inter, hidden, h.stride(0),
            down.stride(0), down.stride(1), out.stride(0), **blocking)
    # a token's k rows summed in one reduction, then rounded once, as the torch path does
    weighted = out if weights.dtype == torch.float32 else out.to(weights.dtype)
    return weighted.view(t, k, hidden).sum(dim=1).to(x.dtype)
