"""The top-k tokens of each row of logits and their log-probabilities, in one pass over the logits.

A draft needs, per block position, only its k best tokens and their log-probs, but done in torch
that is a float32 copy of the logits, a radix top-k and a logsumexp: five or six passes over
[rows, vocab] (at 128 requests x 15 positions x 151,936 tokens, 1.2 GB each). Here one kernel reads
each tile of a row once (in the logits' own dtype) and writes, per tile, its k best (value, index) and its max and sum of exponentials; a top-k over
the few per-tile candidates and a log-sum-exp over the per-tile partials finish the row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048  # vocabulary entries per program: 75 tiles of the default vocabulary, (rows x 75) programs


@triton.jit
def _tile_topk_kernel(X, Vals, Idx, Max, Sum, V, stride_x, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    out = row * tl.num_programs(1) + tile
    offs = tl.arange(0, BLOCK)
    cols = tile * BLOCK + offs
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    tl.store(Max + out, m)
    tl.store(Sum + out, tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0))  # (a tile all -inf: 0)
    alive = cols < V  # not picked yet: picks stay distinct even among -inf entries
    for j in tl.static_range(K):  # the tile's k best, best first (ties: the lower index)
        best = tl.max(tl.where(alive, x, float("-inf")), 0)
        at = tl.min(tl.where(alive & (x == best), offs, BLOCK), 0)
        tl.store(Vals + out * K + j, best)
        tl.store(Idx + out * K + j, (tile * BLOCK + at).to(tl.int64))
        alive = alive & (offs != at)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (any float dtype) -> (log-probs [..., k] float32 best first, token ids [..., k])."""
    shape, V = logits.shape[:-1], logits.shape[-1]
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, T = x.shape[0], triton.cdiv(V, TILE)
    assert 1 <= k <= min(TILE, V)
    vals = torch.empty(M, T * k, dtype=torch.float32, device=x.device)
    idx = torch.empty(M, T * k, dtype=torch.long, device=x.device)
    mx = torch.empty(M, T, dtype=torch.float32, device=x.device)
    sm = torch.empty(M, T, dtype=torch.float32, device=x.device)
    _tile_topk_kernel[(M, T)](x, vals, idx, mx, sm, V, x.stride(0), K=k, BLOCK=TILE, num_warps=4)
    top, pos = vals.topk(k, dim=-1)
    peak = mx.max(dim=-1, keepdim=True).values
    lse = peak + (sm * (mx - peak).exp()).sum(dim=-1, keepdim=True).log()
    return (top - lse).view(*shape, k), idx.gather(1, pos).view(*shape, k)
