"""One speculative decoding step for a batch: draft -> build tree -> verify -> accept -> commit.

The device part (`device_step`) is shape-static and free of host reads, so on GPU it is captured
in a CUDA graph per batch-size bucket; the host reads back one small tensor per step. DFlash
linear is the same step with topk = 1 and budget = block_size - 1 (the tree is a chain of the
drafter's argmax tokens), so both modes share this code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree.engine.graphs import GraphPool
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import sample
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import page_slots
from ddtree.spec.draft import DraftRunner, StepInputs
from ddtree.spec.tree import build_tree
from ddtree.spec.verify import walk


@dataclass(slots=True)
class SpecStats:
    steps: int = 0  # request-steps (one verify of one request)
    committed: int = 0
    depth_accepted: list[int] = field(default_factory=list)  # [d]: request-steps that accepted depth >= d + 1

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

    @property
    def width(self) -> int:
        """Cache positions a step writes past num_cached: the verified tree or the drafter block."""
        return max(self.budget + 1, self.drafter.block_size)

    def device_step(self, inp: StepInputs, pred_fn) -> StepOutputs:
        """Draft, build the tree, verify it, accept, and compact the accepted K/V; device ops only.
        `pred_fn(logits [R, N, V]) -> [R, N]` gives the target's token at every node."""
        draft_logits = self.drafter.logits(inp)
        tree = build_tree(draft_logits.log_softmax(dim=-1), inp.roots, self.budget, self.topk)
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
        fits = all(s.num_cached - s.draft_len <= self.drafter.block_size for s in seqs)
        if self.graphs is not None and greedy and fits and len(seqs) <= self.graphs.max_batch:
            inp = self.drafter.prepare(seqs, ctx_rows=self.drafter.block_size)
            out = self.graphs.run(inp)
        else:  # eager: sampled requests, or a first step whose context is a whole prompt
            inp = self.drafter.prepare(seqs)
            out = self.device_step(inp, lambda logits: self._sample(seqs, logits))
        rows = out.packed.tolist()  # the one read-back of the step
        feats = out.feats[:len(seqs)].clone()
        for i, seq in enumerate(seqs):
            L, bonus, path_tokens = rows[i][0], rows[i][1], rows[i][2:]
            # Target features of the root and accepted nodes become the drafter's next context.
            seq.pending_features.append(feats[i, :L + 1])
            seq.num_cached += L + 1
            kept = commit(seq, path_tokens[1:L + 1] + [bonus])
            seq.accept_lengths.append(kept)
            self.stats.add(L, kept)

    @staticmethod
    def _sample(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        R, N, V = logits.shape
        params = [s.params for s in seqs for _ in range(N)]
        gens = [s.generator for s in seqs for _ in range(N)]
        return sample(logits.view(R * N, V), params, gens).view(R, N)
