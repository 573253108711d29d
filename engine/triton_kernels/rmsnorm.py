"""RMSNorm, plain and fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> rmsnorm(x) * weight, in float32 then cast back first (as transformers rounds)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual) * weight, x + residual)."""
    residual_out = x + residual
    return rms_norm_ref(residual_out, weight, eps), residual_out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     x_stride, res_stride, out_stride, res_out_stride, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype first: the next layer reads the rounded residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    if residual is None:
        return out.view(x.shape), None
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of rms_norm_ref; x [..., hidden] with unit stride on the last dim preferred."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of fused_add_rms_norm_ref: one pass over memory for add + norm."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
