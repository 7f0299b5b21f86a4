"""AdaptiveSpeculator (speculative/auto.py, `budget="auto"`) end to end: auto decoding is lossless like every
other mode. Greedy output equals AR token for token, with a random drafter (auto runs plain AR's steps),
an oracle (it speculates), and a scripted policy that switches between AR, plain AR's steps (which skip
the drafter's context) and every budget, so the drafter's context must catch up after AR steps; the
graphed path emulated on the CPU (bursts, plain AR's steps where speculation cannot win, refeeds). The
policy alone: tests/test_policy.py.
"""
import itertools

import pytest
import torch

from ddtree.config import ModelConfig, PolicyConfig
from ddtree.llm import LLM
from ddtree.models.dflash import random_drafter, save_drafter
from ddtree.sampling_params import SamplingParams
from ddtree.speculative.context import context_of
from ddtree.speculative.costs import CostTable
from ddtree.speculative.draft import has_gap, store_shape
from ddtree.speculative.policy import Policy, candidate_budgets
from emulated import fake_gpu_graphs
from test_policy import BATCHES, BUDGETS, one_thread, roofline, table  # noqa: F401 (one_thread: autouse)
from test_spec import assert_idle, continuation, hook_draft_logits, noisy_oracle, plant
from tiny import make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", page_size=4, num_pages=512)
MAX_TOKENS = [40, 17, 29, 9]  # requests finishing at different times: the batch shrinks 4 -> 1


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """pair(family) -> (target dir, block-8 random drafter dir), memoized."""
    made = {}

    def get(family: str):
        if family not in made:
            path = make_tiny_model(str(tmp_path_factory.mktemp(f"auto_{family}")), family)
            d = str(tmp_path_factory.mktemp(f"auto_draft_{family}"))
            save_drafter(random_drafter(ModelConfig.from_dir(path), num_layers=1, block_size=8,
                                        target_layer_ids=[0, 1]), d)
            made[family] = (path, d)
        return made[family]

    return get


@pytest.fixture(scope="module")
def prompts():
    return [list(range(5, 5 + n)) for n in (3, 17, 6, 11)]


def params_of(max_tokens, sampled: bool = False) -> list[SamplingParams]:
    """Greedy requests; or `sampled`: seeded ones at temperature 0.8, top-p 0.95 and top-k 50, the third
    one greedy (a mixed batch)."""
    if not sampled:
        return [SamplingParams(max_tokens=m) for m in max_tokens]
    return [SamplingParams(max_tokens=m) if i == 2 else
            SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, top_k=50, seed=11 + i)
            for i, m in enumerate(max_tokens)]


@pytest.fixture(scope="module")
def ar_out(pairs, prompts):
    """ar_out(family, max_tokens, sampled) -> the AR engine's outputs for `prompts` with
    `params_of(max_tokens, sampled)` (memoized)."""
    cache = {}

    def get(family, max_tokens=tuple(MAX_TOKENS), sampled=False):
        if (family, max_tokens, sampled) not in cache:
            llm = LLM(pairs(family)[0], **ENGINE)
            cache[family, max_tokens, sampled] = llm.generate(prompts, params_of(max_tokens, sampled))
        return cache[family, max_tokens, sampled]

    return get


class Untimed(Policy):
    """The policy, deaf to step times: tests on a loaded CPU plan on the table they give, deterministically.
    `learned`: what timed bursts would have taught it, (budget, batch, steps, tokens, ms)."""
    def __init__(self, table, budgets, cfg=None, burst_steps=8):
        super().__init__(table, budgets, cfg, burst_steps)
        self.learned = []

    def observe_burst(self, budget, batch, steps, tokens, ms=None):
        if ms is not None:
            self.learned.append((budget, batch, steps, tokens, ms))
        super().observe_burst(budget, batch, steps, tokens, None)

    def observe_store(self, batch, ms):
        pass

    def observe_refeed(self, rows, ms):
        pass


def untimed(llm: LLM) -> Untimed:
    spec, old = llm.engine.speculator, llm.engine.speculator.policy
    spec.policy = Untimed(old.table, spec.budgets, old.cfg, old.burst_steps)
    spec.policy.costs.set_refeed(old.costs.refeed_fixed, old.costs.refeed_row, old.costs.refeed_rows)
    return spec.policy


def auto_llm(pairs, family, cost_table=None, **kw) -> LLM:
    path, d = pairs(family)
    llm = LLM(path, draft=d, spec="ddtree", budget="auto", topk=4, cost_table=cost_table, **ENGINE, **kw)
    if cost_table is not None:
        untimed(llm)
    return llm


def plant_noisy_oracle(llm: LLM, ref: dict) -> None:
    """Drafts the AR continuation's token at rank 0, 1 or 2 (or not at all), decoys above it."""
    plant(llm, noisy_oracle(ref, vocab=llm.config.vocab_size))


