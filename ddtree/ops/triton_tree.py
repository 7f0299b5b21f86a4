"""DDTree's candidate levels (speculative/tree.py `_levels`) in one kernel, one program per request.

The torch version is a stable sort of W x K candidates per depth (14 levels for a 16-token block)
and a final sort of the D x W kept nodes: ~60 kernels, each with a fixed cost however small its sort,
which add up to a sizeable share of a graphed DDTree step. Here each request's levels run in one
program: per depth a bitonic sort of the W x K candidates (padded to powers of two) in registers,
the best W kept for the next depth and written out; then one sort of all kept nodes for the order.

The depth loop is a device loop, not unrolled: unrolled, the body is repeated for every depth and the
kernel builds dozens of times slower. A graphed DDTree step is shorter with it up to the widths and
top-k of speculative/tree.py `TREE_KERNEL_MAX_WIDTH` and `TREE_KERNEL_MAX_TOPK`.

Sort keys make the result match the torch version's stable sorts exactly: a float32 score becomes
an int32 that orders like it, shifted above the complement of the candidate's index, so equal
scores keep the lower index (an earlier parent, a better rank; a shallower node) first, and padding
gets the smallest key of all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Literals in the kernels: -2**63, the padding key (below every real one, -inf scores included),
# and 2**32 - 1, the mask of a key's index half.


@triton.jit
def _key(score, index, valid):
    """int64 keys ordering (score descending, index ascending) when sorted descending."""
    bits = score.to(tl.int32, bitcast=True)
    sortable = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # floats' order as signed ints
    key = (sortable.to(tl.int64) << 32) | (4294967295 - index.to(tl.int64))
    return tl.where(valid, key, -9223372036854775808)


@triton.jit
def _unkey(key):
    """(score, index) back from a key."""
    sortable = (key >> 32).to(tl.int32)
    bits = sortable ^ ((sortable >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 4294967295 - (key & 4294967295)


@triton.jit
def _best(keys, N: tl.constexpr, WP: tl.constexpr):
    """The WP largest of N keys, largest first (N a multiple of WP, both powers of two)."""
    keys = tl.sort(keys, descending=True)
    rows = tl.reshape(keys, [N // WP, WP])  # row 0: the WP largest
    first = tl.arange(0, N // WP)[:, None] == 0
    return tl.max(tl.where(first, rows, -9223372036854775808), axis=0)


@triton.jit
def _levels_kernel(LP, Score, Parent, Rank, Order, D: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                   KP: tl.constexpr, WP: tl.constexpr, NP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    lp = LP + r * (D * K)
    out = r * (D * W)
    slot = tl.arange(0, WP)
    rank = tl.arange(0, KP)
    keep = slot < W
    # Depth 1: the root's children, best first; missing slots score -inf.
    score = tl.load(lp + slot, mask=(slot < K) & keep, other=float("-inf"))
    tl.store(Score + out + slot, score, mask=keep)
    tl.store(Parent + out + slot, tl.zeros([WP], dtype=tl.int64), mask=keep)
    tl.store(Rank + out + slot, tl.minimum(slot, K - 1).to(tl.int64), mask=keep)
    flat = tl.arange(0, WP * KP)  # candidate (slot i, rank j) at i * KP + j: the torch order i * K + j
    real = tl.reshape(keep[:, None] & (rank[None, :] < K), [WP * KP])
    for d in range(1, D):
        x = tl.load(lp + d * K + rank, mask=rank < K, other=float("-inf"))
        cand = tl.reshape(score[:, None] + x[None, :], [WP * KP])
        score, index = _unkey(_best(_key(cand, flat, real), WP * KP, WP))
        tl.store(Score + out + d * W + slot, score, mask=keep)
        tl.store(Parent + out + d * W + slot, index // KP, mask=keep)
        tl.store(Rank + out + d * W + slot, index % KP, mask=keep)
    tl.debug_barrier()  # every level written before it is read back
    n = tl.arange(0, NP)
    every = tl.load(Score + out + n, mask=n < D * W, other=float("-inf"))
    _, index = _unkey(_best(_key(every, n, n < D * W), NP, WP))
    tl.store(Order + r * W + slot, index, mask=keep)


def levels(top_lp: torch.Tensor, width: int, topk: int):
    """`spec.tree._levels` for top_lp [R, D, topk] float32: (score, parent, rank, order)."""
    R, D, K = top_lp.shape
    assert K == topk and top_lp.dtype == torch.float32
    lp = top_lp.contiguous()
    W = width
    score = torch.empty(R, D * W, dtype=torch.float32, device=lp.device)
    parent = torch.empty(R, D * W, dtype=torch.long, device=lp.device)
    rank = torch.empty(R, D * W, dtype=torch.long, device=lp.device)
    order = torch.empty(R, W, dtype=torch.long, device=lp.device)
    WP, KP = triton.next_power_of_2(W), triton.next_power_of_2(K)
    _levels_kernel[(R,)](lp, score, parent, rank, order, D=D, K=K, W=W, KP=KP, WP=WP,
                         NP=triton.next_power_of_2(D * W), num_warps=4)
    return score, parent, rank, order
