"""`budget auto`: speculation whose budget, 0 = plain AR included, is chosen per burst of steps on the
GPU and per step without graphs (the policy: spec/adaptive.py; the step itself: spec/decode.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from ddtree.engine.ar import ARDecoder, decode_inputs
from ddtree.engine.graphs import GraphPool, buckets_up_to
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import wants_logprobs
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import page_slots
from ddtree.sampling_params import SamplingParams
from ddtree.spec.adaptive import AdaptivePolicy, candidate_budgets
from ddtree.spec.costs import STORE_ENTRY_ROWS, STORE_ROWS, CostTable, measure_costs, wall_ms
from ddtree.spec.decode import SPEC_BURST, Speculator, StepOutputs
from ddtree.spec.context import context_of
from ddtree.spec.draft import DraftRunner, StepInputs, close_gap, gap_rows, gaps, has_gap, open_gaps
from ddtree.spec.tree import Candidates, candidates, cut_tree, expected_accepts

PENDING_ROWS = 128  # drafter context rows a request may hold pending (7 KB each) before an AR burst stores them
EXPECTED_SCALE = 1024  # auto's burst steps read E(b) back as integers: E * this, rounded
TIMED_BURST = 4  # auto learns an AR step's host time from AR bursts of at least this many steps


@dataclass(slots=True)
class RootInputs:
    """An AR step's inputs: the tree is the root alone."""
    roots: torch.Tensor  # [R]
    starts: torch.Tensor  # [R]
    block_tables: torch.Tensor  # [R, P]
    draw: torch.Tensor  # [R, COLUMNS] sampling settings
    state_slots: torch.Tensor | None = None  # [R] hybrid targets: the recurrent-state slots

    @classmethod
    def of(cls, inp: StepInputs) -> "RootInputs":
        """A speculative step's inputs without its drafting ones."""
        return cls(inp.roots, inp.starts, inp.block_tables, inp.draw, inp.state_slots)


@dataclass(slots=True)
class TreeInputs:
    """A verify step's inputs: the requests' rows and their drafted candidate nodes (spec/tree.py)."""
    roots: torch.Tensor
    starts: torch.Tensor
    block_tables: torch.Tensor
    draw: torch.Tensor
    score: torch.Tensor
    parent: torch.Tensor
    rank: torch.Tensor
    order: torch.Tensor
    tokens: torch.Tensor
    state_slots: torch.Tensor | None = None

    @property
    def candidates(self) -> Candidates:
        return Candidates(self.score, self.parent, self.rank, self.order, self.tokens)


