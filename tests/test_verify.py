"""Tree verification: the greedy walk (speculative/verify.py) on hand-made trees, and the target's tree forward
(ModelRunner.verify) against a plain transformers forward over each node's root-to-node path."""
import dataclasses
import random

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sequence import Sequence
from ddtree.models.loader import load_model
from ddtree.sampling_params import SamplingParams
from ddtree.speculative.tree import Tree, ancestor_mask, build_tree
from ddtree.speculative.verify import walk
from tiny import make_tiny_model


def make_tree(tokens: list[int], parent: list[int], valid: list[bool] | None = None) -> Tree:
    """A one-request tree from BFS-ordered tokens and parent pointers (node 0 is the root)."""
    depth = [0]
    for p in parent[1:]:
        depth.append(depth[p] + 1)
    parent_t = torch.tensor([parent])
    valid = valid or [True] * len(tokens)
    return Tree(torch.tensor([tokens]), parent_t, torch.tensor([depth]), torch.tensor([valid]),
                ancestor_mask(parent_t, max(depth)), torch.zeros(1, len(tokens)), max(depth))


# node   : 0   1   2   3   4   5
# token  : 5   10  11  20  21  30
# parent : -1  0   0   1   2   3
# depth  : 0   1   1   2   2   3
TOKENS, PARENT = [5, 10, 11, 20, 21, 30], [-1, 0, 0, 1, 2, 3]
X = 99  # a token no node carries


def run_walk(tree: Tree, pred: list[int]):
    acc = walk(tree, torch.tensor([pred]))
    return acc.length.item(), acc.path[0].tolist(), acc.bonus.item()


def test_walk_all_correct_accepts_the_deepest_path_and_bonus_is_pred_at_the_leaf():
    length, path, bonus = run_walk(make_tree(TOKENS, PARENT), [10, 20, X, 30, X, 42])
    assert length == 3
    assert path == [0, 1, 3, 5]
    assert bonus == 42


def test_walk_first_depth_wrong_accepts_nothing_and_bonus_is_pred_at_root():
    length, path, bonus = run_walk(make_tree(TOKENS, PARENT), [12, 20, 21, 30, X, 42])
    assert length == 0
    assert path[0] == 0
    assert bonus == 12


def test_walk_rejects_a_correct_node_under_a_wrong_parent():
    # Node 4 (21) matches pred at its parent 2, but node 2 (11) does not match pred at the root (10).
    length, path, bonus = run_walk(make_tree(TOKENS, PARENT), [10, 77, 21, X, X, X])
    assert length == 1
    assert path[:2] == [0, 1]
    assert bonus == 77


def test_walk_path_lists_node_indices_root_first_on_a_side_branch():
    length, path, bonus = run_walk(make_tree(TOKENS, PARENT), [11, 20, 21, 30, 42, X])
    assert length == 2
    assert path[:3] == [0, 2, 4]
    assert bonus == 42


def test_walk_never_accepts_padding_even_when_its_token_matches():
    # Node 3 is padding hanging off the root with token 12 == pred[root]; node 4 is padding on node 1.
    tree = make_tree([5, 10, 11, 12, 13], [-1, 0, 0, 0, 1], valid=[True, True, True, False, False])
    assert run_walk(tree, [12, 13, X, X, X]) == (0, [0, 0, 0], 12)
    assert run_walk(tree, [10, 13, X, X, X]) == (1, [0, 1, 0], 13)


def test_walk_is_per_request_in_a_batch():
    a, b = make_tree(TOKENS, PARENT), make_tree([6, 40, 41, 50, 51, 60], PARENT)
    batch = Tree(*(torch.cat([getattr(a, f.name), getattr(b, f.name)]) for f in dataclasses.fields(Tree)
                   if f.name != "max_depth"), max(a.max_depth, b.max_depth))
    acc = walk(batch, torch.tensor([[10, 20, X, 30, X, 42], [41, X, 51, X, 43, X]]))
    assert acc.length.tolist() == [3, 2]
    assert acc.path[0].tolist() == [0, 1, 3, 5]
    assert acc.path[1, :3].tolist() == [0, 2, 4]
    assert acc.bonus.tolist() == [42, 43]


def naive_walk(tokens: list[int], parent: list[int], valid: list[bool], pred: list[int]) -> list[int]:
    """Root-first node path: from the root, repeatedly step to the real child whose token is pred here."""
    path = [0]
    while True:
        kids = [i for i in range(1, len(tokens)) if valid[i] and parent[i] == path[-1] and tokens[i] == pred[path[-1]]]
        assert len(kids) <= 1
        if not kids:
            return path
        path.append(kids[0])


