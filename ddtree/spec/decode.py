"""One speculative decoding step for a batch: draft -> build tree -> verify -> accept -> commit.

The device part (`device_step`) is shape-static and free of host reads, so on GPU it is captured
in a CUDA graph per batch-size bucket; the host reads back one small tensor per step. DFlash
linear is the same step with topk = 1 and budget = block_size - 1 (the tree is a chain of the
drafter's argmax tokens), so both modes share this code. `AdaptiveSpeculator` (budget "auto") picks
the budget, 0 = AR included, per burst of steps (per step without graphs; spec/adaptive.py).
"""
from __future__ import annotations

import time

from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import torch

from ddtree.engine.graphs import GraphPool, buckets_up_to
from ddtree.engine.readback import TokenReadback
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import sample
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import pack_rows, page_slots
from ddtree.spec.adaptive import AdaptivePolicy, CostTable, candidate_budgets, measure_costs
from ddtree.spec.draft import DraftRunner, StepInputs
from ddtree.spec.tree import Candidates, Tree, build_tree, candidates, cut_tree, expected_accepts
from ddtree.spec.verify import walk

# Graphed speculative steps per engine step at most, pipelined: each burst pays one drain and one
# unhidden graph launch, so longer is faster; 8 steps take about as long as 16 AR steps.
SPEC_BURST = 8
SHORT_BURST = 2  # while a request waits for a free slot (`short_bursts`), as the engine's AR bursts
EXPECTED_SCALE = 1024  # auto's burst steps read E(b) back as integers: E * this, rounded
TIMED_BURST = 4  # auto learns an AR step's host time from AR bursts of at least this many steps


@dataclass(slots=True)
class SpecStats:
    steps: int = 0  # request-steps (one verify of one request)
    committed: int = 0
    depth_accepted: list[int] = field(default_factory=list)  # [d]: request-steps that accepted depth >= d + 1
    drafted: int = 0  # tree nodes sent to verification (root excluded)
    budget_hist: Counter = field(default_factory=Counter)  # budget -> request-steps (0: AR steps of `auto`)
    # Host ms of prefills and whole engine steps ("prefill_ms", "engine_ms"); auto also counts its bursts
    # ({"ar"|"spec"}_{bursts|steps|ms}: ms from launch to commit), "probes", and context stores ("store_ms")
    bursts: Counter = field(default_factory=Counter)

    def add(self, length: int, committed: int) -> None:
        self.steps += 1
        self.committed += committed
        while len(self.depth_accepted) < length:
            self.depth_accepted.append(0)
        for d in range(length):
            self.depth_accepted[d] += 1

    @property
    def mean_accept_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


@dataclass(slots=True)
class StepOutputs:
    packed: torch.Tensor  # [R, 2 + (D+1)]: accepted length, bonus, tokens along the path (root first)
    feats: torch.Tensor  # [R, D+1, K*D] target features along the path: the drafter's next context


