"""One speculative decoding step for a batch: draft -> build tree -> verify -> accept -> commit.

DFlash linear is the same step with topk = 1 and budget = block_size - 1 (the tree is a chain of
the drafter's argmax tokens), so both modes share this code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import sample
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import slots_for
from ddtree.spec.draft import DraftRunner
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


class Speculator:
    def __init__(self, runner: ModelRunner, drafter: DraftRunner, budget: int, topk: int):
        self.runner, self.drafter, self.budget, self.topk = runner, drafter, budget, topk
        self.stats = SpecStats()

    @property
    def width(self) -> int:
        """Cache positions a step writes past num_cached: the verified tree or the drafter block."""
        return max(self.budget + 1, self.drafter.block_size)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], commit) -> None:
        """`commit(seq, tokens) -> kept` appends tokens to a request, stopping at a stop condition."""
        draft_logits = self.drafter.propose(seqs)  # [R, B-1, V]
        roots = torch.tensor([s.token_ids[-1] for s in seqs], device=self.runner.device)
        tree = build_tree(draft_logits.log_softmax(dim=-1), roots, self.budget, self.topk)
        R, N = tree.tokens.shape
        logits, feats = self.runner.verify(seqs, tree.tokens, tree.depth, tree.mask, self.drafter.layer_ids)
        params = [s.params for s in seqs for _ in range(N)]
        gens = [s.generator for s in seqs for _ in range(N)]
        pred = sample(logits.view(R * N, -1), params, gens).view(R, N)
        acc = walk(tree, pred)
        # The one read-back of the step.
        lengths, paths, bonus = acc.length.tolist(), acc.path.tolist(), acc.bonus.tolist()
        tokens = tree.tokens.gather(1, acc.path).tolist()
        self._compact(seqs, lengths, paths)
        for i, seq in enumerate(seqs):
            L = lengths[i]
            # Target features of the root and accepted nodes become the drafter's next context.
            seq.pending_features.append(feats[i, acc.path[i, :L + 1]])
            seq.num_cached += L + 1
            kept = commit(seq, tokens[i][1:L + 1] + [bonus[i]])
            seq.accept_lengths.append(kept)
            self.stats.add(L, kept)

    def _compact(self, seqs: list[Sequence], lengths: list[int], paths: list[list[int]]) -> None:
        """Moves accepted nodes' K/V from cache position start + node to start + depth. In BFS order
        node >= depth, so nothing is overwritten before it is read; a path along the spine needs no move."""
        src, dst = [], []
        ps = self.runner.page_size
        for seq, L, path in zip(seqs, lengths, paths):
            moves = [(path[d], d) for d in range(1, L + 1) if path[d] != d]
            if moves:
                slots = slots_for(seq.block_table, seq.num_cached, seq.num_cached + self.width, ps)
                src += [slots[s] for s, _ in moves]
                dst += [slots[d] for _, d in moves]
        if src:
            dev = self.runner.device
            self.runner.move_kv(torch.stack(src).to(dev), torch.stack(dst).to(dev))
