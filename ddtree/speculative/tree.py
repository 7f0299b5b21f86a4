"""DDTree construction on the device: the `budget` most probable draft paths as a flattened tree.

From the drafter's per-depth log-probabilities lp[d] (d = 1..D), a path of ranks (r1..rd) scores
sum_i lp[i][r_i]. The tree is the `budget` highest-scoring paths, each node having at most `topk`
children (the topk best tokens at its depth). Because scores only fall along a path, the set is
prefix-closed, and it can be found without a heap: at each depth keep the best `budget` children
of the nodes kept at the previous depth; the global best `budget` of all kept nodes is the answer.
Every shape is fixed by (requests, budget, topk, depth), so the build is batched and graph-friendly.

Flattened in BFS order (node 0 = root = last committed token, parents before children):

Worked example (asserted in tests/test_tree.py): depth 3, topk 2, budget 4, one request,
    lp[1] = log([.6, .3]), lp[2] = log([.5, .4]), lp[3] = log([.9, .05]) over token ids
    tok[1] = [10, 11], tok[2] = [20, 21], tok[3] = [30, 31].
    Path scores: (10)=.6 (10,20)=.3 (10,20,30)=.27 (10,21)=.24 (11)=.3 (11,20)=.15 ...
    Best 4: (10) .6, (10,20) .3, (11) .3, (10,20,30) .27   [(10,20) and (11) tie; the shallower wins]
    node   : 0    1    2    3    4
    token  : r    10   11   20   30
    parent : -1   0    0    1    3
    depth  : 0    1    1    2    3
    mask (ancestor-or-self, row = query):
        1 0 0 0 0
        1 1 0 0 0
        1 0 1 0 0
        1 1 0 1 0
        1 1 0 1 1
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.ops.fused import compiled_on_cuda

# On the GPU the candidate levels run as one Triton kernel (ops/triton_tree.py) instead of the torch
# sorts: it equals them bit for bit and shortens a graphed DDTree step (docs/performance-history.md,
# "tree kernel"). It is used up to the widths and top-k it was measured at; wider trees or top-k past 4
# (the sort held in registers: build time, spills) take the sorts.
TREE_KERNEL_MAX_WIDTH = 64
TREE_KERNEL_MAX_TOPK = 4


@dataclass(slots=True)
class Tree:
    tokens: torch.Tensor  # [R, N] token of each node (node 0: the root)
    parent: torch.Tensor  # [R, N] parent node index, -1 for the root
    depth: torch.Tensor  # [R, N]
    valid: torch.Tensor  # [R, N] False for padding nodes (fewer candidate paths than the budget)
    mask: torch.Tensor  # [R, N, N] ancestor-or-self
    score: torch.Tensor  # [R, N] path log-probability under the drafter (0 for the root)
    max_depth: int  # the deepest a node can be (a static bound: no device read needed)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass(slots=True)
class Candidates:
    """The best `width` nodes of each depth (level-major: flat index = (depth - 1) * width + slot),
    from which the tree of any budget <= width is cut (`cut_tree`)."""
    score: torch.Tensor  # [R, D * W] path log-probability (-inf: no such node)
    parent: torch.Tensor  # [R, D * W] the parent's slot in the previous level
    rank: torch.Tensor  # [R, D * W] the node's token rank among its depth's topk
    order: torch.Tensor  # [R, W] flat indices of the W best nodes, best first (ties: shallower first)
    tokens: torch.Tensor  # [R, D, K] the topk tokens of each depth

    @property
    def width(self) -> int:
        return self.order.shape[1]


def build_tree(logits: torch.Tensor, roots: torch.Tensor, budget: int, topk: int) -> Tree:
    """logits: [R, D, V] drafter logits (or log-probs) for depths 1..D; roots: [R] root tokens.
    Returns a tree of budget + 1 nodes per request."""
    if topk == 1 and budget <= logits.shape[1]:
        return chain_tree(logits, roots, budget)
    return cut_tree(candidates(logits, budget, topk), roots, budget)


def candidates(logits: torch.Tensor, width: int, topk: int) -> Candidates:
    """The `width` best nodes per depth and overall (see the module docstring)."""
    assert width >= 1 and topk >= 1 and logits.shape[1] >= 1
    top_lp, top_tok = top_logprobs(logits, topk)  # [R, D, K], best first
    if top_lp.is_cuda and width <= TREE_KERNEL_MAX_WIDTH and topk <= TREE_KERNEL_MAX_TOPK:
        from ddtree.ops.triton_tree import levels
        return Candidates(*levels(top_lp, width, topk), top_tok)
    return Candidates(*_levels(top_lp, width, topk), top_tok)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (any float dtype) -> the k best tokens' log-probs [..., k] (float32, best
    first) and ids [..., k]. On the GPU one Triton pass over the logits (ops/triton_topk.py);
    here a float32 top-k and one logsumexp (no [..., V] log-softmax written)."""
    if logits.is_cuda:
        from ddtree.ops.triton_topk import topk_logprobs
        return topk_logprobs(logits, k)
    x = logits.float()
    top, tok = x.topk(k, dim=-1)
    return top - x.logsumexp(dim=-1, keepdim=True), tok


def chain_tree(logits: torch.Tensor, roots: torch.Tensor, budget: int) -> Tree:
    """DFlash linear: the tree of topk 1 is the chain of the drafter's argmax tokens (each depth has
    one candidate, and scores fall along the chain), so it needs no candidate levels or sorts."""
    lp, tokens = top_logprobs(logits[:, :budget], 1)
    return Tree(*_chain(tokens[..., 0], lp[..., 0], roots), logits.shape[1])


