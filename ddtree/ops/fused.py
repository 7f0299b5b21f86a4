"""Small hot element-wise ops, fused by torch.compile inside CUDA graphs (eager elsewhere: on the
CPU compiling would only slow the tests down, and outside a graph the compiled call costs more host
time than it saves): residual add + RMSNorm, q/k norm + rotary, SiLU-and-mul; and the
`compiled_on_cuda` wrapper that does it (also used for the tree ops in ddtree/spec).

Each keeps transformers' order of operations and dtype casts, so bf16 results stay close to it.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin [T, 1, D] for NEOX-style rotary (rotate halves) from the [P, D] table."""
    cos, sin = cos_sin[positions].to(dtype).chunk(2, dim=-1)
    return torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotates a [T, heads, D] tensor by each token's position."""
    return _rotate(x, *rope_cos_sin(cos_sin, positions, x.dtype))


def _qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, q_size: int, kv_size: int,
              head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float):
    """Split packed qkv, apply per-head q/k RMSNorm (Qwen3) and rotary. Returns q [T,H,D], k, v [T,Hkv,D]."""
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # (q_size 0: rows of k|v only)
    q = q.reshape(q.shape[0], q_size // head_dim, head_dim)
    k = k.reshape(k.shape[0], kv_size // head_dim, head_dim)
    v = v.reshape(v.shape[0], kv_size // head_dim, head_dim).contiguous()
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    cos, sin = rope_cos_sin(cos_sin, positions, q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_graphing = 0  # > 0 while a CUDA graph is warmed up and captured (`graphing`)


@contextlib.contextmanager
def graphing():
    """Marks a CUDA graph's warm-up and capture: only there do the ops below run compiled."""
    global _graphing
    _graphing += 1
    try:
        yield
    finally:
        _graphing -= 1


def compiled_on_cuda(fn):
    """`fn`, run through torch.compile (dynamic shapes) while a CUDA graph is captured on a GPU
    (`graphing`), and eagerly otherwise: in a graph a chain of tiny element-wise / gather ops becomes
    a few fused kernels (fewer nodes for a replay to submit), but called eagerly a compiled function
    pays host time for its guards and wrappers on every call."""
    compiled = []

    @functools.wraps(fn)
    def run(*args):
        if not _graphing:
            return fn(*args)
        x = next(a for a in args if isinstance(a, torch.Tensor))
        if not x.is_cuda:
            return fn(*args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](*args)
    return run


rms_norm = compiled_on_cuda(_rms_norm)
add_rms_norm = compiled_on_cuda(_add_rms_norm)
qkv_rope = compiled_on_cuda(_qkv_rope)
silu_mul = compiled_on_cuda(_silu_mul)
