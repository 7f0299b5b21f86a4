"""Prefix caching (engine/kv_cache.py, engine/scheduler.py): the allocator's pages by key, and the engine's
outputs with the cache against an engine without it (speculative engines: tests/test_spec.py)."""
import pytest

from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.sequence import Sequence
from ddtree.sampling_params import SamplingParams
from tiny import CORPUS


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), detok=None)


def cached(num_pages: int = 16) -> PageAllocator:
    return PageAllocator(num_pages, page_size=4, prefix_caching=True)


def test_a_request_takes_the_cached_pages_that_begin_its_tokens_and_computes_the_rest():
    alloc = cached()
    a = seq_of(range(14))
    assert alloc.admit(a) and a.num_cached == 0 and len(a.block_table) == 4
    alloc.release(a, 14)  # 3 full pages offered: tokens 0..11
    assert alloc.num_cached_pages == 3 and alloc.num_free == 16
    b = seq_of([*range(10), 99, 98, 97])  # pages 0..7 are a's; the third differs at its third token
    assert alloc.admit(b)
    assert b.num_cached == b.num_cached_prompt == 8 and len(b.block_table) == 4
    assert alloc.hit_tokens == 8 and alloc.queried_tokens == 14 + 13
    c = seq_of(range(12))  # all three pages cached, but the last token is always computed
    assert alloc.admit(c) and c.num_cached == 8
    assert c.block_table[:2] == b.block_table[:2] and c.block_table[2] != b.block_table[2]
    assert alloc.num_free == 16 - 5  # 2 shared pages, 2 more of b's, 1 more of c's


def test_a_shared_page_goes_idle_when_its_last_holder_leaves_and_idle_pages_are_reused_oldest_first():
    alloc = cached(num_pages=8)
    a = seq_of(range(9))
    assert alloc.admit(a)
    alloc.offer(a, 8)  # a's two full pages are final while it runs
    b = seq_of([*range(8), 50])
    assert alloc.admit(b) and b.num_cached == 8 and b.block_table[:2] == a.block_table[:2]
    alloc.release(a, 9)
    assert alloc.num_free == 8 - 3  # b holds the two shared pages and its own
    alloc.release(b, 0)
    c = seq_of(range(100, 109))
    assert alloc.admit(c) and c.num_cached == 0
    alloc.release(c, 9)  # c's two pages are cached after a's
    assert alloc.num_free == 8 and alloc.num_cached_pages == 4
    # 5 pages: the 4 free ones, then the idle one unused longest: a request's pages go idle last one first,
    # so a prefix is given up from its end (a's second page)
    big = seq_of(range(200, 220))
    assert alloc.admit(big) and alloc.num_cached_pages == 3
    alloc.release(big, 0)
    hit = seq_of(range(100, 110))
    assert alloc.admit(hit) and hit.num_cached == 8
    part = seq_of([*range(8), 50])
    assert alloc.admit(part) and part.num_cached == 4


def test_the_same_prefix_computed_twice_is_cached_once_and_the_other_copy_is_freed():
    alloc = cached(num_pages=8)
    a, b = seq_of(range(9)), seq_of(range(9))
    assert alloc.admit(a) and alloc.admit(b)  # admitted together: neither finds the other's pages
    alloc.release(a, 9)
    alloc.release(b, 9)
    assert alloc.num_cached_pages == 2 and alloc.num_free == 8