class Speculator:
    def __init__(self, runner: ModelRunner, drafter: DraftRunner, budget: int, topk: int, use_graphs: bool = False,
                 max_batch: int = 64, max_pages: int = 0):
        self.runner, self.drafter, self.budget, self.topk = runner, drafter, budget, topk
        self.stats = SpecStats()
        self.depth = drafter.block_size - 1
        self.graphs = None
        if use_graphs:  # padding rows: page tables and context slots point at the scratch page
            self.graphs = GraphPool(self._graph_step, max_batch,
                                    pad={"block_tables": runner.scratch_page, "ctx_slots": drafter.scratch_slot},
                                    widths={"block_tables": max_pages})
        # Set by the engine before each step: short bursts while a request waits for a free slot, and
        # whether the step's time is worth learning from (auto: not with a prefill chunk in flight).
        self.short_bursts, self.timed = False, True
        # bursts read packed rows back: [R, depth + 3] (auto: and E(b) of each budget)
        self.readback = TokenReadback(max_batch * self.packed_width, runner.device)

    @property
    def packed_width(self) -> int:
        """Columns of a step's packed output: accepted length, bonus, the path's depth + 1 tokens."""
        return self.depth + 3

    def padding_inputs(self, bs: int, context: int = 0) -> StepInputs:
        """Step inputs of `bs` fake requests with `context` cached tokens whose pages are all the scratch
        page (for capturing and timing graphs: their K/V are garbage, written where nobody reads), with
        a burst's context width (`_burst`)."""
        dev, dr, C = self.runner.device, self.drafter, self.drafter.block_size
        tables = torch.full((bs, -(-(context + self.width) // self.runner.page_size)), self.runner.scratch_page,
                            dtype=torch.long, device=dev)
        starts = torch.full((bs,), context, dtype=torch.long, device=dev)
        return StepInputs(torch.zeros_like(starts), starts, tables,
                          torch.zeros(bs, C, dr.feat_dim, dtype=dr.dtype, device=dev),
                          (starts[:, None] - C + torch.arange(C, device=dev)).clamp(min=0),
                          torch.full((bs, C), dr.scratch_slot, dtype=torch.long, device=dev))

    @property
    def width(self) -> int:
        """Cache positions a step writes past num_cached: the verified tree or the drafter block."""
        return max(self.budget + 1, self.drafter.block_size)

    def device_step(self, inp: StepInputs, pred_fn) -> StepOutputs:
        """Draft, build the tree, verify it, accept, and compact the accepted K/V; device ops only.
        `pred_fn(logits [R, N, V]) -> [R, N]` gives the target's token at every node."""
        draft_logits = self.drafter.logits(inp)
        tree = build_tree(draft_logits, inp.roots, self.budget, self.topk)
        return self._verify(inp, tree, pred_fn)

    def _verify(self, inp, tree: Tree, pred_fn) -> StepOutputs:
        """Verify a tree, accept, compact; `inp` has the requests' roots, starts and block_tables."""
        logits, feats = self.runner.verify(inp.block_tables, inp.starts, tree.tokens, tree.depth, tree.mask,
                                           self.drafter.layer_ids)
        acc = walk(tree, pred_fn(logits))
        self._compact(inp, acc.length, acc.path)
        tokens = tree.tokens.gather(1, acc.path)
        path_feats = feats.gather(1, acc.path[:, :, None].expand(-1, -1, feats.shape[-1]))
        packed = torch.cat([acc.length[:, None], acc.bonus[:, None], tokens], dim=1)
        return StepOutputs(packed, path_feats)

    def _compact(self, inp: StepInputs, length: torch.Tensor, path: torch.Tensor) -> None:
        """Moves accepted nodes' K/V from cache position start + node to start + depth. Every source
        is gathered before any write, and a path along the spine moves onto itself."""
        d = torch.arange(1, self.depth + 1, device=path.device)
        dst = inp.starts[:, None] + d
        moved = (d <= length[:, None]) & (path[:, 1:] != d)
        src = torch.where(moved, inp.starts[:, None] + path[:, 1:], dst)
        ps = self.runner.page_size
        self.runner.move_kv(page_slots(inp.block_tables, src, ps).flatten(), page_slots(inp.block_tables, dst, ps).flatten())

    def _graph_step(self, inp: StepInputs) -> StepOutputs:
        return self.device_step(inp, lambda logits: logits.argmax(dim=-1))

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], commit) -> None:
        """`commit(seq, tokens) -> kept` appends tokens to a request, stopping at a stop condition."""
        greedy = all(s.params.greedy for s in seqs)
        if self.graphs is not None and greedy and len(seqs) <= self.graphs.max_batch:
            if any(s.num_cached - s.draft_len > self.drafter.block_size for s in seqs):
                # context wider than the graph's (prefills store a prompt's themselves): the cache first
                self.drafter.store_pending(seqs)
            self._burst(seqs, commit)
            return
        # eager: sampled requests (on the CPU: every step)
        inp = self.drafter.prepare(seqs)
        out = self.device_step(inp, lambda logits: self._sample(seqs, logits))
        self._commit(seqs, out, commit, self.budget)

    def _burst(self, seqs: list[Sequence], commit, graphs: GraphPool | None = None, budget: int | None = None,
               most: int | None = None) -> int:
        """Graphed speculative steps (`graphs`, default the fixed budget's), pipelined like the engine's
        AR bursts: step i+1's inputs (root = bonus token, positions past the accepted path, drafter
        context = the accepted path's target features) are computed on the device from step i's
        outputs, and step i+1 is launched before step i is read back and committed. Ends after `most`
        steps, or one step after a request finishes (that step is wasted for it; its K/V land in pages
        nobody reuses before the next schedule). Returns the number of steps run."""
        graphs, budget = graphs or self.graphs, budget or self.budget
        most = SPEC_BURST if most is None else most
        R = len(seqs)
        inp = self.drafter.prepare(seqs, ctx_rows=self.drafter.block_size)
        left = max(s.params.max_tokens - len(s.output_ids) for s in seqs)
        pending, steps = None, max(1, min(SHORT_BURST if self.short_bursts else most, most, left))
        for i in range(steps):
            out = graphs.run(inp)
            # graph outputs are static buffers: keep this step's before the next replay overwrites them
            packed, feats = out.packed[:R].clone(), out.feats[:R].clone()
            if i + 1 < steps:  # (past the last step the positions may lie beyond the reserved pages)
                inp = self._next_inputs(inp, packed, feats)
            launched = (self.readback.start(packed.flatten()), feats, packed.shape[1])
            ended = pending is not None and self._commit_burst_step(seqs, pending, commit, budget)
            pending = launched
            if ended:
                steps = i + 1
                break
        self._commit_burst_step(seqs, pending, commit, budget)
        return steps

    def _next_inputs(self, inp: StepInputs, packed: torch.Tensor, feats: torch.Tensor) -> StepInputs:
        """The next step's inputs from this step's outputs, on the device: what `prepare` would build
        after committing them (the accepted path's L + 1 feature rows, padding to the scratch slot)."""
        length, bonus = packed[:, 0], packed[:, 1]
        j = torch.arange(self.drafter.block_size, device=packed.device)
        valid = j[None, :] <= length[:, None]
        pos = torch.where(valid, inp.starts[:, None] + j, inp.starts[:, None])  # padding: a position in range
        slots = torch.where(valid, page_slots(inp.block_tables, pos, self.runner.page_size), self.drafter.scratch_slot)
        return StepInputs(bonus, inp.starts + length + 1, inp.block_tables, feats, torch.where(valid, pos, 0), slots)

    def _commit_burst_step(self, seqs: list[Sequence], pending, commit, budget: int) -> bool:
        """Commits one step of a burst to the requests still running; True if one finished. Each
        keeps only this step's path features pending: the next step (if launched) fed the ones before."""
        handle, feats, W = pending
        flat = self.readback.result(handle, len(seqs) * W)
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        rows = [flat[i * W:(i + 1) * W] for i in live]
        for i, row in zip(live, rows):
            seq = seqs[i]
            L, bonus = row[0], row[1]
            seq.num_cached += L + 1
            seq.draft_len, seq.pending_features = seq.num_cached - L - 1, [feats[i, :L + 1]]
            kept = commit(seq, row[3:3 + L] + [bonus])
            seq.accept_lengths.append(kept)
            self.stats.add(L, kept)
        self.stats.drafted += budget * len(live)
        self.stats.budget_hist[budget] += len(live)
        self._burst_step_done(budget, rows)
        return any(seqs[i].is_finished for i in live)

    def _burst_step_done(self, budget: int, rows: list[list[int]]) -> None:
        """Hook: a burst step's read-back rows (of the requests it committed to)."""

    def _commit(self, seqs: list[Sequence], out: StepOutputs, commit, budget: int) -> int:
        """Host side of a step: commits each request's accepted tokens and bonus; returns the accepted
        draft tokens of the batch. `budget` 0 is an AR step (no acceptance statistics)."""
        rows = out.packed.tolist()  # the one read-back of the step
        # Target features of the root and accepted nodes become the drafter's next context: each
        # request's first L + 1 path rows, cut out of the batch by one split (not one slice per request).
        R, N = len(seqs), out.feats.shape[1]
        if budget:
            sizes = [n for row in rows[:R] for n in (row[0] + 1, N - row[0] - 1)]
            feats = out.feats[:R].clone().flatten(0, 1).split_with_sizes(sizes)
        accepted = 0
        for i, seq in enumerate(seqs):
            L, bonus, path_tokens = rows[i][0], rows[i][1], rows[i][2:]
            seq.num_cached += L + 1
            if budget:
                seq.pending_features.append(feats[2 * i])
            else:  # an AR step of auto: it stored its row in the drafter cache itself
                assert not seq.pending_features, "drafter context rows left behind an AR step"
                seq.draft_len = seq.num_cached
            kept = commit(seq, path_tokens[1:L + 1] + [bonus])
            accepted += L
            if budget:
                seq.accept_lengths.append(kept)
                self.stats.add(L, kept)
        self.stats.drafted += budget * len(seqs)
        self.stats.budget_hist[budget] += len(seqs)
        return accepted

    @staticmethod
    def _sample(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        R, N, V = logits.shape
        params = [s.params for s in seqs for _ in range(N)]
        gens = [s.generator for s in seqs for _ in range(N)]
        return sample(logits.view(R * N, V), params, gens).view(R, N)


@dataclass(slots=True)
class RootInputs:
    """An AR step's inputs: the tree is the root alone."""
    roots: torch.Tensor  # [R]
    starts: torch.Tensor  # [R]
    block_tables: torch.Tensor  # [R, P]


@dataclass(slots=True)
class TreeInputs:
    """A verify step's inputs: the requests' rows and their drafted candidate nodes (spec/tree.py)."""
    roots: torch.Tensor
    starts: torch.Tensor
    block_tables: torch.Tensor
    score: torch.Tensor
    parent: torch.Tensor
    rank: torch.Tensor
    order: torch.Tensor
    tokens: torch.Tensor

    @property
    def candidates(self) -> Candidates:
        return Candidates(self.score, self.parent, self.rank, self.order, self.tokens)


class AdaptiveSpeculator(Speculator):
    """`budget auto`: the budget in `budgets` (0 = AR) for the whole batch, chosen per burst on the GPU
    and per step without graphs (spec/adaptive.py).

    Before each decode step the engine asks `ar_steps`, which plans the next budget on the running
    averages of past drafts. AR runs as the engine's own graphed AR bursts, whose steps also read out
    their target features: each request keeps them as pending drafter context, stored in one go
    before the next draft (or by an AR burst, once a request holds `PENDING_ROWS` of them). A budget
    b > 0 runs as a pipelined burst (`_burst`) of one whole-step graph per budget: draft, candidates
    for the largest budget, the tree of b cut from them, verify, accept; each step also reads back
    the drafter's E(b) of every budget, which keeps the averages current, and what each whole burst
    realized (tokens per ms, its context store included) is what the policy plans on next time at
    that batch size. A probe is a whole burst of the budget that looks best.

    Without graphs (the CPU, sampled requests) a step is split in two at the budget choice: draft
    (candidates and E(b) of every budget), one read-back, the budget chosen on the current draft
    (`choose`: 0 throws the draft away), then that tree verified; `ar_step` runs one AR step that
    stores its own drafter context row."""

    def __init__(self, runner: ModelRunner, drafter: DraftRunner, topk: int, use_graphs: bool = False,
                 max_batch: int = 64, max_pages: int = 0, table: CostTable | None = None):
        self.budgets = candidate_budgets(drafter.block_size - 1, topk)
        super().__init__(runner, drafter, self.budgets[-1], topk, False, max_batch, max_pages)
        self.ctx_rows = drafter.block_size  # a burst's context width: the last accepted path (more: stored first)
        self.max_pages, self.planned = max_pages, 0
        self.burst_expected: list[float] = []  # the current burst's E(b) per request, step by step
        self.draft_graphs, self.ar_graphs, self.step_graphs = None, None, {}
        if use_graphs:  # one memory pool for all: each graph's outputs are consumed before the next replays
            pad = {"block_tables": runner.scratch_page, "ctx_slots": drafter.scratch_slot}
            widths = {"block_tables": max_pages}
            pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None  # (CPU: tests)
            # The draft alone and auto's own AR step are graphed only to be timed for the cost table.
            self.draft_graphs = GraphPool(self._draft, max_batch, pad=pad, widths=widths, mempool=pool)
            self.ar_graphs = GraphPool(partial(self._budget_step, 0, pred_fn=_argmax), max_batch,
                                       pad=pad, widths=widths, mempool=pool)
            for b in self.budgets[1:]:
                self.step_graphs[b] = GraphPool(partial(self._whole_step, b), max_batch, pad=pad, widths=widths,
                                                mempool=pool)
        if table is None:  # with graphs, every batch bucket (capturing the graphs ahead of serving); else two
            sizes = buckets_up_to(max_batch) if use_graphs else sorted({1, min(2, max_batch)})
            with torch.inference_mode():
                table = measure_costs(self, sizes, self._fake_context(), reps=5 if use_graphs else 2)
        self.policy = AdaptivePolicy(table, self.budgets)

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
        out = self._verify(inp, cut_tree(c, inp.roots, budget), _argmax)
        fixed = (expected * EXPECTED_SCALE).round().long()
        return StepOutputs(torch.cat([out.packed, fixed], dim=1), out.feats)

    def _budget_step(self, budget: int, inp: RootInputs | TreeInputs, pred_fn) -> StepOutputs:
        """Verify the tree of `budget` nodes; device ops only. Budget 0: one AR step that also stores
        the root's target features in the drafter cache (its context)."""
        if budget:
            return self._verify(inp, cut_tree(inp.candidates, inp.roots, budget), pred_fn)
        R = inp.roots.shape[0]
        ids = inp.roots[:, None]
        logits, feats = self.runner.verify(inp.block_tables, inp.starts, ids, torch.zeros_like(ids), None,
                                           self.drafter.layer_ids)
        slots = page_slots(inp.block_tables, inp.starts[:, None], self.runner.page_size).flatten()
        self.drafter.store_context(feats[:, 0], inp.starts, slots)
        packed = torch.cat([torch.zeros_like(ids), pred_fn(logits).long(), ids], 1)
        return StepOutputs(packed.view(R, 3), feats)

    def ar_steps(self, batch: int) -> int:
        """Asked by the engine before each decode step: 0 to speculate now (`step`, with the planned
        budget), else how many AR steps to take first (the engine runs them as a graphed AR burst,
        `ar_step` on the CPU)."""
        self.planned = self.policy.plan(batch)
        return 0 if self.planned else 1 + self.policy.ar_steps_ahead()

    def after_ar_burst(self, batch: int, steps: int, request_steps: int, elapsed_ms: float) -> None:
        """The engine ran `steps` AR steps for `batch` requests (`request_steps` tokens committed) in
        `elapsed_ms`."""
        self.policy.skip_ar(steps - 1)
        self.stats.budget_hist[0] += request_steps
        self.stats.bursts.update({"ar_bursts": 1, "ar_steps": steps, "ar_ms": elapsed_ms})
        if self.timed and steps >= TIMED_BURST:
            self.policy.observe_time("ar", batch, elapsed_ms / steps, self.policy.table.ar_ms(batch))

    @torch.inference_mode()
    def ar_step(self, seqs: list[Sequence], commit) -> None:
        """One eager AR step that stores its drafter context row itself (no CUDA graphs: the CPU)."""
        self.drafter.store_pending(seqs)  # AR steps append to the drafter cache: no gap before them
        rows = pack_rows([s.block_table for s in seqs], [[s.last_token for s in seqs], [s.num_cached for s in seqs]],
                         self.runner.scratch_page, self.runner.device)
        t0 = time.perf_counter()
        out = self._budget_step(0, RootInputs(rows[:, 0], rows[:, 1], rows[:, 2:]),
                                lambda logits: self._sample(seqs, logits))
        self._commit(seqs, out, commit, 0)
        if self.timed and self.draft_graphs is None:  # timed as the table was (eager)
            self.policy.observe_time("ar", len(seqs), (time.perf_counter() - t0) * 1e3,
                                     self.policy.table.ar_ms(len(seqs)))

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], commit) -> None:
        """Speculation (the engine asked `ar_steps` first): a graphed burst of the planned budget, or
        without graphs one step that drafts, chooses the budget on that draft, and verifies."""
        R = len(seqs)
        if self.draft_graphs is not None and R <= self.draft_graphs.max_batch and all(s.params.greedy for s in seqs):
            self._auto_burst(seqs, commit)
            return
        eager_pred = lambda logits: self._sample(seqs, logits)  # noqa: E731
        short = all(s.num_cached - s.draft_len <= self.ctx_rows for s in seqs)
        t0 = time.perf_counter()
        inp = self.drafter.prepare(seqs)
        c, expected = self._draft(inp)
        expected = dict(zip(self.budgets[1:], expected[:R].sum(0).tolist()))  # read back mid-step to choose
        budget = self.policy.choose(R, expected)
        if budget == 0:  # (the draft consumed the pending rows: the AR step's row follows them)
            out = self._budget_step(0, RootInputs(inp.roots, inp.starts, inp.block_tables), eager_pred)
        else:
            out = self._budget_step(budget, TreeInputs(inp.roots, inp.starts, inp.block_tables, c.score, c.parent,
                                                       c.rank, c.order, c.tokens), eager_pred)
        accepted = self._commit(seqs, out, commit, budget)
        if budget:
            self.policy.observe(budget, R, expected[budget], accepted)
            # Timed as the table was (eager, without graphs), and not a one-off: a draft over a new
            # prompt, or a step behind a prefill chunk.
            if self.timed and self.draft_graphs is None and short:
                t = self.policy.table
                self.policy.observe_time("spec", R, (time.perf_counter() - t0) * 1e3,
                                         t.draft_ms(R) + t.verify_ms(budget, R))

    def _auto_burst(self, seqs: list[Sequence], commit) -> None:
        """A pipelined burst of the planned budget's whole-step graph (a probe's too; the first draft,
        with nothing known yet, is one step)."""
        budget, R = self.planned or self.budgets[1], len(seqs)
        graphs = self.step_graphs[budget]
        captured = next(b for b in graphs.buckets if b >= R) in graphs.graphs  # (not a burst that captures)
        stored = False
        t0 = time.perf_counter()
        if any(s.num_cached - s.draft_len > self.ctx_rows for s in seqs):
            # an AR stretch's context (or a prompt's, where the prefill did not store it), wider than
            # the graph's: a cost of switching from AR, counted in the burst's rate
            self.drafter.store_pending(seqs)
            stored = True
            store_ms = (time.perf_counter() - t0) * 1e3
            self.stats.bursts["store_ms"] += store_ms
            if self.timed and captured:
                self.policy.observe_switch(R, store_ms)
        t1 = time.perf_counter()
        probing = self.policy.probing
        committed, self.burst_expected = self.stats.committed, []
        blind = self.policy.expected is None  # no draft seen yet: one step to learn from
        steps = self._burst(seqs, commit, graphs, budget, most=1 if blind else SPEC_BURST)
        t2 = time.perf_counter()
        self.stats.bursts.update({"spec_bursts": 1, "spec_steps": steps, "probes": int(probing),
                                  "spec_ms": (t2 - t1) * 1e3})
        self.policy.probing = False
        if not (self.timed and captured):  # (a prefill chunk in flight, or a graph captured: no lesson)
            return
        # What a whole burst realized, store, start and drain included, is what the plan compares next
        # time at this batch size; those without a store also teach the model a step's host time. (A
        # short burst, the first blind step or one cut short by a finishing request, is mostly its start
        # and drain, which the AR bursts around it pay too.)
        if steps < TIMED_BURST:
            return
        self.policy.observe_burst(budget, R, self.stats.committed - committed, (t2 - t0) * 1e3,
                                  sum(self.burst_expected) / len(self.burst_expected), stored)
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
        self.burst_expected.append(expected[budget] / n)

    def _fake_context(self) -> int:
        ps = self.runner.page_size
        room = self.max_pages * ps - self.width if self.max_pages else 256
        return max(1, min(256, room, self.runner.cfg.max_position - self.width - 1))

    def fake_steps(self, bs: int, context: int) -> dict:
        """Step closures on `bs` fake requests with `context` cached tokens whose pages are all the
        scratch page (timing only: their K/V are garbage): {"draft": the draft, 0: auto's AR step, b: a
        whole step of budget b (draft included)}."""
        inp = self.padding_inputs(bs, context)
        root = RootInputs(inp.roots, inp.starts, inp.block_tables)
        if self.draft_graphs is not None:
            steps = {"draft": partial(self.draft_graphs.run, inp), 0: partial(self.ar_graphs.run, root)}
            steps.update({b: partial(self.step_graphs[b].run, inp) for b in self.budgets[1:]})
        else:
            steps = {"draft": partial(self._draft, inp), 0: partial(self._budget_step, 0, root, _argmax)}
            steps.update({b: partial(self._whole_step, b, inp) for b in self.budgets[1:]})
        return steps


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
