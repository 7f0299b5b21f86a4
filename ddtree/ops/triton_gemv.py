"""Matrix-vector product for one-token steps (AR decode at batch 1): y = x @ W^T (+ bias).

At batch 1 the model's small projections are memory-bound but far from the bandwidth floor: each
cuBLAS call of the default target reads 1.6-17 MB in 4-7 us (a 24-layer step spends ~0.55 ms there
against ~0.17 ms of weight reading at the H200's bandwidth), because a handful of thread blocks and a
split-K reduction cannot fill the machine. Here every program owns BLOCK_N output rows and streams
their weights once with wide loads, accumulating in fp32.

Off unless DDTREE_GEMV=1: the block sizes below are a first guess until measured on the H200
(`benchmarks/gemv_tune.py` times every candidate against F.linear at the default target's shapes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, Bias, Y, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(X + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=row_ok)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): enough programs to cover the GPU (>= ~2 per SM) with loads of
    at least 512 bytes per row."""
    block_k = 256 if k <= 1024 else 512
    block_n = 4 if n <= 2048 else 8
    return block_n, block_k, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x: [1, K] (contiguous), weight: [N, K] (rows contiguous) -> [1, N] in x's dtype."""
    assert x.shape[0] == 1 and x.shape[1] == weight.shape[1] and weight.stride(1) == 1
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else weight, y, n, k,
                                              weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
                                              BLOCK_K=block_k, num_warps=warps)
    return y
