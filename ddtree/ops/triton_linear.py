"""Matrix products for steps of a few tokens (AR decode at small batch, tree verification, the drafter),
with the ops around them fused in.

With few rows the model's projections are memory-bound: reading the weights is the whole cost. A
cuBLAS call of the default target at 1-33 rows runs a handful of thread blocks plus a split-K
reduction, which cannot fill the machine, so it reads the weights well below the memory's bandwidth.
Here every program owns BLOCK_N output columns for all rows and streams their weights once,
accumulating in fp32: a matrix-vector loop for one row, tensor-core dots for up to 64.

A layer then needs no separate element-wise kernels:
- the input RMSNorm (with the residual add before it) runs inside the q|k|v and gate|up products:
  the product takes norm weight * x, and each row's 1/rms, summed in the same pass over x, scales
  the accumulator at the end (so no program waits for a norm before its first weight load);
- SiLU-and-mul runs in the gate|up product's epilogue: a program owns the same columns of the gate
  and up halves, so its output is the activation the down product reads.

Roundings differ from the eager ops (the norm scale is applied after the product): the logits can
differ from the cuBLAS path in the last bits, so a greedy near-tie may break differently.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# The interpreter (CI on the CPU) gets bf16 dots wrong (triton 3.x): there, dots run on fp32 operands.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 64  # rows (tokens) one call takes: a tensor-core tile of up to 64 rows


class Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1  # depth slices, each its own program (more programs for few columns), summed after


@triton.jit
def _rounded(x, dtype):
    """x (fp32) rounded to `dtype` as a store would, kept in fp32 (a no-op for fp32)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _mac(acc, a, w, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc [BM, BN] += a [BM, BK] @ w[BN, BK]^T; without DOT, BM is 1 (a matrix-vector product)."""
    if DOT:  # (one return at the end: the compiler also walks what follows an early return)
        if IEEE:  # fp32 products in fp32 (the same values as bf16 operands would give)
            acc = tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
    else:
        acc = acc + tl.sum(w.to(tl.float32) * a, axis=1)[None, :]
    return acc


@triton.jit
def _finish(acc, acc_up, sq, Bias, cols, col_ok, N, K, eps, dtype, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
            GLU: tl.constexpr):
    """The product's epilogue: the norm's 1/rms per row, the bias, silu(gate) * up (rounded as the
    eager ops round)."""
    if NORM:
        rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(Bias + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        gate = _rounded(acc, dtype)
        acc = _rounded(gate / (1.0 + tl.exp(-gate)), dtype) * _rounded(acc_up, dtype)
    return acc


@triton.jit
def _linear_kernel(X, R, G, ROut, W, Bias, Y, Part, SqPart, M, N, K, K_PER, stride_x, stride_r, stride_wn, eps,
                   NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
                   DOT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, s): output columns n * BLOCK_N.. of every row, over depth slice s (K_PER wide). One
    slice: the finished product into Y. Several: fp32 partial sums (and the rows' partial sums of
    squares) into Part / SqPart, finished by `_split_epilogue_kernel`."""
    pid, split = tl.program_id(0), tl.program_id(1)
    dtype = X.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (GLU: of the gate half, and of the up half)
    col_ok = cols < N
    w_rows = W + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_lo = split * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x_ok = row_ok[:, None] & k_ok[None, :]
        a = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
        if NORM:
            if HAS_RES:  # the residual stream x + r, stored once (by the programs of columns 0..)
                a = _rounded(a + tl.load(R + rows[:, None] * stride_r + ks[None, :], mask=x_ok,
                                         other=0.0).to(tl.float32), dtype)
                tl.store(ROut + rows[:, None] * K + ks[None, :], a,
                         mask=x_ok & (ks[None, :] < K - pid * K))  # pid 0 only
            sq += tl.sum(a * a, axis=1)
            a = _rounded(a * tl.load(G + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :], dtype)
        w_ok = col_ok[:, None] & k_ok[None, :]
        acc = _mac(acc, a, tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0), DOT, IEEE)
        if GLU:
            acc_up = _mac(acc_up, a, tl.load(w_rows + N * stride_wn + ks[None, :], mask=w_ok, other=0.0), DOT, IEEE)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        acc = _finish(acc, acc_up, sq, Bias, cols, col_ok, N, K, eps, dtype, NORM, HAS_BIAS, GLU)
        tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=out_ok)
    else:  # partials [SPLIT, 2 (gate, up), M, N] and [SPLIT, M]
        part = Part + split * 2 * M * N + rows[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=out_ok)
        if GLU:
            tl.store(part + M * N, acc_up, mask=out_ok)
        if NORM:
            tl.store(SqPart + split * M + rows, sq, mask=row_ok & (rows < M - pid * M))  # pid 0 only


