"""Matrix-vector products for one-token steps (AR decode at batch 1), with the ops around them fused in.

At batch 1 the model's small projections are memory-bound but far from the bandwidth floor: each
cuBLAS call of the default target reads 1.6-17 MB in 4-6 us plus a split-K reduction (measured on the
H200: 19.6 us for a layer's four projections against ~4 us of weight reading), because a handful of
thread blocks cannot fill the machine. Here every program owns BLOCK_N output rows and streams their
weights once, accumulating in fp32 (11.9 us for the four, `benchmarks/gemv_tune.py`).

A one-token layer then needs no separate element-wise kernels: the input RMSNorm (with the residual
add) runs inside the q|k|v and gate|up products, and SiLU-and-mul inside the down product. Each
program recomputes the norm of the one input row, which costs a re-read of a few KB from L2. Casts
follow the eager ops of `ddtree/ops/fused.py` step by step; the batched path on the GPU runs those
through torch.compile, which may skip intermediate bf16 roundings, so batch-1 and batched logits can
differ in the last bits (a greedy near-tie may then break differently).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, NORM, SILU_MUL = 0, 1, 2  # what the kernel does to its input row before the product


@triton.jit
def _rounded(x, dtype):
    """x (fp32) rounded to `dtype` as a store would, kept in fp32 (a no-op for fp32)."""
    return x.to(dtype).to(tl.float32)  # round to nearest even on the GPU


@triton.jit
def _input_tile(X, R, G, cols, col_ok, K, rstd, PRE: tl.constexpr, HAS_RES: tl.constexpr):
    """The product's input at `cols`, in fp32 holding values of X's dtype."""
    dtype = X.dtype.element_ty
    x = tl.load(X + cols, mask=col_ok, other=0.0)
    if PRE == 1:
        s = x.to(tl.float32)
        if HAS_RES:
            s = _rounded(s + tl.load(R + cols, mask=col_ok, other=0.0).to(tl.float32), dtype)
        g = tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
        return _rounded(_rounded(s * rstd, dtype) * g, dtype)
    elif PRE == 2:
        gate = x.to(tl.float32)
        up = tl.load(X + K + cols, mask=col_ok, other=0.0).to(tl.float32)
        return _rounded(_rounded(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
    else:
        return x.to(tl.float32)


@triton.jit
def _gemv_kernel(X, R, G, ROut, W, Bias, Y, N, K, stride_wn, eps, PRE: tl.constexpr, HAS_RES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rstd = 0.0
    if PRE == 1:  # the row's RMS first (and the residual sum, stored once by program 0)
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            s = tl.load(X + cols, mask=col_ok, other=0.0).to(tl.float32)
            if HAS_RES:
                s = _rounded(s + tl.load(R + cols, mask=col_ok, other=0.0).to(tl.float32), X.dtype.element_ty)
                tl.store(ROut + cols, s, mask=cols < K - pid * K)  # program 0 only
            sq += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = _input_tile(X, R, G, cols, col_ok, K, rstd, PRE, HAS_RES)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=row_ok)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from `benchmarks/gemv_tune.py` on the H200 at the default target's
    shapes (best: q|k|v and o (2, 1024, 1), gate|up (8, 512, 1), down (1, 1024, 1)): one warp per
    program and many programs; a whole 896-wide row per load where it fits."""
    block_k = min(1024, triton.next_power_of_2(k))
    if n >= 4096:
        return 8, min(block_k, 512), 1
    return (2 if k <= 1024 else 1), block_k, 1


def _launch(pre: int, x, weight, bias, residual=None, norm_weight=None, eps=0.0, config=None):
    n, k = weight.shape
    assert x.shape[0] == 1 and weight.stride(1) == 1
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else x
    block_n, block_k, warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, r_out,
        weight, bias if bias is not None else weight, y, n, k, weight.stride(0), eps, PRE=pre,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return y, r_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x: [1, K], weight: [N, K] (rows contiguous) -> x @ weight^T (+ bias): [1, N] in x's dtype."""
    assert x.shape[1] == weight.shape[1]
    return _launch(PLAIN, x, weight, bias, config=config)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T (+ bias), x + residual): the RMSNorm before a projection and
    the residual add before it, in one kernel. `residual` None: the norm of x alone, and x back."""
    assert x.shape[1] == weight.shape[1]
    return _launch(NORM, x, weight, bias, residual, norm_weight, eps, config)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T for gate_up = [gate | up] of [1, 2K]: the MLP's down projection
    with its activation."""
    assert gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(SILU_MUL, gate_up, weight, None, config=config)[0]
