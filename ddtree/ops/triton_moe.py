"""Routed experts at decode widths on the GPU (models/moe.py): a handful of kernels a layer, so a decode
step's MoE layer is not a long row of small launches.

- `softmax_topk`: each token's router logits to its top-k experts and their weights (softmax, then
  renormalised over the k where the config says so), one program a token.
- `routed_experts`: one program per (held expert, block of output columns) runs that expert over the
  pairs (token, j) that chose it, so each chosen expert's weights are read once a step however many
  tokens chose it, and an expert no token chose costs a program that returns at once. A program finds
  its pairs itself: it reads the step's P expert ids, and row r of its tile takes the pair whose running
  count of matches is r + 1 (no sort, no index lists between kernels). Three kernels: SiLU(gate) * up,
  then down times the pair's routing weight, then each token's sum over its k pairs in a fixed order (no
  atomics: the output is deterministic). Pairs routed to experts another rank holds are left out.

Grouped products suit many pairs per expert; these kernels suit a few, where a grouped product's row
tiles are mostly padding: `experts_fit` says which (at most BLOCK_M pairs per expert on average).
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
def _softmax_topk_kernel(Logits, stride_l, Experts, Weights, E, TOP_K: tl.constexpr, KP: tl.constexpr,
                         NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    left = tl.where(e < E, probs, -1.0)
    j = tl.arange(0, KP)
    picks = tl.zeros([KP], tl.int64)
    best = tl.zeros([KP], tl.float32)
    for i in tl.static_range(TOP_K):  # the best left, lowest index first among equals
        top = tl.max(left, 0)
        pick = tl.min(tl.where(left == top, e, BLOCK_E), 0)
        picks = tl.where(j == i, pick, picks)
        best = tl.where(j == i, top, best)
        left = tl.where(e == pick, -1.0, left)
    if NORM:
        best = best / tl.sum(best, 0)
    tl.store(Experts + t * TOP_K + j, picks, mask=j < TOP_K)
    tl.store(Weights + t * TOP_K + j, best, mask=j < TOP_K)


def softmax_topk(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, k] int64, weights [T, k] float32) of router logits [T, E]: the k likeliest by softmax
    probability, renormalised over the k when `normalise`."""
    T, E = logits.shape
    experts = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    assert logits.stride(1) == 1
    _softmax_topk_kernel[(T,)](logits, logits.stride(0), experts, weights, E, TOP_K=top_k,
                               KP=triton.next_power_of_2(top_k), NORM=normalise, BLOCK_E=triton.next_power_of_2(E))
    return experts, weights


@triton.jit
def _my_pairs(Ids, FIRST, P, PP: tl.constexpr):
    """This program's expert (program 0's index, the model's numbering less FIRST): which of the P pairs
    chose it, their running count, and how many."""
    p = tl.arange(0, PP)
    mine = (tl.load(Ids + p, mask=p < P, other=-1) - FIRST) == tl.program_id(0)
    ranks = tl.cumsum(mine.to(tl.int32), 0)
    return p, mine, ranks, tl.sum(mine.to(tl.int32), 0)


@triton.jit
def _tile_pairs(p, mine, ranks, m0, count, BLOCK_M: tl.constexpr):
    """The pairs of tile rows m0 .. m0 + BLOCK_M - 1 (row r: the pair whose running count is r + 1)."""
    m = m0 + tl.arange(0, BLOCK_M)
    hit = mine[None, :] & (ranks[None, :] == m[:, None] + 1)
    return tl.sum(tl.where(hit, p[None, :], 0), 1), m < count


