"""`budget="auto"`'s policy (speculative/policy.py) through its public interface, on synthetic cost tables: AR
when verification is expensive, a larger budget when it is cheap, AR past the crossover batch size and
speculation again below it, no flip-flopping at break-even, switches priced, probes spaced by what they
lose; then in a simulated serving loop (tests/policy_sim.py) against AR and every fixed budget. The
expected accepted length E(b) is checked on the tree module's worked example and against exact
enumeration. The speculator end to end: tests/test_auto.py.
"""
import dataclasses
import itertools
import json
import math
import random

import pytest
import torch

from ddtree.config import PolicyConfig
from ddtree.speculative.costs import CostTable
from ddtree.speculative.policy import Policy, candidate_budgets
from ddtree.speculative.tree import build_tree, candidates, cut_tree, expected_accepts
from policy_sim import (AR_BURST, H200_TABLE, SPEC_BURST, Batches, HardStart, Regime, run_batches, run_fixed,
                        run_noisy_bursts, run_policy)
from test_tree import worked_example_logprobs

BUDGETS = [0, 4, 8, 16, 32]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
E_PER_REQUEST = {4: 2.0, 8: 2.8, 16: 3.4, 32: 3.8}  # a drafter's typical E(b): concave, saturating


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: OpenMP overhead dominates
    yield
    torch.set_num_threads(before)


def table(step_ms, draft_ms=lambda bs: 0.1, store_ms=None) -> CostTable:
    """A synthetic table: `step_ms(tokens per request, batch)` for AR (1 token) and verify (b + 1)."""
    return CostTable(BATCHES, [step_ms(1, bs) for bs in BATCHES], [draft_ms(bs) for bs in BATCHES],
                     {b: [step_ms(b + 1, bs) for bs in BATCHES] for b in BUDGETS[1:]},
                     None if store_ms is None else [store_ms] * len(BATCHES))


def roofline(n: int, bs: int) -> float:
    """Memory-bound (flat) until 64 tokens in the step, then compute-bound (linear)."""
    return 1.0 * max(1.0, n * bs / 64)


def verify(policy: Policy, expected: dict | float, accepted: float | None = None, batch: int = 1, steps: int = 1,
           budget: int = 32) -> None:
    """`steps` verify steps of `budget` for `batch` requests whose drafts expected `expected[b]` per request
    (a number: the same for every budget) and that accepted `accepted` a request (default: as expected)."""
    per = expected if isinstance(expected, dict) else dict.fromkeys(BUDGETS[1:], expected)
    got = per[budget] if accepted is None else accepted
    for _ in range(steps):
        policy.observe_step(budget, batch, {b: e * batch for b, e in per.items()}, got * batch)


def ar_bursts(policy: Policy, batch: int, n: int = 1) -> None:
    for _ in range(n):
        policy.observe_burst(0, batch, AR_BURST, AR_BURST * batch)


# ----------------------------------------------------------------------------- the rule on synthetic tables

def test_ar_when_verification_is_expensive():
    policy = Policy(table(lambda n, bs: 1.0 * n * bs), BUDGETS)  # every token costs an AR step
    assert policy.plan(1) == 4  # nothing known yet: one blind step of the smallest budget
    verify(policy, E_PER_REQUEST)
    assert policy.plan(1) == 0 and policy.plan(2) == 0
    assert policy.hopeless(64) and not policy.hopeless(1)  # (one step of one request: little evidence)


def test_the_largest_useful_budget_when_verification_is_cheap():
    policy = Policy(table(lambda n, bs: 1.0 + 0.001 * n), BUDGETS)
    verify(policy, E_PER_REQUEST)
    assert policy.plan(1) == 32 and policy.mode == 32
    # A budget that adds no expected tokens is not worth its (tiny) extra cost.
    flat = Policy(policy.table, BUDGETS)
    verify(flat, {4: 2.0, 8: 2.8, 16: 3.4, 32: 3.4})
    assert flat.plan(1) == 16


def test_budget_shrinks_then_ar_past_the_crossover_and_speculation_again_below_it():
    policy = Policy(table(roofline), BUDGETS)
    verify(policy, E_PER_REQUEST, steps=100)
    planned = [policy.plan(bs) for bs in BATCHES]
    assert planned == [32, 32, 16, 8, 4, 4, 0, 0]
    # Past the crossover not even an optimistic accepted length wins: auto runs plain AR's steps there
    # without asking the plan; a batch that shrinks below it plans speculation again.
    assert [policy.hopeless(bs) for bs in BATCHES] == [False] * 6 + [True] * 2
    assert policy.plan(32) == 4 and policy.plan(1) == 32


