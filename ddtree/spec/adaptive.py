"""Adaptive speculation (`--budget auto`): each step, the budget (0 = plain AR) that maximizes expected
committed tokens per second.

Cost: a table of step times measured at start-up on the device (spec/costs.py): one AR step, one
draft step and one verify step of each candidate width, at a few batch sizes (linear in between).
Gain: the drafter's own probabilities give the expected accepted length E(b) of the best-first tree
of each budget b (spec/tree.py `expected_accepts`); the drafter is miscalibrated, so the plan
counts what verify steps accepted (`mean_accepted`), and a choice on one draft (`choose`) scales its E
by a running ratio of observed to predicted accepted lengths. One budget per step for the whole batch.

The table times the device work (graph replays); a real step also pays host work around it: building
inputs, the read-backs mid-step, committing tokens. `observe_time` keeps, per kind of step (AR or
speculative) and batch bucket, a running mean of what steps really took beyond the table's figure,
and every cost the model compares includes it.

On the GPU the plan runs as pipelined bursts of whole-step graphs (spec/auto.py), and plans on
run-long figures, as a property of the drafter and the batch size rather than of the text now
(`request_rate`): each budget's accepted length over the run (`mean_accepted`: every draft's E
of it, calibrated by what verify steps accepted), the model's step cost, and per batch bucket the
model's step time over what its bursts took, starts and drains included (`fit`), plus the context
store a switch from AR pays first. On the H200 rates realized by each budget's last bursts followed
the text: they sent C=1 to long AR stretches after hard prompts and ranked budgets by the text each
ran on.

Choosing AR skips the draft, so the budget is planned before drafting (`plan`), with a probe (a
burst of the budget that looks best) as often as keeps what probes lose within PROBE_LOSS of the AR
time at that batch size (`probe_cap`, on the rate the budget's recent bursts realized there).
Without graphs (the CPU, sampled requests) a step drafts first and then picks the budget on the
current draft's probabilities among the remaining costs: verify(b) for b > 0, or the AR step for 0
(`choose`).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

from ddtree.engine.ar import DECODE_BURST
from ddtree.spec.costs import CostTable

BUDGETS = (4, 8, 16, 32)  # speculative candidates; 0 (AR) is always one too
AR_BURST_STEPS = DECODE_BURST  # the most steps of one of the AR decoder's bursts
SWITCH_MARGIN = 1.05  # the rate another mode (AR or speculation) must beat the current one by
PROBE_EVERY = 16  # AR steps at least between probes (a burst of the budget that looks best) ...
MAX_PROBE_EVERY = 1024  # ... and at most, within which as many as keep what losing probes cost
PROBE_LOSS = 0.01  # ... within this share of the AR time
# ... and a probe's refeed of the rows tap-free AR steps skipped at most this share of the AR time since
# the last probe: at PROBE_LOSS, on the H200 at ca1dc39, the run at C=128 drained to 4 requests at its
# end, and a probe there refed 784 rows in 16.9 ms for one speculative step (~1% of the run: auto 0.98x AR)
REFEED_LOSS = 0.0025
# ... growing at most this many times a probe: a few hard probes price the next ones far off (on the
# H200 at d43b91d, C=1, after the hard first MT-Bench prompt: probes 16, 22 and 185 AR steps apart in one
# run; in another the fourth came 1,000 steps on, a switch's store learnt at 3.1 ms, while fixed budget 32
# ran 1.29x AR on that text)
PROBE_GROWTH = 2
# Steps of a speculative burst (spec/decode.py runs them): a probe is one whole burst, whose rate means
# something, and the model spreads a switch's context store over one
BURST_STEPS = 8
# Weight of a speculative burst in its budget's realized rate at its batch size (`realized`: what a probe
# should cost, `probe_cap`; the plan itself no longer compares these rates, which follow the text). At
# 0.25 an estimate was mostly the last few bursts, and the plan stopped speculating after bad ones, so it
# sat low: at C=1 on the H200 (5634d33) each budget's read 0.95-1.05 tokens per ms, where all of auto's
# bursts together realized 1.28 and AR steps 1.16.
RATE_DECAY = 0.1
# Speculation has hope at a batch size where a budget's `hope_rate` beats AR's: an upper estimate, its
# accepted length plus this many tokens over the square root of the run's verified request-steps (plus
# HOPE_PRIOR_STEPS), two standard deviations of one request's accepted length in a step (1.3-1.6 at C=1 on
# MT-Bench, 5222c67). With the host extra in, the model at the mean matched fixed budget 8 against AR
# within 4% on the H200 (5222c67, run 6 drafter): 1.16x (ran 1.12x) at C=8, 0.99x (0.99x) at 16, 0.84x
# (0.84x) at 32, 0.69x (0.67x) at 64. A flat slack instead (1.3x hope at 5222c67, 1.1x at 61b7355) left
# C=32 reading out the drafter's context (auto 0.95x and 0.93x AR) and, at 1.3x, C=64-128 too. (Counted
# in verify steps until 0df5e9d, a step of 64 requests weighing as one of a single request: a fresh
# policy at C=128 alone on the H200, 54 verify steps in, ~2,000 request-steps, kept a spread of 0.38
# tokens and hope at batch 64-128, and ran 0.89x AR.)
HOPE_SPREAD = 3.0
# `hope_rate`'s spread counts the run's verified request-steps and this many more (a fresh engine's
# first ones are not taken at face value)
HOPE_PRIOR_STEPS = 8
# ... and a batch of one request also this many tokens: its text alone sets the accepted length, and the
# next prompt's may be far easier than the run's so far (budget 32 on MT-Bench, the run 8 drafter, CPU
# replay of 12 prompts: 1.34 writing, 1.49 roleplay, 1.98 reasoning, 3.25 coding). A hopeless batch size's
# AR steps skip the read-out, so probing it again means feeding every skipped row through the target
# first (an eager forward, ~16-30 ms on the H200 at batch 1, where the read-out costs ~1% of an AR step):
# in the simulator (tests/policy_sim.py, `HardStart`, refeeds priced) a hard first stretch at batch 1 left
# it hopeless for good on the easy text after (worst of 12 runs 0.80-0.84x the best fixed budget;
# 0.91-0.97x with this). A batch mixes its requests' texts: the term falls as 1/batch^2, so from batch 4 up the verdicts
# the H200 grids tuned stand.
TEXT_SPREAD = 0.7
# ... and the model says "hopeless" only after this many verified request-steps in all: not on a fresh
# engine's blind first step at batch 1, alone or with one probe (1 + 8 steps; 5222c67: from its blind
# step batch 1 was hopeless for 141 AR bursts, until a probe's refeed was affordable: auto 0.92x fixed
# budget 32 at C=1); a blind step of 16 requests or more is (a sample of each one's text).
# (A few hard probes more are HOPE_SPREAD's to weigh.)
HOPE_EVIDENCE = 16
# Where that model shows no clear win (SWITCH_MARGIN), speculation as the plan practised it at the batch
# bucket decides too: all of its timed bursts (at least this many) and the context stores before them
# together realizing fewer tokens per ms than the AR bursts there, the batch size is hopeless (`lost`).
HOPE_BURSTS = 4
# A batch bucket's `fit` starts from this many steps (two bursts) of the nearest smaller bucket's
FIT_PRIOR_STEPS = 16
# A budget's calibration is its own observed/predicted ratio shrunk toward the ratio over all budgets,
# the overall one weighing as much as this many of its own recent steps: a budget tried a few times on
# hard text (0.39 on the H200 at efd2b47, where fixed budget 32 ran 6% above AR) is not shut out.
CALIBRATION_PRIOR = 4.0
# A `_hopeless` verdict is reused for up to this many plans at its batch size (or prefills' questions,
# `hopeless_at`) while the policy learns nothing (a draft, a verify step, a speculative burst, a step
# time: an AR burst's too, where it reads out the context). Ranking every budget's hope took ~17 us of
# host time a plan on this CPU; at C=32-128 on the H200 auto's host time between AR bursts, ~100-150 us
# a burst beyond AR's (2e2c40b), was about the 1% by which it trailed AR. (AR bursts' tallies, which
# only move `lost` slowly, do not count as lessons: hence the limit.)
HOPE_MEMO_PLANS = 16
# DDTREE_POLICY_TRACE=FILE appends one JSON line per plan to FILE (`trace`): what the plan saw and chose, to
# follow a run's decisions where a benchmark row's end state (`state`) cannot say when or why it went AR.
TRACE_PATH = os.environ.get("DDTREE_POLICY_TRACE") or None


def candidate_budgets(depth: int, topk: int) -> list[int]:
    """[0] + BUDGETS, each capped by the number of nodes a tree of this depth and topk can hold."""
    most = sum(topk ** d for d in range(1, depth + 1))
    return [0] + sorted({min(b, most) for b in BUDGETS})


class AdaptivePolicy:
    """The per-step budget choice for a batch; its state is run-long sums (verify steps, drafts, bursts'
    costs) and running averages (weight `decay` per step for drafts and acceptance, RATE_DECAY per burst
    for realized rates)."""

    def __init__(self, table: CostTable, budgets: list[int], probe_every: int = PROBE_EVERY, decay: float = 0.1,
                 max_probe_every: int = MAX_PROBE_EVERY):
        self.table, self.probe_every, self.decay = table, probe_every, decay
        self.budgets = [b for b in budgets if b > 0]  # the speculative candidates
        assert all(b in table.verify for b in self.budgets), (self.budgets, list(table.verify))
        self.expected: dict[int, float] | None = None  # running mean over requests of the drafter's E(b)
        self.fresh = False  # ... and it comes from the steps just taken (not from before an AR stretch)
        self.accepted: dict[int, float] = {}  # running mean accepted length per request, per chosen budget
        self.predicted: dict[int, float] = {}  # ... and the drafter's E(b) for those same steps
        self.weight: dict[int, float] = {}  # ... and how many steps that is, decayed by every later step
        # per budget: accepted length per request summed, steps, and the drafter's E(b) for them summed
        self.verified: dict[int, list[float]] = {}
        self.verified_requests = 0  # request-steps over all verify steps (`hope_rate`'s spread)
        self.drafted: dict[int, list[float]] = {}  # per budget: every draft's E(b) per request summed, drafts
        self.total: tuple[float, float] | None = None  # running (accepted, predicted) over all budgets
        self.ar_streak = 0
        # A probe fell due but its refeed was not affordable: the AR streak at which to price it again.
        # (Before, every later plan priced it, counting the gap rows of every request, until one was
        # affordable: at C=128, where none is, every plan once the streak passed MAX_PROBE_EVERY, and the
        # H200 grids' AR bursts there were ~4 steps long.)
        self.look_again = 0
        self.priced_out = 0  # (hopeless) the AR streak before which a due probe is not priced again
        self.overruled = 0  # drafts in a row `choose` threw away
        self.intervals: dict[int, int] = {}  # batch bucket -> AR steps before the next probe
        self.interval = probe_every  # ... the current batch's
        # (batch bucket, budget) -> running sums over its bursts of tokens per request and ms (their ratio
        # is the rate they realized, `_rate`: what a probe should cost, `probe_cap`)
        self.realized: dict[tuple[int, int], tuple[float, float]] = {}
        # batch bucket -> over its timed bursts, the model's ms for their steps and the ms they took (`fit`)
        self.fits: dict[int, list[float]] = {}
        self.fit_at: dict[int, float] = {}  # batch -> `fit`, until the next lesson
        self.lessons = 0  # lessons learnt so far (`_learnt`)
        # (batch, from AR) -> [`_hopeless` verdict, what it was judged on, plans left to reuse it]
        self.hope_memo: dict[tuple[int, bool], list] = {}
        self.hopeless_seen: dict[int, bool] = {}  # batch bucket -> what its last plan found (`hopeless_at`)
        # ... and what every timed burst of it (0: AR) added up to, undecayed, for benchmark rows:
        # [bursts, tokens per request, ms] (`tally`)
        self.totals: dict[tuple[int, int], list[float]] = {}
        self.max_probe_every = max_probe_every
        # plans by outcome and batch bucket ("spec@16", "probe@1", "ar@4", "hopeless@128", "blind@1"; "headed@16":
        # AR, tap-free for the hopeless batch size the waiting prompts are about to fill; "gapped@8": AR,
        # tap-free as a switch would feed gaps again anyway)
        # since the policy began (it lives as long as its engine), for benchmark rows: an AR plan covers
        # a whole AR burst
        self.plans: dict[str, int] = {}
        self.outcome = ""  # the last plan's ("spec", "probe", "ar", ...: `plans`' keys less the bucket)
        self.outcome_batch = 0  # ... and its batch size
        self.probing = False  # this draft is a probe: AR looked better on past averages
        self.hopeless = False  # the last plan saw no chance for speculation at its batch size (`hope_rate`)
        self.tap_free = False  # ... or said AR where the batch is headed for a size with none (`plan`)
        self.gapped = False  # ... or said AR, tap-free as the batch has gaps a switch refeeds anyway
        self.speculating = False  # the last plan chose a budget > 0 (not a probe) ...
        self.spec_bucket = 0  # ... for this batch bucket
        self.extra: dict[tuple[str, int], float] = {}  # ("ar" | "spec", batch bucket) -> ms beyond the table
        self.switch: dict[int, float] = {}  # batch bucket -> ms of an AR stretch's context store
        self.switch_samples: dict[int, int] = {}  # ... and how many stores (the table's one) it averages
        self.stored_ms: dict[int, float] = {}  # ... and those before timed bursts, undecayed (`lost`)
        # Feeding tokens again where tap-free AR steps skipped their features (`hope_rate`): a fixed cost per
        # refeed and ms per row, timed at start-up where graphs are (`set_refeed_cost`; else a per-row
        # prior, the table's widest verify per token), times what refeeds took over that (`refeed_ms`);
        # and the ms of the rows due now
        widest = max(table.verify.values(), key=lambda v: v[-1])[-1] if self.budgets else 0.0
        self.refeed_fixed_ms, self.refeed_forward_rows = 0.0, None
        self.refeed_row_ms = widest / ((max(self.budgets, default=0) + 1) * table.batch[-1])
        self.refeed_scale, self.refeed_samples = 1.0, 1
        self._gap_rows, self._gap_ms = 0, 0.0  # (`gap_ms`)

    def observe_time(self, kind: str, batch: int, measured_ms: float, table_ms: float) -> None:
        """A real step of `kind` ("ar": per step of an AR burst, "spec": per step of a speculative burst,
        draft and verify) took `measured_ms` where the table says `table_ms`. One sample counts at most
        4x the table (a stray stall, a first-time compile). Steps may also come out cheaper than the
        table, which times each replay to a synchronize where bursts pipeline: an AR step down to half
        (the table's is auto's own AR graph; the AR decoder's bursts run their own), a speculative one down
        to three quarters (the extra is added to every budget's cost, small ones included)."""
        key = (kind, _bucket(batch))
        self._learnt()  # (`fit` weighs by the step's cost, which the extra is part of)
        low = (-0.5 if kind == "ar" else -0.25) * table_ms
        sample = max(low, min(measured_ms, 4 * table_ms) - table_ms)
        old = self.extra.get(key)
        self.extra[key] = sample if old is None else (1 - self.decay) * old + self.decay * sample

    def observe_switch(self, batch: int, ms: float) -> None:
        """A switch from AR to speculation stored the AR stretch's drafter context in `ms` (host). The
        cost is a plain mean over a batch bucket's first samples, then a running one at `decay` (a
        bucket sees few switches). Where the table timed a store, it counts as the first sample, and
        one sample counts at most 10x it (a stall, a first-time compile; a real store's host work grows
        with the rows and entries pending, which the table's fixed layout does not see): at 3800c1b,
        seeded by its first sample alone, the plan at C=1 on the H200 priced a switch at 6 ms (a burst of
        budget 32 takes ~15), which kept it on AR and spaced its probes ~680 steps apart; at 36c0319,
        starting from the table's (one entry a request) and moving 10% a sample, it priced them at half
        of what real stores took (2.3 ms against 1.4 at C=1, 4.6 against 0.8 at C=16)."""
        key = _bucket(batch)
        table, ms = self.table.store_ms(key), self._store_sample(key, ms)
        n = self.switch_samples.get(key, 0 if table is None else 1)
        old = self.switch.get(key, table)
        self.switch[key] = ms if old is None else _learn(old, ms, n, self.decay)
        self.switch_samples[key] = n + 1

    def _store_sample(self, bucket: int, ms: float) -> float:
        """A store's ms as one sample counts: at most 10x the table's store, where it timed one."""
        table = self.table.store_ms(bucket)
        return ms if table is None else min(ms, 10 * table)

    def switch_ms(self, batch: int) -> float:
        """A switch's cost: the context store, and feeding again the rows tap-free AR steps skipped."""
        key = _bucket(batch)
        store = self.switch.get(key, self.table.store_ms(key))
        return (store or 0.0) + self.gap_ms

    def set_refeed_cost(self, fixed_ms: float, row_ms: float, forward_rows: int | None = None) -> None:
        """A refeed's cost as timed at start-up: `fixed_ms` a forward (an eager pass through the target) of
        at most `forward_rows` rows (None: any number), plus `row_ms` a row."""
        self.refeed_fixed_ms, self.refeed_row_ms, self.refeed_forward_rows = fixed_ms, row_ms, forward_rows
        self.priced_out = 0

    def _refeed_model(self, rows: int) -> float:
        """A refeed of `rows` rows as timed at start-up: a fixed cost per forward it takes (at C=128 on the
        H200, 2e2c40b, a probe's refeed of 17,649 rows took nine forwards, 318 ms, where one forward's
        cost had priced it at ~14), plus its rows."""
        return self._refeed_forwards(rows) * self.refeed_fixed_ms + rows * self.refeed_row_ms

    def _refeed_forwards(self, rows: int) -> int:
        return -(-rows // self.refeed_forward_rows) if self.refeed_forward_rows else 1

    def refeed_ms(self, rows: int) -> float:
        """What feeding `rows` gap rows again should cost."""
        return self.refeed_scale * self._refeed_model(rows) if rows else 0.0

    @property
    def gap_rows(self) -> int:
        """The rows due for a refeed now: the last plan's `gap_rows`, counted when first asked (a callable:
        a hopeless plan with no probe due does not ask; counting them walks every request, each burst);
        after a plan that did not ask, 0."""
        if callable(self._gap_rows):
            self._gap_rows = self._gap_rows()
        return self._gap_rows

    @property
    def gap_ms(self) -> float:
        """What feeding again the rows due now should cost (`gap_rows`)."""
        if self._gap_ms is None:
            self._gap_ms = self.refeed_ms(self.gap_rows)
        return self._gap_ms

    def observe_refeed(self, rows: int, ms: float) -> None:
        """Tokens of `rows` gap rows were fed through the target again in `ms` (device time included): the
        ratio to the model, a plain mean over the first refeeds (the model counting as one), then a
        running one; a ratio counts at most 10 (a refeed of a shape the warm-up did not compile). On the
        H200 (36c0319) a refeed of 234 to 3,382 rows took 26-31 ms (an eager forward), 25x the per-row
        prior at 376 rows, and came about once a run: a running mean at `decay` from that prior never
        caught up."""
        model = self._refeed_model(rows) if rows > 0 else 0.0
        if model <= 0:
            return
        self.refeed_scale = _learn(self.refeed_scale, min(ms / model, 10.0), self.refeed_samples, self.decay)
        self.refeed_samples += 1
        self.priced_out = 0  # (priced on the old scale)

    def ar_ms(self, batch: int) -> float:
        """One AR step as the engine pays it (at least half the table's: the extra is learnt per batch
        bucket, at whichever batch in it came by)."""
        table = self.table.ar_ms(batch)
        return max(table + self.extra.get(("ar", _bucket(batch)), 0.0), 0.5 * table)

    def spec_extra_ms(self, batch: int) -> float:
        """What a speculative step costs beyond its draft and verify on the device."""
        return self.extra.get(("spec", _bucket(batch)), 0.0)

    def calibration(self, budget: int) -> float:
        """Observed over predicted accepted length: overall, and for a budget that was verified, its own
        ratio weighed by its recent steps against `CALIBRATION_PRIOR` steps of the overall one."""
        acc, pred = self.total or (1.0, 1.0)
        overall = acc / pred if pred > 0 else 1.0
        if budget not in self.accepted:
            return overall
        acc, pred, w = self.accepted[budget], self.predicted[budget], self.weight[budget]
        own = acc / pred if pred > 0 else 1.0
        return (w * own + CALIBRATION_PRIOR * overall) / (w + CALIBRATION_PRIOR)

    def observe_burst(self, budget: int, batch: int, tokens: int, ms: float, store_ms: float = 0.0,
                      steps: int = 0) -> None:
        """A burst of `steps` steps of `budget` committed `tokens` to `batch` requests in `ms` (host, from
        its first launch to its last commit; a context store before it is a switch's cost,
        `observe_switch`); `store_ms` of such a store, counted with the burst in `lost` (at most 10x the
        table's store, as a switch's cost)."""
        key, a = (_bucket(batch), budget), RATE_DECAY
        self.tally(budget, batch, tokens, ms)
        self._learnt()
        if steps:
            fit = self.fits.setdefault(key[0], [0.0, 0.0])
            fit[0], fit[1] = fit[0] + steps * self.step_ms(budget, batch), fit[1] + ms
        if store_ms:
            self.stored_ms[key[0]] = self.stored_ms.get(key[0], 0.0) + self._store_sample(key[0], store_ms)
        tokens, ms = tokens / batch, max(ms, 1e-3)
        old = self.realized.get(key)
        self.realized[key] = (tokens, ms) if old is None else ((1 - a) * old[0] + a * tokens, (1 - a) * old[1] + a * ms)

    def tally(self, budget: int, batch: int, tokens: int, ms: float) -> None:
        """Counts a burst of `budget` (0: AR) that committed `tokens` to `batch` requests in `ms`."""
        t = self.totals.setdefault((_bucket(batch), budget), [0, 0.0, 0.0])
        t[0], t[1], t[2] = t[0] + 1, t[1] + tokens / batch, t[2] + ms

    def mean_accepted(self, budget: int) -> float:
        """The accepted length per request and step `budget` should give: the drafter's mean E(b) over the
        run's drafts times what verify steps accepted over what they expected, over the run and pooled
        over the budgets. Every draft carries E of every budget, so the budgets are ranked on the same
        text (a budget's own verify steps are text that happened to come its way): on the H200 at
        85a716d, budget 32's first eight steps (a blind burst on a hard prompt) accepted one token, and
        its own mean kept C=1-2 on budget 8 (auto 0.93x fixed budget 32), and C=16 on budget 4 after a few
        bursts of 8 at the end of runs (0.93x fixed budget 8). (At 5222c67 the drafter's raw E ran ~0.6x
        the accepted length at C=1.)"""
        drafted, drafts = self.drafted.get(budget, (0.0, 0))
        got, promised = (sum(v[i] for v in self.verified.values()) for i in (0, 2))
        return (drafted / drafts if drafts else self.expected[budget]) * (got / promised if promised > 0 else 1.0)

    def step_ms(self, budget: int, batch: int) -> float:
        """A whole speculative step of `budget` as the model prices it: the table's draft and verify, plus
        the learned host extra (at a batch bucket no speculative step has run at yet, the nearest smaller
        one's, as host work grows with the batch)."""
        device = self.table.draft_ms(batch) + self.table.verify_ms(budget, batch)
        key = _bucket(batch)
        seen = [k for (kind, k) in self.extra if kind == "spec" and k <= key]
        return max(device + (self.extra[("spec", max(seen))] if seen else 0.0), 0.5 * device)

    def _learnt(self) -> None:
        """Something was learnt (not an AR burst's tally): `fit` and `_hopeless` judge again."""
        self.lessons += 1
        self.fit_at.clear()

    def fit(self, batch: int) -> float:
        """What the model's steps (`step_ms`) of this batch bucket's timed speculative bursts add up to
        over what the bursts took, starts and drains included: running sums, with FIT_PRIOR_STEPS steps
        (of the smallest budget) of the nearest smaller bucket's fit (else 1). A cost's correction
        only: the tokens the bursts realized follow the text (a hard prompt at C=1 is not a cost)."""
        known = self.fit_at.get(batch)  # (kept until the next burst or step time is learnt)
        if known is not None:
            return known
        key = _bucket(batch)
        smaller = [k for k in self.fits if k < key]
        prior = self.fit(max(smaller)) if smaller else 1.0
        weight = FIT_PRIOR_STEPS * self.step_ms(self.budgets[0], batch)
        modelled, took = self.fits.get(key, (0.0, 0.0))
        self.fit_at[batch] = fit = (modelled + weight * prior) / (took + weight)
        return fit

    def model_rate(self, budget: int, batch: int) -> float:
        """The model's committed tokens per ms and request of `budget`, on run-long figures."""
        return (1 + self.mean_accepted(budget)) / self.step_ms(budget, batch)

    def request_rate(self, budget: int, batch: int, store: bool = False) -> float:
        """Expected committed tokens per ms and request of speculating with `budget` at this batch size,
        on run-long figures: the model's (`model_rate`: `step_ms` at the budget's `mean_accepted`) times
        the bucket's `fit`. With a `store` due (after AR steps), one burst also pays it.

        Not on the recent past: rates realized by each budget's last bursts, or the drafter's last E,
        follow the text, and on the H200 (a802534, run 6 drafter) they sent C=1 to AR stretches of
        hundreds of steps after hard prompts (AR on 3,384 of 5,365 request-steps, auto 0.88x fixed
        budget 32, where every category ran faster speculating), and ranked the budgets by the text they
        happened to run on (at batch 1 budget 8 realized 1.16 and 32 0.94 tokens per ms; fixed, 32 ran
        1.05x 8). Earlier still, the model on recent averages chose budget 8 on 45% of request-steps at
        C=16 where fixed budget 8 ran 0.86x AR (it speculated where the averages ran high, and the steps
        after regressed toward the mean)."""
        rate = self.model_rate(budget, batch) * self.fit(batch)
        if store and self.switch_ms(batch) > 0:  # a burst's tokens per request, over its time and the store's
            tokens = BURST_STEPS * (1 + self.mean_accepted(budget))
            rate = tokens / (tokens / rate + self.switch_ms(batch))
        return rate

    def plan(self, batch: int, gap_rows: int | Callable[[], int] = 0, joined: int = 0) -> int:
        """Before drafting: the budget to speculate with next (0: AR) on run-long figures
        (`request_rate`); a probe (a burst of the budget that looks best, `probing` set) when one is due.
        Nothing known yet: the smallest budget (one blind step). `gap_rows`: rows a switch would feed
        again first (tap-free AR steps'), or a function counting them (`gap_ms`).

        AR steps are `tap_free` (they need not read out the drafter's context) where there is no chance
        for speculation at this batch size (`hopeless`), or at `joined`, the batch size once the prompts
        waiting for a slot are in: on the H200 (46c1975) runs at C=64-128 read out their first bursts,
        while their first prompts were let in a few at a time (2,048 prompt tokens a step). Also where
        the batch has gap rows: a switch refeeds them first either way ("gapped")."""
        self.hopeless = self.tap_free = self.gapped = False
        if not self.budgets:
            return 0
        self._gap_rows, self._gap_ms = gap_rows, None
        budget = self._hopeless_again(batch) if self._still_hopeless(batch) else self._plan(batch, joined)
        if TRACE_PATH:
            self.trace(TRACE_PATH, batch, joined, budget)
        if callable(self._gap_rows):  # (not kept past the plan, nor the requests it counts: `gap_ms` keeps
            self._gap_rows, self._gap_ms = 0, self._gap_ms or 0.0  # what it counted, 0 if the plan did not ask)
        return budget

    def _still_hopeless(self, batch: int) -> bool:
        """The last plan, at this very batch size, found it hopeless, nothing was learnt since, that
        verdict may still be reused (`_hopeless`' memo) and no probe is due: `_plan` would take its
        hopeless way again (which neither ranks budgets nor prices anything there), so `_hopeless_again`
        repeats it without the rest. A plan is made per AR burst, and at C=32-128 on the H200 (89e42b6)
        auto spent ~100-120 us more than plain AR between bursts: on the CPU the plan was the largest
        part of it (~45 us a burst, in a run)."""
        if self.outcome != "hopeless" or self.outcome_batch != batch or self.speculating:
            return False
        memo = self._reusable_verdict(batch, True)
        return memo is not None and memo[0] and self.ar_streak < max(self.max_probe_every, self.look_again,
                                                                     self.priced_out)

    def _hopeless_again(self, batch: int) -> int:
        """`_plan`'s hopeless way, where `_still_hopeless` says it would take it: the same state after."""
        self.hope_memo[(batch, True)][2] -= 1  # (a reuse of the verdict, as `_hopeless` counts them)
        self.hopeless = self.tap_free = True  # (`hopeless_seen` and `speculating` hold as the last plan left them)
        self.interval, self.fresh = self.max_probe_every, False
        self._whole_bursts()
        self.ar_streak += 1
        self._count("hopeless", batch)
        return 0

    def _whole_bursts(self) -> None:
        """Whole AR bursts while a due probe waits for its refeed to be affordable: past the interval, the
        next PROBE_EVERY steps are planned AR too (`ar_steps_ahead`)."""
        if self.ar_streak >= self.interval:
            self.interval = self.ar_streak + PROBE_EVERY

    def _plan(self, batch: int, joined: int) -> int:
        """`plan`, once the gap rows are in place."""
        if self.expected is None:
            self._count("blind", batch)
            return self.budgets[0]
        switching = not self.speculating
        store = switching and not self.fresh  # (after a probe its burst stored the AR stretch already)
        staying = not switching and self.spec_bucket == _bucket(batch)
        ar_rate = 1 / self.ar_ms(batch)
        self.hopeless = self.hopeless_seen[_bucket(batch)] = self._hopeless(batch, switching)
        # (hopeless: the budgets are ranked only for a probe; a plan is made per burst, ~160 times a grid
        # row at C=64 on the H200, and its host time is the GPU's idle time)
        best, best_rate = (None, 0.0) if self.hopeless else self._best(batch, store)
        # Hysteresis: switching between AR and speculation costs a pipeline drain and the drafter's
        # catch-up, so near break-even the policy keeps the mode it is in, at the batch size it chose
        # it for (speculation chosen for the few requests left at the end of a batch is not kept on
        # for the full batch after it). (Also right after a probe, whose burst paid the store: without
        # the margin there, at 36c0319 on the H200, the plan at C=16 took budget 8 on 17% of request-steps,
        # realizing 0.88 tokens per ms against AR's 0.85 in its own accounting, where fixed budget 8 ran
        # 0.83x AR end to end; auto 0.87x AR.)
        if not self.hopeless and best_rate > ar_rate * (SWITCH_MARGIN if switching else 1 / SWITCH_MARGIN
                                                        if staying else 1.0):
            self.probing, self.ar_streak, self.look_again, self.priced_out, self.speculating = False, 0, 0, 0, True
            self.spec_bucket = _bucket(batch)
            self._count("spec", batch)
            return best
        self.speculating = False
        # A probe when due: as often as keeps what probes lose at this batch size within PROBE_LOSS
        # of the AR time (`probe_cap`; per batch bucket: the one or two requests left at the end of a
        # batch may well speculate, which says nothing about the next full batch).
        # Hopeless: only at the longest spacing (the averages may be stale, from hard text, and only a
        # probe's draft renews them). Any probe: only where feeding the rows tap-free steps skipped again
        # costs at most REFEED_LOSS of the AR time since the last one (at batch 128 on the H200, ~0.3 ms
        # of refeed per AR step of 1.6 ms: never; at the end of a run at C=64-128 the batch drains to a
        # size with hope, and a probe there refeeds a few hundred rows in 15-30 ms, for a step or two).
        bucket = _bucket(batch)
        if bucket not in self.intervals:
            best = best or self._best(batch, store)[0]
            self.intervals[bucket] = self.probe_cap(batch, best)
        self.interval = self.max_probe_every if self.hopeless else self.intervals[bucket]
        due = self.ar_streak >= max(self.interval, self.look_again, self.priced_out if self.hopeless else 0)
        if due and self.gap_ms <= REFEED_LOSS * self.ar_streak * self.ar_ms(batch):  # (affordable)
            best = best or self._best(batch, store)[0]
            self.probing, self.ar_streak, self.look_again, self.priced_out = True, 0, 0, 0
            self.intervals[bucket] = min(self.probe_cap(batch, best), PROBE_GROWTH * self.intervals[bucket])
            self._count("probe", batch)
            return best
        if due:  # due, but not affordable yet: priced again PROBE_EVERY AR steps on (`look_again`) ...
            self.look_again = self.ar_streak + PROBE_EVERY
            if self.hopeless:
                # ... and at a hopeless batch size not before the streak that would afford today's refeed:
                # its gaps only grow while its requests run tap-free. (AR bursts of 16 steps priced it on
                # every plan, counting every request's gap rows; this CPU's host-overhead stubs, auto-ar
                # at batch 128: 103 of 161 plans.) At a batch size with hope the usual spacing holds.
                self.priced_out = math.ceil(self.gap_ms / (REFEED_LOSS * self.ar_ms(batch)))
        self._whole_bursts()
        self.ar_streak += 1
        self.fresh = False  # AR steps next: no drafts, the averages grow stale
        self.tap_free = self.hopeless or joined > batch and self.hopeless_at(joined)
        outcome = "hopeless" if self.hopeless else "headed" if self.tap_free else "ar"
        rows = 0 if self.tap_free else self.gap_rows
        burst_rows = batch * min(1 + self.ar_steps_ahead(), AR_BURST_STEPS)
        if rows and self._refeed_forwards(rows + burst_rows) == self._refeed_forwards(rows):
            # A switch from here feeds the batch's gaps again first, at a cost per forward (`_refeed_model`):
            # while this burst's rows fit the forwards that refeed takes anyway, reading them out would
            # spare it little. (On the H200 at 2e2c40b, the tail of a run at C=32, requests all with gaps
            # from tap-free bursts at batch 32, read out 42 of 137 AR bursts, and never speculated.) Past
            # that, the burst reads out: the gaps stop growing, and a probe's refeed with them.
            self.tap_free = self.gapped = True
            outcome = "gapped"
        self._count(outcome, batch)
        return 0

    def trace(self, path: str, batch: int, joined: int, budget: int) -> None:
        """Appends the plan just made to `path`, one JSON line: its outcome and budget, the AR streak and
        probe interval, the run's verify steps, each budget's run-long accepted length and rate
        (`request_rate`, without a store) against AR's, the running E and calibration, and the store a
        switch pays (the gap rows' refeed only where the plan counted them: counting walks the batch)."""
        row = {"plan": sum(self.plans.values()), "batch": batch, "joined": joined, "outcome": self.outcome,
               "budget": budget, "ar_streak": self.ar_streak, "interval": self.interval,
               "verify_steps": sum(v[1] for v in self.verified.values()), "ar_rate": 1 / self.ar_ms(batch),
               "store_ms": self.switch.get(_bucket(batch), self.table.store_ms(_bucket(batch))),
               "gap_ms": self._gap_ms}
        if self.expected is not None:
            row.update({"accepted": {b: self.mean_accepted(b) for b in self.budgets},
                        "rate": {b: self.request_rate(b, batch) for b in self.budgets}, "fit": self.fit(batch),
                        # (what probes are priced on: the running E and calibration, `probe_cap`)
                        "expected": self.expected, "calibration": {b: self.calibration(b) for b in self.budgets}})
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _best(self, batch: int, store: bool) -> tuple[int, float]:
        """The budget with the highest `request_rate` here, and that rate."""
        best, best_rate = self.budgets[0], self.request_rate(self.budgets[0], batch, store)
        for b in self.budgets[1:]:  # ascending: a larger budget must be strictly better
            rate = self.request_rate(b, batch, store)
            if rate > best_rate:
                best, best_rate = b, rate
        return best, best_rate

    def _count(self, outcome: str, batch: int) -> None:
        self.outcome, self.outcome_batch = outcome, batch
        key = f"{outcome}@{_bucket(batch)}"
        self.plans[key] = self.plans.get(key, 0) + 1

    def hope_rate(self, budget: int, batch: int) -> float:
        """Whether speculation can pay at this batch size at all: the model's committed tokens per ms and
        request of `budget` (`step_ms` times the bucket's `fit`) at its accepted length over the run
        (`mean_accepted`), plus HOPE_SPREAD over the root of the run's verified request-steps (all of
        them, pooled: the calibration rests on them; after a long run that margin is small), plus
        TEXT_SPREAD over the square of the batch size (one request's text may yet turn easy; many
        requests' average less). Where no budget's beats the AR step by the margin a plan needs
        (`_hopeless`: SWITCH_MARGIN from AR; after HOPE_EVIDENCE verified request-steps; or, where none
        beats it clearly, the plan's own bursts lost to AR's: `lost`), AR steps do not read out the
        drafter's context (fed again at a switch, should one come): auto runs plain AR's own steps, and
        probes come only every `max_probe_every` AR steps. On the H200 those read-outs cost 3-7% of AR's
        steps at C=32-128, and prefills 5-7% more.

        Meant as a property of the drafter and the batch size rather than of the text now (the drafter's
        E over the run, calibrated over the run): judged on the rates plans compare (realized, or
        the model times what the budgets tried realized), one hard stretch made C=1 hopeless (48d119e:
        61 AR bursts ran tap-free, where fixed budget 32 ran 1.10x AR), and C=64 kept reading out where
        fixed budget 8 ran 0.66x AR (623f5b3, run 5 drafter: auto 0.89x AR)."""
        pooled = self.verified_requests + HOPE_PRIOR_STEPS
        accepted = self.mean_accepted(budget) + HOPE_SPREAD / math.sqrt(pooled) + TEXT_SPREAD / batch ** 2
        return (1 + accepted) / self.step_ms(budget, batch) * self.fit(batch)

    def hopeless_at(self, batch: int) -> bool:
        """No chance for speculation at this batch size: as the last plan at its bucket found (a prompt's
        prefill asks, every step it has one; a plan is made every burst, so at the batch running now this
        is at most a burst old, while a bucket the batch only passes through, as prompts are admitted,
        may answer from an earlier stretch of the run), else judged now."""
        seen = self.hopeless_seen.get(_bucket(batch))
        return self._hopeless(batch) if seen is None else seen

    def _hopeless(self, batch: int, from_ar: bool = True) -> bool:
        """No chance for speculation at this batch size (`hope_rate`); False before the first draft.

        From AR, where no budget's hope beats AR by SWITCH_MARGIN, the margin a plan needs to switch:
        such a batch size would stay on AR anyway, so its AR steps need not read out the drafter's
        context (on the H200 at a112e10, at C=32 the best hope read ~1.02x AR after the tree kernel
        made speculation cheaper: 34 of 125 AR bursts kept reading out, and a probe every ~1,000 steps
        fed their gaps again, for nothing: auto 0.97x AR). While speculating (not `from_ar`): AR's rate,
        the plan's own threshold then. Reused for up to HOPE_MEMO_PLANS plans while nothing is learnt."""
        if not self.budgets or self.expected is None:
            return False
        memo = self._reusable_verdict(batch, from_ar)
        if memo is not None:
            memo[2] -= 1
            return memo[0]
        verdict = self._judge_hope(batch, from_ar)
        self.hope_memo[(batch, from_ar)] = [verdict, self._hope_basis(), HOPE_MEMO_PLANS]
        return verdict

    def _hope_basis(self) -> tuple:
        """What a verdict is judged on: the lessons so far, and the figures a caller may replace wholesale."""
        return self.lessons, self.expected, self.verified, self.table

    def _reusable_verdict(self, batch: int, from_ar: bool) -> list | None:
        """The memo entry [verdict, basis, reuses left] of `_hopeless` at this batch size, if it may serve
        again (reuses left, nothing learnt or replaced since); else None."""
        memo = self.hope_memo.get((batch, from_ar))
        if memo is None or memo[2] <= 0:
            return None
        basis = memo[1]
        if basis[0] != self.lessons or not all(a is b for a, b in zip(basis[1:], self._hope_basis()[1:])):
            return None
        return memo

    def _judge_hope(self, batch: int, from_ar: bool) -> bool:
        ar_rate = 1 / self.ar_ms(batch)
        hope = max(self.hope_rate(b, batch) for b in self.budgets)
        evidence = self.verified_requests >= HOPE_EVIDENCE
        below = hope < (SWITCH_MARGIN if from_ar else 1.0) * ar_rate
        return (evidence and below and not self.won(batch)) or (hope < SWITCH_MARGIN * ar_rate and self.lost(batch))

    def lost(self, batch: int) -> bool:
        """Speculation at this batch bucket, all its timed bursts (at least HOPE_BURSTS) and the stores
        before them together, realized fewer tokens per ms and request than the AR bursts there (or
        than the AR step's cost, none timed yet): running sums, undecayed. At C=16-32 on the H200
        (623f5b3) it made them hopeless on 161 of 169 plans at batch 16 and 109 of 121 at 32 (auto 0.96x
        AR at C=16 and 32; 0.90x at 48d119e, where bursts of budgets 4-16 had realized 0.94x AR's, each
        a near-tie that kept the AR steps reading out); alone, without the model's say (`hope_rate`),
        it made C=1 hopeless after a blind step and a few probes (0.85x fixed budget 32). (Undecayed, and
        tap-free AR bursts count with AR's: a batch size this makes hopeless stays so until probes'
        bursts, at most one every `max_probe_every` AR steps, outweigh its sums.)"""
        got = self._spec_against_ar(batch)
        return got is not None and got[0] < got[1]

    def won(self, batch: int) -> bool:
        """`lost`'s mirror: the bucket's timed speculative bursts (at least HOPE_BURSTS), stores included,
        realized SWITCH_MARGIN more tokens per ms and request than its AR bursts. The model alone does
        not make such a batch size hopeless: its run-long accepted length follows the texts so far, and
        at C=16 on the H200 (c038e9b, a fresh policy) the first 16 MT-Bench prompts (writing, roleplay)
        held it at 1.03x AR where the bucket's 5 bursts of budget 8 had realized 1.08x AR's: hopeless
        after 8 speculative plans, auto 0.99x AR where fixed budget 8 ran 1.08x."""
        got = self._spec_against_ar(batch)
        return got is not None and got[0] > SWITCH_MARGIN * got[1]

    def _spec_against_ar(self, batch: int) -> tuple[float, float] | None:
        """The tokens per request the bucket's timed speculative bursts committed (running sums,
        undecayed), and what its AR bursts' rate (or the AR step's cost, none timed yet) commits in their
        time and the stores before them; None before HOPE_BURSTS speculative bursts."""
        key = _bucket(batch)
        spec = [t for (k, b), t in self.totals.items() if k == key and b > 0]
        if sum(t[0] for t in spec) < HOPE_BURSTS:
            return None
        ar = self.totals.get((key, 0))
        ar_rate = ar[1] / ar[2] if ar and ar[2] > 0 else 1 / self.ar_ms(batch)
        return sum(t[1] for t in spec), ar_rate * (sum(t[2] for t in spec) + self.stored_ms.get(key, 0.0))

    def probe_cap(self, batch: int, budget: int | None = None) -> int:
        """AR steps between probes: enough that a probe's loss against AR (a burst of `budget`, default
        the smallest, less the AR time of the tokens it commits) stays within `PROBE_LOSS` of the AR
        time, from PROBE_EVERY to `max_probe_every`. On the H200 a probe at batch 1 costs about what it
        commits (every 16 steps); at 32 and more its steps cost ~3 AR steps for ~2 tokens (hundreds)."""
        if self.expected is None:  # (nothing drafted yet: `plan` drafts blind first)
            return self.probe_every
        b = budget or self.budgets[0]
        ar = self.ar_ms(batch)
        tokens = BURST_STEPS * (1 + self.calibration(b) * self.expected[b])  # per request
        got = self.realized.get((_bucket(batch), b))  # (its bursts' rate as measured: steadier than now's E)
        if got:  # a probe comes from AR: it pays the context store too
            spent = tokens / _rate(got) + self.switch_ms(batch)
        else:
            spent = tokens / self.request_rate(b, batch, store=True)
        loss = max(spent - tokens * ar, 0.0)  # ms per request
        return int(min(self.max_probe_every, max(self.probe_every, loss / (PROBE_LOSS * ar))))

    def ar_steps_ahead(self) -> int:
        """After `plan` said AR: how many more steps it will say so (until a probe is due;
        without new drafts nothing else changes its answer)."""
        return max(0, self.interval - self.ar_streak)

    def skip_ar(self, steps: int) -> None:
        """Count AR steps taken without asking `plan` (an AR burst)."""
        self.ar_streak += steps

    def state(self) -> dict:
        """What the policy has learned, for benchmark rows (JSON-ready)."""
        return {"table": self.table.as_dict(), "extra_ms": {f"{k}@{b}": v for (k, b), v in sorted(self.extra.items())},
                "switch_ms": dict(sorted(self.switch.items())),
                "refeed": {"fixed_ms": self.refeed_fixed_ms, "row_ms": self.refeed_row_ms,
                           "forward_rows": self.refeed_forward_rows, "scale": self.refeed_scale},
                "expected": self.expected,
                "calibration": {b: self.calibration(b) for b in self.budgets},
                # tokens per ms and request of each budget's recent bursts (RATE_DECAY)
                "realized": {f"{b}@{k}": round(_rate(v), 4) for (k, b), v in sorted(self.realized.items())},
                "probe_intervals": dict(sorted(self.intervals.items())),
                # per batch bucket: the model's step cost and what its timed bursts took, summed, and `fit`
                "fits": {k: [round(m, 2), round(t, 2), round(self.fit(k), 4)]
                         for k, (m, t) in sorted(self.fits.items())},
                "plans": dict(sorted(self.plans.items())), "stored_ms": dict(sorted(self.stored_ms.items())),
                # accepted length per request summed, verify steps, the drafter's E(b) for them summed
                "verified": {b: [round(acc, 2), n, round(e, 2)] for b, (acc, n, e) in sorted(self.verified.items())},
                "verified_requests": self.verified_requests,
                # every draft's E(b) per request summed, drafts (their mean is `mean_accepted`'s base)
                "drafted": {b: [round(e, 2), n] for b, (e, n) in sorted(self.drafted.items())},
                # every timed burst of each budget at each batch bucket: bursts, tokens per request, ms
                "totals": {f"{b}@{k}": [n, round(tokens, 2), round(ms, 2)] for (k, b), (n, tokens, ms)
                           in sorted(self.totals.items())}}

    def record_draft(self, batch: int, expected: dict[int, float]) -> None:
        """A draft's E(b) summed over the batch, into the running means `plan` compares. A probe's
        draft replaces them: they are as old as the AR stretch before it (no drafts), and blended in at
        `decay` one probe could hardly move them, which kept the policy on AR where speculation paid."""
        a = self.decay
        mean = {b: e / batch for b, e in expected.items()}
        for b in self.budgets:
            total = self.drafted.setdefault(b, [0.0, 0])
            total[0], total[1] = total[0] + mean[b], total[1] + 1
        self.fresh = True
        self._learnt()
        self.expected = mean if self.expected is None or self.probing else \
            {b: (1 - a) * self.expected[b] + a * mean[b] for b in self.budgets}

    def choose(self, batch: int, expected: dict[int, float]) -> int:
        """After drafting: `expected[b]`, the drafter's E(b) summed over the batch. Returns the budget
        with the most expected tokens per remaining millisecond (0: AR, the draft thrown away)."""
        self.record_draft(batch, expected)
        t = self.table
        best, best_rate = 0, batch / self.ar_ms(batch)
        extra = max(0.0, self.spec_extra_ms(batch))  # the draft is paid; its host share is a guess, counted whole
        for b in self.budgets:  # ascending: a larger budget must be strictly better
            rate = (batch + self.calibration(b) * expected[b]) / (t.verify_ms(b, batch) + extra)
            if rate > best_rate:
                best, best_rate = b, rate
        # A probe verifies the smallest tree anyway, and so does the `probe_every`-th draft in a row that
        # would be thrown away (the plan, on run-long figures, said speculate): the calibration only learns
        # from verified steps, so without this a drafter that looked bad once could keep the policy on AR
        # for good.
        self.overruled = self.overruled + 1 if best == 0 and not self.probing else 0
        if best == 0 and (self.probing or self.overruled >= self.probe_every):
            best, self.overruled = self.budgets[0], 0
        elif best == 0:
            self.speculating = False  # the draft says AR after all: the next plan starts from AR
        self.probing = False
        return best

    def observe(self, budget: int, batch: int, predicted: float, accepted: int) -> None:
        """A verify step of `budget` accepted `accepted` draft tokens over the batch where the drafter
        expected `predicted`."""
        a = self.decay
        p, q = predicted / batch, accepted / batch
        total = self.verified.setdefault(budget, [0.0, 0, 0.0])
        total[0], total[1], total[2] = total[0] + q, total[1] + 1, total[2] + p
        self.verified_requests += batch
        self._learnt()
        if budget not in self.accepted:
            self.accepted[budget], self.predicted[budget] = q, p
        else:
            self.accepted[budget] = (1 - a) * self.accepted[budget] + a * q
            self.predicted[budget] = (1 - a) * self.predicted[budget] + a * p
        for b in self.weight:
            self.weight[b] *= 1 - a
        self.weight[budget] = self.weight.get(budget, 0.0) + 1.0
        acc, pred = self.total or (q, p)
        self.total = ((1 - a) * acc + a * q, (1 - a) * pred + a * p)


def _learn(old: float, sample: float, n: int, decay: float) -> float:
    """`old`, the mean of `n` samples, with `sample` in: a plain mean while there are few (a cost seen
    only a few times a run is learnt from its first samples), a running one at `decay` after."""
    a = max(decay, 1 / (n + 1))
    return (1 - a) * old + a * sample


def _rate(realized: tuple[float, ...]) -> float:
    """Tokens per ms and request of a `realized` entry: its running sums' ratio."""
    return max(realized[0] / realized[1], 1e-6)


def _bucket(batch: int) -> int:
    """The power of two at or above `batch`: host costs are kept per bucket, as the CUDA graphs are."""
    return 1 << (batch - 1).bit_length()