@triton.jit
def _experts_up_kernel(X, stride_x, Ids, FIRST, P, W, H, TOP_K, D, I, PP: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    p, mine, ranks, count = _my_pairs(Ids, FIRST, P, PP)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    gate_rows = W + tl.program_id(0).to(tl.int64) * 2 * I * D + n[None, :] * D
    up_rows = gate_rows + I * D
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _tile_pairs(p, mine, ranks, m0, count, BLOCK_M)
        tokens = pair // TOP_K
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < D
            x = tl.load(X + tokens[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            gate = tl.dot(x, tl.load(gate_rows + k[:, None], mask=w_ok, other=0.0), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.load(up_rows + k[:, None], mask=w_ok, other=0.0), up, input_precision=PRECISION)
        # (rounded to the model dtype where the torch path rounds: the products' outputs)
        gate = gate.to(H.dtype.element_ty).to(tl.float32)
        up = up.to(H.dtype.element_ty).to(tl.float32)
        h = gate * tl.sigmoid(gate) * up
        tl.store(H + pair[:, None] * I + n[None, :], h.to(H.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _experts_down_kernel(Hbuf, Ids, FIRST, P, W, Weights, Y, D, I, PP: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    p, mine, ranks, count = _my_pairs(Ids, FIRST, P, PP)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    rows = W + tl.program_id(0).to(tl.int64) * D * I + n[None, :] * I
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _tile_pairs(p, mine, ranks, m0, count, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < I
            h = tl.load(Hbuf + pair[:, None] * I + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        weight = tl.load(Weights + pair, mask=m_ok, other=0.0).to(tl.float32)
        y = acc.to(Y.dtype.element_ty).to(tl.float32) * weight[:, None]
        tl.store(Y + pair[:, None] * D + n[None, :], y.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_pairs_kernel(Y, Ids, FIRST, HELD, Out, D, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        local = tl.load(Ids + pair + tl.zeros([BLOCK], tl.int32)) - FIRST  # (the pair's expert on every column)
        acc += tl.load(Y + pair * D + c, mask=ok & (local >= 0) & (local < HELD), other=0.0).to(tl.float32)
    tl.store(Out + t * D + c, acc.to(Out.dtype.element_ty), mask=ok)


# Column blocks and reduction depth, tried at the first call of each shape and number of pairs rounded up
# to a power of two (a handful of trials, not one per prompt length; the kernels write only their own
# outputs, so the trials are harmless). Triton's interpreter has no timer: there the first runs.
SPLITS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4)
          for n, k in ((32, 128), (64, 64), (32, 256), (64, 128))]
_experts_up = _experts_up_kernel if INTERPRETED else \
    triton.autotune(SPLITS, key=["D", "I", "PP"])(_experts_up_kernel)
_experts_down = _experts_down_kernel if INTERPRETED else \
    triton.autotune(SPLITS, key=["D", "I", "PP"])(_experts_down_kernel)


def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, first: int) -> torch.Tensor:
    """sum over k of weights[t, k] * SiLU-gated expert experts[t, k] (x[t]), over the experts held here
    (the model's numbers first .. first + held - 1): x [T, D], experts and weights [T, k], gate_up [held,
    2I, D], down [held, D, I]. Device ops only: the layer can be captured in a CUDA graph."""
    T, top_k = experts.shape
    held, two_i, D = gate_up.shape
    I, P = two_i // 2, T * top_k
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    ids = experts.contiguous()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    PP = max(16, triton.next_power_of_2(P))  # (also the tuning key)
    # (float32 models: three TF32 products carry float32's precision)
    common = dict(PP=PP, PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M)
    if INTERPRETED:
        common.update(BLOCK_N=32, BLOCK_K=32, num_warps=4)
    _experts_up[lambda meta: (held, triton.cdiv(I, meta["BLOCK_N"]))](
        x, x.stride(0), ids, first, P, gate_up, h, top_k, D, I, **common)
    _experts_down[lambda meta: (held, triton.cdiv(D, meta["BLOCK_N"]))](
        h, ids, first, P, down, weights.contiguous(), y, D, I, **common)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(D))
    _sum_pairs_kernel[(T, triton.cdiv(D, block))](y, ids, first, held, out, D, TOP_K=top_k, BLOCK=block)
    return out