def test_the_calibrated_accepted_length_is_the_mean_draft_times_what_verify_steps_accepted():
    # An overconfident drafter: half of what it expects is accepted. Every draft's E of every budget
    # counts (budgets are ranked on the same text), calibrated by the verify steps.
    policy = Policy(table(roofline), BUDGETS)
    verify(policy, {4: 1.0, 8: 1.5, 16: 1.8, 32: 2.0}, accepted=1.0, steps=99)
    verify(policy, {4: 3.0, 8: 3.5, 16: 3.8, 32: 4.0}, accepted=2.0, budget=8)  # a draft on easy text
    c = (99 * 1.0 + 2.0) / (99 * 2.0 + 3.5)
    assert policy.acceptance.calibration == pytest.approx(c)
    assert policy.acceptance.mean(4) == pytest.approx((99 * 1.0 + 3.0) / 100 * c)
    assert policy.rate(4, 1) == pytest.approx((1 + policy.acceptance.mean(4)) / (0.1 + 1.0))


def test_no_flip_flop_at_break_even():
    # AR 1 ms a token, a speculative step 1.1 ms for 1 + A tokens: within `margin` of AR the plan keeps
    # the mode it is in.
    cost = table(lambda n, bs: 1.0)
    on_ar = Policy(cost, BUDGETS)
    verify(on_ar, 0.122)  # 1.122 tokens in 1.1 ms: 2% above AR
    assert on_ar.plan(1) == 0 and on_ar.mode == 0
    speculating = Policy(cost, BUDGETS)
    verify(speculating, 1.0)  # 1.82x AR
    assert speculating.plan(1) == 4
    verify(speculating, 0.077, steps=999)  # the run's mean now 2% below AR
    assert speculating.plan(1) == 4 and speculating.mode == 4
    verify(speculating, 0.0, steps=1000)  # clearly below
    assert speculating.plan(1) == 0
    # Steps scattered around break-even: the run-long estimate settles, and the mode changes rarely.
    rng, policy, modes = random.Random(0), Policy(cost, BUDGETS), []
    for _ in range(400):
        budget = policy.plan(1)
        if budget:
            verify(policy, 0.1 * rng.lognormvariate(0, 0.5), budget=budget)
        else:
            ar_bursts(policy, 1)
        modes.append(policy.mode)
    assert sum(a != b for a, b in zip(modes, modes[1:])) <= 2, modes


def test_a_switch_from_ar_pays_the_store_and_the_refeed_over_the_tokens_left():
    # Speculation 1.82x AR per token; from AR a switch stores the AR steps' drafter context (1 ms) and
    # feeds again the rows plain AR steps skipped (20 ms a forward + 0.01 ms a row): worth it over 128
    # tokens per request left, not over 32.
    policy = Policy(table(lambda n, bs: 1.0, store_ms=1.0), BUDGETS)
    policy.costs.set_refeed(20.0, 0.01)
    verify(policy, 1.0)
    ar_bursts(policy, 1)
    assert policy.plan(1, lambda: (1000, 128)) == 4
    policy = Policy(policy.table, BUDGETS)
    policy.costs.set_refeed(20.0, 0.01)
    verify(policy, 1.0)
    ar_bursts(policy, 1)
    assert policy.plan(1, lambda: (1000, 32)) == 0
    assert policy.plan(1, lambda: (0, 32)) == 4  # (no gap: the store alone)
    # A refeed wider than one forward pays the fixed part once per forward it takes.
    policy.costs.set_refeed(20.0, 0.01, forward_rows=2048)
    assert policy.costs.refeed_ms(2048) == pytest.approx(20.0 + 20.48)
    assert policy.costs.refeed_ms(5000) == pytest.approx(3 * 20.0 + 50.0) and policy.costs.refeed_ms(0) == 0.0


