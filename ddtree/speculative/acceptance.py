"""What the drafter's trees accept, as `budget="auto"`'s plan (speculative/policy.py) needs it: A(b), the draft
tokens per request and verify step that budget b should get accepted.

Every draft carries the drafter's own expected accepted length E(b) of every budget (speculative/tree.py
`expected_accepts`), so all budgets are ranked on the same text. The drafter is miscalibrated, so
A(b) is the mean E(b) over the run's drafts times c, what the run's verify steps accepted over what
their drafts expected (pooled over budgets). Both are sums since the engine began: a property of the
drafter and the workload, not of the text being written now.
"""
from __future__ import annotations

import math


class Acceptance:
    def __init__(self, budgets: list[int]):
        self.budgets = list(budgets)
        self.drafted = dict.fromkeys(self.budgets, 0.0)  # per budget: E(b) per request, summed over drafts
        self.drafts = 0
        self.accepted = self.predicted = 0.0  # per request, summed over verify steps: accepted and E(budget)
        self.request_steps = 0  # verified request-steps: the evidence `optimistic` weighs

    @property
    def known(self) -> bool:
        """Whether any draft was verified yet."""
        return self.drafts > 0

    def observe(self, budget: int, batch: int, expected: dict[int, float], accepted: int) -> None:
        """A verify step of `budget` for `batch` requests: the draft's E(b) of every budget and the draft
        tokens accepted, each summed over the requests."""
        for b in self.budgets:
            self.drafted[b] += expected[b] / batch
        self.drafts += 1
        self.accepted += accepted / batch
        self.predicted += expected[budget] / batch
        self.request_steps += batch

    @property
    def calibration(self) -> float:
        """Accepted over expected, over the run's verify steps (1 before any)."""
        return self.accepted / self.predicted if self.predicted > 0 else 1.0

    def mean(self, budget: int) -> float:
        """A(b): the run's mean E(b), calibrated."""
        return self.drafted[budget] / max(self.drafts, 1) * self.calibration

    def optimistic(self, budget: int, batch: int, spread: float, text_spread: float) -> float:
        """An upper estimate of A(b) for a batch of `batch` requests: the run's mean is known to about
        1/sqrt(its request-steps), and a few requests' texts may be far easier than the run's."""
        return self.mean(budget) + spread / math.sqrt(1 + self.request_steps) + text_spread / batch ** 2

    def state(self) -> dict:
        return {"accepted": {b: round(self.mean(b), 4) for b in self.budgets},
                "calibration": round(self.calibration, 4), "drafts": self.drafts,
                "request_steps": self.request_steps}