def test_admission_counts_its_idle_hits_as_taken_and_takes_nothing_when_short():
    alloc = cached(num_pages=4)
    a = seq_of(range(12))
    assert alloc.admit(a)
    alloc.release(a, 12)  # 3 idle cached pages, 1 free
    b = seq_of([*range(8), 1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 hits, 3 more pages: only 2 can be had
    assert not alloc.admit(b) and b.block_table == [] and b.num_cached == 0
    assert alloc.num_free == 4 and alloc.num_cached_pages == 3
    c = seq_of([*range(8), 1, 2, 3, 4, 5])  # 2 hits and 2 more
    assert alloc.admit(c) and c.num_cached == 8 and alloc.num_free == 0


def test_pages_are_marked_drafted_once_the_drafter_entries_are_final_and_a_fixed_budget_takes_only_those():
    for require in (False, True):
        alloc = PageAllocator(16, 4, prefix_caching=True, require_drafted=require)
        a = seq_of(range(13))
        assert alloc.admit(a)
        alloc.offer(a, 12, drafted_tokens=5)  # three pages final, the drafter's entries in the first only
        b = seq_of([*range(12), 7])
        assert alloc.admit(b)
        assert (b.num_cached, b.num_prefix_drafted) == ((4, 4) if require else (12, 4))
        alloc.offer(a, 13, drafted_tokens=13)  # later: all three drafted
        c = seq_of([*range(12), 8])
        assert alloc.admit(c) and (c.num_cached, c.num_prefix_drafted) == (12, 12)


def test_a_copy_with_the_drafter_entries_replaces_a_cached_copy_without():
    alloc = PageAllocator(8, 4, prefix_caching=True, require_drafted=True)
    a, b = seq_of(range(9)), seq_of(range(9))
    assert alloc.admit(a)
    alloc.offer(a, 8)  # cached, not drafted (budget auto's plain AR steps)
    assert alloc.admit(b) and b.num_cached == 0  # a fixed budget takes drafted pages only
    alloc.offer(b, 8, drafted_tokens=8)
    c = seq_of(range(9))
    assert alloc.admit(c) and c.num_cached == 8 and c.block_table[:2] == b.block_table[:2]
    alloc.release(a, 9)  # a's copies are no longer cached: free
    assert alloc.num_cached_pages == 2 and alloc.num_free == 8 - 4


def test_clearing_the_cache_frees_idle_pages_and_forgets_every_prefix():
    alloc = cached(num_pages=8)
    a, b = seq_of(range(9)), seq_of(range(100, 109))
    assert alloc.admit(a) and alloc.admit(b)
    alloc.release(a, 9)
    alloc.offer(b, 8)
    alloc.clear_cache()
    assert alloc.num_cached_pages == 0 and alloc.num_free == 8 - 3 and len(alloc.free_pages) == 5
    alloc.release(b, 9)  # (pages offered before the clear are not offered again)
    again = seq_of(range(9))
    assert alloc.admit(again) and again.num_cached == 0


def test_a_hybrid_keeps_states_where_prompts_branch_off_and_at_their_last_full_page():
    # (the engine feeds a prompt up to each of its `snapshot_at` stops, copies the state the allocator names
    # there, and copies the states admission asks for before the next step; num_cached stands for what it fed)
    alloc = PageAllocator(16, 4, num_state_slots=2, prefix_caching=True, snapshot_slots=[10, 11])
    a = seq_of(range(14))
    assert alloc.admit(a) and a.snapshot_at == [12] and alloc.take_state_copies() == []
    a.num_cached = 12
    assert alloc.snapshot(a) == (a.state_slot, 10) and a.snapshot_at == []
    alloc.release(a, 12)
    b = seq_of([*range(12), 50, 51])
    assert alloc.admit(b) and b.num_cached == 12 and b.snapshot_at == []  # (its last full page's state: a hit)
    assert alloc.take_state_copies() == [(10, b.state_slot)]
    alloc.release(b, 0)
    c = seq_of([*range(8), 60, 61, 62, 63, 64])  # branches off a's pages after two of them: no state kept there
    assert alloc.admit(c) and c.num_cached == 0 and c.snapshot_at == [8, 12]
    c.num_cached = 8
    assert alloc.snapshot(c) == (c.state_slot, 11) and c.snapshot_at == [12]
    alloc.release(c, 8)
    d = seq_of([*range(8), 70, 71, 72, 73, 74])  # a third prompt on the same head starts from the kept state
    assert alloc.admit(d) and d.num_cached == 8 and alloc.take_state_copies() == [(11, d.state_slot)]
    assert d.snapshot_at == [12]
    alloc.release(d, 0)
    s = seq_of(range(100, 109))  # one more kept state: the one unused longest (a's, at 12) gives its slot
    assert alloc.admit(s)
    s.num_cached = 8
    assert alloc.snapshot(s) == (s.state_slot, 10)
    alloc.release(s, 8)
    again = seq_of([*range(12), 50, 51])
    assert alloc.admit(again) and again.num_cached == 8  # (the state at 8 is still kept)
    alloc.release(again, 0)
    alloc.admit(seq_of(range(300, 364)))  # every page: the cached ones are taken and their states dropped
    assert not alloc.snapshot_of and sorted(alloc.free_snapshots) == [10, 11]


def test_without_prefix_caching_nothing_is_cached():
    alloc = PageAllocator(8, 4)
    a = seq_of(range(9))
    assert alloc.admit(a)
    alloc.release(a, 9)
    b = seq_of(range(9))
    assert alloc.admit(b) and b.num_cached == 0 and alloc.num_cached_pages == 0


# ----------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def shared_prompts(tiny_qwen2):
    """Prompts that share prefixes as chat traffic does: a common system part, a repeat, a follow-up that
    extends an earlier prompt, and a prompt shorter than one page."""
    from ddtree.llm import load_tokenizer
    ids = load_tokenizer(tiny_qwen2).encode("".join(CORPUS[:4]))
    system = ids[:21]
    return [system + ids[30:37], system + ids[40:52], system + ids[30:37], ids[60:63], system + ids[40:52] + ids[70:79]]


def test_shared_prefixes_give_the_outputs_of_an_engine_without_the_cache(make_llm, shared_prompts):
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, seed=3)]
    plain = make_llm(enable_prefix_caching=False)
    llm = make_llm()
    for p in params:
        want = [o.token_ids for o in plain.generate(shared_prompts, p)]
        alone = [llm.generate([q], p)[0] for q in shared_prompts]
        batched = llm.generate(shared_prompts, p)
        assert [o.token_ids for o in alone] == want and [o.token_ids for o in batched] == want
        assert [o.num_cached_tokens for o in batched] == [(len(q) - 1) // 4 * 4 for q in shared_prompts]
    assert [o.num_cached_tokens for o in plain.generate(shared_prompts, params[0])] == [0] * 5
    alloc = llm.engine.allocator
    assert alloc.num_free == alloc.num_pages and alloc.num_cached_pages > 0
    assert alloc.hit_tokens > 0


def test_preempted_requests_find_their_pages_again_and_every_page_is_accounted_for(make_llm, shared_prompts,
                                                                                   monkeypatch):
    # 20 pages of 4 slots: the requests preempt each other. After every step, a page is held by exactly the
    # running requests whose tables list it, and free, idle and held pages add up to the pool.
    llm = make_llm(num_pages=20)
    engine, step = llm.engine, llm.engine.step
    alloc = engine.allocator

    def checked_step():
        out = step()
        holders = {}
        for s in engine.scheduler.running:
            for p in s.block_table:
                holders[p] = holders.get(p, 0) + 1
        assert all(alloc.refs[p] == n for p, n in holders.items())
        assert not set(holders) & (set(alloc.free_pages) | set(alloc.idle))
        assert len(holders) + alloc.num_free == alloc.num_pages
        assert all(not s.block_table for s in engine.scheduler.waiting)
        return out

    monkeypatch.setattr(engine, "step", checked_step)
    params = SamplingParams(max_tokens=14)
    want = [o.token_ids for o in make_llm(enable_prefix_caching=False).generate(shared_prompts, params)]
    out = llm.generate(shared_prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == want
    assert alloc.num_free == alloc.num_pages


def test_an_aborted_request_offers_the_pages_it_computed(make_llm, shared_prompts):
    llm = make_llm()
    engine = llm.engine
    seq = engine.add_request(shared_prompts[1], SamplingParams(max_tokens=30), stream=False)
    while seq.num_cached < len(shared_prompts[1]) + 5:
        engine.step()
    computed, tokens = seq.num_cached, list(seq.token_ids)
    engine.abort(seq)
    assert engine.allocator.num_free == engine.allocator.num_pages
    (out,) = llm.generate([tokens], SamplingParams(max_tokens=2))
    assert out.num_cached_tokens == computed // 4 * 4
