"""Paged KV cache: a pool of fixed-size pages and the allocator that hands them to requests.

The cache itself is one tensor per layer of shape [num_pages * page_size, Hkv, D]; a request's
token at position p lives at slot block_table[p // page_size] * page_size + p % page_size. Hybrid
models also keep a recurrent state per request (models/hybrid.py): the allocator hands out a state
slot with a request's first pages and takes it back with them.

Prefix caching (`prefix_caching`): a full page whose target K/V are final is offered to the cache under
a key for its tokens and all tokens before it (`page_key`), so the key names the whole prefix; it is
marked `drafted` once the drafter's entries in its slots (a speculative engine's) are final too. A
request admitted later takes the longest run of cached pages that begins its tokens and skips computing
them; pages are shared by reference count. A page no request holds stays cached (`idle`, least recently
used first; a request's last pages go idle before its first, so a prefix is lost from its end) until the
pool runs out of free pages and it is taken for new entries. A request always computes its last token
(its logits are needed), so the pages it shares end before its first new token: no request writes its
target K/V into a shared page. Its drafter context starts after the run of drafted pages it took; the
speculative side fills the rest (`require_drafted`: a decoder that cannot takes drafted pages only).

Hybrid targets keep a recurrent state per request, not per page, so their prefix cache also keeps state
snapshots (`snapshot_slots`, slots of the state cache past the requests'): a request's prompt is fed in
chunks that stop where a later request may branch off (`Sequence.snapshot_at`): at the end of the cached
pages it shares with earlier requests (where it branches off them) and at its last full page. The state
at each stop is copied into a snapshot slot tied to that page (`snapshot`), and a later request's hits
end at the last page with a snapshot, which its own slot is given (`take_state_copies`: the engine copies
the states before the step). So a head that many prompts share (a system prompt) has its state kept once
a second prompt has branched off it. When the snapshots run out, the one unused longest is dropped; a
page that is taken drops its snapshot.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from array import array

import torch

from ddtree.engine.sequence import Sequence


def page_key(previous: bytes, tokens: list[int]) -> bytes:
    """The cache key of a page holding `tokens`, after the prefix whose last page's key is `previous`
    (b"" for a first page): a 128-bit digest of the prefix, so keys of different prefixes do not meet."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, num_state_slots: int = 0, prefix_caching: bool = False,
                 require_drafted: bool = False, snapshot_slots: list[int] = ()):
        """`num_state_slots`: hybrid models, one per request that may hold pages at once. `prefix_caching`:
        keep full pages' entries for later requests with the same prefix (a hybrid's with `snapshot_slots`,
        the state cache's slots for its snapshots). `require_drafted`: hits end at the first cached page
        without the drafter's entries (a decoder that cannot feed a drafter context's gap)."""
        assert num_pages > 0 and page_size > 0
        assert not (prefix_caching and num_state_slots and not snapshot_slots), "a hybrid's cache needs snapshots"
        self.num_pages, self.page_size = num_pages, page_size
        # A stack: the most recently freed pages are reused first (warm in cache, low ids).
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))
        self.prefix_caching, self.require_drafted = prefix_caching, require_drafted
        self.refs = [0] * num_pages  # requests holding each page
        self.key_of: dict[int, bytes] = {}  # cached page -> its key
        self.page_of: dict[bytes, int] = {}  # key -> cached page
        self.drafted: set[int] = set()  # cached pages whose drafter entries are final too
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, oldest use first
        self.keeps_states = bool(snapshot_slots)  # (a hybrid's cache: hits end where a state was kept)
        self.free_snapshots: list[int] = list(snapshot_slots)[::-1]
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # page -> the state after it, oldest use first
        self.state_copies: list[tuple[int, int]] = []  # (snapshot, request slot) for the engine to copy
        self.hit_tokens = self.queried_tokens = 0  # admitted prompts' tokens found cached, and looked up

    @property
    def num_free(self) -> int:
        """Pages a request can be given: free ones, and cached ones no request holds."""
        return len(self.free_pages) + len(self.idle)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached_pages(self) -> int:
        return len(self.key_of)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra pages `seq` needs so that positions [0, num_tokens) have a slot."""
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        n = self.pages_needed(seq, num_tokens)
        assert n <= self.num_free, "caller must check can_grow"
        seq.block_table.extend(self._take() for _ in range(n))
        if self.num_state_slots and seq.state_slot < 0:
            assert self.free_slots, "more requests hold pages than there are state slots"
            seq.state_slot = self.free_slots.pop()

    def admit(self, seq: Sequence) -> bool:
        """Gives a waiting request pages for all its tokens, the cached ones first (its `num_cached` then
        counts their tokens, `num_prefix_drafted` those of the leading pages with the drafter's entries);
        False, and nothing taken, where the pool holds too few."""
        hits, shared = self._lookup(seq)
        idle_hits = sum(1 for p in hits if self.refs[p] == 0)
        if -(-len(seq) // self.page_size) - len(hits) > self.num_free - idle_hits:
            return False
        for p in hits:
            self._hold(p)
        seq.block_table = list(hits)
        seq.num_cached = len(hits) * self.page_size
        if self.keeps_states:  # (where its chunks stop for a state snapshot)
            stops = {shared * self.page_size, (len(seq) - 1) // self.page_size * self.page_size}
            seq.snapshot_at = sorted(p for p in stops if p > seq.num_cached)
        drafted = next((i for i, p in enumerate(hits) if p not in self.drafted), len(hits))
        seq.num_prefix_drafted = drafted * self.page_size
        if self.prefix_caching and seq.num_cached_prompt is None:  # (a readmission finds its own pages)
            seq.num_cached_prompt = min(seq.num_cached, len(seq.prompt_ids))
            self.queried_tokens += len(seq.prompt_ids)
            self.hit_tokens += seq.num_cached_prompt
        self.grow(seq, len(seq))
        if hits and self.keeps_states:
            self.snapshot_of.move_to_end(hits[-1])
            self.state_copies.append((self.snapshot_of[hits[-1]], seq.state_slot))
        return True

    def snapshot(self, seq: Sequence) -> tuple[int, int] | None:
        """Hybrid models, a request whose prompt chunks reached its next stop (`snapshot_at[0]`): the
        snapshot slot its state goes to, as (its slot, the snapshot slot) for the engine to copy; None where
        that page's state is kept already. The page is cached now if it was not."""
        at = seq.snapshot_at.pop(0)
        assert seq.num_cached == at, "a snapshot is taken where the prompt's chunks stopped"
        self.offer(seq, at)
        page = self.page_of.get(self._keys(seq, at // self.page_size)[at // self.page_size - 1])
        if page is None or page in self.snapshot_of:
            return None
        if self.free_snapshots:
            slot = self.free_snapshots.pop()
        else:  # the snapshot unused the longest gives its slot
            _, slot = self.snapshot_of.popitem(last=False)
        self.snapshot_of[page] = slot
        return seq.state_slot, slot

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (snapshot, request slot) copies admission asked for since the last call."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def offer(self, seq: Sequence, final_tokens: int, drafted_tokens: int = 0) -> None:
        """Caches the request's full pages among its first `final_tokens` tokens (target K/V that no
        later step of the request changes), those not offered before, and marks the ones among its first
        `drafted_tokens` (whose drafter entries are final too) drafted."""
        if not self.prefix_caching:
            return
        last = min(final_tokens, len(seq)) // self.page_size
        if last > seq.num_offered_pages:
            keys = self._keys(seq, last)
            for i in range(seq.num_offered_pages, last):
                page, key = seq.block_table[i], keys[i]
                if key not in self.page_of and page not in self.key_of:  # (one prefix computed twice: keep one)
                    self.page_of[key], self.key_of[page] = page, key
            seq.num_offered_pages = last
        drafted = min(drafted_tokens // self.page_size, last)
        for i in range(seq.num_drafted_pages, drafted):
            page = seq.block_table[i]
            if page not in self.key_of:  # another copy of this prefix was cached first: this one replaces it
                key = seq.page_keys[i]  # where that one lacks the drafter's entries (or was taken since)
                other = self.page_of.get(key)
                if other in self.drafted:
                    continue
                slot = self.snapshot_of.pop(other, None)  # (the state after the prefix is the same: it moves)
                if other is not None:
                    self._uncache(other)
                self.page_of[key], self.key_of[page] = page, key
                if slot is not None:
                    self.snapshot_of[page] = slot
            self.drafted.add(page)
        seq.num_drafted_pages = max(seq.num_drafted_pages, drafted)

    def release(self, seq: Sequence, final_tokens: int = 0, drafted_tokens: int = 0) -> None:
        """Takes back the request's pages (after caching those among its first `final_tokens` tokens, as
        `offer`) and its state slot. Its last pages go idle first: the cache gives up a prefix from its end."""
        self.offer(seq, final_tokens, drafted_tokens)
        for p in reversed(seq.block_table):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.key_of:
                    self.idle[p] = None
                else:
                    self.free_pages.append(p)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
        seq.drop_cache()
        assert self.num_free <= self.num_pages and len(self.free_slots) <= self.num_state_slots

    def clear_cache(self) -> None:
        """Forgets every cached prefix (after a failed step, whose entries may be half written); pages no
        request holds are free again."""
        self.free_pages.extend(self.idle)
        self.idle.clear()
        self.key_of.clear()
        self.page_of.clear()
        self.drafted.clear()
        self.free_snapshots.extend(self.snapshot_of.values())
        self.snapshot_of.clear()
        self.state_copies.clear()

    def _forget(self, page: int) -> None:
        """Drops a cached page's key, mark and snapshot."""
        del self.page_of[self.key_of.pop(page)]
        self.drafted.discard(page)
        if page in self.snapshot_of:
            self.free_snapshots.append(self.snapshot_of.pop(page))

    def _uncache(self, page: int) -> None:
        """Drops a cached page's key; free again if no request holds it."""
        self._forget(page)
        if self.refs[page] == 0:
            del self.idle[page]
            self.free_pages.append(page)

    def _take(self) -> int:
        """A page for new entries: a free one, else the cached page unused the longest (uncached now)."""
        if self.free_pages:
            page = self.free_pages.pop()
        else:
            page, _ = self.idle.popitem(last=False)
            self._forget(page)
        self.refs[page] = 1
        return page

    def _hold(self, page: int) -> None:
        self.refs[page] += 1
        self.idle.pop(page, None)

    def _keys(self, seq: Sequence, pages: int) -> list[bytes]:
        """The keys of the request's first `pages` full pages (computed once a request)."""
        keys, ps = seq.page_keys, self.page_size
        while len(keys) < pages:
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", seq.tokens(i * ps, (i + 1) * ps)))
        return keys

    def _lookup(self, seq: Sequence) -> tuple[list[int], int]:
        """The cached pages that begin the request's tokens, up to its last one (always computed), and how
        many there are before a hybrid's hits are cut back to the last page with a kept state."""
        if not self.prefix_caching:
            return [], 0
        hits = []
        for key in self._keys(seq, (len(seq) - 1) // self.page_size):
            page = self.page_of.get(key)
            if page is None or (self.require_drafted and page not in self.drafted):
                break
            hits.append(page)
        shared = len(hits)
        while self.keeps_states and hits and hits[-1] not in self.snapshot_of:
            hits.pop()  # (a hybrid's hits end where a state was kept)
        return hits, shared


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
