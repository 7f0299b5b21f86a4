"""One speculative decoding step for a batch: draft -> build tree -> verify -> accept -> commit.

The device part (`device_step`) is shape-static and free of host reads, so on GPU it is captured
in a CUDA graph per batch-size bucket; the host reads back one small tensor per step. DFlash
linear is the same step with topk = 1 and budget = block_size - 1 (the tree is a chain of the
drafter's argmax tokens), so both modes share this code. `AdaptiveSpeculator` (speculative/auto.py, budget
"auto") picks the budget, 0 = AR included, per burst of these steps. Requests that ask for logprobs or
follow a structure take eager steps beside the graphed ones: the host reads the logits along their
accepted paths, or masks each tree node's row by the structure after the node's path (engine/grammar.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ddtree.engine.ar import SHORT_BURST, ARDecoder
from ddtree.engine.graphs import GraphPool
from ddtree.engine.readback import TokenReadback, pipelined
from ddtree.engine.runner import ModelRunner
from ddtree.engine.grammar import constrained_tree
from ddtree.engine.sampler import COLUMNS, logprob_records, needs_host, sample
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import page_slots
from ddtree.speculative.context import context_of
from ddtree.speculative.draft import DraftRunner, StepInputs
from ddtree.speculative.tree import Tree, build_tree
from ddtree.speculative.verify import walk

# Graphed speculative steps per engine step at most, pipelined: each burst pays one drain and one
# unhidden graph launch, so longer is faster; 8 steps take about as long as 16 AR steps.
SPEC_BURST = 8


@dataclass(slots=True)
class SpecStats:
    steps: int = 0  # request-steps (one verify of one request)
    committed: int = 0
    depth_accepted: list[int] = field(default_factory=list)  # [d]: request-steps that accepted depth >= d + 1
    drafted: int = 0  # tree nodes sent to verification (root excluded)
    budget_hist: Counter = field(default_factory=Counter)  # budget -> request-steps (auto's AR: "ar_tokens")
    # The engine's `timing`, shared: host ms of prefills and whole steps ("prefill_ms", "engine_ms"),
    # prefills that missed the graphs ("eager_prefills"), graphed AR bursts ("ar_bursts", "ar_steps",
    # "ar_ms": launch to last commit) and the tokens AR steps committed ("ar_tokens"); auto adds its
    # speculative bursts ("spec_*", "probes"), the AR stretches' context stores ("store_ms", also the
    # engine's where rows pile up; "stores": those at a switch) and "refeeds" of rows AR steps skipped
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
    # (eager steps for requests that ask for logprobs) [R, D+1, V] the target's logits along the path
    # (as the model gives them: before a structure's mask, temperature, top-k and top-p):
    # the distributions the path's tokens after the root and the bonus were drawn from
    path_logits: torch.Tensor | None = None


class Speculator:
    """The decoder of DFlash and DDTree at a fixed budget: prompt chunks go through the AR decoder
    (which also stores them as the drafter's context), decode requests speculate."""

    def __init__(self, runner: ModelRunner, drafter: DraftRunner, ar: ARDecoder, budget: int, topk: int,
                 use_graphs: bool = False, max_batch: int = 64, max_pages: int = 0):
        self.runner, self.drafter, self.ar, self.budget, self.topk = runner, drafter, ar, budget, topk
        self.commit = ar.commit
        self.stats = SpecStats()
        self.depth = drafter.block_size - 1
        self.graphs = None
        if use_graphs:  # padding rows: page tables and context slots point at the scratch page
            self.graphs = GraphPool(self._graph_step, max_batch,
                                    pad={"block_tables": runner.scratch_page, "ctx_slots": drafter.scratch_slot,
                                         "state_slots": runner.scratch_state_slot},
                                    widths={"block_tables": max_pages}, tp=runner.tp)
            drafter.warm_stores(max_batch, runner.max_num_batched_tokens)
        # Set before each decode: short bursts while a request waits for a free slot, and whether the
        # step's time is worth learning from (auto: not with a prefill chunk in flight).
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
        dev, dr, C, ps = self.runner.device, self.drafter, self.drafter.block_size, self.runner.page_size
        P = -(-(context + self.width) // ps)
        tables = torch.full((bs, P), self.runner.scratch_page, dtype=torch.long, device=dev)
        starts = torch.full((bs,), context, dtype=torch.long, device=dev)
        ctx_pos = (starts[:, None] - C + torch.arange(C, device=dev)).clamp(min=0)
        slots = torch.full((bs, C), dr.scratch_slot, dtype=torch.long, device=dev)
        # (hybrid targets: every fake request on the scratch state slot)
        state_slots = torch.full((bs,), self.runner.scratch_state_slot, dtype=torch.long, device=dev) \
            if dr.hybrid_target else None
        return StepInputs(torch.zeros_like(starts), starts, tables,
                          torch.zeros(bs, C, dr.feat_dim, dtype=dr.dtype, device=dev), ctx_pos, slots,
                          torch.zeros(bs, COLUMNS, dtype=torch.long, device=dev), state_slots)

    @property
    def width(self) -> int:
        """Cache positions a step writes past num_cached: the verified tree or the drafter block."""
        return max(self.budget + 1, self.drafter.block_size)

    def device_step(self, inp: StepInputs, scored: bool = False, constraints: list | None = None) -> StepOutputs:
        """Draft, build the tree, verify it, accept, and compact the accepted K/V; device ops only, unless
        `constraints` (eager steps). `scored`: the outputs keep the logits along the accepted path (for
        logprobs). `constraints`: each request's structure (engine/grammar.py) or None."""
        tree = build_tree(self.drafter.logits(inp), inp.roots, self.budget, self.topk)
        return self._verify(inp, tree, scored, constraints)

    def target_draws(self, logits: torch.Tensor, inp, depth: torch.Tensor) -> torch.Tensor:
        """The target's token at every node [R, N] from its logits [R, N, V]: the draw (or argmax) for
        the node's next position, start + depth + 1, keyed as AR keys the token it draws there."""
        R, N, V = logits.shape
        positions = (inp.starts[:, None] + depth + 1).flatten()
        return sample(logits.reshape(R * N, V), inp.draw, positions, self.runner.use_triton).view(R, N)

    def _verify(self, inp, tree: Tree, scored: bool = False, constraints: list | None = None) -> StepOutputs:
        """Verify a tree, accept, compact; `inp` has the requests' roots, starts, block_tables and
        sampling settings. `scored`: keep the logits along the accepted path. `constraints`: each
        request's structure or None; the nodes' draws are masked by it (a host walk of the tree)."""
        state_slots = getattr(inp, "state_slots", None)
        logits, feats = self.runner.verify(inp.block_tables, inp.starts, tree.tokens, tree.depth, tree.mask,
                                           self.drafter.layer_ids, state_slots)
        allowed = logits if constraints is None else \
            constrained_tree(logits, constraints, tree.tokens, tree.parent, tree.valid)
        acc = walk(tree, self.target_draws(allowed, inp, tree.depth))
        self._compact(inp, acc.length, acc.path)
        if state_slots is not None:  # hybrid targets: the recurrent state becomes the accepted path's
            self.runner.commit_states(state_slots, acc.path.gather(1, acc.length[:, None])[:, 0])
        tokens = tree.tokens.gather(1, acc.path)
        path_feats = feats.gather(1, acc.path[:, :, None].expand(-1, -1, feats.shape[-1]))
        packed = torch.cat([acc.length[:, None], acc.bonus[:, None], tokens], dim=1)
        path_logits = logits.gather(1, acc.path[:, :, None].expand(-1, -1, logits.shape[-1])) if scored else None
        return StepOutputs(packed, path_feats, path_logits)

    def _compact(self, inp: StepInputs, length: torch.Tensor, path: torch.Tensor) -> None:
        """Moves accepted nodes' K/V from cache position start + node to start + depth. Every source
        is gathered before any write, and a path along the spine moves onto itself."""
        d = torch.arange(1, self.depth + 1, device=path.device)
        dst = inp.starts[:, None] + d
        moved = (d <= length[:, None]) & (path[:, 1:] != d)
        src = torch.where(moved, inp.starts[:, None] + path[:, 1:], dst)
        ps = self.runner.page_size
        self.runner.move_kv(page_slots(inp.block_tables, src, ps).flatten(),
                            page_slots(inp.block_tables, dst, ps).flatten())

    def _graph_step(self, inp: StepInputs) -> StepOutputs:
        return self.device_step(inp)

    @torch.inference_mode()
    def step(self, prefill: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """The engine's step: prompt chunks (their context stored), then the decode requests'
        speculation. Returns the requests that got tokens."""
        touched = self.ar.prefill(prefill, taps=True) if prefill else []
        plain, hosted = needs_host(decode)
        if plain:
            self.timed = not prefill  # (a prefill chunk still running on the device would count in the times)
            self.short_bursts = self.ar.scheduler.admitting()
            self.decode(plain)
        if hosted:
            self._eager_step(hosted)
        return touched + decode

    def decode(self, seqs: list[Sequence]) -> None:
        """Speculative steps for the batch: a graphed burst, or one eager step."""
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            if any(s.num_cached - context_of(s).stored > self.drafter.block_size for s in seqs):
                # context wider than the graph's (prefills store a prompt's themselves): the cache first
                self.drafter.store_pending(seqs)
            self._burst(seqs)
        else:
            self._eager_step(seqs)

    def _eager_step(self, seqs: list[Sequence]) -> None:
        """One step without graphs (the CPU), or for a batch larger than the graphs'."""
        inp = self.drafter.prepare(seqs)
        out = self.device_step(inp, any(s.logprobs is not None for s in seqs), [s.constraint for s in seqs])
        self._commit(seqs, out, self.budget)

    def _burst(self, seqs: list[Sequence], graphs: GraphPool | None = None, budget: int | None = None,
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
        steps = max(1, min(SHORT_BURST if self.short_bursts else most, most, left))

        def launch(i: int):
            nonlocal inp
            out = graphs.run(inp)
            # graph outputs are static buffers: keep this step's before the next replay overwrites them
            packed, feats = out.packed[:R].clone(), out.feats[:R].clone()
            if i + 1 < steps:  # (past the last step the positions may lie beyond the reserved pages)
                inp = self._next_inputs(inp, packed, feats)
            return self.readback.start(packed.flatten()), feats, packed.shape[1]

        return pipelined(steps, launch, lambda launched: self._commit_burst_step(seqs, launched, budget))

    def _next_inputs(self, inp: StepInputs, packed: torch.Tensor, feats: torch.Tensor) -> StepInputs:
        """The next step's inputs from this step's outputs, on the device: what `prepare` would build
        after committing them (the accepted path's L + 1 feature rows, padding to the scratch slot)."""
        length, bonus = packed[:, 0], packed[:, 1]
        j = torch.arange(self.drafter.block_size, device=packed.device)
        valid = j[None, :] <= length[:, None]
        pos = torch.where(valid, inp.starts[:, None] + j, inp.starts[:, None])  # padding: a position in range
        slots = torch.where(valid, page_slots(inp.block_tables, pos, self.runner.page_size), self.drafter.scratch_slot)
        return StepInputs(bonus, inp.starts + length + 1, inp.block_tables, feats, torch.where(valid, pos, 0), slots,
                          inp.draw, inp.state_slots)

    def _commit_burst_step(self, seqs: list[Sequence], pending, budget: int) -> bool:
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
            context_of(seq).replace(seq.num_cached - L - 1, [feats[i, :L + 1]])
            kept = self.commit(seq, row[3:3 + L] + [bonus])
            seq.accept_lengths.append(kept)
            self.stats.add(L, kept)
        self.stats.drafted += budget * len(live)
        self.stats.budget_hist[budget] += len(live)
        self._burst_step_done(budget, rows)
        return any(seqs[i].is_finished for i in live)

    def _burst_step_done(self, budget: int, rows: list[list[int]]) -> None:
        """Hook: a burst step's read-back rows (of the requests it committed to)."""

    def _commit(self, seqs: list[Sequence], out: StepOutputs, budget: int) -> int:
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
                context_of(seq).add(feats[2 * i])
            else:  # an AR step of auto: it stored its row in the drafter cache itself
                assert not context_of(seq).pending, "drafter context rows left behind an AR step"
                context_of(seq).take(seq.num_cached)
            tokens = path_tokens[1:L + 1] + [bonus]
            scores = None
            if seq.logprobs is not None:  # (the token at depth d + 1 was drawn from node d's logits)
                scores = logprob_records(out.path_logits[i, :L + 1], tokens, seq.params.logprobs)
            kept = self.commit(seq, tokens, scores)
            accepted += L
            if budget:
                seq.accept_lengths.append(kept)
                self.stats.add(L, kept)
        self.stats.drafted += budget * len(seqs)
        if budget:  # (auto's AR steps count in the engine's "ar_tokens", as AR bursts do)
            self.stats.budget_hist[budget] += len(seqs)
        else:
            self.stats.bursts["ar_tokens"] += len(seqs)
        return accepted