class Scripted(Policy):
    """A policy that follows a fixed cycle, one entry per engine step: "ar" (AR steps that read out the
    drafter's context), "plain" (speculation hopeless: plain AR's steps, which do not; on a hybrid
    target, never asked, "ar") or a budget. `seen`: the budgets of the verify steps it was told about."""
    def __init__(self, plan, table=table(lambda n, bs: 1.0)):
        super().__init__(table, BUDGETS)
        self.script, self.now, self.asked, self.seen = itertools.cycle(plan), None, False, []

    def hopeless(self, batch):
        self.now, self.asked = next(self.script), True
        return self.now == "plain"

    def plan(self, batch, switch=None):
        if not self.asked:
            self.now = next(self.script)
        self.asked = False
        if switch is not None:
            rows, left = switch()
            assert rows >= 0 and left > 0
        return self.now if isinstance(self.now, int) else 0

    def observe_step(self, budget, batch, expected, accepted):
        assert sorted(expected) == BUDGETS[1:]
        assert all(0 <= expected[b] <= b * batch + 1e-2 for b in expected)
        assert all(expected[a] <= expected[b] + 1e-2 for a, b in zip(BUDGETS[1:], BUDGETS[2:]))  # more nodes, more hope
        self.seen.append(budget)
        super().observe_step(budget, batch, expected, accepted)

    def observe_burst(self, budget, batch, steps, tokens, ms=None):
        assert steps >= 1 and tokens >= 0 and (ms is None or ms > 0)

    def observe_refeed(self, rows, ms):
        assert rows > 0 and ms > 0


def check_lossless(llm: LLM, prompts, ref, tokens_per_step_le: int = 8, sampled: bool = False) -> list:
    params = params_of(MAX_TOKENS, sampled)
    outs, hist = [], {}
    for batch, ps in [([p], [q]) for p, q in zip(prompts, params)] + [(prompts, params)]:  # alone, then batched
        outs += llm.generate(batch, ps)
        for b, n in llm.last_stats["budget_hist"].items():
            hist[b] = hist.get(b, 0) + n
    for o, r in zip(outs, ref + ref):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        assert max(o.accept_lengths, default=1) <= tokens_per_step_le
    # Every generated token: one from the prefill, the rest from verify steps or AR steps.
    assert sum(len(o.token_ids) for o in outs) == len(outs) + sum(sum(o.accept_lengths) for o in outs) + hist.get(0, 0)
    assert_idle(llm)
    return outs, hist


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_auto_with_a_random_drafter_runs_plain_ar_and_equals_it(family, pairs, prompts, ar_out):
    llm = auto_llm(pairs, family)  # the cost table measured here, on the CPU
    t = llm.engine.speculator.policy.table
    assert t.batch == [1, 2] and sorted(t.verify) == BUDGETS[1:] and min(t.ar + t.draft) > 0
    llm.set_mode("ddtree", "auto", 4, cost_table=table(lambda n, bs: 1.0 * n))  # drafts far below their cost
    policy = untimed(llm)
    outs, hist = check_lossless(llm, prompts, ar_out(family))
    # One blind step (budget 4) shows the drafter accepts nothing: from then on no batch size has hope, and
    # every step is plain AR's, with no plan made.
    assert hist.get(BUDGETS[1]) == 1 and set(hist) == {0, BUDGETS[1]}, hist
    assert sum(len(o.accept_lengths) for o in outs) == 1 and policy.hopeless(1)
    assert dict(policy.plans) == {"blind@1": 1} and llm.last_stats["bursts"].get("refeeds", 0) == 0
    assert llm.budget == "auto" and llm.spec == "ddtree"


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_5"])  # (qwen3_5: a hybrid)
def test_auto_with_a_good_drafter_speculates_and_equals_ar(family, pairs, prompts, ar_out):
    ref = ar_out(family)
    llm = auto_llm(pairs, family, cost_table=table(lambda n, bs: 1.0 + 0.01 * n))
    plant_noisy_oracle(llm, continuation(prompts, ar_out(family, (max(MAX_TOKENS),) * 4)))
    outs, hist = check_lossless(llm, prompts, ref)
    assert hist.get(0, 0) < sum(hist.values()) / 4, hist  # mostly speculating
    accepts = [n for o in outs for n in o.accept_lengths]
    assert sum(accepts) / len(accepts) > 1.5


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_5"])  # (qwen3_5: a hybrid)
def test_switching_between_ar_and_budgets_every_step_stays_lossless(family, pairs, prompts, ar_out):
    ref = ar_out(family)
    llm = auto_llm(pairs, family, cost_table=table(roofline))
    plant_noisy_oracle(llm, continuation(prompts, ar_out(family, (max(MAX_TOKENS),) * 4)))
    llm.engine.speculator.policy = script = Scripted(["ar", "ar", 4, "plain", 8, "ar", 16, 32, "plain", "ar", "ar",
                                                      32, "plain", "plain", 8])
    outs, hist = check_lossless(llm, prompts, ref)
    assert set(hist) == set(BUDGETS), hist
    assert set(script.seen) == set(BUDGETS[1:])
    refeeds = llm.last_stats["bursts"].get("refeeds", 0)
    assert (refeeds > 0) == (family != "qwen3_5")  # (a hybrid target never skips its drafter context)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_hybrid_target_under_graphed_auto_switches_without_skipping_the_context(pairs, prompts, ar_out, monkeypatch,
                                                                                    sampled):
    # CUDA graphs emulated: graphed AR bursts that read out the context and speculative bursts of every
    # budget, switching back and forth over the recurrent states, commit exactly AR's tokens; nothing is
    # fed through the target again.
    family = "qwen3_5"
    fake_gpu_graphs(monkeypatch)
    llm = auto_llm(pairs, family, cost_table=table(roofline), max_num_seqs=3)
    spec = llm.engine.speculator
    assert llm.engine.ar.decode_graphs is not None and spec.draft_graphs is not None and not spec.skips_context
    plant_by_position(llm, noisy_oracle(continuation(prompts, ar_out(family, (max(MAX_TOKENS),) * 4, sampled)),
                                        vocab=llm.config.vocab_size))
    spec.policy = Scripted(["ar", 4, 8, "ar", 32, 16, "ar", "ar", 8, 32])
    _, hist = check_lossless(llm, prompts, ar_out(family, sampled=sampled), sampled=sampled)
    assert set(hist) == set(BUDGETS), hist
    stats = llm.last_stats["bursts"]
    assert stats["ar_bursts"] > 0 and stats["spec_bursts"] > 0 and stats.get("refeeds", 0) == 0, stats


