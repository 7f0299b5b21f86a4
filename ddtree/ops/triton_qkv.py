"""One kernel from the packed q|k|v projection to attention-ready tensors: per-head q/k RMSNorm
(Qwen3), rotary (of the whole head, or its first channels: Qwen3.5's partial rotary), and the new K/V
written straight into their paged-cache slots. Gated queries (Qwen3.5) interleave each head's query
with its output gate; the kernel reads the query and leaves the gate.

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
                           NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                           Q_STRIDE: tl.constexpr, ROT: tl.constexpr, QK_NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..H-1: query heads; H..H+Hkv-1: key heads (which also move their v head)
    RH: tl.constexpr = ROT // 2
    offs = tl.arange(0, D_P)  # a head's channels padded to a power of two; the padding is masked
    if D_P == D:  # (a constant mask, folded away: unmasked loads and stores)
        ok = tl.full([D_P], 1, tl.int1)
    else:
        ok = offs < D
    # the rotary pairs (i, i + RH) for i < RH; channels from ROT on pass through
    partner = tl.where(offs < RH, offs + RH, tl.where(offs < ROT, offs - RH, offs))
    row = QKV + t.to(tl.int64) * stride_t
    if h < NUM_HEADS:  # q heads, each Q_STRIDE apart (a gated query's gate follows it), then k heads
        src = row + h * Q_STRIDE
    else:
        src = row + NUM_HEADS * Q_STRIDE + (h - NUM_HEADS) * D
    x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
    dtype = QOut.dtype.element_ty
    if QK_NORM:
        if h < NUM_HEADS:
            w = QNorm
        else:
            w = KNorm
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        x = (x * rstd).to(dtype).to(tl.float32) * tl.load(w + offs, mask=ok, other=0.0).to(tl.float32)
        x = x.to(dtype).to(tl.float32)
        xp = (xp * rstd).to(dtype).to(tl.float32) * tl.load(w + partner, mask=ok, other=0.0).to(tl.float32)
        xp = xp.to(dtype).to(tl.float32)
    pos = tl.load(Pos + t).to(tl.int64)
    c = offs % RH
    cos = tl.load(CosSin + pos * stride_cs + c).to(dtype).to(tl.float32)  # (c < RH: in the row, padding too)
    sin = tl.load(CosSin + pos * stride_cs + RH + c).to(dtype).to(tl.float32)
    y = tl.where(offs < RH, x * cos - xp * sin, tl.where(offs < ROT, x * cos + xp * sin, x))
    if h < NUM_HEADS:
        tl.store(QOut + t.to(tl.int64) * stride_qt + h * D + offs, y.to(dtype), mask=ok)
    else:
        j = h - NUM_HEADS
        slot = tl.load(Slots + t).to(tl.int64)
        tl.store(KC + slot * stride_kcs + j * D + offs, y.to(dtype), mask=ok)
        vsrc = row + NUM_HEADS * Q_STRIDE + (NUM_KV + j) * D
        tl.store(VC + slot * stride_kcs + j * D + offs, tl.load(vsrc + offs, mask=ok), mask=ok)


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 0.0, rotary_dim: int | None = None, gated: bool = False) -> torch.Tensor:
    """qkv: [T, (H + 2 Hkv) * D] packed projections (with `gated`, each query head followed by its gate:
    [T, (2 H + 2 Hkv) * D]); writes rotated K and V of token t to cache slot slot_mapping[t]
    ([num_slots, Hkv, D] caches) and returns the rotated q [T, H, D]. Only the first `rotary_dim`
    channels of a head rotate (all by default); cos_sin rows hold rotary_dim / 2 cosines, then sines."""
    T = qkv.shape[0]
    rot = rotary_dim or head_dim
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert rot % 2 == 0 and rot <= head_dim, (head_dim, rot)
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    norm = q_norm is not None
    _qkv_rope_store_kernel[(T, num_heads + num_kv_heads)](
        qkv, positions, cos_sin, slot_mapping, q, k_cache, v_cache,
        q_norm if norm else qkv, k_norm if norm else qkv, eps,
        qkv.stride(0), q.stride(0), cos_sin.stride(0), k_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, D=head_dim, D_P=triton.next_power_of_2(head_dim),
        Q_STRIDE=(2 if gated else 1) * head_dim, ROT=rot, QK_NORM=norm)
    return q
