"""Sampling keyed by position (engine/sampler.py, ops/triton_sample.py) and SamplingParams validation."""
import math
import os

import pytest
import torch

from ddtree.engine.sampler import SamplingRows, draw_tensor, keep_threshold, row_keys, sample, target_probs
from ddtree.sampling_params import SamplingParams

# Probabilities 0.5, 0.3, 0.15, 0.05, stored out of order so the scatter back to vocab order is exercised.
PROBS = [0.15, 0.5, 0.05, 0.3]


def log_probs_row() -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in PROBS]])


def rows_of(params: list[SamplingParams], seeds: list[int] | None = None) -> torch.Tensor:
    """The requests' settings as `sample` reads them."""
    return draw_tensor(params, seeds or [0] * len(params), "cpu")


def kept(logits: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    """The tokens each row can draw."""
    keep = logits >= keep_threshold(logits, SamplingRows.unpack(rows_of(params)))[:, None]
    return [set(row.nonzero().flatten().tolist()) for row in keep]


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def test_top_k_keeps_exactly_k_highest_tokens_per_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ks = [2, 3, 10, 50]
    for got, k, full in zip(kept(logits, [sp(top_k=k) for k in ks]), ks, logits):
        assert got == set(full.topk(k).indices.tolist())


def test_top_k_larger_than_vocab_keeps_everything():
    assert kept(torch.randn(1, 8), [sp(top_k=100)]) == [set(range(8))]


@pytest.mark.parametrize("top_p, expected", [(0.4, {1}), (0.75, {1, 3}), (0.85, {1, 3, 0}), (0.99, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_prefix_whose_mass_reaches_p(top_p, expected):
    # Sorted mass: 0.5, 0.8, 0.95, 1.0 -> p=0.75 needs {0.5, 0.3}; p=0.85 also needs 0.15.
    assert kept(log_probs_row(), [sp(top_p=top_p)]) == [expected]


def test_top_p_applies_to_top_k_renormalized_mass():
    # top_k=2 leaves 0.5 and 0.3, renormalized to 0.625 / 0.375; p=0.6 is reached by the first alone.
    # (Measured against the unfiltered mass, 0.5 < 0.6 would wrongly keep both.)
    assert kept(log_probs_row(), [sp(top_k=2, top_p=0.6)]) == [{1}]


def test_temperature_scales_logits_before_top_p():
    # At T=0.5 the sorted probabilities become 0.5^2 : 0.3^2 : ... = 0.685, 0.247, ... so p=0.6 keeps one token.
    assert kept(log_probs_row(), [sp(top_p=0.6)]) == [{1, 3}]
    assert kept(log_probs_row(), [sp(temperature=0.5, top_p=0.6)]) == [{1}]


def test_rows_are_filtered_with_their_own_parameters():
    logits = log_probs_row().repeat(3, 1)
    assert kept(logits, [sp(top_k=2), sp(), sp(top_p=0.75)]) == [{1, 3}, {0, 1, 2, 3}, {1, 3}]


def test_greedy_rows_return_argmax_even_when_batched_with_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    params = [SamplingParams(), sp(top_p=0.9), SamplingParams(temperature=0.7, top_k=1), sp(), SamplingParams(),
              sp(top_k=5)]
    for trial in range(5):
        tokens = sample(logits, rows_of(params, list(range(trial, trial + 6))), torch.full((6,), 10 + trial))
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


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_keyed_draws_match_filtered_softmax_distribution(vary):
    # Draws over many seeds at one position, or one seed over many positions, are i.i.d. from the
    # filtered distribution.
    expected = expected_distribution(LOGITS, T, TOP_K, TOP_P)
    assert [e > 0 for e in expected] == [True, True, True, False, False, False]
    n = 20000
    seeds = list(range(n)) if vary == "seed" else [12345] * n
    positions = torch.full((n,), 7) if vary == "seed" else torch.arange(n)
    rows = rows_of([SamplingParams(temperature=T, top_k=TOP_K, top_p=TOP_P)] * n, seeds)
    tokens = sample(torch.tensor([LOGITS]).repeat(n, 1), rows, positions)
    assert tokens.max().item() <= 2  # filtered tokens are never drawn
    assert total_variation(tokens, expected) < 0.02


def test_a_draw_depends_on_seed_and_position_only():
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    params = [sp(top_p=0.95, top_k=50)] * 4
    alone = [sample(logits[2:3], rows_of(params[:1], [s]), torch.tensor([30])).item() for s in range(20)]
    together = [sample(logits, rows_of(params, [5, 99, s, 7]), torch.tensor([3, 9, 30, 1]))[2].item()
                for s in range(20)]
    assert alone == together
    assert len(set(alone)) > 1  # the seeds really sample, not collapse to argmax


def test_position_keys_are_64_bit_and_do_not_wrap():
    # position x vocabulary in 32 bits wraps after ~14k positions at a 151,936-token vocabulary; the
    # keys of positions 2^32 apart, and of seeds 2^32 apart, differ.
    seed = torch.tensor([3, 3, 3 + 2**32])
    keys = row_keys(seed, torch.tensor([5, 5 + 2**32, 5]))
    assert len(set(keys.tolist())) == 3


def test_seeds_beyond_int64_and_negative_ones_are_accepted():
    from ddtree.engine.sampler import request_seed
    assert request_seed(SamplingParams(seed=2**64 - 1)) == -1
    assert request_seed(SamplingParams(seed=-5)) == -5
    assert request_seed(SamplingParams(seed=None)) != request_seed(SamplingParams(seed=None))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_draws_equal_the_torch_reference(dtype):
    # Greedy, plain sampled, top-k, top-p, both, and a draw that must be taken again above a token
    # outside the nucleus; a vocabulary of two and a half tiles.
    pytest.importorskip("triton")
    from ddtree.ops.triton_sample import TILE
    g = torch.Generator().manual_seed(1)
    V = 2 * TILE + 501
    params = [SamplingParams(), sp(), sp(temperature=0.7, top_p=0.9), sp(top_k=20), sp(top_k=30, top_p=0.8),
              sp(temperature=1.3, top_p=0.5), sp(top_p=0.99), sp(temperature=2.0, top_k=3)]
    logits = (torch.randn(len(params), V, generator=g) * 3).to(dtype)
    logits[1, V - 3] = 30.0  # a clear winner in the partial last tile
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for trial in range(3):
        rows = draw_tensor(params, [1000 * trial + i for i in range(len(params))], device)
        positions = torch.arange(len(params), device=device) + 50 * trial
        want = sample(logits.to(device), rows, positions, use_triton=False)
        got = sample(logits.to(device), rows, positions, use_triton=True)
        assert got.tolist() == want.tolist()




@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
def test_triton_draws_equal_the_reference_with_ties_a_vanishing_top_p_and_nan_logits():
    # Coarse logits tie at the k-th largest (the top-k mass counts every tie, both ways); a top-p that
    # rounds to 0 in float32 keeps the largest logit only; a row with a NaN still returns a token.
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(2)
    V, device = 700, "cuda" if torch.cuda.is_available() else "cpu"
    params = [sp(top_k=5, top_p=0.5), sp(top_k=40, top_p=0.9), sp(top_k=3), sp(top_p=1e-50),
              sp(temperature=0.3, top_p=1e-50)] * 4
    logits = (torch.randn(len(params), V, generator=g) * 2).round()
    rows = draw_tensor(params, list(range(len(params))), device)
    positions = torch.arange(len(params), device=device)
    want = sample(logits.to(device), rows, positions, use_triton=False)
    got = sample(logits.to(device), rows, positions, use_triton=True)
    assert got.tolist() == want.tolist()
    nan = torch.randn(2, V, generator=g)
    nan[:, 10] = float("nan")
    drawn = sample(nan.to(device), draw_tensor([sp(top_p=0.9), sp(top_k=5, top_p=0.9)], [1, 2], device),
                   positions[:2], use_triton=True)
    assert ((drawn >= 0) & (drawn < V)).all()

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