class AdaptiveSpeculator(Speculator):
    """`budget auto`: the budget in `budgets` (0 = AR) for the whole batch, chosen per burst on the GPU
    and per step without graphs (spec/adaptive.py).

    Before each decode step `step` asks `ar_steps`, which plans the next budget on run-long
    figures (spec/adaptive.py `request_rate`). AR runs as the AR decoder's graphed bursts, whose
    steps also read out their target features: each request keeps them as pending drafter context,
    stored in one go before the next draft (or by an AR burst, once a request holds `PENDING_ROWS` of
    them). A budget b > 0 runs as a pipelined burst (`_burst`) of one whole-step graph per budget:
    draft, candidates for the largest budget, the tree of b cut from them, verify, accept; each step
    also reads back the drafter's E(b) of every budget, which keeps the averages current, and what
    the whole bursts took against the model's steps (a context store before one is a switch's cost,
    learnt apart) corrects the model's cost at that batch size. A probe is a whole burst of the
    budget that looks best.

    Without graphs (the CPU, sampled requests) a step is split in two at the budget choice: draft
    (candidates and E(b) of every budget), one read-back, the budget chosen on the current draft
    (`choose`: 0 throws the draft away), then that tree verified; `ar_step` runs one AR step that
    stores its own drafter context row."""

    def __init__(self, runner: ModelRunner, drafter: DraftRunner, ar: ARDecoder, topk: int, use_graphs: bool = False,
                 max_batch: int = 64, max_pages: int = 0, table: CostTable | None = None):
        self.budgets = candidate_budgets(drafter.block_size - 1, topk)
        super().__init__(runner, drafter, ar, self.budgets[-1], topk, False, max_batch, max_pages)
        self.ctx_rows = drafter.block_size  # a burst's context width: the last accepted path (more: stored first)
        self.max_pages, self.planned, self.tap_free = max_pages, 0, False  # (`ar_steps`)
        self.draft_graphs, self.ar_graphs, self.step_graphs = None, None, {}
        if use_graphs:  # one memory pool for all: each graph's outputs are consumed before the next replays
            pad = {"block_tables": runner.scratch_page, "ctx_slots": drafter.scratch_slot}
            widths = {"block_tables": max_pages}
            pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None  # (CPU: tests)
            # The draft alone and auto's own AR step are graphed only to be timed for the cost table.
            self.draft_graphs = GraphPool(self._draft, max_batch, pad=pad, widths=widths, mempool=pool, tp=runner.tp)
            self.ar_graphs = GraphPool(partial(self._budget_step, 0), max_batch,
                                       pad=pad, widths=widths, mempool=pool, tp=runner.tp)
            for b in self.budgets[1:]:
                self.step_graphs[b] = GraphPool(partial(self._whole_step, b), max_batch, pad=pad, widths=widths,
                                                mempool=pool, tp=runner.tp)
            drafter.warm_stores(max_batch, runner.max_num_batched_tokens)
        if table is None:  # with graphs, every batch bucket (capturing the graphs ahead of serving); else two
            sizes = buckets_up_to(max_batch) if use_graphs else sorted({1, min(2, max_batch)})
            with torch.inference_mode():
                table = measure_costs(self, sizes, self._fake_context(), reps=5 if use_graphs else 2)
        elif use_graphs:  # a table given (or kept from an earlier start): the graphs are captured now all the same
            with torch.inference_mode():
                self.draft_graphs.capture_all(self.padding_inputs)
                self.ar_graphs.capture_all(lambda bs: RootInputs.of(self.padding_inputs(bs)))
                for graphs in self.step_graphs.values():
                    graphs.capture_all(self.padding_inputs)
        self.policy = AdaptivePolicy(table, self.budgets)
        if use_graphs:
            with torch.inference_mode():
                self._warm_refeed(max_batch)

    def _warm_refeed(self, max_batch: int) -> None:
        """Refeeds on the scratch page, ahead of serving, of the shapes that compile every variant of
        the attention kernel a refeed can pick (a first compile mid-run stalls serving for up to a
        second). Then a small refeed and a large one (one forward, as
        wide as the runner feeds at once) timed again, the best of three each: the policy's refeed
        cost, a fixed part per forward and a part per row."""
        from ddtree.ops.triton_attention import variant_shapes  # (GPU only: Triton)
        runner = self.runner
        ps, scratch = runner.page_size, runner.scratch_page
        seqs = {}

        def row(n: int) -> tuple[Sequence, int, int]:  # n tokens after a page of context
            if n not in seqs:
                seqs[n] = Sequence([0] * (ps + n), SamplingParams(), None)
                seqs[n].block_table = [scratch] * (1 + n // ps + 1)
            return seqs[n], ps, n

        for lengths in variant_shapes(runner.max_num_batched_tokens, runner.heads_per_kv, runner.cfg.num_kv_heads):
            runner.refeed([row(n) for n in lengths], self.drafter.layer_ids)

        def timed(n: int, rows: int) -> float:
            refeed = partial(runner.refeed, [row(n)] * rows, self.drafter.layer_ids)
            return min(wall_ms(refeed, runner.device, reps=3))

        most = max(1, min(64, max_batch, runner.max_num_batched_tokens // 100))
        small, large = timed(2, 1), timed(100, most)
        row_ms = max(large - small, 0.0) / max(100 * most - 2, 1)
        self.policy.set_refeed_cost(max(small - 2 * row_ms, 0.0), row_ms, runner.max_num_batched_tokens)

    def _draft(self, inp: StepInputs) -> tuple[Candidates, torch.Tensor]:
        """Drafter block -> candidates for the largest budget and E(b) [R, budgets] for each b > 0."""
        c = candidates(self.drafter.logits(inp), self.budget, self.topk)
        return c, expected_accepts(c, self.budgets[1:])

    @property
    def packed_width(self) -> int:
        return self.depth + 3 + len(self.budgets) - 1  # then E(b) of each budget b > 0, in fixed point

    def _whole_step(self, budget: int, inp: StepInputs) -> StepOutputs:
        """A burst step of `budget` (device ops only): the packed rows gain E(b) of every budget, in
        fixed point so that one integer read-back carries them."""
        c, expected = self._draft(inp)
        out = self._verify(inp, cut_tree(c, inp.roots, budget))
        fixed = (expected * EXPECTED_SCALE).round().long()
        return StepOutputs(torch.cat([out.packed, fixed], dim=1), out.feats)

    def _budget_step(self, budget: int, inp: RootInputs | TreeInputs, scored: bool = False) -> StepOutputs:
        """Verify the tree of `budget` nodes; device ops only. Budget 0: one AR step that also stores
        the root's target features in the drafter cache (its context). `scored`: the outputs keep the
        logits along the accepted path (for logprobs)."""
        if budget:
            return self._verify(inp, cut_tree(inp.candidates, inp.roots, budget), scored)
        R = inp.roots.shape[0]
        ids = inp.roots[:, None]
        logits, feats = self.runner.verify(inp.block_tables, inp.starts, ids, torch.zeros_like(ids), None,
                                           self.drafter.layer_ids, inp.state_slots)
        if inp.state_slots is not None:  # hybrid targets: the root is committed, so its state is kept
            self.runner.commit_states(inp.state_slots, torch.zeros_like(inp.starts))
        slots = page_slots(inp.block_tables, inp.starts[:, None], self.runner.page_size).flatten()
        self.drafter.store_context(feats[:, 0], inp.starts, slots)
        packed = torch.cat([torch.zeros_like(ids), self.target_draws(logits, inp, torch.zeros_like(ids)), ids], 1)
        return StepOutputs(packed.view(R, 3), feats, logits if scored else None)

    def tap_free_prefill(self, batch: int) -> bool:
        """A prefill joining a decode batch of `batch` requests skips reading out the drafter's context
        too (a gap, as tap-free AR steps leave): the policy sees no chance for speculation there, and reading
        the context out would slow the prefill for nothing."""
        return self.policy.hopeless_at(batch)

    def _refeed_gaps(self, seqs: list[Sequence]) -> float:
        """The target features of every gap in the requests' drafter context (AR steps or prefills that
        skipped them), fed again through the target, into their pending rows; timed to its end (a device
        sync: the policy prices the next ones on it). Returns the ms it took (0: no gap)."""
        found = gaps(seqs)
        if not found:
            return 0.0
        t0 = time.perf_counter()
        feats = self.runner.refeed([(s, start, n) for s, _, start, n in found], self.drafter.layer_ids)
        for (s, j, _, _), f in zip(found, feats.split([n for *_, n in found])):
            context_of(s).fill_gap(j, f)
        _sync(self.runner.device)
        rows, ms = sum(n for *_, n in found), (time.perf_counter() - t0) * 1e3
        if self.timed:  # (not behind a prefill chunk still running on the device)
            self.policy.observe_refeed(rows, ms)
        self.stats.bursts.update({"refeeds": 1, "refeed_rows": rows, "refeed_ms": ms})
        return ms

    def gap_rows(self, seqs: list[Sequence]) -> int:
        """Rows a switch would have to feed again first (the policy prices a probe on them)."""
        return sum(map(gap_rows, seqs))

    def ar_steps(self, seqs: list[Sequence], joined: int = 0) -> int:
        """Asked before each decode step: 0 to speculate now (`decode`, with the planned budget), else
        how many AR steps to take first (run as a graphed burst of the AR decoder's,
        `ar_step` on the CPU). `joined`: the batch size once the prompts waiting for a slot are in.
        A graphed AR burst is `tap_free` as the plan says (it skips reading out the target features: the
        requests' context gets a gap, refed at a switch); the CPU's `ar_step` always reads them out."""
        self.planned = self.policy.plan(len(seqs), lambda: self.gap_rows(seqs), joined)
        self.tap_free = self.policy.tap_free  # (False where the plan speculates)
        return 0 if self.planned else 1 + self.policy.ar_steps_ahead()

    def after_ar_burst(self, batch: int, steps: int, request_steps: int, elapsed_ms: float) -> None:
        """An AR burst ran `steps` AR steps for `batch` requests (`request_steps` tokens committed) in
        `elapsed_ms`."""
        self.policy.skip_ar(steps - 1)
        self.stats.budget_hist[0] += request_steps
        bursts = self.stats.bursts  # (a Counter: += where `update` from a dict took ~4 us a burst on the CPU)
        bursts["ar_bursts"] += 1
        bursts["ar_steps"] += steps
        bursts["ar_ms"] += elapsed_ms
        bursts["tap_free_bursts"] += int(self.tap_free)
        if self.timed and steps >= TIMED_BURST:
            # (tap-free bursts, cheaper, do not teach the AR step's cost: the plan weighs speculation
            # against the AR steps that keep the drafter's context; nor do those tap-free for the gaps
            # the batch has, at a size with hope, count with AR's bursts there: `lost`)
            if not self.tap_free:
                self.policy.observe_time("ar", batch, elapsed_ms / steps, self.policy.table.ar_ms(batch))
            if not self.policy.gapped:
                self.policy.tally(0, batch, request_steps, elapsed_ms)

    @torch.inference_mode()
    def step(self, prefill: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """The engine's step: prompt chunks (`prefill`), then the plan for the decode requests: AR steps
        (a graphed burst of the AR decoder's, or one eager step that stores its context) or speculation.
        Requests that ask for logprobs take one eager step, its budget chosen on its draft."""
        touched = self.prefill(prefill) if prefill else []
        plain, scored = wants_logprobs(decode)
        if plain:
            self.timed = not prefill  # (a prefill chunk still running on the device would count in the times)
            self.short_bursts = self.ar.scheduler.admitting()
            ar = self.ar_steps(plain, self.ar.scheduler.headed_for())
            if ar and self.ar.can_burst(len(plain)):
                self._ar_burst(plain, ar)
            elif ar:
                self.ar_step(plain)
            else:
                self.decode(plain)
        if scored:
            self.timed = False  # (its host-side logprob work is no step time to learn from)
            self._eager_step(scored)
        return touched + decode

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prompt chunks that also store the drafter's context; with graphed AR bursts, not where the
        policy sees no chance for speculation at the batch they join, or a chunk's request already has a
        gap (a switch refeeds first anyway): their context is left with one, as tap-free AR bursts leave
        it (fed again at a switch, should one come). All the step's chunks go one way, in one forward
        (split in two, a run's prefills take more forwards than plain AR's)."""
        if self.ar.decode_graphs is None or not (any(has_gap(seq) for seq, _ in chunks) or
                                                 self.tap_free_prefill(self.ar.scheduler.headed_for())):
            return self.ar.prefill(chunks, taps=True)
        open_gaps([seq for seq, _ in chunks])
        self.stats.bursts["tap_free_prefills"] += 1
        return self.ar.prefill(chunks)

    def _ar_burst(self, seqs: list[Sequence], most: int) -> None:
        """AR steps chosen by the plan (at most `most`): a graphed AR burst whose steps also read out their
        target features, kept as each request's pending drafter context; or, where the policy sees no
        chance for speculation at this batch size or the one it is headed for, or a switch would refeed
        gaps first anyway (`tap_free`), plain AR's burst, the requests' context left with a gap."""
        tap_free = self.tap_free
        # The context rows wait (a verified path's, earlier AR steps'), to be stored in one go before
        # the next draft: an AR step that stored its own row spent ~7 small kernels, 4-5% of an AR
        # step on the H200. Only rows piling up are stored now (not a time to learn from: device work
        # not waited for), and not a request's with a gap (refed only at a switch).
        full = [] if tap_free else [s for s in seqs if s.num_cached - context_of(s).stored > PENDING_ROWS
                                    and not has_gap(s)]
        if full:
            t0 = time.perf_counter()
            self.drafter.store_pending(full)
            self.timed = False
            self.stats.bursts["store_ms"] += (time.perf_counter() - t0) * 1e3
        if tap_free:  # the gap opens, or goes on
            open_gaps(seqs)
        else:  # rows join the context after it
            for seq in seqs:
                if has_gap(seq):
                    close_gap(seq)
        t0 = time.perf_counter()
        burst = self.ar.burst(seqs, most, taps=not tap_free)
        if burst.feats is not None:
            # One pending block per request and burst (not a row per step: a store then concatenates
            # thousands of tiny tensors at a large batch, ~10 ms of host time at 128 requests), and not
            # cut out as a view here (spec/draft.py `pending_rows`). (Not to a request that finished in
            # the burst: its cache is dropped, and the entry would keep the whole buffer alive as long
            # as the request object.)
            for i, (seq, n) in enumerate(zip(seqs, burst.kept)):
                if n and not seq.is_finished:
                    context_of(seq).add((burst.feats, i, n))
        self.after_ar_burst(len(seqs), burst.steps, sum(burst.kept), (time.perf_counter() - t0) * 1e3)

    @torch.inference_mode()
    def ar_step(self, seqs: list[Sequence]) -> None:
        """One eager AR step that stores its drafter context row itself (no CUDA graphs: the CPU)."""
        self._refeed_gaps(seqs)
        self.drafter.store_pending(seqs)  # AR steps append to the drafter cache: no gap before them
        d = decode_inputs(seqs, [s.block_table for s in seqs], self.drafter.hybrid_target, self.runner.scratch_page,
                          self.runner.device)
        t0 = time.perf_counter()
        out = self._budget_step(0, RootInputs(d.ids, d.starts, d.block_tables, d.draw, d.state_slots),
                                any(s.logprobs is not None for s in seqs))
        self._commit(seqs, out, 0)
        if self.timed and self.draft_graphs is None:  # timed as the table was (eager)
            self.policy.observe_time("ar", len(seqs), (time.perf_counter() - t0) * 1e3,
                                     self.policy.table.ar_ms(len(seqs)))

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> None:
        """Speculation (the plan chose it): a graphed burst of the planned budget, or without graphs
        one step that drafts, chooses the budget on that draft, and verifies."""
        if self.draft_graphs is not None and len(seqs) <= self.draft_graphs.max_batch:
            self._auto_burst(seqs)
        else:
            self._eager_step(seqs)

    def _eager_step(self, seqs: list[Sequence]) -> None:
        """One step without graphs: draft, the budget chosen on this draft, verify."""
        R = len(seqs)
        self._refeed_gaps(seqs)
        short = all(s.num_cached - context_of(s).stored <= self.ctx_rows for s in seqs)
        t0 = time.perf_counter()
        inp = self.drafter.prepare(seqs)
        c, expected = self._draft(inp)
        expected = dict(zip(self.budgets[1:], expected[:R].sum(0).tolist()))  # read back mid-step to choose
        budget = self.policy.choose(R, expected)
        scored = any(s.logprobs is not None for s in seqs)
        if budget == 0:  # (the draft consumed the pending rows: the AR step's row follows them)
            out = self._budget_step(0, RootInputs.of(inp), scored)
        else:
            out = self._budget_step(budget, TreeInputs(inp.roots, inp.starts, inp.block_tables, inp.draw, c.score,
                                                       c.parent, c.rank, c.order, c.tokens, inp.state_slots), scored)
        accepted = self._commit(seqs, out, budget)
        if budget:
            self.policy.observe(budget, R, expected[budget], accepted)
            # Timed as the table was (eager, without graphs), and not a one-off: a draft over a new
            # prompt, or a step behind a prefill chunk.
            if self.timed and self.draft_graphs is None and short:
                t = self.policy.table
                self.policy.observe_time("spec", R, (time.perf_counter() - t0) * 1e3,
                                         t.draft_ms(R) + t.verify_ms(budget, R))

    def _auto_burst(self, seqs: list[Sequence]) -> None:
        """A pipelined burst of the planned budget's whole-step graph (a probe's too; the first draft,
        with nothing known yet, is one step)."""
        budget, R = self.planned or self.budgets[1], len(seqs)
        graphs = self.step_graphs[budget]
        captured = next(b for b in graphs.buckets if b >= R) in graphs.graphs  # (not a burst that captures)
        stored, store_ms = False, 0.0
        t0 = time.perf_counter()
        refeed_ms = self._refeed_gaps(seqs)  # (priced apart, on the rows it feeds again)
        if refeed_ms or any(s.num_cached - context_of(s).stored > self.ctx_rows for s in seqs):
            # an AR stretch's context (fed again where its steps did not read it out), wider than the
            # graph's: a cost of switching from AR, which the plan adds to a switch (not to the burst's
            # rate: a store comes only after AR steps; waited for, so that the burst's time is its own)
            self.drafter.store_pending(seqs)
            _sync(self.runner.device)
            stored = True
            store_ms = (time.perf_counter() - t0) * 1e3 - refeed_ms
            self.stats.bursts.update({"store_ms": store_ms, "stores": 1})
            if self.timed and captured:
                self.policy.observe_switch(R, store_ms)
        t1 = time.perf_counter()
        probing = self.policy.probing
        committed = self.stats.committed
        blind = self.policy.expected is None  # no draft seen yet: one step to learn from
        steps = self._burst(seqs, graphs, budget, most=1 if blind else SPEC_BURST)
        t2 = time.perf_counter()
        self.stats.bursts.update({"spec_bursts": 1, "spec_steps": steps, "probes": int(probing),
                                  "spec_ms": (t2 - t1) * 1e3})
        self.policy.probing = False
        if not (self.timed and captured):  # (a prefill chunk in flight, or a graph captured: no lesson)
            return
        # What a whole burst took, start and drain included, against the model's steps corrects the
        # model's cost at this batch size (and counts in `lost`); those without a store before them
        # (whose device work it may still wait on) also teach the model a step's host time. (A short
        # burst, the first blind step or one cut short by a finishing request, is mostly its start and
        # drain, which the AR bursts around it pay too.)
        if steps < TIMED_BURST:
            return
        self.policy.observe_burst(budget, R, self.stats.committed - committed, (t2 - t1) * 1e3, store_ms, steps)
        if not stored:
            t = self.policy.table
            self.policy.observe_time("spec", R, (t2 - t1) * 1e3 / steps, t.draft_ms(R) + t.verify_ms(budget, R))

    def _burst_step_done(self, budget: int, rows: list[list[int]]) -> None:
        """A burst step's E(b) of every budget into the policy's averages (a probe's first step
        replaces them), and its acceptance against its own draft's E(b)."""
        if not rows:
            return
        n, first = len(rows), super().packed_width
        expected = {b: sum(r[first + j] for r in rows) / EXPECTED_SCALE for j, b in enumerate(self.budgets[1:])}
        self.policy.record_draft(n, expected)
        self.policy.probing = False
        self.policy.observe(budget, n, expected[budget], sum(r[0] for r in rows))

    def _fake_context(self) -> int:
        ps = self.runner.page_size
        room = self.max_pages * ps - self.width if self.max_pages else 256
        return max(1, min(256, room, self.runner.cfg.max_position - self.width - 1))

    def fake_steps(self, bs: int, context: int) -> dict:
        """Step closures on `bs` fake requests with `context` cached tokens whose pages are all the
        scratch page (`padding_inputs`; timing only: their K/V are garbage): {"draft": the draft, 0:
        auto's AR step, b: a whole step of budget b (draft included), "store": a switch's store of
        STORE_ROWS pending rows a request, kept as AR bursts keep them}."""
        inp = self.padding_inputs(bs, context)
        root = RootInputs.of(inp)
        if self.draft_graphs is not None:
            steps = {"draft": partial(self.draft_graphs.run, inp), 0: partial(self.ar_graphs.run, root)}
            steps.update({b: partial(self.step_graphs[b].run, inp) for b in self.budgets[1:]})
        else:
            steps = {"draft": partial(self._draft, inp), 0: partial(self._budget_step, 0, root)}
            steps.update({b: partial(self._whole_step, b, inp) for b in self.budgets[1:]})
        # (an entry per request and AR burst, as the AR decoder's bursts leave them; rebuilding the lists is
        # timed too, ~0.3 ms at 512 requests on the CPU, against table stores of ~1 ms)
        per = min(STORE_ENTRY_ROWS, context)
        bursts = max(1, min(STORE_ROWS, context) // per)
        seqs = [Sequence([0] * context, SamplingParams(), None, block_table=table, num_cached=context)
                for table in inp.block_tables.tolist()]
        bufs = [torch.zeros(bs, per, self.drafter.feat_dim, dtype=self.drafter.dtype, device=self.runner.device)
                for _ in range(bursts)]

        def store():
            for i, s in enumerate(seqs):
                context_of(s).replace(context - per * bursts, [(buf, i, per) for buf in bufs])
            self.drafter.store_pending(seqs)
        steps["store"] = store
        return steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