@pytest.mark.parametrize("draft_ms", [0.13, 0.3])
def test_probes_come_as_rarely_as_they_lose(draft_ms):
    # On AR where speculation has hope, A stands still: a probe (a burst of SPEC_BURST steps) comes
    # once probe_share of the AR time since the last verify covers what it should lose, or after
    # `horizon` AR steps (the text has moved on). Here each of its steps costs 1 + draft_ms for one token
    # where AR takes 1 ms (0.13: 1.04 ms a probe, due after 104 ms of AR steps; 0.3: 2.4 ms, but the
    # text moves on after 128).
    policy = Policy(table(lambda n, bs: 1.0, draft_ms=lambda bs: draft_ms), BUDGETS)
    verify(policy, 0.0)
    loss = SPEC_BURST * (1 + draft_ms) - SPEC_BURST * 1.0
    every = min(math.ceil(loss / (policy.cfg.probe_share * AR_BURST * 1.0)),  # AR bursts between probes
                policy.cfg.horizon // AR_BURST)
    assert every == (7 if draft_ms < 0.2 else 8)
    pattern = []
    for _ in range(3 * (every + 1)):
        budget = policy.plan(1)
        pattern.append(budget)
        if budget:
            verify(policy, 0.0, budget=budget)
        else:
            ar_bursts(policy, 1)
    assert pattern == ([0] * every + [4]) * 3 and policy.mode == 0
    assert not policy.hopeless(1)


def test_a_blind_step_that_accepted_nothing_leaves_hope_and_many_requests_are_evidence():
    # One step of one request is no evidence: batch 1-2 keep their hope. One step of 128 requests (the
    # H200's costs, the drafter calibrated) is: batch 128 is hopeless.
    policy = Policy(H200_TABLE, BUDGETS)
    verify(policy, {4: 2.0, 8: 2.4, 16: 2.7, 32: 2.9}, accepted=0.0, budget=4)
    assert policy.acceptance.calibration == 0.0 and not policy.hopeless(1) and not policy.hopeless(2)
    busy = Policy(H200_TABLE, BUDGETS)
    verify(busy, {4: 1.3, 8: 1.6, 16: 1.8, 32: 1.95}, batch=128, budget=4)
    assert busy.hopeless(128) and not busy.hopeless(1)


def test_the_cost_model_learns_what_steps_really_take_per_batch_bucket():
    # Bursts at batch 4 taking 3x the table's step time: speculation there (and at batch 8, not timed
    # yet: the nearest smaller bucket's correction) turns to AR; batch 1 keeps its own table.
    policy = Policy(table(lambda n, bs: 1.0 + 0.001 * n), BUDGETS)
    verify(policy, {4: 0.6, 8: 0.8, 16: 0.9, 32: 1.0})  # budget 32: 1.77x AR
    assert [policy.plan(bs) for bs in (1, 4, 8)] == [32, 32, 32]
    step = policy.table.draft_ms(4) + policy.table.verify_ms(32, 4)
    for _ in range(30):
        policy.observe_burst(32, 4, SPEC_BURST, 4 * 30, SPEC_BURST * 3 * step)
    assert policy.costs.scale("spec", 4) == pytest.approx(3.0, rel=0.05) and policy.costs.scale("spec", 1) == 1.0
    assert policy.costs.scale("spec", 8) == policy.costs.scale("spec", 4)
    assert policy.plan(4) == 0 and policy.plan(8) == 0 and policy.plan(1) == 32
    assert policy.state()["totals"]["32@4"][0] == 30  # (bursts, tokens per request, ms)
    policy.observe_burst(32, 1, SPEC_BURST, 30, 1000.0)  # a stall counts at most 4x
    assert policy.costs.scale("spec", 1) == pytest.approx((1.0 + 4.0) / 2)  # (the table counts as a sample)


def test_a_traced_policy_writes_each_plan_and_plans_as_an_untraced_one(tmp_path):
    path = tmp_path / "trace.jsonl"
    chosen = []
    for cfg in (PolicyConfig(), PolicyConfig(trace=str(path))):
        policy = Policy(table(roofline), BUDGETS, cfg)
        plans = [policy.plan(1)]
        verify(policy, E_PER_REQUEST)
        plans += [policy.plan(bs) for bs in BATCHES]
        chosen.append(plans)
    assert chosen[0] == chosen[1]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["budget"] for r in rows] == chosen[1] and rows[0]["outcome"] == "blind"
    assert set(rows[-1]["rates"]) == {"4", "8", "16", "32"} and rows[-1]["batch"] == 128


def test_policy_settings_are_checked():
    with pytest.raises(ValueError):
        PolicyConfig(margin=0.9)
    with pytest.raises(ValueError):
        PolicyConfig(budgets=())


