"""Small hot element-wise ops, fused by torch.compile on GPU (eager on CPU, where compiling would
only slow the tests down): residual add + RMSNorm, q/k norm + rotary, SiLU-and-mul.

Each keeps transformers' order of operations and dtype casts, so bf16 results stay close to it.
"""
from __future__ import annotations

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
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(q.shape[0], -1, head_dim)
    k = k.reshape(k.shape[0], -1, head_dim)
    v = v.reshape(v.shape[0], -1, head_dim).contiguous()
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    cos, sin = rope_cos_sin(cos_sin, positions, q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_compiled = {}


def _pick(fn, x: torch.Tensor):
    if not x.is_cuda:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def rms_norm(x, weight, eps):
    return _pick(_rms_norm, x)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return _pick(_add_rms_norm, x)(x, residual, weight, eps)


def qkv_rope(qkv, positions, cos_sin, q_size, kv_size, head_dim, q_norm, k_norm, eps):
    return _pick(_qkv_rope, qkv)(qkv, positions, cos_sin, q_size, kv_size, head_dim, q_norm, k_norm, eps)


def silu_mul(x):
    return _pick(_silu_mul, x)(x)
