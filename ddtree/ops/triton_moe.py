"""Routed experts at decode widths on the GPU (models/moe.py `Experts`): the token-expert pairs sorted by
expert, then one program per (held expert, block of output columns) runs that expert over its pairs, so
each expert's weights are read once a step however many of the batch's tokens chose it, and experts
no token chose cost a program that returns at once.

Three kernels: the gate and up products with SiLU(gate) * up over the pairs (`_experts_up_kernel`), the
down product scaled by each pair's routing weight (`_experts_down_kernel`), and each token's sum over
its k pairs in a fixed order (`_sum_pairs_kernel`: no atomics, so the output is deterministic). Pairs
routed to experts another rank holds are left out of the sum.

Grouped products (`torch._grouped_mm`) suit many pairs per expert; these kernels suit a few, where a
grouped product's row tiles are mostly padding: `experts_fit` says which (at most BLOCK_M pairs per
expert on average).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.ops.triton_linear import INTERPRETED

BLOCK_M = 16  # pairs per product tile (tl.dot's smallest)


def experts_fit(pairs: int, held: int) -> bool:
    """Whether `pairs` token-expert pairs over `held` experts take these kernels."""
    return pairs <= BLOCK_M * held


@triton.jit
def _experts_up_kernel(X, stride_x, Order, Starts, Counts, W, H, TOP_K, D, I, PAIRS,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    count = tl.load(Counts + e)
    start = tl.load(Starts + e)
    n_ok = n < I
    gate_rows = W + e.to(tl.int64) * 2 * I * D + n[None, :] * D
    up_rows = gate_rows + I * D
    for m0 in range(0, count, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < count
        pair = tl.load(Order + start + m, mask=m_ok, other=0)
        tokens = pair // TOP_K
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < D
            x = tl.load(X + tokens[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            gate = tl.dot(x, tl.load(gate_rows + k[:, None], mask=w_ok, other=0.0), gate)
            up = tl.dot(x, tl.load(up_rows + k[:, None], mask=w_ok, other=0.0), up)
        # (rounded to the model dtype where the torch path rounds: the products' outputs)
        gate = gate.to(H.dtype.element_ty).to(tl.float32)
        up = up.to(H.dtype.element_ty).to(tl.float32)
        h = gate * tl.sigmoid(gate) * up
        tl.store(H + pair[:, None] * I + n[None, :], h.to(H.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _experts_down_kernel(Hbuf, Order, Starts, Counts, W, Weights, Y, TOP_K, D, I, PAIRS,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    count = tl.load(Counts + e)
    start = tl.load(Starts + e)
    n_ok = n < D
    rows = W + e.to(tl.int64) * D * I + n[None, :] * I
    for m0 in range(0, count, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < count
        pair = tl.load(Order + start + m, mask=m_ok, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < I
            h = tl.load(Hbuf + pair[:, None] * I + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(h, tl.load(rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
        weight = tl.load(Weights + pair, mask=m_ok, other=0.0).to(tl.float32)
        y = acc.to(Y.dtype.element_ty).to(tl.float32) * weight[:, None]
        tl.store(Y + pair[:, None] * D + n[None, :], y.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_pairs_kernel(Y, Local, Out, HELD, D, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        held = tl.load(Local + pair + tl.zeros([BLOCK], tl.int32)) < HELD  # (the pair's flag on every column)
        acc += tl.load(Y + pair * D + c, mask=ok & held, other=0.0).to(tl.float32)
    tl.store(Out + t * D + c, acc.to(Out.dtype.element_ty), mask=ok)


# Column blocks and reduction depth, tried at the first call of each shape and number of pairs rounded up
# to a power of two (a handful of trials, not one per prompt length; the kernels write only their own
# outputs, so the trials are harmless). Triton's interpreter has no timer: there the first runs.
SPLITS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4)
          for n, k in ((32, 128), (64, 64), (32, 256), (64, 128))]
_experts_up = _experts_up_kernel if INTERPRETED else \
    triton.autotune(SPLITS, key=["D", "I", "PAIRS"])(_experts_up_kernel)
_experts_down = _experts_down_kernel if INTERPRETED else \
    triton.autotune(SPLITS, key=["D", "I", "PAIRS"])(_experts_down_kernel)


def routed_experts(x: torch.Tensor, local: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * SiLU-gated expert (x[t]) for the held experts: x [T, D]; `local` [T k]
    each pair's held expert (`held` for another rank's), `order` [T k] the pairs sorted by it, `counts`
    [held] pairs per held expert (models/moe.py `Experts._sorted_pairs`); gate_up [held, 2I, D], down
    [held, D, I], weights [T, k]. Device ops only: the layer can be captured in a CUDA graph."""
    T, top_k = weights.shape
    held, two_i, D = gate_up.shape
    I = two_i // 2
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    starts = (counts.cumsum(0, dtype=torch.int32) - counts).contiguous()
    order = order.to(torch.int32).contiguous()
    h = torch.empty(T * top_k, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * top_k, D, dtype=x.dtype, device=x.device)
    fixed = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4) if INTERPRETED else {}
    pairs = triton.next_power_of_2(T * top_k)  # (the tuning key)
    _experts_up[lambda meta: (held, triton.cdiv(I, meta["BLOCK_N"]))](
        x, x.stride(0), order, starts, counts, gate_up, h, top_k, D, I, pairs, BLOCK_M=BLOCK_M, **fixed)
    _experts_down[lambda meta: (held, triton.cdiv(D, meta["BLOCK_N"]))](
        h, order, starts, counts, down, weights.contiguous(), y, top_k, D, I, pairs, BLOCK_M=BLOCK_M, **fixed)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(D))
    _sum_pairs_kernel[(T, triton.cdiv(D, block))](y, local.contiguous(), out, held, D, TOP_K=top_k, BLOCK=block)
    return out