def test_cost_table_interpolates_between_batch_sizes_and_extrapolates_the_last_slope():
    t = CostTable([1, 4, 16], [1.0, 1.0, 4.0], [0.1, 0.1, 0.1], {4: [2.0, 3.0, 6.0]})
    assert t.ar_ms(1) == 1.0 and t.ar_ms(0) == 1.0 and t.ar_ms(10) == pytest.approx(2.5)
    assert t.ar_ms(28) == pytest.approx(7.0)  # slope 0.25 per request past 16
    assert t.verify_ms(4, 2) == pytest.approx(2 + 1 / 3)
    down = CostTable([1, 2], [2.0, 1.0], [0.1, 0.1], {})  # a noisy measurement: never extrapolate downwards
    assert down.ar_ms(64) == 1.0


def test_candidate_budgets_are_capped_by_what_a_tree_can_hold():
    assert candidate_budgets(15, 4) == [0, 4, 8, 16, 32]
    assert candidate_budgets(7, 1) == [0, 4, 7]  # a chain of 7
    assert candidate_budgets(3, 2) == [0, 4, 8, 14]  # 2 + 4 + 8 nodes
    assert candidate_budgets(15, 4, (8, 64)) == [0, 8, 64]


# ----------------------------------------------------------------------------- expected accepted length

def test_expected_accepted_length_is_the_prefix_sum_of_the_best_path_probabilities():
    c = candidates(worked_example_logprobs(), 4, 2)  # tree.py's worked example: best paths .6, .3, .3, .27
    e = expected_accepts(c, [1, 2, 3, 4])
    torch.testing.assert_close(e, torch.tensor([[.6, .9, 1.2, 1.47]]))


def accepted_depth(paths: set, seq: tuple) -> int:
    d = 0
    while d < len(seq) and seq[:d + 1] in paths:
        d += 1
    return d


@pytest.mark.parametrize("seed", range(3))
def test_expected_accepted_length_equals_exact_enumeration_under_the_drafters_distribution(seed):
    # Target tokens drawn independently per depth from the drafter's own distributions: the mean
    # accepted depth of the budget-b tree, enumerated exactly over all V^D outcomes, is E(b).
    g = torch.Generator().manual_seed(seed)
    D, V, topk = 3, 4, 3
    lp = (torch.randn(1, D, V, generator=g, dtype=torch.float64) * 1.5).log_softmax(-1).float()
    c = candidates(lp, 12, topk)
    budgets = [1, 3, 5, 8, 12]
    e = expected_accepts(c, budgets)[0]
    for b, want in zip(budgets, e.tolist()):
        tree = cut_tree(c, torch.tensor([0]), b)
        nodes = {}
        for n in range(1, b + 1):  # token path of every node
            p, path = n, []
            while p > 0:
                path.append(tree.tokens[0, p].item())
                p = tree.parent[0, p].item()
            nodes[n] = tuple(reversed(path))
        paths = set(nodes.values())
        exact = sum(math.prod(lp[0, d, t].exp().item() for d, t in enumerate(seq)) * accepted_depth(paths, seq)
                    for seq in itertools.product(range(V), repeat=D))
        assert exact == pytest.approx(want, rel=1e-4), b


def test_trees_cut_from_wider_candidates_are_the_trees_built_for_that_budget():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, 40, generator=g).log_softmax(-1)
    roots = torch.tensor([1, 2, 3])
    c = candidates(lp, 32, 4)
    for b in (1, 4, 8, 16, 32):
        cut, built = cut_tree(c, roots, b), build_tree(lp, roots, b, 4)
        for name in ("tokens", "parent", "depth", "valid", "mask", "score"):
            assert torch.equal(getattr(cut, name), getattr(built, name)), (b, name)


# ----------------------------------------------------------------------------- the policy in a synthetic loop