def test_prefixes_cached_by_plain_ar_steps_are_fed_to_the_drafter_before_it_drafts(pairs, prompts, ar_out):
    # Plain AR's steps (speculation hopeless) read nothing out for the drafter, yet the prefix cache keeps
    # their pages, unmarked for the drafter. A later request that takes them starts with a gap in its drafter
    # context, fed through the target again before its first draft, and stays lossless; the pages are then
    # marked.
    family = "qwen2"
    ref = ar_out(family)
    llm = auto_llm(pairs, family, cost_table=table(roofline))
    plant_noisy_oracle(llm, continuation(prompts, ar_out(family, (max(MAX_TOKENS),) * 4)))
    spec, alloc, params = llm.engine.speculator, llm.engine.allocator, params_of(MAX_TOKENS)
    spec.policy = Scripted(["plain"])
    first = llm.generate(prompts, params)
    assert alloc.num_cached_pages > 0 and not alloc.drafted
    spec.policy = Scripted([4, 8])
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [r.token_ids for r in ref]
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert llm.last_stats["bursts"].get("refeeds", 0) > 0 and alloc.drafted
    assert_idle(llm)


def test_policy_settings_come_from_the_engine_config(pairs, tmp_path):
    trace = tmp_path / "plans.jsonl"
    llm = auto_llm(pairs, "qwen2", cost_table=table(roofline), policy=PolicyConfig(margin=1.2, trace=str(trace)))
    assert llm.engine_cfg.policy.margin == 1.2 and llm.engine.speculator.policy.cfg.trace == str(trace)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert trace.read_text().count("\n") >= 1  # (a line per plan)


def recorder(into: dict):
    """A `replace` for hook_draft_logits that keeps each request's draft logits, keyed by its tokens."""
    def record(seqs, out):
        for seq, row in zip(seqs, out):
            into[tuple(seq.token_ids)] = row.clone()
        return out
    return record


@pytest.mark.parametrize("graphed,pending_rows,plain", [(False, None, False), (True, None, False), (True, 2, False),
                                                       (False, None, True), (True, 2, True), (True, 2, "mixed")])
def test_drafter_context_after_ar_steps_equals_a_fresh_prefill(pairs, prompts, ar_out, graphed, pending_rows, plain,
                                                               monkeypatch):
    # AR steps' target features reach the drafter cache (eager: each step stores its row; graphed: the
    # engine's AR bursts keep them pending, stored by the next draft, or by an AR burst once a request
    # holds `pending_rows`; `plain`: some steps are plain AR's, prompts included, which read none out,
    # and a switch feeds those tokens again; "mixed": prompts in chunks of a few tokens, some steps
    # plain, and refeeds in forwards of at most 3 tokens, so gaps split across them); the next draft must
    # see exactly the context a fresh engine builds by prefilling the same tokens.
    import ddtree.speculative.auto as auto
    family = "qwen2"
    if pending_rows is not None:
        monkeypatch.setattr(auto, "PENDING_ROWS", pending_rows)
    if graphed:
        fake_gpu_graphs(monkeypatch)
        # speculative bursts of one step: the recorder keys each draft by its request's tokens on the
        # host, which a burst's later steps (inputs prepared on the device) run ahead of
        monkeypatch.setattr(auto, "SPEC_BURST", 1)
    # (no prefix cache here: the prompts begin alike, and hits would leave little prompt to feed in chunks; the
    # fresh engine below has one, so its drafts check the drafter context of cached pages too)
    llm = auto_llm(pairs, family, cost_table=table(roofline), enable_prefix_caching=False)
    if plain == "mixed":
        llm.engine.runner.max_num_batched_tokens = 3
        llm.engine.scheduler.max_num_batched_tokens = 8
    steps = []  # per forward of prompt chunks: which of its requests had a gap, and whether it read out
    feed = llm.engine.ar._feed
    monkeypatch.setattr(llm.engine.ar, "_feed", lambda chunks, taps=False: steps.append(
        ([has_gap(seq) for seq, _ in chunks], taps)) or feed(chunks, taps))
    seen = {}
    hook_draft_logits(llm, recorder(seen))
    script = ["plain", "ar", 4, "plain", 8, "plain", "plain", "ar", 16, 32] if plain else ["ar", 4, 8, "ar", 16, 32]
    llm.engine.speculator.policy = Scripted(script)
    llm.generate(prompts, [SamplingParams(max_tokens=m) for m in MAX_TOKENS])
    assert (llm.engine.ar.decode_graphs is not None) == graphed
    stats = llm.last_stats["bursts"]
    assert (stats.get("refeeds", 0) > 0) == bool(plain), stats
    assert any(not tapped for _, tapped in steps if _) == bool(plain), steps  # (prompts read out or not)
    assert all(not any(gaps) for gaps, tapped in steps if tapped)  # (no read-out where a gap is open)
    keys = [k for k in seen if list(k[:-1]) not in prompts]
    assert len(keys) > 3  # (graphed: AR bursts of 16 steps, fewer drafts)
    fresh = auto_llm(pairs, family, cost_table=table(roofline))
    again = {}
    hook_draft_logits(fresh, recorder(again))
    fresh.engine.speculator.policy = Scripted([4])
    out = []
    for i in range(0, len(keys), 16):  # (few enough at a time that none is preempted before its draft)
        out += fresh.generate([list(k[:-1]) for k in keys[i:i + 16]], SamplingParams(max_tokens=2))
    assert [o.token_ids[0] for o in out] == [k[-1] for k in keys]
    for k in keys:
        torch.testing.assert_close(again[k], seen[k], atol=1e-3, rtol=1e-3)


