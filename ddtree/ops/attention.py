"""The one attention entry point: every request contributes q tokens over its paged KV prefix.

Prefill (q = prompt chunk), decode (q = 1), tree verify (q = budget+1) and the drafter block
(q = block_size) all go through `paged_attention`. The new tokens' K/V are written into the paged
cache first, then each query attends to the request's whole cached prefix plus, among the new
tokens, those its mask allows: causal by default, or a per-request [q, q] boolean mask (a tree's
ancestor-or-self mask, or all-ones for the drafter's non-causal block).

Two implementations read the same `AttentionBatch`: the torch reference below (CPU, and the
oracle in tests) and the Triton kernels in `triton_attention.py` (GPU, CUDA-graph safe).
The Triton modules are imported where a Triton path runs, so that the package imports without triton.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionBatch:
    """Per-step attention metadata, built by the runner and read by every attention layer.
    Request r feeds q_lens[r] new tokens, stored at its cache positions prefix_lens[r] onwards."""
    slot_mapping: torch.Tensor  # [T] cache slot of each new token's K/V
    block_tables: torch.Tensor  # [R, max_pages] int32 page ids (entries past a request's pages unused)
    prefix_lens: torch.Tensor  # [R] int32 tokens already cached before this step
    q_lens: torch.Tensor  # [R] int32
    q_starts: torch.Tensor  # [R] int32 offset of each request's first token among the T
    mask: torch.Tensor | None  # [R, Qmax, Qmax] bool over new tokens; None = causal
    page_size: int
    blk_req: torch.Tensor | None = None  # Triton work split: request of each query block
    blk_q: torch.Tensor | None = None  # and its first query index
    block_m: int = 0
    splits: int = 1  # Triton: key slices per query block (flash-decoding), fixed per shape
    use_triton: bool = False
    state_slots: torch.Tensor | None = None  # [R] hybrid models: each request's recurrent-state slot
    # Hybrid models: whether every new token is committed (prompt chunks, AR steps), so the recurrent
    # state slots advance; a verified tree keeps a state per node until the walk picks a path.
    commit_states: bool = True
    tree: tuple | None = None  # hybrid models: a verified tree's shape, kept by models/hybrid.py's tree_shape


def slots_for(block_table: list[int] | torch.Tensor, start: int, end: int, page_size: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Cache slots of token positions [start, end) for a request whose pages are `block_table`."""
    pos = torch.arange(start, end, device=device)
    pages = torch.as_tensor(block_table, dtype=torch.long, device=device)
    return pages[pos // page_size] * page_size + pos % page_size


def make_batch(block_tables: list[list[int]], prefix_lens: list[int], q_lens: list[int],
               mask: torch.Tensor | None, page_size: int, device: torch.device,
               use_triton: bool = False, num_heads_per_kv: int = 1, num_kv_heads: int = 1,
               state_slots: list[int] | None = None) -> AttentionBatch:
    """Builds a step's metadata from host lists (eager path; CUDA graphs fill static copies)."""
    R = len(q_lens)
    width = max((len(t) for t in block_tables), default=1)
    tables = torch.zeros(R, max(width, 1), dtype=torch.int32)
    slots = []
    for r, (table, prefix, n) in enumerate(zip(block_tables, prefix_lens, q_lens)):
        assert len(table) * page_size >= prefix + n, "pages must be allocated first"
        tables[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        slots.append(slots_for(table, prefix, prefix + n, page_size))
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    batch = AttentionBatch(torch.cat(slots).to(device), tables.to(device), i32(prefix_lens), i32(q_lens),
                           i32(starts), mask, page_size, use_triton=use_triton,
                           state_slots=None if state_slots is None else i32(state_slots))
    if use_triton:
        from ddtree.ops.triton_attention import choose_block_m, choose_splits, plan_blocks
        batch.block_m = choose_block_m(max(q_lens), num_heads_per_kv)
        req, qs = plan_blocks(q_lens, batch.block_m)
        batch.blk_req, batch.blk_q = i32(req), i32(qs)
        batch.splits = choose_splits(len(req), num_kv_heads, max(q_lens))
    return batch


def pack_rows(block_tables: list[list[int]], columns: list[list[int]], pad_page: int,
              device: torch.device) -> torch.Tensor:
    """Per-request integer inputs in one host->device copy: [R, len(columns) + P] int64 rows, the
    given columns first, then each page table padded with `pad_page` to the batch's widest. Built as one
    flat list read by `array` (host time before every graphed burst: `torch.tensor` of nested rows is
    several times slower)."""
    width = max(map(len, block_tables))
    flat: list[int] = []
    for *values, table in zip(*columns, block_tables):
        flat += values
        flat += table
        if len(table) < width:
            flat += [pad_page] * (width - len(table))
    if not flat:  # (frombuffer refuses an empty buffer)
        return torch.empty(len(block_tables), 0, dtype=torch.long, device=device)
    packed = torch.frombuffer(array.array("q", flat), dtype=torch.long)
    return packed.view(len(block_tables), len(columns) + width).to(device, non_blocking=True)


def uniform_batch(block_tables: torch.Tensor, starts: torch.Tensor, width: int, mask: torch.Tensor | None,
                  page_size: int, use_triton: bool = False, num_heads_per_kv: int = 1,
                  num_kv_heads: int = 1) -> AttentionBatch:
    """Metadata for `width` new tokens per request at positions starts .. starts + width - 1, built
    with device ops only (no host data), so it can be recorded inside a CUDA graph."""
    R, dev = starts.shape[0], starts.device
    pos = starts[:, None] + torch.arange(width, device=dev)
    slots = page_slots(block_tables, pos, page_size).flatten()
    ar = torch.arange(R, device=dev, dtype=torch.int32)
    batch = AttentionBatch(slots, block_tables, starts.int(), torch.full((R,), width, dtype=torch.int32, device=dev),
                           ar * width, mask, page_size, use_triton=use_triton)
    if use_triton:
        from ddtree.ops.triton_attention import choose_block_m, choose_splits
        bm = choose_block_m(width, num_heads_per_kv)
        per = -(-width // bm)
        batch.block_m = bm
        batch.splits = choose_splits(R * per, num_kv_heads, width)
        batch.blk_req = ar.repeat_interleave(per)
        batch.blk_q = (torch.arange(per, device=dev, dtype=torch.int32) * bm).repeat(R)
    return batch


def page_slots(block_tables: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of positions pos [R, n] given per-request page tables [R, P] (device ops only)."""
    return block_tables.long().gather(1, pos // page_size) * page_size + pos % page_size


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, use_triton: bool = False) -> None:
    if use_triton:
        from ddtree.ops.triton_attention import triton_store_kv
        triton_store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        k_cache[slot_mapping] = k
        v_cache[slot_mapping] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens, or None when they are already in the cache;
    caches: [num_slots, Hkv, D]. Returns [T, H, D]."""
    if k is not None:
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.use_triton)
    if batch.use_triton:
        from ddtree.ops.triton_attention import triton_paged_attention
        return triton_paged_attention(q, k_cache, v_cache, batch, scale)
    return reference_attention(q, k_cache, v_cache, batch, scale)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: AttentionBatch, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    groups = q.shape[1] // k_cache.shape[1]
    for r, (prefix, q_len, start) in enumerate(zip(batch.prefix_lens.tolist(), batch.q_lens.tolist(),
                                                   batch.q_starts.tolist())):
        qi = q[start:start + q_len].transpose(0, 1)  # [H, q, D]
        slots = slots_for(batch.block_tables[r], 0, prefix + q_len, batch.page_size, q.device)
        # Expand K/V to every query head: SDPA's enable_gqa path with a mask is far slower on CPU.
        ki = k_cache[slots].repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, kv, D]
        vi = v_cache[slots].repeat_interleave(groups, dim=1).transpose(0, 1)
        custom = batch.mask[r, :q_len, :q_len] if batch.mask is not None else None
        if custom is None and prefix == 0:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=q_len > 1, scale=scale)
        else:
            mask = attention_mask(q_len, prefix, custom, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:start + q_len] = o.transpose(0, 1)
    return out


def attention_mask(q_len: int, prefix: int, custom: torch.Tensor | None, device) -> torch.Tensor:
    """[q, prefix + q] bool: the whole prefix, then causal or `custom` over the new tokens."""
    if custom is None:
        qi = torch.arange(q_len, device=device)[:, None]
        kj = torch.arange(prefix + q_len, device=device)[None, :]
        return kj <= qi + prefix
    assert custom.shape == (q_len, q_len), (custom.shape, q_len)
    return torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=device), custom.to(device)], dim=1)
