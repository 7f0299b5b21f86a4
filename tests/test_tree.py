"""DDTree construction (speculative/tree.py): the docstring's worked example, a heap oracle, and the invariants."""
import heapq
import math

import numpy as np
import pytest
import torch

from ddtree.speculative import tree as tree_mod
from ddtree.speculative.tree import Tree, ancestor_mask, build_tree

VOCAB = 50


def worked_example_logprobs() -> torch.Tensor:
    """lp[d] is log(p) on the two listed token ids, as the docstring writes it; the rest of each depth's
    mass sits on lower-ranked tokens (build_tree normalizes what it is given)."""
    lp = torch.full((1, 3, 32), float("-inf"))
    for d, (toks, probs) in enumerate([([10, 11, 12], [.6, .3, .1]), ([20, 21, 22], [.5, .4, .1]),
                                       ([30, 31, 1, 2], [.9, .05, .025, .025])]):
        lp[0, d, toks] = torch.tensor(probs).log()
    return lp


def test_worked_example_from_docstring():
    lp = worked_example_logprobs()
    root = 7
    tree = build_tree(lp, torch.tensor([root]), budget=4, topk=2)
    assert tree.num_nodes == 5
    assert tree.tokens.tolist() == [[root, 10, 11, 20, 30]]
    assert tree.parent.tolist() == [[-1, 0, 0, 1, 3]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 3]]
    assert tree.valid.tolist() == [[True] * 5]
    assert tree.mask.int().tolist() == [[
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]]
    expected = torch.tensor([[0, .6, .3, .3, .27]]).log()
    expected[0, 0] = 0.0
    assert torch.allclose(tree.score, expected, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Reference: the DDTree paper's best-first enumeration with a host heap, in plain Python.
#
# A node is a path of ranks (r1..rd): r_i indexes depth i's tokens sorted by log-prob, best first, and only
# ranks < topk exist (the topk cap). Its score is lp[1][r1] + ... + lp[d][rd], accumulated left to right in
# float32 exactly as build_tree does, so the two see bit-identical scores. Start from (0,). Each pop is
# selected and pushes its first child (rank 0 at depth d+1, if d < D) and its next sibling (r_d + 1 at the
# same depth, if < topk); both score no higher than the popped node, so pops come out best first and every
# path is pushed exactly once (by its previous sibling, or by its parent when r_d = 0). Stop after `budget`
# pops or when the heap runs dry. Ties are broken by (score desc, depth asc), then by the rank tuple; with
# random continuous log-probs only the depth rule ever matters (a child whose log-prob rounds to 0).
# ---------------------------------------------------------------------------------------------------------
def heap_reference(lp: np.ndarray, budget: int, topk: int) -> dict[tuple[int, ...], np.float32]:
    """lp: [D, V] float32 log-probs for one request. Returns {token path below the root: score}."""
    D, V = lp.shape
    ranked = [sorted(range(V), key=lambda t: -lp[d, t]) for d in range(D)]  # token ids, best first
    heap: list = []

    def push(ranks: tuple[int, ...], parent_score: np.float32) -> None:
        d, r = len(ranks), ranks[-1]
        score = np.float32(parent_score + lp[d - 1, ranked[d - 1][r]])
        heapq.heappush(heap, (-float(score), d, ranks, score, parent_score))

    push((0,), np.float32(0.0))
    selected = {}
    while heap and len(selected) < budget:
        _, d, ranks, score, parent_score = heapq.heappop(heap)
        selected[tuple(ranked[i][r] for i, r in enumerate(ranks))] = score
        if d < D:
            push(ranks + (0,), score)  # first child
        if ranks[-1] + 1 < topk:
            push(ranks[:-1] + (ranks[-1] + 1,), parent_score)  # next sibling
    return selected


def token_path(tokens: list[int], parent: list[int], node: int) -> tuple[int, ...]:
    """Token ids from the root's child down to `node` (the root's own token excluded)."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parent[node]
    return tuple(reversed(path))


def naive_ancestor_mask(parent: list[int]) -> list[list[bool]]:
    rows = []
    for i in range(len(parent)):
        row, node = [False] * len(parent), i
        while node >= 0:
            row[node] = True
            node = parent[node]
        rows.append(row)
    return rows


def check_tree(tree, lp: torch.Tensor, roots: torch.Tensor, budget: int, topk: int, ties: bool = False) -> None:
    """All invariants, and the heap's selection: the same token paths, or with `ties` (where several
    selections are equally good) the same multiset of path scores."""
    R, D, _ = lp.shape
    N = budget + 1
    assert tree.num_nodes == N
    for f in ("tokens", "parent", "depth", "valid", "score"):
        assert getattr(tree, f).shape == (R, N), f
    assert tree.mask.shape == (R, N, N)
    candidates = sum(topk ** d for d in range(1, D + 1))  # every rank path of depth <= D with ranks < topk
    for r in range(R):
        tokens, parent, depth = tree.tokens[r].tolist(), tree.parent[r].tolist(), tree.depth[r].tolist()
        valid, score = tree.valid[r].tolist(), tree.score[r]
        # The root.
        assert (tokens[0], parent[0], depth[0], valid[0]) == (int(roots[r]), -1, 0, True)
        assert score[0] == 0
        # Padding exactly when there are fewer candidate paths than the budget.
        assert sum(valid[1:]) == min(budget, candidates)
        # BFS order: parents first, depth never decreases.
        assert all(depth[i] <= depth[i + 1] for i in range(N - 1)), depth
        for i in range(1, N):
            assert 0 <= parent[i] < i
            assert valid[parent[i]]
            assert 1 <= depth[i] <= D
            if valid[i]:
                assert depth[i] == depth[parent[i]] + 1
            else:  # padding hangs off the root, at depth 1 like a root child
                assert parent[i] == 0 and depth[i] == 1 and not math.isfinite(score[i])
        # At most topk children per node, with distinct tokens among real siblings.
        for p in range(N):
            kids = [tokens[i] for i in range(1, N) if valid[i] and parent[i] == p]
            assert len(kids) <= topk
            assert len(set(kids)) == len(kids), (p, kids)
        # Mask = ancestor-or-self from parent pointers; so a padding row is just root + self.
        expected_mask = torch.tensor(naive_ancestor_mask(parent))
        assert torch.equal(tree.mask[r], expected_mask)
        for i in range(N):
            if not valid[i]:
                assert tree.mask[r, i].nonzero().flatten().tolist() == [0, i]
        # Same selected paths (and scores) as the heap.
        ref = heap_reference(lp[r].numpy(), budget, topk)
        got = {token_path(tokens, parent, i): score[i].item() for i in range(1, N) if valid[i]}
        assert len(got) == sum(valid[1:])  # no two nodes spell the same path
        if ties:
            # (up to float error: build_tree renormalizes lp, which moves it by an ulp here and there)
            assert sorted(got.values()) == pytest.approx(sorted(float(s) for s in ref.values()), abs=1e-5)
            for i in range(1, N):  # a real node's score is its parent's plus its own log-prob
                if valid[i]:
                    assert score[i].item() == pytest.approx((score[parent[i]] + lp[r, depth[i] - 1, tokens[i]]).item(), abs=1e-5)
            continue
        assert set(got) == set(ref), (r, sorted(set(got) ^ set(ref)))
        for path, s in ref.items():
            assert got[path] == pytest.approx(float(s), abs=1e-5), path


@pytest.mark.parametrize("topk", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [1, 3, 7, 15])
@pytest.mark.parametrize("R", [1, 3])
def test_build_tree_selects_the_heaps_paths_and_keeps_invariants(R, D, topk):
    for seed in range(3):
        g = torch.Generator().manual_seed(1000 * seed + 100 * R + 10 * D + topk)
        # Logit scale 2 gives a spread of confident and flat depths over a 50-token vocabulary.
        lp = (2 * torch.randn(R, D, VOCAB, generator=g)).log_softmax(-1)
        roots = torch.randint(0, VOCAB, (R,), generator=g)
        for budget in [1, 3, 4, 7, 8, 16, 32, 63]:
            tree = build_tree(lp, roots, budget, topk)
            check_tree(tree, lp, roots, budget, topk)


def test_build_tree_on_peaked_distributions_matches_heap():
    # Near-one-hot depths: child log-probs close to 0 make parents and children nearly tie, where
    # the shallower-first rule is what keeps the set prefix-closed.
    g = torch.Generator().manual_seed(7)
    lp = (12 * torch.randn(2, 7, VOCAB, generator=g)).log_softmax(-1)
    roots = torch.tensor([1, 2])
    for budget in [3, 8, 16, 40]:
        for topk in [2, 4]:
            check_tree(build_tree(lp, roots, budget, topk), lp, roots, budget, topk)


def test_build_tree_with_massive_ties_is_still_a_prefix_closed_top_budget():
    # Log-probs on a coarse grid, with 0 allowed: paths tie everywhere and children tie their parents,
    # so only the tie rules keep the selection prefix-closed (a parent is chosen before its child).
    g = torch.Generator().manual_seed(11)
    for D in [1, 3, 6]:
        # (normalized as build_tree normalizes what it is given: ties within a depth stay exact)
        lp = (-0.5 * torch.randint(0, 4, (3, D, 12), generator=g).float()).log_softmax(-1)
        roots = torch.tensor([0, 1, 2])
        for topk in [1, 2, 4]:
            for budget in [1, 3, 8, 16, 40]:
                check_tree(build_tree(lp, roots, budget, topk), lp, roots, budget, topk, ties=True)


def chain_tree(draft_tokens: torch.Tensor, roots: torch.Tensor) -> Tree:
    """DFlash linear written directly as a tree: the root followed by one draft per depth."""
    R, D = draft_tokens.shape
    tokens = torch.cat([roots.view(R, 1).long(), draft_tokens.long()], 1)
    ar = torch.arange(D + 1, device=tokens.device)
    parent = (ar - 1).expand(R, D + 1).clone()
    depth = ar.expand(R, D + 1).clone()
    valid = torch.ones(R, D + 1, dtype=torch.bool, device=tokens.device)
    mask = torch.tril(torch.ones(D + 1, D + 1, dtype=torch.bool, device=tokens.device)).expand(R, D + 1, D + 1)
    return Tree(tokens, parent, depth, valid, mask.clone(), torch.zeros(R, D + 1, device=tokens.device), D)


@pytest.mark.parametrize("budget", [1, 4, 6])
def test_topk_one_is_the_chain_of_per_depth_argmax_tokens(budget):
    g = torch.Generator().manual_seed(budget)
    R, D = 3, 6
    lp = (2 * torch.randn(R, D, VOCAB, generator=g)).log_softmax(-1)
    roots = torch.randint(0, VOCAB, (R,), generator=g)
    tree = build_tree(lp, roots, budget, topk=1)
    chain = chain_tree(lp.argmax(-1)[:, :budget], roots)  # DFlash linear
    assert torch.equal(tree.tokens, chain.tokens)
    assert torch.equal(tree.parent, chain.parent)
    assert torch.equal(tree.depth, chain.depth)
    assert torch.equal(tree.mask, chain.mask)
    assert tree.valid.all()
    expected = lp.max(-1).values[:, :budget].cumsum(-1)
    assert torch.allclose(tree.score[:, 1:], expected, atol=1e-5)


def test_topk_one_with_budget_past_the_depth_is_the_chain_then_padding():
    g = torch.Generator().manual_seed(3)
    lp = (2 * torch.randn(2, 3, VOCAB, generator=g)).log_softmax(-1)
    tree = build_tree(lp, torch.tensor([4, 5]), budget=8, topk=1)
    for r in range(2):
        nodes = tree.valid[r].nonzero().flatten().tolist()
        assert len(nodes) == 4  # root + one node per depth; the other 5 are padding
        assert tree.tokens[r, nodes[1:]].tolist() == lp[r].argmax(-1).tolist()
        assert tree.parent[r, nodes].tolist() == [-1] + nodes[:-1]
        assert tree.depth[r, nodes].tolist() == [0, 1, 2, 3]


def test_ancestor_mask_follows_parent_pointers():
    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(ancestor_mask(parent, 7), torch.tensor([naive_ancestor_mask(p) for p in parent.tolist()]))


def test_tree_ops_trace_under_torch_compile_and_give_the_eager_results():
    # On the GPU the tree ops run through torch.compile (ddtree.ops.fused.compiled_on_cuda); here the
    # same functions are traced by dynamo (aot_eager backend: no code generation, so it stays fast)
    # for DDTree and DFlash shapes, and must reproduce the eager results exactly.
    from ddtree.speculative import verify as V
    torch.manual_seed(0)
    R, D, vocab = 3, 15, 200
    lp = torch.randn(R, D, vocab).log_softmax(-1)
    roots = torch.tensor([1, 2, 3])
    fns = {f: torch.compile(f.__wrapped__, dynamic=True, backend="aot_eager")
           for f in (tree_mod._levels, tree_mod._cut, tree_mod._expected, V._walk)}
    for budget, topk in [(32, 4), (15, 1)]:
        top_lp, top_tok = lp.topk(topk, -1)
        levels = tree_mod._levels.__wrapped__(top_lp, budget, topk)
        assert all(torch.equal(a, b) for a, b in zip(levels, fns[tree_mod._levels](top_lp, budget, topk)))
        c = tree_mod.Candidates(*levels, top_tok)
        args = (c.score, c.parent, c.rank, c.order, c.tokens, roots, budget)
        cut = tree_mod._cut.__wrapped__(*args)
        assert all(torch.equal(a, b) for a, b in zip(cut, fns[tree_mod._cut](*args)))
        t = tree_mod.Tree(*cut, D)
        right = t.tokens.gather(1, torch.arange(budget + 1).expand(R, -1).clamp(max=budget))  # some agreement
        pred = torch.where(torch.rand(R, budget + 1) < 0.7, right.roll(-1, 1), torch.randint(0, vocab, (R, budget + 1)))
        wargs = (t.tokens, t.parent, t.depth, t.valid, pred, D)
        assert all(torch.equal(a, b) for a, b in zip(V._walk.__wrapped__(*wargs), fns[V._walk](*wargs)))
        torch.testing.assert_close(fns[tree_mod._expected](c.score, c.order, (4, 8)),
                                   tree_mod._expected.__wrapped__(c.score, c.order, (4, 8)))
