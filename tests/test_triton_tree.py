"""DDTree's candidate levels as one Triton kernel against the torch sorts, by Triton's CPU interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from ddtree.speculative.tree import _levels  # noqa: E402

tri = pytest.importorskip("ddtree.ops.triton_tree")


# (width 64: the 4th level is cut from 256 candidates, as budget 64's levels are)
@pytest.mark.parametrize("D,K,W", [(1, 4, 8), (5, 1, 4), (5, 2, 32), (6, 3, 6), (4, 4, 12), (8, 4, 32), (4, 4, 64)])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_levels_equal_the_torch_sorts(D, K, W, ties):
    g = torch.Generator().manual_seed(D * 100 + K * 10 + W)
    lp = torch.randn(3, D, K, generator=g).log_softmax(-1) if not ties else \
        torch.randint(-3, 0, (3, D, K), generator=g).float()  # many equal scores: the tie order is checked too
    lp = lp.sort(dim=-1, descending=True).values  # top-k log-probs come best first
    got = tri.levels(lp, W, K)
    want = _levels(lp, W, K)
    for name, a, b in zip(("score", "parent", "rank", "order"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
