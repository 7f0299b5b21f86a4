"""The drafter's training forward over many blocks at once: each block of B tokens starts at an anchor
in a record and attends to the record's fused target features before the anchor and to its own block
(`block_mask`, or a flex_attention BlockMask on the GPU), with the drafter's own layers and the target's
embedding and LM head. Training (train/drafter.py) and the acceptance replay (train/acceptance.py)
both draft through it."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ddtree.models.dflash import DFlashDrafter, DraftAttention
from ddtree.models.transformer import CausalLM


def block_attention(attn: DraftAttention, x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                    ctx_pos: torch.Tensor, mask) -> torch.Tensor:
    """The drafter attention in training form, with the layer's own weights. x: [R, Q, D] block tokens
    at positions pos [R, Q]; ctx: [R, C, D] fused target features at ctx_pos [R, C]; mask [R, Q, C+Q]
    bool (True = may attend), or a flex_attention BlockMask of that pattern. Keys/values are
    [kv(ctx); kv(block)] as in inference."""
    R, Q, _ = x.shape
    C = ctx.shape[1]
    H, Hkv, Dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q(x.reshape(R * Q, -1), pos.flatten())
    kc, vc = attn.kv(ctx.reshape(R * C, -1), ctx_pos.flatten())
    kb, vb = attn.kv(x.reshape(R * Q, -1), pos.flatten())
    k = torch.cat([kc.view(R, C, Hkv, Dh), kb.view(R, Q, Hkv, Dh)], 1)
    v = torch.cat([vc.view(R, C, Hkv, Dh), vb.view(R, Q, Hkv, Dh)], 1)
    if not isinstance(mask, torch.Tensor):  # a BlockMask: flex_attention skips the masked-out tiles
        o = _flex()(q.view(R, Q, H, Dh).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                    scale=attn.scale, enable_gqa=H != Hkv)
        return attn.o_proj(o.transpose(1, 2).reshape(R, Q, H * Dh))
    groups = H // Hkv
    k = k.repeat_interleave(groups, dim=2).transpose(1, 2)  # [R, H, C+Q, Dh]
    v = v.repeat_interleave(groups, dim=2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.view(R, Q, H, Dh).transpose(1, 2), k, v, attn_mask=mask[:, None],
                                       scale=attn.scale)
    return attn.o_proj(o.transpose(1, 2).reshape(R, Q, H * Dh))


def block_mask(anchors: torch.Tensor, ctx_len: torch.Tensor, C: int, B: int) -> torch.Tensor:
    """[R, n*B, C + n*B] bool. anchors [R, n] (padding: -1); ctx_len [R] valid context rows. A block
    query sees context j < its anchor (and j < ctx_len) and every token of its own block."""
    R, n = anchors.shape
    dev = anchors.device
    a = anchors.repeat_interleave(B, dim=1)  # [R, n*B] anchor of each query
    j = torch.arange(C, device=dev)
    ctx = (j[None, None, :] < a[:, :, None]) & (j[None, None, :] < ctx_len[:, None, None])
    blk = torch.arange(n, device=dev).repeat_interleave(B)
    own = blk[:, None] == blk[None, :]
    return torch.cat([ctx, own[None].expand(R, -1, -1)], dim=2)


@functools.cache
def _flex():
    """flex_attention, compiled once on GPU (the eager version is a slow reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention


def flex_block_mask(anchors: torch.Tensor, ctx_len: torch.Tensor, C: int, B: int):
    """`block_mask`'s pattern as a flex_attention BlockMask (the GPU path: memory and work scale with
    the unmasked tiles instead of R * Q * (C+Q))."""
    from torch.nn.attention.flex_attention import create_block_mask
    R, n = anchors.shape

    def mask_mod(b, h, q, kv):
        blk = q // B
        in_ctx = (kv < C) & (kv < anchors[b, blk]) & (kv < ctx_len[b])
        return in_ctx | ((kv >= C) & ((kv - C) // B == blk))
    return create_block_mask(mask_mod, R, None, n * B, C + n * B, device=anchors.device)


def draft_logits(drafter: DFlashDrafter, target: CausalLM, ids: torch.Tensor, feats: torch.Tensor,
                 ctx_len: torch.Tensor, anchors: torch.Tensor, flex: bool = False) -> torch.Tensor:
    """Training-mode drafter forward. ids [R, L] tokens (padded), feats [R, L, K*D] target features,
    ctx_len [R] real lengths, anchors [R, n] block starts (padding -1; such blocks are computed but
    meaningless). Returns logits [R, n, B-1, V] for block indices 1..B-1. `flex`: attention through
    flex_attention with a BlockMask instead of SDPA with a dense boolean mask."""
    return block_logits(drafter, target, ids, fuse_features(drafter, feats), ctx_len, anchors, flex)


def fuse_features(drafter: DFlashDrafter, feats: torch.Tensor) -> torch.Tensor:
    """Target features [..., K*D] -> the drafter's context rows hidden_norm(fc(.)) [..., D]."""
    return drafter.hidden_norm(drafter.fc(feats.to(drafter.fc.weight.dtype)))


def block_logits(drafter: DFlashDrafter, target: CausalLM, ids: torch.Tensor, ctx: torch.Tensor,
                 ctx_len: torch.Tensor, anchors: torch.Tensor, flex: bool = False) -> torch.Tensor:
    """`draft_logits` from fused context rows ctx [R, L, D] (`fuse_features`), for callers that draft
    many blocks over the same records (train/acceptance.py)."""
    dc = drafter.dcfg
    B = dc.block_size
    R, n = anchors.shape
    L = ids.shape[1]
    dev = ids.device
    a = anchors.clamp(min=0)
    block_ids = torch.full((R, n, B), dc.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = ids.gather(1, a)
    pos = (a[:, :, None] + torch.arange(B, device=dev)).view(R, n * B)
    wdt = drafter.fc.weight.dtype  # the drafter may train in fp32 on a bf16 target
    h = target.model.embed_tokens(block_ids.view(R, n * B)).to(wdt) * dc.input_embedding_scale
    ctx_pos = torch.arange(L, device=dev).expand(R, L)
    mask = flex_block_mask(anchors, ctx_len, L, B) if flex else block_mask(anchors, ctx_len, L, B)
    for layer in drafter.layers:
        h = h + block_attention(layer.self_attn, layer.input_layernorm(h), pos, ctx, ctx_pos, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = drafter.norm(h).view(R, n, B, -1)[:, :, 1:]
    return drafter.logits(h.to(target.lm_head.weight.dtype), target.lm_head)
