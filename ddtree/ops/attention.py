"""The one attention entry point: every request contributes q tokens over its paged KV prefix.

Prefill (q = prompt chunk), decode (q = 1), tree verify (q = budget+1) and the drafter block
(q = block_size) all go through `paged_attention`. The new tokens' K/V are written into the paged
cache first, then each query attends to the request's whole cached prefix plus, among the new
tokens, those its mask allows: causal by default, or a per-request [q, q] boolean mask (a tree's
ancestor-or-self mask, or all-ones for the drafter's non-causal block).

This file holds the torch reference implementation (CPU and GPU, the oracle in tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionBatch:
    """Per-step attention metadata, built by the runner and read by every attention layer."""
    q_lens: list[int]  # new tokens per request
    prefix_lens: list[int]  # tokens already in the cache before this step, per request
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    kv_slots: list[torch.Tensor]  # per request: cache slot of each of its prefix_len + q_len keys
    masks: list[torch.Tensor | None] | None = None  # per request [q, q] bool over new tokens; None = causal

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def slots_for(block_table: list[int] | torch.Tensor, start: int, end: int, page_size: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Cache slots of token positions [start, end) for a request whose pages are `block_table`."""
    pos = torch.arange(start, end, device=device)
    pages = torch.as_tensor(block_table, dtype=torch.long, device=device)
    return pages[pos // page_size] * page_size + pos % page_size


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens; caches: [num_slots, Hkv, D]. Returns [T, H, D]."""
    store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = torch.empty_like(q)
    groups = q.shape[1] // k_cache.shape[1]
    start = 0
    for i, (q_len, prefix) in enumerate(zip(batch.q_lens, batch.prefix_lens)):
        qi = q[start:start + q_len].transpose(0, 1)  # [H, q, D]
        slots = batch.kv_slots[i]
        # Expand K/V to every query head: SDPA's enable_gqa path with a mask is ~100x slower on CPU.
        ki = k_cache[slots].repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, kv, D]
        vi = v_cache[slots].repeat_interleave(groups, dim=1).transpose(0, 1)
        custom = batch.masks[i] if batch.masks is not None else None
        if custom is None and prefix == 0:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=q_len > 1, scale=scale)
        else:
            mask = attention_mask(q_len, prefix, custom, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def attention_mask(q_len: int, prefix: int, custom: torch.Tensor | None, device) -> torch.Tensor:
    """[q, prefix + q] bool: the whole prefix, then causal or `custom` over the new tokens."""
    if custom is None:
        qi = torch.arange(q_len, device=device)[:, None]
        kj = torch.arange(prefix + q_len, device=device)[None, :]
        return kj <= qi + prefix
    assert custom.shape == (q_len, q_len), (custom.shape, q_len)
    return torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=device), custom.to(device)], dim=1)
