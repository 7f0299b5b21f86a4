"""Accepting a verified tree: the walk from the root along nodes the target agrees with.

`pred[n]` is the target's token at node n: its argmax (greedy) or one sample from its
distribution after temperature / top-k / top-p (sampling). A node is correct when its token equals
its parent's `pred`; the accepted path ends at the deepest node whose whole ancestry is correct
(siblings carry distinct tokens, so the path is unique), and the bonus token is `pred` there.
Sampling is lossless this way: every committed token is a target sample given its accepted prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.ops.fused import compiled_on_cuda
from ddtree.speculative.tree import Tree


@dataclass(slots=True)
class Acceptance:
    length: torch.Tensor  # [R] accepted draft tokens (depth of the last accepted node)
    path: torch.Tensor  # [R, D + 1] node index at each depth along the accepted path (root first)
    bonus: torch.Tensor  # [R] the target's token after the accepted path


def walk(tree: Tree, pred: torch.Tensor) -> Acceptance:
    return Acceptance(*_walk(tree.tokens, tree.parent, tree.depth, tree.valid, pred, tree.max_depth))


@compiled_on_cuda
def _walk(tokens, parent, depth, valid, pred: torch.Tensor, max_depth: int):
    """(length, path, bonus): see `Acceptance`."""
    R, N = tokens.shape
    up = parent.clamp(min=0)
    correct = valid & (tokens == pred.gather(1, up))
    correct[:, 0] = True
    on_path = correct
    for _ in range(max_depth):  # each pass extends "all ancestors correct" by one level
        on_path = correct & on_path.gather(1, up)
    deepest = torch.where(on_path, depth, -1).argmax(dim=1)
    length = depth.gather(1, deepest[:, None]).squeeze(1)
    path = torch.zeros(R, max_depth + 1, dtype=torch.long, device=pred.device)
    node = deepest
    for _ in range(max_depth + 1):  # climb to the root, filling path[depth(node)] = node
        path.scatter_(1, depth.gather(1, node[:, None]), node[:, None])
        node = up.gather(1, node[:, None]).squeeze(1)
    bonus = pred.gather(1, deepest[:, None]).squeeze(1)
    return length, path, bonus