SIM_REGIMES = [  # costs shaped like the H200's at C = 1, 2, 8, 32, 128 (ms; whole speculative steps)
    Regime(1, 0.86, {4: 1.8, 8: 1.85, 16: 1.9, 32: 1.96}, switch_ms=1.5, readout=0.01),
    Regime(2, 1.07, {4: 1.9, 8: 1.95, 16: 2.0, 32: 2.1}, switch_ms=2.4, readout=0.01),
    Regime(8, 1.08, {4: 2.0, 8: 2.1, 16: 2.3, 32: 2.7}, switch_ms=3.4, readout=0.02),
    Regime(32, 1.2, {4: 3.0, 8: 3.4, 16: 4.1, 32: 5.8}, switch_ms=4.5, readout=0.04),
    Regime(128, 1.4, {4: 5.7, 8: 7.2, 16: 10.0, 32: 15.7}, switch_ms=10.0, readout=0.06),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("accepted", [(0.8, 2.2), (0.2, 2.6)])
@pytest.mark.parametrize("regime", SIM_REGIMES, ids=lambda r: f"batch{r.batch}")
def test_policy_keeps_up_with_the_best_fixed_mode(regime, accepted, seed):
    # Planning, probing and learning from its own bursts (an overconfident, noisy drafter; text whose
    # difficulty changes every 48 tokens), auto runs within the switch margin of the best of plain AR and
    # every fixed budget on the same text, where speculation wins (small batches) and where it loses by
    # up to 5x (large ones, where it runs plain AR's steps).
    r = dataclasses.replace(regime, accepted=accepted, seed=seed, difficulty=[])
    fixed = {b: run_fixed(r, b, 2000) for b in [0, *r.step_ms]}
    rate, policy = run_policy(r, 2000)
    assert rate >= 0.95 * max(fixed.values()), (rate / fixed[0], {b: v / fixed[0] for b, v in fixed.items()})
    if r.batch == 128:
        assert rate >= 0.99 * fixed[0] and set(policy.plans) == {"blind@128"}  # (then plain AR, unplanned)


@pytest.mark.parametrize("seed", [0, 1])
def test_policy_keeps_up_in_batches_run_to_completion(seed):
    # As `bench sweep` runs them (batches of C requests of different lengths, each batch to its end, the
    # batch shrinking through smaller sizes, gaps fed again where it re-enters speculation), on the
    # H200's cost table, one policy through C = 1-8 and another through 16-128 as in the two halves of
    # the H200 grid, each C after a warm-up batch: auto stays within 6% of the best of AR and each fixed
    # budget, and within 1% of AR, at every C.
    for phase in ((1, 2, 4, 8), (16, 32, 64, 128)):
        policy = Policy(H200_TABLE, BUDGETS)
        policy.costs.set_refeed(20.0, 0.005)
        for c in phase:
            run_batches(Batches(c, batches=1, seed=seed + 100), None, policy)  # warm-up
            w = Batches(c, batches=max(1, 32 // c), seed=seed)
            fixed = {b: run_batches(w, b) for b in BUDGETS}
            auto = run_batches(w, None, policy)
            assert auto >= 0.94 * max(fixed.values()) and auto >= 0.99 * fixed[0], \
                (c, auto / fixed[0], {b: v / fixed[0] for b, v in fixed.items()})


@pytest.mark.parametrize("seed", [0, 1])
def test_a_cold_start_at_high_load_stays_near_ar(seed):
    # A fresh policy at C=128 (batches run to completion, filling and draining), where an AR step that
    # reads out the drafter's context costs 6% more: hopeless after its first verify step of many
    # requests, it runs plain AR's steps.
    w = Batches(128, batches=3, seed=seed, readout=0.06)
    assert run_batches(w, None) >= 0.98 * run_batches(w, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_small_noisy_gain_is_taken_and_a_small_loss_avoided(seed):
    # Bursts whose rates scatter by ~30% around 1.1x AR's (or 0.9x), the drafter's E no guide: the
    # calibration learns what they accept. (At 0.9x the probes, at least every `horizon` AR steps, cost
    # about 3%.)
    assert run_noisy_bursts(1.1, seed) >= 1.08
    assert run_noisy_bursts(0.9, seed) >= 0.96


@pytest.mark.parametrize("seed", range(4))
def test_a_hard_start_at_batch_1_does_not_lock_out_the_easy_text_after(seed):
    # Batch 1 with the H200's costs (AR 0.87 ms, a whole step 1.6 ms: break-even near 0.9 tokens
    # accepted): a first prompt with nothing accepted and 3,500 tokens near break-even must not make
    # batch 1 hopeless (its steps would then be plain AR's, with nothing verified to learn from) for the
    # easy 6,500 tokens after: one text's spread (`text_spread`) keeps its hope.
    r = HardStart(1, 0.87, {4: 1.58, 8: 1.6, 16: 1.61, 32: 1.66}, switch_ms=2.4, accepted=(0.3, 1.3), seed=seed,
                  over=1.0, refeed_ms=(25.0, 0.002), readout=0.01)
    fixed = {b: run_fixed(r, b, 10000) for b in [0, *r.step_ms]}
    rate, policy = run_policy(r, 10000)
    assert rate >= 0.95 * max(fixed.values()), (rate / max(fixed.values()), policy.plans)
    assert not policy.hopeless(1)
