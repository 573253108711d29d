"""The gated delta rule's decode update for single-token rows, the states advanced in place at their slots.

As transformers' torch_recurrent_gated_delta_rule for one token (q and k l2-normed in float32, q scaled by
1/sqrt(d_k), a key head serving num_v / num_k value heads). On CPU, where engine/cpu_kernels/delta_rule.cpp runs,
each state is read once and written once, at its slot; elsewhere (a GPU, no kernel) the torch form below, without
the reference's per-call copies: the state is decayed and updated where it lies (a view of the slots' states where
they are consecutive, else one gather and one scatter) and the two reductions over d_k run as batched products.
"""

from __future__ import annotations

import torch

from engine.cpu_kernels import delta_rule
from engine.layers.parallel import WORKERS

# the kernel's states from which a call takes the step's threads: a smaller update (Qwen3.5-0.8B at batch 1: 1 MB,
# ~0.1 ms) saves less than a team's join costs when another process holds a core (bench/README.md, "Hybrid decode
# against the memory bound")
TEAM_STATE_BYTES = 4 << 20


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _first_of_run(slots: torch.Tensor) -> int | None:
    """The first slot where `slots` are consecutive (their states a view, no gather), else None; on CPU only, as
    reading the slots syncs a GPU."""
    if slots.device.type != "cpu":
        return None
    got = slots.tolist()
    return got[0] if got == list(range(got[0], got[0] + len(got))) else None


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; states [slots, Hv, dk, dv] float32 -> out [B, Hv, dv]
    in v's dtype; the rows' states (at `slots`, distinct) advanced in place."""
    if delta_rule.usable(q, k, v, states):
        state_bytes = v.shape[0] * states[0].numel() * states.element_size()
        threads = WORKERS.threads if state_bytes >= TEAM_STATE_BYTES else 1
        return delta_rule.decode(q, k, v, g, beta, states, slots, threads)
    return torch_delta_rule_decode(q, k, v, g, beta, states, slots)


def torch_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """delta_rule_decode in torch ops (any device)."""
    b, hv, dv = v.shape
    dk = k.shape[-1]
    rep = hv // k.shape[1]
    qf, kf = (x.float() if rep == 1 else x.float().repeat_interleave(rep, dim=1) for x in (q, k))
    qf, kf = _l2norm(qf) / (dk**0.5), _l2norm(kf)
    first = _first_of_run(slots)
    s = states.index_select(0, slots) if first is None else states[first : first + b]
    s.mul_(g.float().exp()[..., None, None])
    flat = s.view(b * hv, dk, dv)
    kv_mem = torch.bmm(kf.reshape(b * hv, 1, dk), flat).view(b, hv, dv)
    delta = (v.float() - kv_mem) * beta.float().unsqueeze(-1)
    flat.baddbmm_(kf.reshape(b * hv, dk, 1), delta.view(b * hv, 1, dv))
    out = torch.bmm(qf.reshape(b * hv, 1, dk), flat).view(b, hv, dv)
    if first is None:
        states.index_copy_(0, slots, s)
    return out.to(v.dtype)