@compiled_on_cuda
def _chain(tokens: torch.Tensor, lp: torch.Tensor, roots: torch.Tensor):
    R, D = tokens.shape
    N, dev = D + 1, tokens.device
    node = torch.arange(N, device=dev)
    return (torch.cat([roots.view(R, 1).long(), tokens], 1), (node - 1).expand(R, N).contiguous(),
            node.expand(R, N).contiguous(), torch.ones(R, N, dtype=torch.bool, device=dev),
            torch.ones(N, N, dtype=torch.bool, device=dev).tril().expand(R, N, N).contiguous(),
            torch.cat([torch.zeros(R, 1, device=dev), lp.cumsum(dim=1)], 1))


@compiled_on_cuda
def _levels(top_lp: torch.Tensor, width: int, topk: int):
    """(score, parent, rank, order) of the candidates from the per-depth top-k log-probs."""
    R, D, _ = top_lp.shape
    W = width
    # Level 1: the root's children. Levels are padded to W slots; missing nodes score -inf.
    dev = top_lp.device
    lvl_score = torch.full((R, W), float("-inf"), device=dev)
    k1 = min(topk, W)
    lvl_score[:, :k1] = top_lp[:, 0, :k1]
    lvl_parent = torch.zeros(R, W, dtype=torch.long, device=dev)
    lvl_rank = torch.arange(W, device=dev).clamp(max=topk - 1).expand(R, W).clone()
    scores, parents, ranks = [lvl_score], [lvl_parent], [lvl_rank]
    for d in range(1, D):
        cand = (lvl_score[:, :, None] + top_lp[:, d, None, :]).reshape(R, W * topk)
        # Stable sort: among equal scores the lower index (earlier parent, better rank) wins.
        lvl_score, idx = cand.sort(dim=-1, descending=True, stable=True)
        lvl_score, idx = lvl_score[:, :W], idx[:, :W]
        scores.append(lvl_score)
        parents.append(idx // topk)
        ranks.append(idx % topk)
    all_score = torch.stack(scores, 1).reshape(R, D * W)  # level-major: shallower first
    # Global best W; the stable sort prefers shallower nodes on ties, keeping the set prefix-closed.
    _, order = all_score.sort(dim=-1, descending=True, stable=True)
    return all_score, torch.stack(parents, 1).reshape(R, D * W), torch.stack(ranks, 1).reshape(R, D * W), order[:, :W]


def cut_tree(c: Candidates, roots: torch.Tensor, budget: int) -> Tree:
    """The tree of the `budget` best candidates (budget <= c.width), flattened in BFS order."""
    assert 1 <= budget <= c.width
    return Tree(*_cut(c.score, c.parent, c.rank, c.order, c.tokens, roots, budget), c.tokens.shape[1])


@compiled_on_cuda
def _cut(c_score, c_parent, c_rank, c_order, c_tokens, roots: torch.Tensor, budget: int):
    """(tokens, parent, depth, valid, mask, score) of the tree cut from the candidates."""
    R, D, _ = c_tokens.shape
    W = c_order.shape[1]
    chosen = c_order[:, :budget].sort(dim=-1).values  # ascending flat index == BFS order (depth, then slot)
    depth = chosen // W + 1
    rank = c_rank.gather(1, chosen)
    parent_slot = c_parent.gather(1, chosen)
    score = c_score.gather(1, chosen)
    valid = torch.isfinite(score)
    tokens = c_tokens[torch.arange(R, device=chosen.device)[:, None], depth - 1, rank]
    # Parent's flat index (depth - 1, parent_slot) -> its node index: position among `chosen`, + 1 for root.
    parent_flat = (depth - 2) * W + parent_slot
    match = chosen[:, None, :] == parent_flat[:, :, None]  # [R, budget, budget]
    parent = torch.where(depth == 1, torch.zeros_like(depth), match.float().argmax(-1) + 1)
    # Prepend the root.
    zeros = torch.zeros(R, 1, dtype=torch.long, device=chosen.device)
    tokens = torch.cat([roots.view(R, 1).long(), tokens], 1)
    parent = torch.cat([zeros - 1, parent], 1)
    depth = torch.cat([zeros, depth], 1)
    valid = torch.cat([torch.ones(R, 1, dtype=torch.bool, device=chosen.device), valid], 1)
    score = torch.cat([zeros.float(), score], 1)
    parent = torch.where(valid, parent, torch.zeros_like(parent))  # padding hangs off the root
    return tokens, parent, depth, valid, ancestor_mask(parent, D), score


def expected_accepts(c: Candidates, budgets: list[int]) -> torch.Tensor:
    """[R, len(budgets)]: the expected accepted length of the tree of each budget under the drafter's
    (independent per-depth) distribution. A node is accepted with its path probability, and the
    accepted length is the number of accepted nodes, so E(b) = sum of the b best path probabilities."""
    return _expected(c.score, c.order, tuple(budgets))


@compiled_on_cuda
def _expected(score: torch.Tensor, order: torch.Tensor, budgets: tuple[int, ...]) -> torch.Tensor:
    cum = score.gather(1, order).exp().cumsum(dim=-1)  # missing nodes: exp(-inf) = 0
    return torch.stack([cum[:, b - 1] for b in budgets], 1)


def ancestor_mask(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[R, N, N] ancestor-or-self: row i marks i and every node on its path to the root.
    Built by following parent pointers max_depth times, all nodes at once (padding nodes hang off
    the root, so they see only the root and themselves)."""
    R, N = parent.shape
    up = parent.clamp(min=0)  # the root is its own parent, so walking past it stays there
    node = torch.arange(N, device=parent.device).expand(R, N)
    mask = torch.eye(N, dtype=torch.bool, device=parent.device).repeat(R, 1, 1)
    for _ in range(max_depth):
        node = up.gather(1, node)
        mask.scatter_(2, node[:, :, None], True)
    return mask

