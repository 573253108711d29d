"""A sparse MoE block: a router picks top-k experts per token, each a gated MLP; outputs are summed by weight.

On CPU the tokens are grouped by expert (one sort, one gather, two matmuls per expert that got tokens, one
sum per token back), never a loop over tokens. On GPU the experts run in engine/triton_kernels/fused_moe.py's Triton
kernels. Under tensor parallelism each rank holds a slice of every expert's intermediate dimension, so
`moe(x)` returns that rank's partial sum and the caller all-reduces it, as after a dense MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.layers.linear import make_linear

Activation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Activation] = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class SparseMoE:
    """router [E, hidden]; gate_up [E, 2 * I, hidden] (each expert's gate rows, then its up rows);
    down [E, hidden, I]. Called as `moe(x)` on x [T, hidden]. The router is a Linear, never quantized (a
    rounded router picks other experts); the experts' weights stay stacked for the grouped products."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        top_k: int,
        norm_topk_prob: bool,
        weights_in_model_dtype: bool,
        activation: str = "silu",
    ) -> None:
        self.router, self.gate_up, self.down = make_linear(router), gate_up, down
        self.num_experts, self.top_k = router.shape[0], top_k
        self.norm_topk_prob = norm_topk_prob
        self.weights_in_model_dtype = weights_in_model_dtype
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.use_triton = False  # the runner turns it on with the Triton ops (CUDA)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k]), as transformers' top-k routers compute them:
        softmax in float32 over every expert, the top k, renormalised when norm_topk_prob."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.use_triton:
            from engine.triton_kernels.fused_moe import fused_moe  # late: triton is imported on the GPU path only

            return fused_moe(x, self.gate_up, self.down, weights, ids, self.activation)
        return grouped_experts(x, self.gate_up, self.down, weights, ids, self.act)


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Activation,
) -> torch.Tensor:
    """Every token's experts, grouped by expert: the torch reference the Triton kernel is tested against.

    x [T, hidden], weights / ids [T, k] -> [T, hidden] in x's dtype."""
    t, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs, grouped by expert
    tokens = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, tokens)
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate, up = F.linear(rows[start : start + n], gate_up[e]).chunk(2, dim=-1)
        out[start : start + n] = F.linear(act(gate) * up, down[e])
        start += n
    # back in (token, slot) order, then each token's k rows summed in one reduction: transformers' grouped
    # experts round this way (float32 weights widen the product, a half-precision sum rounds once)
    scaled = out * weights.flatten().index_select(0, order)[:, None]
    unsorted = torch.empty_like(scaled)
    unsorted[order] = scaled
    return unsorted.view(t, k, -1).sum(dim=1).to(x.dtype)
