"""Paged KV cache: a pool of fixed-size pages and the allocator that hands them to requests.

The cache itself is one tensor per layer of shape [num_pages * page_size, Hkv, D]; a request's
token at position p lives at slot block_table[p // page_size] * page_size + p % page_size. Hybrid
models also keep a recurrent state per request (models/hybrid.py): the allocator hands out a state
slot with a request's first pages and takes it back with them.
"""
from __future__ import annotations

import torch

from ddtree.engine.sequence import Sequence


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, num_state_slots: int = 0):
        """`num_state_slots`: hybrid models, one per request that may hold pages at once."""
        assert num_pages > 0 and page_size > 0
        self.num_pages, self.page_size = num_pages, page_size
        # A stack: the most recently freed pages are reused first (warm in cache, low ids).
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_pages)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra pages `seq` needs so that positions [0, num_tokens) have a slot."""
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        n = self.pages_needed(seq, num_tokens)
        assert n <= self.num_free, "caller must check can_grow"
        seq.block_table.extend(self.free_pages.pop() for _ in range(n))
        if self.num_state_slots and seq.state_slot < 0:
            assert self.free_slots, "more requests hold pages than there are state slots"
            seq.state_slot = self.free_slots.pop()

    def release(self, seq: Sequence) -> None:
        self.free_pages.extend(seq.block_table)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
        seq.drop_cache()
        assert len(self.free_pages) <= self.num_pages and len(self.free_slots) <= self.num_state_slots


def allocate_kv_cache(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: str | torch.device, parts: int = 2) -> torch.Tensor:
    """[parts, layers, slots, Hkv, D]: K and V for every layer in one allocation; `parts` 1 where the
    keys and values are one cached vector (MLA: a layer's V cache is its K cache)."""
    return torch.zeros(parts, num_layers, num_pages * page_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def allocate_state_cache(cfg, num_slots: int, dtype: torch.dtype, device: str | torch.device):
    """Hybrid models: each linear layer's convolution windows [slots, conv_dim, K - 1] (model dtype) and
    recurrent states [slots, Hv, Dk, Dv] (float32), for `num_slots` requests."""
    lin, n = cfg.linear, len(cfg.linear_layers)
    conv = torch.zeros(n, num_slots, lin.conv_dim, lin.conv_kernel - 1, dtype=dtype, device=device)
    state = torch.zeros(n, num_slots, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, dtype=torch.float32,
                        device=device)
    return conv, state


def pages_for_memory(bytes_available: float, num_layers: int, page_size: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, parts: int = 2) -> int:
    per_page = parts * num_layers * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return max(1, int(bytes_available // per_page))
