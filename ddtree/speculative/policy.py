"""`budget="auto"`: the plan that picks the next burst's budget for the whole batch, 0 being plain AR.

The rule. At batch size B the plan compares tokens per ms and request,

    AR          1 / ar_ms(B)
    budget b    (1 + A(b)) / spec_ms(b, B)        A(b): draft tokens a verify step accepts (speculative/acceptance.py)

on step times from the cost table measured at start-up, corrected by what steps took (speculative/costs.py),
and takes the best once it beats the current mode by `margin`: while speculating at this batch size, AR
must win by it; from AR, speculation must, paying a switch's cost (storing the drafter context the AR
steps read out, feeding again what they skipped) over the next `horizon` tokens per request (or fewer,
what the requests have left).

Two consequences:
- `hopeless(B)`: no budget beats AR by the margin even at an optimistic A. There auto runs plain AR's own
  steps and never asks the plan (speculative/auto.py); when the batch shrinks to a size with hope, the plan
  prices feeding the skipped context again as part of a switch.
- On AR where speculation could win, A stands still (only verify steps teach it): a probe, one burst of
  the best budget, comes once `probe_share` of the AR time since the last verify covers its expected
  loss (after one AR burst at least), or after `horizon` AR steps, by which the text has moved on
  (unless it has rows to feed again).

Greedy and sampled requests run the same plan. Tunables: PolicyConfig (ddtree/config.py); why each is
what it is, and what was tried: docs/auto.md.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

from ddtree.config import PolicyConfig
from ddtree.speculative.acceptance import Acceptance
from ddtree.speculative.costs import CostModel, CostTable, bucket


def candidate_budgets(depth: int, topk: int, budgets: tuple[int, ...] = PolicyConfig().budgets) -> list[int]:
    """[0] + `budgets`, each capped by the number of nodes a tree of this depth and topk can hold."""
    most = sum(topk ** d for d in range(1, depth + 1))
    return [0] + sorted({min(b, most) for b in budgets})


class Policy:
    def __init__(self, table: CostTable, budgets: list[int], cfg: PolicyConfig | None = None,
                 burst_steps: int = 8):
        """`budgets`: the candidates (0, AR, is always one); `burst_steps`: steps of a speculative burst."""
        self.cfg, self.burst_steps = cfg or PolicyConfig(), burst_steps
        self.budgets = [b for b in budgets if b > 0]
        self.costs = CostModel(table, self.cfg.decay)
        self.acceptance = Acceptance(self.budgets)
        self.mode, self.mode_bucket = 0, 0  # the budget being speculated with (0: AR), chosen at this batch bucket
        self.ar_steps, self.ar_ms = 0, 0.0  # AR steps since the last verify step, and their time
        self.plans: Counter = Counter()  # "outcome@bucket" -> plans
        self.totals: dict[tuple[int, int], list] = {}  # (bucket, budget) -> timed bursts, tokens per request, ms
        self._hopeless: dict[int, bool] = {}  # batch -> `hopeless`, until something is learnt

    @property
    def table(self) -> CostTable:
        return self.costs.table

    def rate(self, budget: int, batch: int, accepted: float | None = None) -> float:
        """Tokens per ms and request of AR (budget 0), or of `budget` at `accepted` (default: A(b))."""
        if not budget:
            return 1 / self.costs.ar_ms(batch)
        a = self.acceptance.mean(budget) if accepted is None else accepted
        return (1 + a) / self.costs.spec_ms(budget, batch)

    def hopeless(self, batch: int) -> bool:
        """No budget beats AR by the margin at this batch size even at an optimistic A (speculative/acceptance.py);
        False before the first verify step. Kept until something is learnt."""
        verdict = self._hopeless.get(batch)
        if verdict is None:
            cfg, ar = self.cfg, self.cfg.margin * self.rate(0, batch)
            verdict = self.acceptance.known and all(
                self.rate(b, batch, self.acceptance.optimistic(b, batch, cfg.spread, cfg.text_spread)) <= ar
                for b in self.budgets)
            self._hopeless[batch] = verdict
        return verdict

    def plan(self, batch: int, switch: Callable[[], tuple[int, float]] | None = None) -> int:
        """The budget of the next burst for `batch` requests (0: AR). `switch()`, asked only from AR: the
        rows a switch would feed again first (skipped by plain AR steps) and the tokens per request left."""
        if not self.acceptance.known:  # nothing known: one blind step of the smallest budget
            return self._chose("blind", batch, self.budgets[0])
        m, ar = self.cfg.margin, self.rate(0, batch)
        best = max(self.budgets, key=lambda b: self.rate(b, batch))  # (ties: the smaller)
        spec = self.rate(best, batch)
        if self.mode and self.mode_bucket == bucket(batch):  # speculating at this batch size
            return self._chose("spec", batch, best) if m * spec >= ar else self._chose("ar", batch, 0)
        rows, left = switch() if switch else (0, self.cfg.horizon)
        cost = (self.costs.store_ms(batch) if self.ar_ms else 0.0) + self.costs.refeed_ms(rows)
        tokens = max(1.0, min(self.cfg.horizon, left))  # ms below: per request, for that many tokens
        if tokens / ar > m * (tokens / spec + cost):
            return self._chose("spec", batch, best)
        burst = self.burst_steps * (1 + self.acceptance.mean(best))  # a probe's tokens per request
        loss = cost + burst / spec - burst / ar
        moved_on = self.ar_steps >= self.cfg.horizon and not rows  # (a refeed is priced by the share alone)
        if moved_on or (self.ar_ms and self.cfg.probe_share * self.ar_ms >= loss):
            return self._chose("probe", batch, best)
        return self._chose("ar", batch, 0)

    def _chose(self, outcome: str, batch: int, budget: int) -> int:
        if outcome in ("spec", "ar"):  # (a blind step or a probe leaves the mode as it was)
            self.mode, self.mode_bucket = budget, bucket(batch)
        self.plans[f"{outcome}@{bucket(batch)}"] += 1
        if self.cfg.trace:
            self._trace(outcome, batch, budget)
        return budget

    # ------------------------------------------------------------------------- what steps taught

    def observe_step(self, budget: int, batch: int, expected: dict[int, float], accepted: int) -> None:
        """A verify step of `budget` for `batch` requests: its draft's E(b) of every budget and the draft
        tokens accepted, each summed over the requests."""
        self.acceptance.observe(budget, batch, expected, accepted)
        self.ar_steps, self.ar_ms = 0, 0.0
        self._hopeless.clear()

    def observe_burst(self, budget: int, batch: int, steps: int, tokens: int, ms: float | None = None) -> None:
        """`steps` steps of `budget` (0: AR steps that read out the drafter's context) committed `tokens` to
        `batch` requests, in `ms` (None: a time that teaches nothing, as with a prefill chunk beside it)."""
        if not budget:
            self.ar_steps, self.ar_ms = self.ar_steps + steps, self.ar_ms + steps * self.costs.ar_ms(batch)
        if ms is None:
            return
        t = self.table
        model = t.verify_ms(budget, batch) + t.draft_ms(batch) if budget else t.ar_ms(batch)
        self.costs.observe("spec" if budget else "ar", batch, ms / steps, model)
        total = self.totals.setdefault((bucket(batch), budget), [0, 0.0, 0.0])
        total[0], total[1], total[2] = total[0] + 1, total[1] + tokens / batch, total[2] + ms
        self._hopeless.clear()

    def observe_store(self, batch: int, ms: float) -> None:
        """A switch stored the AR steps' drafter context in `ms`."""
        self.costs.observe("store", batch, ms, self.table.store_ms(batch) or 0.0)
        self._hopeless.clear()

    def observe_refeed(self, rows: int, ms: float) -> None:
        """`rows` skipped rows were fed through the target again in `ms`."""
        self.costs.observe("refeed", 1, ms, self.costs.refeed_model(rows))
        self._hopeless.clear()

    # ------------------------------------------------------------------------- for benchmark rows

    def state(self) -> dict:
        """What the policy learnt, JSON-ready: the table and its corrections, A(b), the plans by outcome and
        batch bucket, and what its timed bursts committed ("budget@bucket": bursts, tokens per request, ms)."""
        return {"table": self.table.as_dict(), "costs": self.costs.state(), **self.acceptance.state(),
                "plans": dict(sorted(self.plans.items())),
                "totals": {f"{b}@{k}": [n, round(tokens, 2), round(ms, 2)]
                           for (k, b), (n, tokens, ms) in sorted(self.totals.items())}}

    def _trace(self, outcome: str, batch: int, budget: int) -> None:
        row = {"plan": sum(self.plans.values()), "batch": batch, "outcome": outcome, "budget": budget,
               "ar_steps": self.ar_steps, "ar_rate": self.rate(0, batch),
               "rates": {b: self.rate(b, batch) for b in self.budgets}, **self.acceptance.state()}
        with open(self.cfg.trace, "a") as f:
            f.write(json.dumps(row) + "\n")
