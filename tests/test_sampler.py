"""Token sampling (engine/sampler.py) and SamplingParams validation (sampling_params.py)."""
import math

import pytest
import torch

from ddtree.engine.sampler import filter_logits, sample, target_probs
from ddtree.sampling_params import SamplingParams

# Probabilities 0.5, 0.3, 0.15, 0.05, stored out of order so the scatter back to vocab order is exercised.
PROBS = [0.15, 0.5, 0.05, 0.3]


def log_probs_row() -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in PROBS]])


def kept(filtered: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in filtered]


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def test_top_k_keeps_exactly_k_highest_tokens_per_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ks = [1, 3, 10, 50]
    out = filter_logits(logits, [sp(top_k=k) for k in ks])
    for row, k, full in zip(out, ks, logits):
        finite = torch.isfinite(row)
        assert finite.sum().item() == k
        assert set(finite.nonzero().flatten().tolist()) == set(full.topk(k).indices.tolist())
        torch.testing.assert_close(row[finite], full[finite])  # T = 1: kept logits are untouched


def test_top_k_larger_than_vocab_keeps_everything():
    logits = torch.randn(1, 8)
    assert torch.isfinite(filter_logits(logits, [sp(top_k=100)])).all()


@pytest.mark.parametrize("top_p, expected", [(0.4, {1}), (0.75, {1, 3}), (0.85, {1, 3, 0}), (0.99, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_prefix_whose_mass_reaches_p(top_p, expected):
    # Sorted mass: 0.5, 0.8, 0.95, 1.0 -> p=0.75 needs {0.5, 0.3}; p=0.85 also needs 0.15.
    assert kept(filter_logits(log_probs_row(), [sp(top_p=top_p)])) == [expected]


def test_top_p_applies_to_top_k_renormalized_mass():
    # top_k=2 leaves 0.5 and 0.3, renormalized to 0.625 / 0.375; p=0.6 is reached by the first alone.
    # (Measured against the unfiltered mass, 0.5 < 0.6 would wrongly keep both.)
    assert kept(filter_logits(log_probs_row(), [sp(top_k=2, top_p=0.6)])) == [{1}]


def test_temperature_scales_logits_before_top_p():
    # At T=0.5 the sorted probabilities become 0.5^2 : 0.3^2 : ... = 0.685, 0.247, ... so p=0.6 keeps one token.
    assert kept(filter_logits(log_probs_row(), [sp(top_p=0.6)])) == [{1, 3}]
    assert kept(filter_logits(log_probs_row(), [sp(temperature=0.5, top_p=0.6)])) == [{1}]


def test_rows_are_filtered_with_their_own_parameters():
    logits = log_probs_row().repeat(3, 1)
    out = filter_logits(logits, [sp(top_k=1), sp(), sp(top_p=0.75)])
    assert kept(out) == [{1}, {0, 1, 2, 3}, {1, 3}]


def test_greedy_rows_return_argmax_even_when_batched_with_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    params = [SamplingParams(), sp(top_p=0.9), SamplingParams(temperature=0.7, top_k=1), sp(), SamplingParams(),
              sp(top_k=5)]
    gens = [None, torch.Generator().manual_seed(1), None, None, None, torch.Generator().manual_seed(2)]
    for _ in range(5):
        tokens = sample(logits, params, gens)
        for i in (0, 2, 4):
            assert tokens[i].item() == logits[i].argmax().item()


def test_target_probs_is_one_hot_for_greedy_rows():
    logits = torch.randn(2, 10)
    probs = target_probs(logits, [SamplingParams(), sp()])
    assert probs[0].argmax() == logits[0].argmax() and probs[0].max() == 1.0
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Reference written independently: softmax(logits / T), keep top-k, renormalize, keep top-p, renormalize."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])[:top_k]
    mass = sum(p[i] for i in order)
    keep, acc = [], 0.0
    for i in order:
        if acc >= top_p:
            break
        keep.append(i)
        acc += p[i] / mass
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in range(len(p))]


def total_variation(tokens: torch.Tensor, expected: list[float]) -> float:
    freq = torch.bincount(tokens, minlength=len(expected)).double() / len(tokens)
    return 0.5 * sum(abs(f - e) for f, e in zip(freq.tolist(), expected))


LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
T, TOP_K, TOP_P = 0.8, 4, 0.8  # top-k drops tokens 4, 5; top-p then drops token 3


def test_unseeded_draws_match_filtered_softmax_distribution():
    expected = expected_distribution(LOGITS, T, TOP_K, TOP_P)
    assert [e > 0 for e in expected] == [True, True, True, False, False, False]
    n = 20000
    params = [SamplingParams(temperature=T, top_k=TOP_K, top_p=TOP_P)] * n
    torch.manual_seed(0)
    tokens = sample(torch.tensor([LOGITS]).repeat(n, 1), params, [None] * n)
    assert tokens.max().item() <= 2  # filtered tokens are never drawn
    assert total_variation(tokens, expected) < 0.02


def test_seeded_draws_match_filtered_softmax_distribution():
    expected = expected_distribution(LOGITS, T, TOP_K, TOP_P)
    n = 4000
    params = [SamplingParams(temperature=T, top_k=TOP_K, top_p=TOP_P, seed=i) for i in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens = sample(torch.tensor([LOGITS]).repeat(n, 1), params, gens)
    assert tokens.max().item() <= 2
    assert total_variation(tokens, expected) < 0.05


def test_seeded_row_draw_does_not_depend_on_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    params = [sp(top_p=0.95, top_k=50)] * 4
    alone = [sample(logits[2:3], params[:1], [torch.Generator().manual_seed(s)]).item() for s in range(20)]
    together = [sample(logits, params, [None, torch.Generator().manual_seed(99), torch.Generator().manual_seed(s),
                                        None])[2].item() for s in range(20)]
    assert alone == together
    assert len(set(alone)) > 1  # the seeds really sample, not collapse to argmax


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=1.5), "seed"),
])
def test_sampling_params_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_normalizes_stop_and_disabled_top_k():
    p = SamplingParams(stop="END", top_k=-1)
    assert p.stop == ["END"] and p.top_k == 0
    assert SamplingParams(stop=["", "x"]).stop == ["x"]
    assert SamplingParams().greedy and SamplingParams(temperature=1.0, top_k=1).greedy
    assert not SamplingParams(temperature=1.0).greedy
