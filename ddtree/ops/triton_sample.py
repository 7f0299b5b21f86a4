"""Keyed Gumbel-max sampling on the GPU (engine/sampler.py defines the draw; this is its kernel).

Two kernels, both CUDA-graph friendly and neither holding a [rows, vocab] noise tensor:

1. `_tile_kernel`, one program per (row, tile of TILE tokens): the tile's best noisy score
   logits + T * gumbel(seed, pos, v) and its index, and the tile's max logit and sum of
   exp((logit - max) / T) (the row's softmax mass, for top-p). A row's draw without top-k or top-p
   is the best of its tiles, picked in torch.
2. `_filter_kernel`, one program per row, for rows with top-k or top-p (others return at once): the
   drawn token y is kept when fewer than k tokens have a larger logit and their mass is below p of
   the (top-k) total. Otherwise no token with a logit <= y's is kept, so the draw is taken again
   over the larger logits only, until it is kept. The best noisy token among the kept ones is the
   draw of the filtered distribution, the set the reference's sort-based threshold keeps. A draw
   from outside the nucleus has probability about 1 - p, so most rows pass the first check.
   With both top-k and top-p, the top-k mass needs the k-th largest logit: found by bisection on
   the logits' ordered bit patterns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048  # vocabulary entries per program of the tile kernel
BLOCK = 1024  # entries per loop iteration of the row kernel


@triton.jit
def _mix(x):
    """splitmix64's finalizer (uint64, wrapping)."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _row_key(seed, pos):
    return _mix(seed.to(tl.uint64, bitcast=True) + pos.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)


@triton.jit
def _noisy(x, key, cols, T):
    """x + T * gumbel(key, cols), float32."""
    h = _mix(key + cols.to(tl.uint64) * 0xD1B54A32D192ED03)
    u = ((h >> 40).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
    return x + T * (-tl.log(-tl.log(u)))


@triton.jit
def _tile_kernel(X, stride_x, V, Temp, TopP, TopK, Seed, Pos, BestVal, BestIdx, TileMax, TileSum,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    out = row * tl.num_programs(1) + tile
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    T = tl.load(Temp + row)
    score = x
    if T > 0:
        score = _noisy(x, _row_key(tl.load(Seed + row), tl.load(Pos + row)), cols, T)
        score = tl.where(cols < V, score, float("-inf"))
    best = tl.max(score, 0)
    at = tl.min(tl.where(score == best, cols, 2147483647), 0)  # (a tie: the lower index)
    tl.store(BestVal + out, best)
    tl.store(BestIdx + out, at)
    k = tl.load(TopK + row)
    if (T > 0) & ((tl.load(TopP + row) < 1.0) | ((k > 0) & (k < V))):  # (the mass: filtered rows only)
        m = tl.max(x, 0)
        tl.store(TileMax + out, m)
        tl.store(TileSum + out, tl.sum(tl.exp((x - tl.where(m == float("-inf"), 0.0, m)) / T), 0))
    else:
        tl.store(TileMax + out, 0.0)
        tl.store(TileSum + out, 0.0)


@triton.jit
def _key(x):
    """float32 -> int32 in the same order (non-NaN)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _filter_kernel(X, stride_x, V, Temp, TopP, TopK, Seed, Pos, RowMax, RowSum, Token, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    T = tl.load(Temp + row)
    p = tl.load(TopP + row)
    k = tl.load(TopK + row)
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    if (T > 0) & (use_k | use_p):
        base = X + row.to(tl.int64) * stride_x
        m = tl.load(RowMax + row)
        total = tl.load(RowSum + row)
        offs = tl.arange(0, BLOCK)
        if use_k & use_p:  # the top-k mass: the k-th largest logit by bisection on ordered bit patterns
            lo = _key(m).to(tl.int64) * 0 - 2147483648  # every logit's key is >= lo
            hi = _key(m).to(tl.int64)
            for _ in range(33):
                mid = lo + (hi - lo + 1) // 2
                count = 0
                for c0 in range(0, V, BLOCK):
                    cols = c0 + offs
                    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                    count += tl.sum(((_key(x).to(tl.int64) >= mid) & (cols < V)).to(tl.int32), 0)
                take = count >= k
                lo = tl.where(take, mid, lo)
                hi = tl.where(take, hi, mid - 1)
            total = 0.0
            for c0 in range(0, V, BLOCK):
                cols = c0 + offs
                x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                total += tl.sum(tl.where(_key(x).to(tl.int64) >= lo, tl.exp((x - m) / T), 0.0), 0)
        key = _row_key(tl.load(Seed + row), tl.load(Pos + row))
        y = tl.load(Token + row)
        ly = tl.load(base + y).to(tl.float32)
        kept = 0
        while kept == 0:
            count = 0
            mass = 0.0
            for c0 in range(0, V, BLOCK):
                cols = c0 + offs
                x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                above = x > ly
                count += tl.sum(above.to(tl.int32), 0)
                mass += tl.sum(tl.where(above, tl.exp((x - m) / T), 0.0), 0)
            kept = (((count < k) | (use_k == 0)) & ((mass < p * total) | (use_p == 0))).to(tl.int32)
            if kept == 0:  # the draw again, over the logits above y's
                lower = ly
                best = float("-inf")
                for c0 in range(0, V, BLOCK):
                    cols = c0 + offs
                    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                    score = tl.where(x > lower, _noisy(x, key, cols, T), float("-inf"))
                    bmax = tl.max(score, 0)
                    bat = tl.min(tl.where(score == bmax, cols, 2147483647), 0)
                    better = bmax > best
                    y = tl.where(better, bat, y)
                    best = tl.where(better, bmax, best)
                ly = tl.load(base + y).to(tl.float32)
        tl.store(Token + row, y)


def triton_sample(logits: torch.Tensor, rows, positions: torch.Tensor) -> torch.Tensor:
    """`sampler.sample` on the GPU: logits [M, V] (any float dtype, unit stride in V)."""
    M, V = logits.shape
    assert logits.stride(1) == 1
    tiles = triton.cdiv(V, TILE)
    dev = logits.device
    best_val = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    best_idx = torch.empty(M, tiles, dtype=torch.int32, device=dev)
    tile_max = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    tile_sum = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    temp = rows.temperature.float().contiguous()
    seed, pos = rows.seed.contiguous(), positions.long().contiguous()
    top_p, top_k = rows.top_p.float().contiguous(), rows.top_k.contiguous()
    _tile_kernel[(M, tiles)](logits, logits.stride(0), V, temp, top_p, top_k, seed, pos, best_val, best_idx,
                             tile_max, tile_sum, BLOCK=TILE)
    token = best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1)
    row_max = tile_max.max(dim=1).values
    scale = torch.where(temp > 0, temp, 1.0)
    safe = torch.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = (tile_sum * ((tile_max - safe[:, None]) / scale[:, None]).exp()).sum(1)
    token = token.contiguous()
    _filter_kernel[(M,)](logits, logits.stride(0), V, temp, top_p, top_k, seed, pos, safe.contiguous(),
                         row_sum.contiguous(), token, BLOCK=BLOCK)
    return token.long()
