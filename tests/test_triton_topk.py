"""The fused top-k + log-probs kernel against the torch path, by Triton's CPU interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from ddtree.speculative.tree import top_logprobs  # noqa: E402

tri = pytest.importorskip("ddtree.ops.triton_topk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_kernel_matches_torch_topk_and_logsumexp(dtype, k):
    g = torch.Generator().manual_seed(k)
    V = 2 * tri.TILE + 357  # a partial last tile
    logits = (torch.randn(2, 3, V, generator=g) * 4).to(dtype)
    logits[0, 1, V - 5] = 40.0  # the best token in the partial tile
    logits[1, 2, 7] = 40.0  # ... and in the first
    lp, tok = tri.topk_logprobs(logits[:, 1:], k)  # a strided input, as a draft's block rows are
    want_lp, want_tok = top_logprobs(logits[:, 1:], k)  # (the CPU path: torch)
    assert lp.dtype == torch.float32 and lp.shape == tok.shape == (2, 2, k)
    rows = logits[:, 1:].float()
    assert torch.equal(rows.gather(-1, tok), rows.gather(-1, want_tok))  # the same values (bf16 ties: any order)
    assert torch.equal(tok[..., :3], want_tok[..., :3])
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    assert tok[0, 0, 0] == V - 5 and tok[1, 1, 0] == 7


def test_ties_keep_a_valid_top_k():
    logits = torch.zeros(1, tri.TILE + 10)
    logits[0, [3, tri.TILE + 4]] = 1.0
    lp, tok = tri.topk_logprobs(logits, 3)
    assert sorted(tok[0, :2].tolist()) == [3, tri.TILE + 4] and tok[0, 2].item() not in (3, tri.TILE + 4)
    torch.testing.assert_close(lp[0].exp().sum(), torch.tensor((2 * 2.718281828 + 1) / (2 * 2.718281828 + tri.TILE + 8)))


def test_rows_with_masked_tokens_keep_finite_log_probs_and_distinct_ids():
    # A tile all -inf (a banned vocabulary range) must not turn the row's log-probs into NaN, and a
    # tile with fewer finite entries than k must not pick the same token twice.
    logits = torch.full((2, 2 * tri.TILE), float("-inf"))
    logits[0, tri.TILE:] = torch.linspace(0, 1, tri.TILE)
    logits[1, [5, 9]] = torch.tensor([2.0, 1.0])
    lp, tok = tri.topk_logprobs(logits, 4)
    want_lp, _ = top_logprobs(logits, 4)
    assert torch.isfinite(lp[0]).all() and torch.equal(lp[0], lp[0])
    torch.testing.assert_close(lp[0], want_lp[0], rtol=1e-5, atol=1e-5)
    assert tok[1, :2].tolist() == [5, 9] and len(set(tok[1].tolist())) == 4
    torch.testing.assert_close(lp[1, :2], want_lp[1, :2], rtol=1e-5, atol=1e-5)
