"""Keyed Gumbel-max sampling on the GPU (engine/sampler.py defines the draw; this is its kernel).

Two kernels, both CUDA-graph friendly and neither holding a [rows, vocab] noise tensor. Each reads a
row's settings from the request's `draw` row (seed, temperature and top-p as float bits, top-k); a
request's tree nodes are consecutive rows.

1. `_tile_kernel`, one program per (row, tile of TILE tokens): the tile's best noisy score
   logits + T * gumbel(seed, pos, v) and its index; for rows with top-k or top-p also the tile's max
   logit and sum of exp((logit - max) / T) (the row's softmax mass).
2. `_row_kernel`, one program per row: the best of the row's tiles is the draw. Rows with top-k or
   top-p then check it: the drawn token y is kept when fewer than k tokens have a larger logit and
   their mass is below p of the (top-k) total. Otherwise no token with a logit <= y's is kept, so
   the draw is taken again over the larger logits only, until it is kept. The best noisy token among
   the kept ones is the draw of the filtered distribution, the set the reference's sort-based
   threshold keeps. A draw from outside the nucleus has probability about 1 - p, so most rows pass
   the first check. With both top-k and top-p the top-k mass needs the k-th largest logit: found by
   bisection on the logits' ordered bit patterns.
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
def _settings(Draw, row, nodes):
    """(seed, temperature, top_p, top_k) of the request that row belongs to."""
    d = Draw + (row // nodes) * 4
    seed = tl.load(d)
    T = tl.load(d + 1).to(tl.int32).to(tl.float32, bitcast=True)
    p = tl.load(d + 2).to(tl.int32).to(tl.float32, bitcast=True)
    k = tl.load(d + 3)
    return seed, T, p, k


@triton.jit
def _tile_kernel(X, stride_x, V, Draw, nodes, Pos, BestVal, BestIdx, TileMax, TileSum, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    out = row * tl.num_programs(1) + tile
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    seed, T, p, k = _settings(Draw, row, nodes)
    score = x
    if T > 0:
        score = tl.where(cols < V, _noisy(x, _row_key(seed, tl.load(Pos + row)), cols, T), float("-inf"))
    best = tl.max(score, 0)
    tl.store(BestVal + out, best)
    tl.store(BestIdx + out, tl.min(tl.where(score == best, cols, 2147483647), 0))  # (a tie: the lower index)
    if (T > 0) & ((p < 1.0) | ((k > 0) & (k < V))):  # the mass: filtered rows only
        m = tl.max(x, 0)
        tl.store(TileMax + out, m)
        tl.store(TileSum + out, tl.sum(tl.exp((x - tl.where(m == float("-inf"), 0.0, m)) / T), 0))


@triton.jit
def _key(x):
    """float32 -> int32 in the same order (non-NaN)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _row_kernel(X, stride_x, V, Draw, nodes, Pos, BestVal, BestIdx, TileMax, TileSum, tiles, Token,
                TILES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, TILES)
    alive = t < tiles
    vals = tl.load(BestVal + row * tiles + t, mask=alive, other=float("-inf"))
    best = tl.max(vals, 0)
    first = tl.min(tl.where(alive & (vals == best), t, TILES), 0)  # (a tie: the lower tile)
    y = tl.load(BestIdx + row * tiles + first)
    seed, T, p, k = _settings(Draw, row, nodes)
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    if (T > 0) & (use_k | use_p):
        base = X + row.to(tl.int64) * stride_x
        tmax = tl.load(TileMax + row * tiles + t, mask=alive, other=float("-inf"))
        m = tl.max(tmax, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.load(TileSum + row * tiles + t, mask=alive, other=0.0) * tl.exp((tmax - m) / T), 0)
        offs = tl.arange(0, BLOCK)
        if use_k & use_p:  # the top-k mass: the k-th largest logit by bisection on ordered bit patterns
            lo = _key(m).to(tl.int64) * 0 - 2147483648  # every logit's key is >= lo
            hi = _key(tl.max(tmax, 0)).to(tl.int64)
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
        key = _row_key(seed, tl.load(Pos + row))
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
            # (the largest logit is always kept, as the reference keeps rank 0: a top-p that rounds to
            # 0, or a NaN mass, cannot reject every token)
            kept = ((((count < k) | (use_k == 0)) & ((mass < p * total) | (use_p == 0))) | (count == 0)).to(tl.int32)
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
                kept = (best == float("-inf")).to(tl.int32)  # (nothing above: NaN logits; keep the draw)
    tl.store(Token + row, y.to(tl.int64))


def triton_sample(logits: torch.Tensor, draw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`sampler.sample` on the GPU: logits [M, V] (any float dtype, unit stride in V), `draw` [R, 4]
    int64, positions [M]."""
    M, V = logits.shape
    assert logits.stride(1) == 1 and draw.dtype == torch.long
    tiles, dev = triton.cdiv(V, TILE), logits.device
    best_val = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    best_idx = torch.empty(M, tiles, dtype=torch.int32, device=dev)
    tile_max = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    tile_sum = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    draw, pos = draw.contiguous(), positions.long().contiguous()
    nodes = M // draw.shape[0]
    token = torch.empty(M, dtype=torch.long, device=dev)
    _tile_kernel[(M, tiles)](logits, logits.stride(0), V, draw, nodes, pos, best_val, best_idx, tile_max, tile_sum,
                             BLOCK=TILE)
    _row_kernel[(M,)](logits, logits.stride(0), V, draw, nodes, pos, best_val, best_idx, tile_max, tile_sum, tiles,
                      token, TILES=max(16, triton.next_power_of_2(tiles)), BLOCK=BLOCK)
    return token
