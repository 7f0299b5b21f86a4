"""A synthetic serving loop for `AdaptivePolicy`: the policy plans, AR runs in bursts, speculation in
bursts of SPEC_BURST steps, as spec/decode.py and the engine drive it on the GPU, against text whose
difficulty changes every segment and a drafter that is overconfident and noisy. The same text runs
under plain AR and every fixed budget, so the policy's tokens per ms can be compared with theirs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ddtree.spec.adaptive import AdaptivePolicy, CostTable

SPEC_BURST, AR_BURST = 8, 16
SHARE = {4: 0.6, 8: 0.8, 16: 0.92, 32: 1.0}  # a budget's accepted length, as a share of budget 32's


@dataclass
class Regime:
    """One batch size's costs (ms) and its text: segments of `segment` tokens whose mean accepted
    length (budget 32) is drawn from `accepted` (uniform); the drafter's E is `over` x that, times
    log-normal noise of `noise`, per step."""
    batch: int
    ar_ms: float
    step_ms: dict[int, float]  # a whole speculative step (draft and verify) by budget
    switch_ms: float  # a switch from AR: the AR stretch's context store
    accepted: tuple[float, float] = (0.2, 2.6)
    segment: int = 48
    over: float = 1.4
    noise: float = 0.5
    seed: int = 0
    difficulty: list[float] = field(default_factory=list)  # per segment, drawn as the text grows

    def mean_accepted(self, pos: float, budget: int) -> float:
        pos = int(pos)
        while len(self.difficulty) <= pos // self.segment:
            self.difficulty.append(random.Random(self.seed * 7919 + len(self.difficulty)).uniform(*self.accepted))
        return self.difficulty[pos // self.segment] * SHARE[budget]

    def table(self) -> CostTable:
        return CostTable([self.batch], [self.ar_ms], [0.0], {b: [ms] for b, ms in self.step_ms.items()})


def run_fixed(r: Regime, budget: int, tokens: int) -> float:
    """Tokens per ms of always `budget` (0: AR) over the first `tokens` tokens of the text."""
    pos, ms = 0, 0.0
    while pos < tokens:
        if budget == 0:
            pos, ms = pos + 1, ms + r.ar_ms
        else:
            pos, ms = pos + 1 + r.mean_accepted(pos, budget), ms + r.step_ms[budget]
    return pos * r.batch / ms


def run_policy(r: Regime, tokens: int, policy: AdaptivePolicy | None = None) -> tuple[float, AdaptivePolicy]:
    """Tokens per ms of the policy over the same text (every request of the batch at one position)."""
    policy = policy or AdaptivePolicy(r.table(), [0, *r.step_ms])
    noise = random.Random(r.seed + 1)
    pos, ms, from_ar = 0.0, 0.0, False  # (the prefill stored the prompts' context)
    while pos < tokens:
        budget = policy.plan(r.batch)
        if budget == 0:
            steps = min(AR_BURST, 1 + policy.ar_steps_ahead())
            policy.skip_ar(steps - 1)
            pos, ms, from_ar = pos + steps, ms + steps * r.ar_ms, True
            continue
        start, stored, t = pos, from_ar, (r.switch_ms if from_ar else 0.0)
        drafts = []
        for _ in range(1 if policy.expected is None else SPEC_BURST):
            accepted = r.mean_accepted(int(pos), budget)
            expected = {b: r.over * r.mean_accepted(int(pos), b) * noise.lognormvariate(0, r.noise) for b in r.step_ms}
            policy.record_draft(r.batch, {b: e * r.batch for b, e in expected.items()})
            policy.probing = False
            policy.observe(budget, r.batch, expected[budget] * r.batch, accepted * r.batch)
            drafts.append(expected[budget])
            pos, t = pos + 1 + accepted, t + r.step_ms[budget]
        if len(drafts) > 1:  # (as spec/decode.py: not the first, blind, one-step burst)
            policy.observe_burst(budget, r.batch, (pos - start) * r.batch, t, sum(drafts) / len(drafts), stored)
        ms, from_ar = ms + t, False
    return pos * r.batch / ms, policy
