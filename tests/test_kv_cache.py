"""Page accounting of the paged KV cache (engine/kv_cache.py) and the position -> slot mapping it implies."""
import torch

from ddtree.engine.kv_cache import PageAllocator, allocate_kv_cache, pages_for_memory
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import slots_for
from ddtree.sampling_params import SamplingParams


def new_seq(n: int = 1) -> Sequence:
    return Sequence(list(range(n)), SamplingParams(), detok=None)


def test_pages_needed_rounds_up_and_counts_only_missing_pages():
    alloc, seq = PageAllocator(num_pages=10, page_size=4), new_seq()
    assert [alloc.pages_needed(seq, n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    alloc.grow(seq, 5)
    assert len(seq.block_table) == 2
    assert [alloc.pages_needed(seq, n) for n in (3, 8, 9, 16)] == [0, 0, 1, 2]


def test_grow_takes_pages_from_the_free_pool_and_can_grow_tracks_it():
    alloc = PageAllocator(num_pages=6, page_size=4)
    a, b = new_seq(), new_seq()
    assert alloc.can_grow(a, 24) and not alloc.can_grow(a, 25)
    alloc.grow(a, 10)  # 3 pages
    assert alloc.num_free == 3 and alloc.num_used == 3
    assert alloc.can_grow(b, 12) and not alloc.can_grow(b, 13)
    alloc.grow(a, 12)  # still 3 pages: no-op
    assert len(a.block_table) == 3 and alloc.num_free == 3
    alloc.grow(b, 12)
    assert alloc.num_free == 0 and not alloc.can_grow(a, 13) and alloc.can_grow(a, 12)


def test_no_page_is_handed_to_two_requests():
    alloc = PageAllocator(num_pages=16, page_size=2)
    seqs = [new_seq() for _ in range(4)]
    for n in range(1, 9):  # interleaved growth
        for s in seqs:
            alloc.grow(s, n)
    pages = [p for s in seqs for p in s.block_table]
    assert len(pages) == 16 and len(set(pages)) == 16 and set(pages) == set(range(16))


def test_release_returns_all_pages_and_resets_the_request():
    alloc = PageAllocator(num_pages=8, page_size=4)
    a, b = new_seq(), new_seq()
    alloc.grow(a, 13)
    alloc.grow(b, 9)
    a.num_cached = 13
    taken_by_a = list(a.block_table)
    alloc.release(a)
    assert a.block_table == [] and a.num_cached == 0
    assert alloc.num_free == 8 - 3
    alloc.release(b)
    assert alloc.num_free == 8 and sorted(alloc.free_pages) == list(range(8))
    c = new_seq()
    alloc.grow(c, 32)  # released pages are reusable
    assert set(taken_by_a) <= set(c.block_table)


def test_slots_for_maps_position_to_page_times_page_size_plus_offset():
    block_table, page_size = [5, 2, 7], 4
    slots = slots_for(block_table, 0, 12, page_size)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    # A sub-range (a prompt chunk or a decode step) maps the same way.
    assert slots_for(block_table, 3, 6, page_size).tolist() == [23, 8, 9]
    assert slots_for(torch.tensor(block_table), 11, 12, page_size).tolist() == [31]


def test_kv_cache_has_one_slot_per_page_position_and_memory_sizing_matches():
    cache = allocate_kv_cache(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8,
                              dtype=torch.float32, device="cpu")
    assert cache.shape == (2, 3, 20, 2, 8)
    per_page = 2 * 3 * 4 * 2 * 8 * 4
    assert pages_for_memory(per_page * 5 + per_page // 2, 3, 4, 2, 8, torch.float32) == 5