def test_pending_rows_gathers_burst_entries_and_tensors_in_order():
    # A request's pending context mixes tensors (a prompt's, a verified path's) and (buffer, i, n)
    # entries of AR bursts' buffers shared by the batch; one cat and one gather give every row in order.
    from ddtree.engine.sequence import Sequence
    from ddtree.speculative.draft import pending_rows
    F = 5
    a, b, t, u = torch.randn(3, 4, F), torch.randn(2, 6, F), torch.randn(2, F), torch.randn(1, F)
    seqs = [Sequence([0], SamplingParams(), None) for _ in range(4)]
    context_of(seqs[0]).replace(0, [t, (a, 0, 4), (b, 1, 2)])
    context_of(seqs[1]).replace(0, [(a, 2, 1)])
    context_of(seqs[3]).replace(0, [(b, 0, 6), u, (a, 1, 3)])  # (seqs[2]: nothing pending)
    want = torch.cat([t, a[0, :4], b[1, :2], a[2, :1], b[0], u, a[1, :3]])
    assert torch.equal(pending_rows(seqs), want)
    context_of(seqs[1]).replace(0, [t, u])
    assert torch.equal(pending_rows(seqs[1:3]), torch.cat([t, u]))  # tensors only
    assert pending_rows(seqs[2:3]) is None
    context_of(seqs[1]).replace(0, [(b, 1, 6)])
    assert torch.equal(pending_rows(seqs[1:2]), b[1])  # one buffer (no cat)
    context_of(seqs[1]).replace(0, [(b, 1, 6), (b, 0, 6)])
    assert torch.equal(pending_rows(seqs[1:2]), torch.cat([b[1], b[0]]))  # every row, out of order
    c = torch.randn(64, 4, F)  # a few rows of a large buffer: views, not a copy of the whole buffer
    context_of(seqs[1]).replace(0, [(c, 5, 3), t])
    assert torch.equal(pending_rows(seqs[1:2]), torch.cat([c[5, :3], t]))