def test_walk_matches_a_naive_walk_on_built_trees():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for budget, topk, D in [(4, 2, 3), (8, 4, 5), (16, 2, 7), (8, 1, 4), (12, 1, 7), (31, 8, 3)]:
        for _ in range(8):
            R = 3
            lp = (2 * torch.randn(R, D, 20, generator=g)).log_softmax(-1)
            tree = build_tree(lp, torch.randint(0, 20, (R,), generator=g), budget, topk)
            # pred at each node: usually one of its children's tokens, so deep paths get accepted.
            pred = torch.randint(0, 20, tree.tokens.shape, generator=g)
            for r in range(R):
                for n in range(tree.num_nodes):
                    kids = [i for i in range(tree.num_nodes) if tree.parent[r, i] == n]
                    if kids and rng.random() < 0.8:
                        pred[r, n] = tree.tokens[r, rng.choice(kids)]
            acc = walk(tree, pred)
            for r in range(R):
                path = naive_walk(tree.tokens[r].tolist(), tree.parent[r].tolist(), tree.valid[r].tolist(),
                                  pred[r].tolist())
                assert acc.length[r].item() == len(path) - 1
                assert acc.path[r, :len(path)].tolist() == path
                assert acc.bonus[r].item() == pred[r, path[-1]].item()


# ---------------------------------------------------------------------------------------------------------
# Tree verify oracle: a node's logits are the target's next-token logits after prefix + root ... node.
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def target(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, cfg = load_model(path, "cpu", torch.float32)
    return hf, ours, cfg


def verify_against_transformers(target, prefix_lens: list[int], page_size: int, budget: int, topk: int,
                                depth: int, seed: int) -> None:
    hf, ours, cfg = target
    g = torch.Generator().manual_seed(seed)
    R, N = len(prefix_lens), budget + 1
    num_pages = sum(-(-(P + N) // page_size) for P in prefix_lens) + 3
    runner = ModelRunner(ours, cfg, EngineConfig(page_size=page_size, num_pages=num_pages), torch.device("cpu"),
                         torch.float32)
    alloc = PageAllocator(num_pages, page_size)
    # Scrambled free list, and pages handed out in turns: block tables are neither contiguous nor sorted.
    alloc.free_pages = type(alloc.free_pages)(torch.randperm(num_pages, generator=g).tolist())
    prefixes = [torch.randint(0, cfg.vocab_size, (P,), generator=g).tolist() for P in prefix_lens]
    seqs = [Sequence(p, SamplingParams(), None) for p in prefixes]
    for seq in seqs:
        alloc.grow(seq, len(seq))
    for seq in seqs:
        alloc.grow(seq, len(seq) + N)
    runner.run([(seq, len(seq)) for seq in seqs])
    assert [s.num_cached for s in seqs] == prefix_lens

    lp = (3 * torch.randn(R, depth, cfg.vocab_size, generator=g)).log_softmax(-1)
    roots = torch.randint(0, cfg.vocab_size, (R,), generator=g)
    tree = build_tree(lp, roots, budget, topk)
    taps = [0, cfg.num_layers - 1]
    starts = torch.tensor([s.num_cached for s in seqs])
    with torch.inference_mode():
        logits, feats = runner.verify(runner.tables(seqs), starts, tree.tokens, tree.depth, tree.mask, taps)
    assert logits.shape == (R, N, cfg.vocab_size)
    assert feats.shape == (R, N, len(taps) * cfg.hidden_size)

    # One transformers forward per request over every leaf's path (right-padded: causal attention keeps
    # the padding out of earlier positions); node n at depth d is position P + d of any leaf below it.
    checked = 0
    for r in range(R):
        tokens, parent, depths, valid = (tree.tokens[r].tolist(), tree.parent[r].tolist(), tree.depth[r].tolist(),
                                         tree.valid[r].tolist())
        paths = []  # root ... node, per node
        for n in range(N):
            paths.append(paths[parent[n]] + [tokens[n]] if n else [tokens[0]])
        leaves = [n for n in range(N) if valid[n] and not any(valid[c] and parent[c] == n for c in range(1, N))]
        P, width = prefix_lens[r], max(len(paths[n]) for n in leaves)
        ids = torch.zeros(len(leaves), P + width, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            ids[row, :P + len(paths[leaf])] = torch.tensor(prefixes[r] + paths[leaf])
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        for n in range(N):
            if not valid[n]:
                continue
            row = next(i for i, leaf in enumerate(leaves) if paths[leaf][:len(paths[n])] == paths[n])
            ref = out.logits[row, P + depths[n]]
            err = (logits[r, n] - ref).abs().max().item()
            assert err < 1e-4, (r, n, err)
            assert torch.allclose(feats[r, n, :cfg.hidden_size], out.hidden_states[1][row, P + depths[n]], atol=1e-4)
            checked += 1
    assert checked == sum(tree.valid.flatten().tolist())


@pytest.mark.parametrize("prefix_lens,page_size,budget,topk,depth", [
    ([10], 3, 7, 2, 4),
    ([11], 5, 16, 4, 7),
    ([10, 7], 3, 12, 3, 5),
    ([8, 13], 5, 16, 2, 6),
    ([9, 11], 3, 8, 1, 4),  # topk 1: a chain plus padding, DFlash linear through the tree path
])
def test_tree_verify_logits_equal_a_causal_forward_over_each_nodes_path(target, prefix_lens, page_size, budget,
                                                                       topk, depth):
    verify_against_transformers(target, prefix_lens, page_size, budget, topk, depth, seed=sum(prefix_lens) + budget)
