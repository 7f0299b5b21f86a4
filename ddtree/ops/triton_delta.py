"""One decode step of the gated delta rule (hybrid models' linear layers, models/hybrid.py) in one
kernel, updating each request's recurrent state in place in its slot.

Per request r and value head h, with S its [Dk, Dv] state (float32):

    S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q

q and k arrive L2-normalised (q also scaled by 1 / sqrt(Dk)) and repeated per value head. One program
takes one (request, head, slice of BLOCK_V value columns): the columns of S are independent, so a
slice needs only its own columns, read once and written once. A request whose state is fresh (nothing
cached before this token) starts from zeros, whatever its slot holds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_step_kernel(State, Slots, Fresh, Q, K, V, G, Beta, Out, stride_slot, stride_head,
                       HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, DK)
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    row = r * HEADS + h
    base = State + tl.load(Slots + r).to(tl.int64) * stride_slot + h * stride_head
    ptrs = base + dk[:, None] * DV + dv[None, :]
    s = tl.load(ptrs).to(tl.float32)
    s = tl.where(tl.load(Fresh + r) != 0, 0.0, s)
    q = tl.load(Q + row * DK + dk).to(tl.float32)
    k = tl.load(K + row * DK + dk).to(tl.float32)
    v = tl.load(V + row * DV + dv).to(tl.float32)
    s = s * tl.exp(tl.load(G + row).to(tl.float32))
    delta = (v - tl.sum(s * k[:, None], 0)) * tl.load(Beta + row).to(tl.float32)
    s = s + k[:, None] * delta[None, :]
    tl.store(ptrs, s)
    tl.store(Out + row * DV + dv, tl.sum(s * q[:, None], 0))


def delta_step(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """state [slots, H, Dk, Dv] float32, updated in place at rows `slots` [R]; fresh [R] (nonzero: start
    from zeros); q, k [R, H, Dk]; v [R, H, Dv]; g, beta [R, H]. Returns the outputs [R, H, Dv] float32."""
    R, H, DK = q.shape
    DV = v.shape[-1]
    assert state.dtype == torch.float32 and state.stride(3) == 1 and state.stride(2) == DV
    block_v = min(DV, 32)
    out = torch.empty(R, H, DV, dtype=torch.float32, device=q.device)
    _delta_step_kernel[(R, H, triton.cdiv(DV, block_v))](
        state, slots.contiguous(), fresh.to(torch.int32).contiguous(), q.float().contiguous(), k.float().contiguous(),
        v.float().contiguous(), g.float().contiguous(), beta.float().contiguous(), out,
        state.stride(0), state.stride(1), HEADS=H, DK=DK, DV=DV, BLOCK_V=block_v)
    return out