@triton.jit
def _split_epilogue_kernel(Part, SqPart, Bias, Y, M, N, K, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                           GLU: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sums a split product's partials in a fixed order (deterministic) and finishes it."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    out_ok = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        part = Part + s * 2 * M * N + rows[:, None] * N + cols[None, :]
        acc += tl.load(part, mask=out_ok, other=0.0)
        if GLU:
            acc_up += tl.load(part + M * N, mask=out_ok, other=0.0)
        if NORM:
            sq += tl.load(SqPart + s * M + rows, mask=row_ok, other=0.0)
    acc = _finish(acc, acc_up, sq, Bias, cols, col_ok, N, K, eps, Y.dtype.element_ty, NORM, HAS_BIAS, GLU)
    tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=out_ok)


# Block sizes by tile height (1, 16, 32 or 64 rows) and shape kind: "small" (q|k|v, o: 896 deep,
# about 1,000 wide), "wide" (gate|up: 4,864 per half), "deep" (down: 4,864 deep). One row: tuned with
# `benchmarks/linear_tune.py` at the default target's shapes. More rows: guesses with split-K (unsplit
# tiles are too few programs and lose to cuBLAS), not yet tuned;
# the model uses this path for one row only (transformer.FUSED_ROWS).
CONFIGS = {
    1: {"small": Config(2, 1024, 1), "wide": Config(4, 512, 1), "deep": Config(1, 1024, 1)},
    16: {"small": Config(16, 128, 2, 4), "wide": Config(16, 128, 2, 2), "deep": Config(16, 128, 2, 8)},
    32: {"small": Config(16, 128, 2, 4), "wide": Config(16, 128, 2, 2), "deep": Config(16, 128, 2, 8)},
    64: {"small": Config(16, 128, 4, 4), "wide": Config(16, 128, 4, 2), "deep": Config(16, 128, 4, 8)},
}


def linear_config(m: int, n: int, k: int) -> Config:
    """Block sizes for `m` rows, `n` output columns (GLU: per half) and depth `k`."""
    kind = "wide" if n >= 4096 else "deep" if k > 1024 else "small"
    c = CONFIGS[_block_m(m)][kind]
    return c._replace(block_k=min(c.block_k, max(16, triton.next_power_of_2(k))))


def _block_m(m: int) -> int:
    return 1 if m == 1 else max(16, triton.next_power_of_2(m))


def _launch(x, weight, bias, residual=None, norm_weight=None, eps=0.0, glu=False, config=None):
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None else x
    if residual is not None:  # (the residual add lives in the norm's pass)
        assert norm_weight is not None and residual.shape == x.shape and residual.stride(1) == 1
    cfg = config or linear_config(m, n, k)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k  # each slice whole blocks
    split = triton.cdiv(k, k_per)
    part = torch.empty(split, 2, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    sq_part = torch.empty(split, m, dtype=torch.float32, device=x.device) if split > 1 else y
    norm, has_bias = norm_weight is not None, bias is not None
    _linear_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, residual if residual is not None else x, norm_weight if norm else x, r_out,
        weight, bias if has_bias else weight, y, part, sq_part, m, n, k, k_per, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0), eps,
        NORM=norm, HAS_RES=residual is not None, HAS_BIAS=has_bias, GLU=glu,
        DOT=m > 1, IEEE=x.dtype == torch.float32 or INTERPRETED, SPLIT=split, BLOCK_M=_block_m(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if split > 1:
        block = 64
        _split_epilogue_kernel[(triton.cdiv(n, block),)](
            part, sq_part, bias if has_bias else weight, y, m, n, k, eps, NORM=norm, HAS_BIAS=has_bias, GLU=glu,
            SPLIT=split, BLOCK_M=_block_m(m), BLOCK_N=block)
    return y, r_out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: Config | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] (rows contiguous) -> x @ weight^T (+ bias): [M, N]."""
    return _launch(x, weight, bias, config=config)[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, glu: bool = False,
                config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T (+ bias), x + residual): the RMSNorm before a projection and
    the residual add before it, in one kernel. `residual` None: the norm of x alone, and x back.
    `glu`: weight is [gate | up] stacked (2N rows), and the result is silu(gate) * up, [M, N]."""
    return _launch(x, weight, bias, residual, norm_weight, eps, glu, config)
