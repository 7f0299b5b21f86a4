"""`budget auto`: speculation whose budget, 0 = plain AR included, is chosen per burst of steps for the
whole batch (the plan: speculative/policy.py; a speculative step: speculative/decode.py).

Each engine step first asks whether speculation could win at the batch size (that of the running batch,
or the one the waiting prompts are about to fill: `Policy.hopeless`). Where it could not, the step is
plain AR's own (`ARDecoder.step`: its graphs, no read-out of the drafter's context, no plan): each
request's context is left with an open gap (speculative/context.py). Elsewhere the plan picks the budget:
- AR runs as the AR decoder's graphed bursts whose steps read out the target features (kept as each
  request's pending drafter context, stored in one go before the next draft), or as eager steps that
  store their own row (no graphs). Where some request has a gap, AR stays plain AR's: a switch feeds the
  gaps through the target again first (`_refeed_gaps`) either way, and the plan prices that.
- A budget b > 0 runs as a pipelined burst of one whole-step graph per budget (draft, candidates for the
  largest budget, the tree of b cut from them, verify, accept), each step reading back the drafter's
  E(b) of every budget for the policy; or as one eager step (no graphs, requests that ask for logprobs or follow a structure).

Hybrid targets never skip the read-out: feeding skipped rows again would advance their recurrent states
twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from ddtree.config import PolicyConfig
from ddtree.engine.ar import ARDecoder, decode_inputs
from ddtree.engine.graphs import GraphPool, buckets_up_to
from ddtree.engine.runner import ModelRunner
from ddtree.engine.grammar import constrained_rows
from ddtree.engine.sampler import needs_host
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import page_slots
from ddtree.sampling_params import SamplingParams
from ddtree.speculative.context import context_of
from ddtree.speculative.costs import STORE_ENTRY_ROWS, STORE_ROWS, CostTable, measure_costs, wall_ms
from ddtree.speculative.decode import SPEC_BURST, Speculator, StepOutputs
from ddtree.speculative.draft import DraftRunner, StepInputs, gap_rows, gaps, has_gap
from ddtree.speculative.policy import Policy, candidate_budgets
from ddtree.speculative.tree import Candidates, candidates, cut_tree, expected_accepts

PENDING_ROWS = 128  # drafter context rows a request may hold pending (7 KB each) before an AR burst stores them
EXPECTED_SCALE = 1024  # auto's burst steps read E(b) back as integers: E * this, rounded
TIMED_BURST = 4  # bursts of at least this many steps teach the policy what a step costs


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
    """A verify step's inputs: the requests' rows and their drafted candidate nodes (speculative/tree.py)."""
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
    def __init__(self, runner: ModelRunner, drafter: DraftRunner, ar: ARDecoder, topk: int, use_graphs: bool = False,
                 max_batch: int = 64, max_pages: int = 0, table: CostTable | None = None,
                 policy: PolicyConfig | None = None):
        policy = policy or PolicyConfig()
        self.budgets = candidate_budgets(drafter.block_size - 1, topk, policy.budgets)
        super().__init__(runner, drafter, ar, self.budgets[-1], topk, False, max_batch, max_pages)
        self.ctx_rows = drafter.block_size  # a burst's context width: the last accepted path (more: stored first)
        self.max_pages = max_pages
        self.skips_context = not drafter.hybrid_target  # (plain AR's steps, which skip the read-out)
        self.draft_graphs, self.ar_graphs, self.step_graphs = None, None, {}
        if use_graphs:  # one memory pool for all: each graph's outputs are consumed before the next replays
            pad = {"block_tables": runner.scratch_page, "ctx_slots": drafter.scratch_slot,
                   "state_slots": runner.scratch_state_slot}  # (hybrids: padding rows advance the scratch state)
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
        self.policy = Policy(table, self.budgets, policy, SPEC_BURST)
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
                seqs[n].state_slot = runner.scratch_state_slot
            return seqs[n], ps, n

        for lengths in variant_shapes(runner.max_num_batched_tokens, runner.heads_per_kv, runner.cfg.num_kv_heads):
            runner.refeed([row(n) for n in lengths], self.drafter.layer_ids)

        def timed(n: int, rows: int) -> float:
            refeed = partial(runner.refeed, [row(n)] * rows, self.drafter.layer_ids)
            return min(wall_ms(refeed, runner.device, reps=3))

        most = max(1, min(64, max_batch, runner.max_num_batched_tokens // 100))
        small, large = timed(2, 1), timed(100, most)
        row_ms = max(large - small, 0.0) / max(100 * most - 2, 1)
        self.policy.costs.set_refeed(max(small - 2 * row_ms, 0.0), row_ms, runner.max_num_batched_tokens)

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

    def _budget_step(self, budget: int, inp: RootInputs | TreeInputs, scored: bool = False,
                     constraints: list | None = None) -> StepOutputs:
        """Verify the tree of `budget` nodes; device ops only. Budget 0: one AR step that also stores
        the root's target features in the drafter cache (its context). `scored`: the outputs keep the
        logits along the accepted path (for logprobs). `constraints`: each request's structure or None
        (engine/grammar.py: the draws are masked by it, on the host)."""
        if budget:
            return self._verify(inp, cut_tree(inp.candidates, inp.roots, budget), scored, constraints)
        R = inp.roots.shape[0]
        ids = inp.roots[:, None]
        logits, feats = self.runner.verify(inp.block_tables, inp.starts, ids, torch.zeros_like(ids), None,
                                           self.drafter.layer_ids, inp.state_slots)
        if inp.state_slots is not None:  # hybrid targets: the root is committed, so its state is kept
            self.runner.commit_states(inp.state_slots, torch.zeros_like(inp.starts))
        slots = page_slots(inp.block_tables, inp.starts[:, None], self.runner.page_size).flatten()
        self.drafter.store_context(feats[:, 0], inp.starts, slots)
        allowed = logits if constraints is None else constrained_rows(logits[:, 0], constraints)[:, None]
        packed = torch.cat([torch.zeros_like(ids), self.target_draws(allowed, inp, torch.zeros_like(ids)), ids], 1)
        return StepOutputs(packed.view(R, 3), feats, logits if scored else None)

    @torch.inference_mode()
    def step(self, prefill: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """The engine's step: plain AR's where speculation cannot win at this batch size; else prompt
        chunks, then the plan's budget for the decode requests (a graphed burst, or eager steps). Requests
        that ask for logprobs or follow a structure take one eager step of that budget."""
        if self.skips_context and self.policy.hopeless(max(len(decode), self.ar.scheduler.headed_for())):
            return self.ar.step(prefill, decode)
        plain, hosted = needs_host(decode)
        batch = plain or hosted
        budget = self.policy.plan(len(batch), partial(self._switch, batch)) if batch else 0
        if not budget and self.skips_context and any(map(has_gap, decode)):
            return self.ar.step(prefill, decode)  # (a switch feeds the gaps again first in any case)
        touched = self.prefill(prefill) if prefill else []
        if plain:
            self.timed = not prefill  # (a prefill chunk still running on the device would count in the times)
            self.short_bursts = self.ar.scheduler.admitting()
            if budget:
                self.decode(plain, budget)
            elif self.ar.can_burst(len(plain)):
                self._ar_burst(plain)
            else:
                self.ar_step(plain)
        if hosted:
            self.timed = False  # (its host-side logprob and mask work is no step time to learn from)
            if budget:
                self._eager_step(hosted, budget)
            else:
                self.ar_step(hosted)
        return touched + decode

    def _switch(self, seqs: list[Sequence]) -> tuple[int, float]:
        """What a switch from AR would pay for: the rows it feeds again first, and the tokens per request
        left to win them back over."""
        rows = sum(map(gap_rows, seqs)) if self.skips_context else 0
        return rows, sum(s.params.max_tokens - len(s.output_ids) for s in seqs) / len(seqs)

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prompt chunks that also store the drafter's context, unless a chunk's request has a gap (all the
        step's chunks go one way, in one forward): then theirs gets one too."""
        if self.skips_context and any(has_gap(seq) for seq, _ in chunks):
            return self.ar.prefill(chunks)
        return self.ar.prefill(chunks, taps=True)

    def _refeed_gaps(self, seqs: list[Sequence]) -> float:
        """The target features of every gap in the requests' drafter context, fed again through the target
        into their pending rows; timed to its end (a device sync: the policy prices the next ones on it).
        Returns the ms it took (0: no gap)."""
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

    def _ar_burst(self, seqs: list[Sequence]) -> None:
        """A graphed AR burst whose steps also read out their target features, kept as each request's
        pending drafter context (one entry per request and burst, cut out of the burst's buffer only
        when stored). Only rows piling up are stored now (not a time to learn from: device work not
        waited for)."""
        full = [s for s in seqs if s.num_cached - context_of(s).stored > PENDING_ROWS]
        if full:
            t0 = time.perf_counter()
            self.drafter.store_pending(full)
            self.timed = False
            self.stats.bursts["store_ms"] += (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        burst = self.ar.burst(seqs, taps=True)
        for i, (seq, n) in enumerate(zip(seqs, burst.kept)):
            if n and not seq.is_finished:  # (a finished request's entry would keep the buffer alive)
                context_of(seq).add((burst.feats, i, n))
        ms, tokens = (time.perf_counter() - t0) * 1e3, sum(burst.kept)
        self.stats.bursts.update({"ar_bursts": 1, "ar_steps": burst.steps, "ar_tokens": tokens, "ar_ms": ms})
        timed = self.timed and burst.steps >= TIMED_BURST
        self.policy.observe_burst(0, len(seqs), burst.steps, tokens, ms if timed else None)

    @torch.inference_mode()
    def ar_step(self, seqs: list[Sequence]) -> None:
        """One eager AR step that stores its drafter context row itself (no graphs, or logprobs)."""
        self._refeed_gaps(seqs)
        self.drafter.store_pending(seqs)  # AR steps append to the drafter cache: no gap before them
        d = decode_inputs(seqs, [s.block_table for s in seqs], self.drafter.hybrid_target, self.runner.scratch_page,
                          self.runner.device)
        t0 = time.perf_counter()
        out = self._budget_step(0, RootInputs(d.ids, d.starts, d.block_tables, d.draw, d.state_slots),
                                any(s.logprobs is not None for s in seqs), [s.constraint for s in seqs])
        self._commit(seqs, out, 0)
        timed = self.timed and self.draft_graphs is None  # (timed as the table was: eager)
        self.policy.observe_burst(0, len(seqs), 1, len(seqs), (time.perf_counter() - t0) * 1e3 if timed else None)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], budget: int) -> None:
        """Speculation with `budget`: a graphed burst, or one eager step."""
        if self.draft_graphs is not None and len(seqs) <= self.draft_graphs.max_batch:
            self._auto_burst(seqs, budget)
        else:
            self._eager_step(seqs, budget)

    def _eager_step(self, seqs: list[Sequence], budget: int) -> None:
        """One step without graphs: draft, verify the tree of `budget`, and tell the policy what it saw."""
        R = len(seqs)
        self._refeed_gaps(seqs)
        short = all(s.num_cached - context_of(s).stored <= self.ctx_rows for s in seqs)
        t0 = time.perf_counter()
        inp = self.drafter.prepare(seqs)
        c, expected = self._draft(inp)
        expected = dict(zip(self.budgets[1:], expected[:R].sum(0).tolist()))
        out = self._budget_step(budget, TreeInputs(inp.roots, inp.starts, inp.block_tables, inp.draw, c.score,
                                                   c.parent, c.rank, c.order, c.tokens, inp.state_slots),
                                any(s.logprobs is not None for s in seqs), [s.constraint for s in seqs])
        committed = self.stats.committed
        accepted = self._commit(seqs, out, budget)
        self.policy.observe_step(budget, R, expected, accepted)
        # timed as the table was (eager, without graphs), and not a one-off: a draft over a new prompt
        timed = self.timed and self.draft_graphs is None and short
        self.policy.observe_burst(budget, R, 1, self.stats.committed - committed,
                                  (time.perf_counter() - t0) * 1e3 if timed else None)

    def _auto_burst(self, seqs: list[Sequence], budget: int) -> None:
        """A pipelined burst of `budget`'s whole-step graph (the first, with nothing known yet, one step),
        after feeding the requests' gaps again and storing an AR stretch's context (a switch's cost,
        timed apart: waited for, so that the burst's time is its own)."""
        R = len(seqs)
        graphs = self.step_graphs[budget]
        captured = next(b for b in graphs.buckets if b >= R) in graphs.graphs  # (not a burst that captures)
        t0 = time.perf_counter()
        refeed_ms = self._refeed_gaps(seqs)
        if refeed_ms or any(s.num_cached - context_of(s).stored > self.ctx_rows for s in seqs):
            self.drafter.store_pending(seqs)
            _sync(self.runner.device)
            store_ms = (time.perf_counter() - t0) * 1e3 - refeed_ms
            self.stats.bursts.update({"store_ms": store_ms, "stores": 1})
            if self.timed and captured:
                self.policy.observe_store(R, store_ms)
        t1 = time.perf_counter()
        committed = self.stats.committed
        probe = self.policy.mode != budget
        steps = self._burst(seqs, graphs, budget, most=SPEC_BURST if self.policy.acceptance.known else 1)
        ms = (time.perf_counter() - t1) * 1e3
        self.stats.bursts.update({"spec_bursts": 1, "spec_steps": steps, "probes": int(probe), "spec_ms": ms})
        # (a short burst, a blind step or one cut short by a finishing request, is mostly its start and drain)
        timed = self.timed and captured and steps >= TIMED_BURST
        self.policy.observe_burst(budget, R, steps, self.stats.committed - committed, ms if timed else None)

    def _burst_step_done(self, budget: int, rows: list[list[int]]) -> None:
        """A burst step's read-back: its drafts' E(b) of every budget and what they accepted, to the policy."""
        if not rows:
            return
        first = super().packed_width
        expected = {b: sum(r[first + j] for r in rows) / EXPECTED_SCALE for j, b in enumerate(self.budgets[1:])}
        self.policy.observe_step(budget, len(rows), expected, sum(r[0] for r in rows))

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
        # timed too, a fraction of a store's time)
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