def test_store_pending_puts_each_row_at_its_position_and_slot(pairs):
    # Before AR steps, auto moves pending features into the drafter cache; positions and slots are
    # computed on the device from the page tables (rows spanning pages, a request with none pending).
    from ddtree.engine.sequence import Sequence
    llm = auto_llm(pairs, "qwen2", cost_table=table(roofline))
    dr = llm.engine.speculator.drafter
    got = {}
    dr.drafter.store_context = lambda f, pos, slots, use_triton=False: got.update(f=f, pos=pos.tolist(),
                                                                                   slots=slots.tolist())
    ps, want_pos, want_slots, want_feats, seqs = dr.page_size, [], [], [], []
    for cached, drafted, first in [(2 * ps + 5, 3, 7), (5, 5, 4), (ps + 4, 0, 1)]:
        pages = [(first + 5 * j) % 23 for j in range(-(-cached // ps))]  # scattered pages
        seq = Sequence(list(range(cached)), SamplingParams(), None)
        seq.block_table, seq.num_cached = pages, cached
        n = cached - drafted
        f = torch.randn(n, dr.feat_dim)
        context_of(seq).replace(drafted, [f[:n // 2], f[n // 2:]] if n else [])
        want_pos += range(drafted, cached)
        want_slots += [pages[q // ps] * ps + q % ps for q in range(drafted, cached)]
        want_feats.append(f)
        seqs.append(seq)
    dr.store_pending(seqs)
    n = len(want_pos)  # then padding rows up to the store's shape: zeros, into the scratch slot
    pad = store_shape(n) - n
    assert pad and got["pos"] == want_pos + [0] * pad and got["slots"] == want_slots + [dr.scratch_slot] * pad
    assert torch.equal(got["f"], torch.cat(want_feats + [torch.zeros(pad, dr.feat_dim)]))
    assert all(context_of(s).stored == s.num_cached and not context_of(s).pending for s in seqs)
    shapes = []  # every shape once, up to the most rows a store can have
    dr.store_context = lambda f, pos, slots: shapes.append((f.shape[0], pos.shape[0], set(slots.tolist())))
    dr.warm_stores(2, 300)
    assert shapes == [(m, m, {dr.scratch_slot}) for m in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)]


def test_store_shapes_are_few_and_pad_little():
    sizes = range(1, 5000)
    assert all(n <= store_shape(n) <= max(n + 15, 1.25 * n) for n in sizes)
    assert len({store_shape(n) for n in sizes}) == 8 + 4 * 5 + 1  # to 128, 4 an octave to 4096, then 5120


def test_sampled_and_greedy_requests_in_one_auto_batch(pairs, prompts, ar_out):
    family = "qwen2"
    llm = auto_llm(pairs, family, cost_table=table(roofline))
    plant_noisy_oracle(llm, continuation(prompts, ar_out(family, (max(MAX_TOKENS),) * 4)))
    llm.engine.speculator.policy = Scripted(["ar", 8, "plain", 32, 4])
    params = [SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=i) for i in range(3)]
    params.insert(1, SamplingParams(max_tokens=30))
    got = llm.generate(prompts, params)
    assert got[1].token_ids == ar_out(family, (30,) * 4)[1].token_ids
    assert all(len(o.token_ids) == 30 or o.finish_reason == "stop" for o in got)
    llm.engine.speculator.policy = Scripted(["ar", 8, "plain", 32, 4])  # samples depend on the trees drawn
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in got]  # seeded: reproducible
    assert_idle(llm)


def test_budget_auto_validation_and_mode_switches(pairs):
    path, d = pairs("qwen2")
    t = table(roofline)
    llm = LLM(path, draft=d, budget="auto", **ENGINE)
    assert llm.budget == "auto" and llm.engine.speculator.width == 33
    llm.set_mode("ddtree", "8", 4)  # as the command line passes it
    assert llm.budget == 8 and type(llm.engine.speculator).__name__ == "Speculator"
    llm.set_mode("dflash", "auto", cost_table=CostTable(t.batch, t.ar, t.draft, {4: t.verify[4], 7: t.verify[8]}))
    assert llm.engine.speculator.budgets == [0, 4, 7] and llm.topk == 1
    llm.set_mode("none", "auto")
    assert llm.engine.speculator is None and llm.budget == 0
    with pytest.raises(ValueError, match="'bogus'"):
        llm.set_mode("ddtree", "bogus")
    with pytest.raises(ValueError, match="-1"):
        llm.set_mode("ddtree", -1)


# ----------------------------------------------------------------------------- the graphed path, emulated

def test_graphed_auto_path_emulated_on_cpu_equals_ar(pairs, prompts, ar_out, monkeypatch):
    # The GPU path's plumbing (static inputs padded to batch buckets, pipelined bursts of each budget's
    # whole-step graph reading back E(b) with the packed rows, the cost table measured on the graphs,
    # refeeds timed at start-up) run on CPU with graph replays emulated.
    import ddtree.speculative.auto as auto
    family = "llama"
    ref, longer = ar_out(family), ar_out(family, (max(MAX_TOKENS),) * 4)
    fake_gpu_graphs(monkeypatch)
    path, d = pairs(family)
    from ddtree.engine.runner import ModelRunner
    refed = []  # every refeed's row lengths (the warm-up's: each attention variant's shape, then timed ones)
    refeed = ModelRunner.refeed
    monkeypatch.setattr(ModelRunner, "refeed",
                        lambda self, rows, taps: refed.append([n for *_, n in rows]) or refeed(self, rows, taps))
    llm = LLM(path, draft=d, spec="none", max_num_seqs=3, **ENGINE)
    llm.set_mode("ddtree", "auto", 4)  # (the table measured on the emulated graphs: buckets 1, 2, 3)
    eng = llm.engine
    spec = eng.speculator
    assert spec.draft_graphs is not None and spec.policy.table.batch == [1, 2, 3]
    assert len(spec.policy.table.store) == 3  # a switch's store, timed at every bucket
    assert spec.policy.costs.refeed_fixed > 0  # and a refeed's cost (0 unless timed at start-up), per forward
    assert spec.policy.costs.refeed_rows == eng.runner.max_num_batched_tokens
    from ddtree.ops.triton_attention import variant_shapes
    shapes = variant_shapes(eng.runner.max_num_batched_tokens, eng.runner.heads_per_kv, eng.runner.cfg.num_kv_heads)
    assert refed[:len(shapes)] == shapes
    assert all(set(spec.step_graphs[b].graphs) == {1, 2, 3} for b in BUDGETS[1:])  # captured while measuring
    plant_by_position(llm, noisy_oracle(continuation(prompts, longer), vocab=llm.config.vocab_size))
    spec.policy = script = Scripted(["ar", 4, 8, "plain", 32, 16, "ar", 8, 32])
    burst, done = spec._burst, spec._burst_step_done
    calls = {"bursts": 0, "steps": 0}
    monkeypatch.setattr(spec, "_burst", lambda *a, **k: calls.__setitem__("bursts", calls["bursts"] + 1) or
                        burst(*a, **k))
    monkeypatch.setattr(spec, "_burst_step_done", lambda *a: calls.__setitem__("steps", calls["steps"] + 1) or
                        done(*a))
    outs, hist = check_lossless(llm, prompts, ref)
    assert set(hist) == set(BUDGETS), hist
    assert calls["steps"] > calls["bursts"] > 0, calls  # pipelined bursts of several steps ...
    assert set(script.seen) == set(BUDGETS[1:])  # ... whose read-backs reached the policy
    accepted = [a for o in outs for a in o.accept_lengths]
    assert sum(accepted) / len(accepted) > 1.5, accepted  # the oracle's drafts were accepted inside bursts
    assert len(refed) > len(shapes) + 2  # (the start-up's timed refeeds, then the switches')


@pytest.mark.parametrize("spec_mode,topk", [("ddtree", 4), ("dflash", 1)])
def test_graphed_auto_ar_bursts_emulated_on_cpu_equal_ar(pairs, prompts, ar_out, monkeypatch, spec_mode, topk):
    # Verification priced high: the real policy runs AR bursts (the engine's pipelined AR steps: plain AR's
    # where speculation has no hope, else ones that read out the drafter's context), requests finish
    # mid-burst; the output is AR's exactly. The engine is built as on a GPU, so its page reservation must
    # cover a whole AR burst even when the trees are narrower (DFlash with a block-8 drafter: budgets 4 and 7).
    import ddtree.engine.engine as engine_mod
    family = "qwen2"
    ref, longer = ar_out(family), ar_out(family, (max(MAX_TOKENS),) * 4)  # AR before graphs are faked
    fake_gpu_graphs(monkeypatch)
    path, d = pairs(family)
    budgets = candidate_budgets(7, topk)[1:]
    cost = CostTable(BATCHES, [1.0 * bs for bs in BATCHES], [0.1] * len(BATCHES),
                     {b: [(b + 1.0) * bs for bs in BATCHES] for b in budgets})
    llm = LLM(path, draft=d, spec="none", max_num_seqs=4, **ENGINE)
    llm.set_mode(spec_mode, "auto", topk, cost_table=cost)
    untimed(llm)
    spec = llm.engine.speculator
    eng = llm.engine
    assert spec.draft_graphs is not None and eng.scheduler.decode_width >= engine_mod.DECODE_BURST
    assert eng.scheduler.decode_tokens == 1  # prompts are not starved by trees auto rarely verifies at scale
    plant_noisy_oracle(llm, continuation(prompts, longer))
    calls = {"bursts": 0, "steps": 0}
    burst, read = eng.ar.burst, eng.ar._commit_step
    monkeypatch.setattr(eng.ar, "burst", lambda *a, **k: calls.__setitem__("bursts", calls["bursts"] + 1) or
                        burst(*a, **k))
    monkeypatch.setattr(eng.ar, "_commit_step", lambda *a: calls.__setitem__("steps", calls["steps"] + 1) or read(*a))
    monkeypatch.setattr(spec, "_eager_step", lambda *a: pytest.fail("an eager step: greedy steps run graphed, "
                                                                     "a new prompt's context stored first"))
    finished = []
    finish = eng.scheduler.finish
    monkeypatch.setattr(eng.scheduler, "finish", lambda seq, reason: finished.append(seq) or finish(seq, reason))
    outs, hist = check_lossless(llm, prompts, ref)
    assert hist.get(0, 0) > 3 * sum(n for b, n in hist.items() if b), hist  # mostly AR ...
    assert len(set(hist)) > 1, hist  # ... with speculation where it pays (one request: oracle drafts)
    assert calls["steps"] > 3 * calls["bursts"] > 0, calls  # AR steps ran in pipelined bursts
    # a request that finished in a burst keeps no feature rows (a view would hold the burst's buffer)
    assert finished and not any(context_of(seq).pending for seq in finished)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_graphed_auto_speculates_in_bursts_with_a_good_drafter(pairs, prompts, ar_out, monkeypatch, sampled):
    # Verification priced cheap and an oracle drafter: the real policy plans budgets > 0, which run as
    # pipelined bursts of whole-step graphs; the output is AR's exactly (sampled: seeded requests and a
    # greedy one, the same graphs and the same plan, seeded AR's tokens).
    import ddtree.speculative.auto as auto
    import ddtree.speculative.decode as decode
    llm, ref = graphed_auto_with_an_oracle(pairs, prompts, ar_out, monkeypatch, table(lambda n, bs: 1.0 + 0.01 * n),
                                           sampled)
    spec = llm.engine.speculator
    monkeypatch.setattr(spec, "_eager_step", lambda *a: pytest.fail("an eager step: every step runs graphed"))
    steps = []
    burst = spec._burst
    monkeypatch.setattr(spec, "_burst", lambda *a, **k: (lambda n: steps.append(n) or n)(burst(*a, **k)))
    outs, hist = check_lossless(llm, prompts, ref, sampled=sampled)
    assert hist.get(0, 0) < sum(hist.values()) / 4, hist  # mostly speculating ...
    assert max(steps) > decode.SHORT_BURST and sum(steps) > 2 * len(steps), steps  # ... in pipelined bursts
    bursts = llm.last_stats["bursts"]  # (the last generate call: the four requests batched)
    assert bursts["spec_bursts"] > 0 and bursts["spec_steps"] > bursts["spec_bursts"], bursts
    accepted = [a for o in outs for a in o.accept_lengths]
    assert sum(accepted) / len(accepted) > 1.5, accepted
    learned = spec.policy.learned  # what whole bursts would teach the policy: (budget, batch, steps, tokens, ms)
    assert learned and all(b in BUDGETS[1:] and 1 <= n <= 4 and auto.TIMED_BURST <= k <= auto.SPEC_BURST
                           and tokens >= k * n and ms > 0 for b, n, k, tokens, ms in learned if b), learned


def test_graphed_auto_runs_plain_ar_where_speculation_is_hopeless(pairs, prompts, ar_out, monkeypatch):
    # Verification priced out of reach at 3-4 requests and cheap at 1-2, an oracle drafter: with the whole
    # batch running, steps are plain AR's (its graphs, no target features read out, no plan); once requests
    # finish it speculates, the skipped tokens fed through the target again first. The output is AR's.
    cost = table(lambda n, bs: 1.0 if n == 1 or bs <= 2 else 100.0 * n)
    llm, ref = graphed_auto_with_an_oracle(pairs, prompts, ar_out, monkeypatch, cost)
    spec, eng = llm.engine.speculator, llm.engine
    spec.policy.costs.set_refeed(0.5, 0.001)  # (cheap against the table's 1 ms steps)
    assert eng.ar.untapped_decode_graphs is not eng.ar.decode_graphs
    pools, prefills = [], []
    graphed, feed = eng.ar.burst, eng.ar._feed
    monkeypatch.setattr(eng.ar, "burst", lambda seqs, most=None, taps=False: pools.append(
        (len(seqs), not taps)) or graphed(seqs, most, taps))
    monkeypatch.setattr(eng.ar, "_feed", lambda chunks, taps=False: prefills.append(taps) or feed(chunks, taps))
    outs, hist = check_lossless(llm, prompts, ref)
    bursts = llm.last_stats["bursts"]  # (the last generate call: the four requests batched)
    assert bursts["refeeds"] > 0 and bursts["spec_bursts"] > 0, bursts
    assert False in prefills  # the batched prompts joined a hopeless batch: not read out
    assert all(bs <= 2 for bs, untapped in pools if not untapped), pools  # taps only where speculation may win
    assert any(bs > 2 for bs, untapped in pools if untapped), pools
    assert all(int(key.split("@")[1]) <= 2 for key in spec.policy.plans), spec.policy.plans  # no plan above


def graphed_auto_with_an_oracle(pairs, prompts, ar_out, monkeypatch, cost: CostTable, sampled: bool = False):
    """An engine built as on a GPU (graphs emulated) in `auto` on `cost` (`Untimed`), its drafter a noisy
    oracle of AR's continuation (`params_of(..., sampled)`); and AR's outputs (made before the graphs are
    faked)."""
    family = "qwen2"
    ref, longer = ar_out(family, sampled=sampled), ar_out(family, (max(MAX_TOKENS),) * 4, sampled)
    fake_gpu_graphs(monkeypatch)
    path, d = pairs(family)
    llm = LLM(path, draft=d, spec="none", max_num_seqs=4, **ENGINE)
    llm.set_mode("ddtree", "auto", 4, cost_table=cost)
    untimed(llm)
    plant_by_position(llm, noisy_oracle(continuation(prompts, longer), vocab=llm.config.vocab_size))
    return llm, ref


def plant_by_position(llm: LLM, choose) -> None:
    """Like test_spec's `plant`, but the drafted position comes from the step's device inputs (the
    root's position), so it stays right inside a burst, where steps after the first are prepared
    on the device without the host's help."""
    spec, current = llm.engine.speculator, []
    real_step, real_logits = spec.decode, spec.drafter.logits

    def step(seqs, *args):
        current[:] = seqs
        return real_step(seqs, *args)

    def logits(inp):
        out = torch.zeros_like(real_logits(inp))
        for i, seq in enumerate(current):  # rows past the requests: graph padding
            for j in range(out.shape[1]):  # depth j + 1 predicts position root + j + 1
                for tok, value in choose(seq, int(inp.starts[i]) + 1 + j).items():
                    out[i, j, tok] = value
        return out

    spec.decode, spec.drafter.logits = step, logits


@pytest.mark.parametrize("budget,topk,min_tau,admitting,sampled",
                         [(8, 4, 2.0, False, False), (7, 1, 1.5, False, False), (8, 4, 2.0, True, False),
                          (8, 4, 2.0, False, True), (7, 1, 1.5, False, True)],
                         ids=["ddtree", "dflash", "ddtree-admitting", "ddtree-sampled", "dflash-sampled"])
def test_graphed_speculative_bursts_emulated_on_cpu_equal_ar(pairs, prompts, ar_out, monkeypatch, budget, topk,
                                                             min_tau, admitting, sampled):
    # Fixed-budget speculation on the graphed path: bursts of pipelined steps whose inputs (root, positions,
    # drafter context = the accepted path's features) are built on the device from the previous step,
    # requests finishing mid-burst; the output is AR's exactly and no page leaks. Sampled: seeded requests
    # (and a greedy one) run the same graphs and commit exactly seeded AR's tokens.
    import ddtree.speculative.decode as decode
    family = "qwen2"
    ref, longer = ar_out(family, sampled=sampled), ar_out(family, (max(MAX_TOKENS),) * 4, sampled)  # (before graphs are faked)
    fake_gpu_graphs(monkeypatch)
    path, d = pairs(family)
    llm = LLM(path, draft=d, spec="ddtree", budget=budget, topk=topk, **ENGINE)
    spec = llm.engine.speculator
    assert spec.graphs is not None and llm.engine.scheduler.decode_width > budget + 1
    assert set(spec.graphs.graphs) == set(spec.graphs.buckets)  # every bucket captured at start-up
    monkeypatch.setattr(spec, "_eager_step", lambda *a: pytest.fail("an eager step: every step runs graphed, "
                                                                     "a new prompt's context stored first"))
    prefills = []  # prefills replay graphs that also store the drafter's context
    real = llm.engine.ar._prefill_graphed
    monkeypatch.setattr(llm.engine.ar, "_prefill_graphed",
                        lambda chunks, taps=False: (lambda r: prefills.append(r is not None) or r)(real(chunks, taps)))
    plant_by_position(llm, noisy_oracle(continuation(prompts, longer)))
    calls = {"bursts": 0, "steps": 0}
    burst, read = spec._burst, spec._commit_burst_step
    monkeypatch.setattr(spec, "_burst", lambda *a: calls.__setitem__("bursts", calls["bursts"] + 1) or burst(*a))
    monkeypatch.setattr(spec, "_commit_burst_step",
                        lambda *a: calls.__setitem__("steps", calls["steps"] + 1) or read(*a))
    # steps per burst: at most SPEC_BURST, or SHORT_BURST while a request waits for a slot
    if admitting:
        monkeypatch.setattr(llm.engine.scheduler, "admitting", lambda: True)
    outs, hist = check_lossless(llm, prompts, ref, sampled=sampled)
    assert calls["steps"] > (1 if admitting else 2) * calls["bursts"] > 0, calls
    assert calls["steps"] <= (decode.SHORT_BURST if admitting else decode.SPEC_BURST) * calls["bursts"], calls
    accepted = [a for o in outs for a in o.accept_lengths]
    assert sum(accepted) / len(accepted) > min_tau, accepted  # the oracle's drafts were accepted inside bursts
    assert any(prefills), prefills


def test_next_burst_inputs_stay_inside_the_pages_the_accepted_path_used(pairs):
    # The next step's drafter context is the accepted path (L + 1 rows); its padding rows must get the
    # scratch slot without indexing past a request's last page (the table may end right after the path).
    from ddtree.speculative.decode import StepInputs
    path, d = pairs("qwen2")
    llm = LLM(path, draft=d, spec="dflash", **ENGINE)  # block 8, page size 4
    spec = llm.engine.speculator
    B, ps, scratch = spec.drafter.block_size, 4, spec.drafter.scratch_slot
    starts = torch.tensor([5, 10])
    tables = torch.tensor([[3, 9, -1, -1], [4, 6, 7, 0]])  # request 0: pages for positions < 8 only
    length = torch.tensor([2, 5])  # request 0's path: positions 5, 6, 7
    packed = torch.stack([length, torch.tensor([11, 12])], 1)
    feats = torch.randn(2, B, spec.drafter.feat_dim)
    inp = StepInputs(torch.tensor([1, 2]), starts, tables.clamp(min=0), feats, starts[:, None].expand(2, B),
                     torch.zeros(2, B, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    nxt = spec._next_inputs(inp, packed, feats)
    assert nxt.roots.tolist() == [11, 12] and nxt.starts.tolist() == [8, 16]
    assert nxt.ctx_pos[0].tolist() == [5, 6, 7] + [0] * (B - 3)
    assert nxt.ctx_slots[0].tolist() == [9 * ps + 1, 9 * ps + 2, 9 * ps + 3] + [scratch] * (B - 3)
    assert nxt.ctx_slots[1, :6].tolist() == [7 * ps + 2, 7 * ps + 3, 0, 1, 2, 3]  # positions 10..15
    assert (nxt.ctx_slots[1, 6:] == scratch).all()



def test_the_measured_cost_table_is_kept_and_reused_by_a_later_start(pairs, tmp_path, monkeypatch):
    # Budget auto measures its step costs once per setup (device, model, drafter, dtype, engine sizes);
    # a later start with the same setup reads them from the ddtree cache instead of measuring.
    import ddtree.speculative.auto as auto
    monkeypatch.setenv("DDTREE_COST_CACHE", str(tmp_path / "costs"))
    path, d = pairs("qwen2")
    measured = []
    real = auto.measure_costs
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **kw: measured.append(1) or real(*a, **kw))
    first = LLM(path, draft=d, spec="ddtree", budget="auto", topk=4, **ENGINE)
    second = LLM(path, draft=d, spec="ddtree", budget="auto", topk=4, **ENGINE)
    assert measured == [1] and len(list((tmp_path / "costs").iterdir())) == 1
    assert second.engine.speculator.policy.table.as_dict() == first.engine.speculator.policy.table.as_dict()
    LLM(path, draft=d, spec="ddtree", budget="auto", topk=2, **ENGINE)  # another setup: measured anew
    assert measured == [1, 1]


def test_a_given_cost_table_still_captures_every_graph_before_serving(pairs, monkeypatch):
    # (measuring captures them as it times them; a table given or kept must not leave them to the
    # first steps that need them, which would stall mid-run)
    fake_gpu_graphs(monkeypatch)
    llm = auto_llm(pairs, "qwen2", cost_table=table(lambda n, bs: 1.0 + 0.01 * n))
    spec = llm.engine.speculator
    for pool in [spec.draft_graphs, spec.ar_graphs, *spec.step_graphs.values()]:
        assert set(pool.graphs) == set(pool.buckets)


def test_a_kept_table_without_today_s_budgets_is_measured_again(pairs, tmp_path, monkeypatch):
    # (a table kept by code with another budget set must not fail a start: it is a miss)
    import json

    import ddtree.speculative.auto as auto
    monkeypatch.setenv("DDTREE_COST_CACHE", str(tmp_path / "costs"))
    path, d = pairs("qwen2")
    LLM(path, draft=d, spec="ddtree", budget="auto", topk=4, **ENGINE)
    (kept,) = (tmp_path / "costs").iterdir()
    data = json.loads(kept.read_text())
    data["table"]["verify"].pop(max(data["table"]["verify"], key=int))
    kept.write_text(json.dumps(data))
    measured = []
    real = auto.measure_costs
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **kw: measured.append(1) or real(*a, **kw))
    llm = LLM(path, draft=d, spec="ddtree", budget="auto", topk=4, **ENGINE)
    assert measured == [1] and llm.engine.speculator.policy.table is not None
