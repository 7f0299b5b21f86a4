"""One kernel from the packed q|k|v projection to attention-ready tensors: per-head q/k RMSNorm
(Qwen3), rotary, and the new K/V written straight into their paged-cache slots.

At decode sizes each of these steps is a launch-bound kernel of a couple of microseconds; done
separately (split, norm, rotary for q, rotary for k, copy v, store K/V) they were four or five
launches per layer, and every launch is also a node that a CUDA graph replay must submit. Same
arithmetic as `ddtree.ops.fused.qkv_rope` + `store_kv`: fp32 math, cos/sin rounded to the model's
dtype first, one rounding of each output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qkv_rope_store_kernel(QKV, Pos, CosSin, Slots, QOut, KC, VC, QNorm, KNorm, eps,
                           stride_t, stride_qt, stride_cs, stride_kcs,
                           NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
                           QK_NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..H-1: query heads; H..H+Hkv-1: key heads (which also move their v head)
    D: tl.constexpr = 2 * HALF
    offs = tl.arange(0, HALF)
    row = QKV + t.to(tl.int64) * stride_t
    src = row + h * D  # q heads then k heads are contiguous in the packed row
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    dtype = QOut.dtype.element_ty
    if QK_NORM:
        if h < NUM_HEADS:
            w = QNorm
        else:
            w = KNorm
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        x1 = (x1 * rstd).to(dtype).to(tl.float32) * tl.load(w + offs).to(tl.float32)
        x2 = (x2 * rstd).to(dtype).to(tl.float32) * tl.load(w + HALF + offs).to(tl.float32)
        x1 = x1.to(dtype).to(tl.float32)
        x2 = x2.to(dtype).to(tl.float32)
    pos = tl.load(Pos + t).to(tl.int64)
    cos = tl.load(CosSin + pos * stride_cs + offs).to(dtype).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs).to(dtype).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if h < NUM_HEADS:
        dst = QOut + t.to(tl.int64) * stride_qt + h * D
        tl.store(dst + offs, y1.to(dtype))
        tl.store(dst + HALF + offs, y2.to(dtype))
    else:
        j = h - NUM_HEADS
        slot = tl.load(Slots + t).to(tl.int64)
        kdst = KC + slot * stride_kcs + j * D
        tl.store(kdst + offs, y1.to(dtype))
        tl.store(kdst + HALF + offs, y2.to(dtype))
        vsrc = row + (NUM_HEADS + NUM_KV + j) * D
        vdst = VC + slot * stride_kcs + j * D
        tl.store(vdst + offs, tl.load(vsrc + offs))
        tl.store(vdst + HALF + offs, tl.load(vsrc + HALF + offs))


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor:
    """qkv: [T, (H + 2 Hkv) * D] packed projections; writes rotated K and V of token t to cache slot
    slot_mapping[t] ([num_slots, Hkv, D] caches) and returns the rotated q [T, H, D]."""
    T = qkv.shape[0]
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim // 2) == head_dim // 2, head_dim
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    norm = q_norm is not None
    _qkv_rope_store_kernel[(T, num_heads + num_kv_heads)](
        qkv, positions, cos_sin, slot_mapping, q, k_cache, v_cache,
        q_norm if norm else qkv, k_norm if norm else qkv, eps,
        qkv.stride(0), q.stride(0), cos_sin.stride(0), k_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HALF=head_dim // 2, QK_NORM=norm)
    return q
