"""A synthetic serving loop for `AdaptivePolicy`: the policy plans, AR runs in bursts, speculation in
bursts of SPEC_BURST steps, as spec/auto.py and the engine drive it on the GPU, against text whose
difficulty changes every segment and a drafter that is overconfident and noisy. The same text runs
under plain AR and every fixed budget, so the policy's tokens per ms can be compared with theirs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ddtree.spec.adaptive import BURST_STEPS as SPEC_BURST, AdaptivePolicy
from ddtree.spec.costs import CostTable

AR_BURST = 16  # (ddtree/engine/ar.py DECODE_BURST)
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
    # A refeed (ms): fixed per forward and per row. Set: tap-free AR steps (a hopeless plan) leave a gap
    # that a switch back feeds through the target again first, as spec/auto.py does; None: no gaps.
    refeed_ms: tuple[float, float] | None = None

    def mean_accepted(self, pos: float, budget: int) -> float:
        pos = int(pos)
        while len(self.difficulty) <= pos // self.segment:
            self.difficulty.append(random.Random(self.seed * 7919 + len(self.difficulty)).uniform(*self.accepted))
        return self.difficulty[pos // self.segment] * SHARE[budget]

    def table(self) -> CostTable:
        return CostTable([self.batch], [self.ar_ms], [0.0], {b: [ms] for b, ms in self.step_ms.items()})


@dataclass
class HardStart(Regime):
    """Text that is hard for its first `hard` tokens (a first prompt with nothing accepted, then prompts
    at `accepted`, near break-even) and easier after (`easy`)."""
    hard: int = 3500
    easy: tuple[float, float] = (1.5, 3.2)

    def mean_accepted(self, pos: float, budget: int) -> float:
        pos = int(pos)
        span = (0.0, 0.05) if pos < 60 else self.accepted if pos < self.hard else self.easy
        return random.Random(self.seed * 31 + pos // self.segment).uniform(*span) * SHARE[budget]


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
    if r.refeed_ms:
        policy.set_refeed_cost(*r.refeed_ms)
    noise = random.Random(r.seed + 1)
    pos, ms, from_ar, gap = 0.0, 0.0, False, 0  # (the prefill stored the prompts' context)
    while pos < tokens:
        budget = policy.plan(r.batch, gap * r.batch)
        if budget == 0:
            steps = min(AR_BURST, 1 + policy.ar_steps_ahead())
            policy.skip_ar(steps - 1)
            gap += steps if r.refeed_ms and policy.tap_free else 0
            pos, ms, from_ar = pos + steps, ms + steps * r.ar_ms, True
            continue
        if gap:
            refeed = r.refeed_ms[0] + gap * r.batch * r.refeed_ms[1]
            policy.observe_refeed(gap * r.batch, refeed)
            ms, gap = ms + refeed, 0
        start, store = pos, (r.switch_ms if from_ar else 0.0)
        if from_ar:
            policy.observe_switch(r.batch, store)
        t = 0.0
        verified = 0
        for _ in range(1 if policy.expected is None else SPEC_BURST):
            accepted = r.mean_accepted(int(pos), budget)
            expected = {b: r.over * r.mean_accepted(int(pos), b) * noise.lognormvariate(0, r.noise) for b in r.step_ms}
            policy.record_draft(r.batch, {b: e * r.batch for b, e in expected.items()})
            policy.probing = False
            policy.observe(budget, r.batch, expected[budget] * r.batch, accepted * r.batch)
            verified += 1
            pos, t = pos + 1 + accepted, t + r.step_ms[budget]
        if verified > 1:  # (as spec/auto.py: not the first, blind, one-step burst)
            policy.observe_burst(budget, r.batch, (pos - start) * r.batch, t)
        ms, from_ar = ms + store + t, False
    return pos * r.batch / ms, policy


# ----------------------------------------------------------------------------- batches run to completion

# The cost table auto measured on the H200 at 72bc674 (ms; `results/h200_72bc674_grid/`).
H200_TABLE = CostTable(
    [1, 2, 4, 8, 16, 32, 64, 128],
    [0.871, 1.065, 1.064, 1.067, 1.104, 1.168, 1.267, 1.412],
    [0.552, 0.586, 0.604, 0.653, 0.780, 1.034, 1.559, 2.554],
    {4: [1.296, 1.279, 1.300, 1.363, 1.473, 1.779, 2.395, 3.104],
     8: [1.398, 1.290, 1.352, 1.580, 1.665, 2.073, 2.956, 4.677],
     16: [1.313, 1.335, 1.451, 1.642, 2.087, 2.824, 4.646, 7.479],
     32: [1.460, 1.432, 1.678, 2.018, 2.682, 4.635, 7.344, 12.981]})


@dataclass
class Batches:
    """`batches` batches of `concurrency` requests run to completion, as `ddtree bench sweep` runs them:
    each request wants a length drawn from `lengths` and has text of its own (segments as in `Regime`);
    a switch from AR stores `switch_ms` + `switch_row_ms` per request."""
    concurrency: int
    batches: int = 6
    lengths: tuple[int, int] = (60, 128)
    accepted: tuple[float, float] = (0.8, 2.2)
    segment: int = 48
    over: float = 1.4
    noise: float = 0.5
    switch_ms: float = 2.0
    switch_row_ms: float = 0.02
    seed: int = 0
    table: CostTable = field(default_factory=lambda: H200_TABLE)
    readout: float = 0.0  # an AR step that reads out the drafter's context costs this share more (not tap-free)

    def mean_accepted(self, request: int, pos: float, budget: int) -> float:
        rng = random.Random(f"{self.seed}-{request}-{int(pos) // self.segment}")
        return rng.uniform(*self.accepted) * SHARE[budget]

    def length(self, request: int) -> int:
        return random.Random(f"{self.seed}-{request}-length").randint(*self.lengths)

    def step_ms(self, budget: int, batch: int) -> float:
        t = self.table
        return t.ar_ms(batch) if budget == 0 else t.draft_ms(batch) + t.verify_ms(budget, batch)


def run_batches(w: Batches, budget: int | None, policy: AdaptivePolicy | None = None):
    """Tokens per ms over all the batches: AR (`budget` 0), a fixed budget, or (`budget` None) the policy
    driving bursts as the engine does (an AR burst or a speculative one ends a step after a request
    finishes)."""
    if budget is None:
        policy = policy or AdaptivePolicy(w.table, [0, 4, 8, 16, 32])
    noise = random.Random(w.seed + 1)
    tokens, ms = 0.0, 0.0
    for k in range(w.batches):
        ids = [k * w.concurrency + i for i in range(w.concurrency)]
        want = {i: w.length(i) for i in ids}
        pos = {i: 0.0 for i in ids}
        from_ar = False
        while any(pos[i] < want[i] for i in ids):
            live = [i for i in ids if pos[i] < want[i]]
            B = len(live)
            b = budget if budget is not None else policy.plan(B)
            if b == 0:
                steps = 1 if budget is not None else min(16, 1 + policy.ar_steps_ahead())
                n = 0
                for _ in range(steps):
                    n += 1
                    for i in live:
                        pos[i] += 1
                    if any(pos[i] >= want[i] for i in live):
                        break
                if budget is None:
                    policy.skip_ar(n - 1)
                extra = w.readout if budget is None and not policy.tap_free else 0.0
                tokens, ms, from_ar = tokens + n * B, ms + n * w.step_ms(0, B) * (1 + extra), True
                continue
            store = (w.switch_ms + w.switch_row_ms * B) if budget is None and from_ar else 0.0
            if store:
                policy.observe_switch(B, store)
            t = 0.0
            steps = 1 if budget is not None or policy.expected is None else SPEC_BURST
            got, verified = 0.0, 0
            for _ in range(steps):
                acc = {i: w.mean_accepted(i, pos[i], b) for i in live}
                if budget is None:
                    e = {c: sum(w.over * w.mean_accepted(i, pos[i], c) * noise.lognormvariate(0, w.noise)
                                for i in live) for c in SHARE}
                    policy.record_draft(B, e)
                    policy.probing = False
                    policy.observe(b, B, e[b], sum(acc.values()))
                    verified += 1
                for i in live:
                    pos[i] += 1 + acc[i]
                got, t = got + sum(1 + a for a in acc.values()), t + w.step_ms(b, B)
                if any(pos[i] >= want[i] for i in live):
                    break
            if budget is None and verified >= 4:
                policy.observe_burst(b, B, got, t)
            tokens, ms, from_ar = tokens + got, ms + store + t, False
    return tokens / ms


# ----------------------------------------------------------------------------- noisy bursts, one batch size

def run_noisy_bursts(advantage: float, seed: int, plans: int = 3000, sigma: float = 0.3) -> float:
    """Tokens per ms over AR's at batch 1, where a speculative burst realizes `advantage` x AR's rate
    times log-normal noise of `sigma` (the spread of bursts at C=1 on the H200; its verify steps accept
    that evenly) and the drafter's E says nothing about it. The plan stops speculating after bad bursts, so an estimate that weighs the last
    ones most is biased low (at C=1 on the H200 auto ran AR on 93% of request-steps where fixed budget
    32 ran 1.07x)."""
    ar = 0.87
    table = CostTable([1], [ar], [0.55], {b: [1.45] for b in SHARE})
    policy = AdaptivePolicy(table, [0, *SHARE])
    rng = random.Random(seed)
    ms = tokens = 0.0
    from_ar = False  # (the prefill stored the prompt's context)
    for _ in range(plans):
        budget = policy.plan(1)
        if budget == 0:
            steps = min(AR_BURST, 1 + policy.ar_steps_ahead())
            policy.skip_ar(steps - 1)
            ms, tokens, from_ar = ms + steps * ar, tokens + steps, True
            continue
        if from_ar:  # a switch: the AR stretch's context store first
            policy.observe_switch(1, 2.5)
            ms, from_ar = ms + 2.5, False
        blind = policy.expected is None
        steps = 1 if blind else SPEC_BURST
        expected = {b: 1.5 * rng.lognormvariate(0, 0.3) for b in SHARE}
        t = steps * 2.0
        got = t * advantage / ar * rng.lognormvariate(0, sigma)
        for _ in range(steps):  # (what the burst's verify steps accepted, evenly)
            policy.record_draft(1, expected)
            policy.probing = False
            policy.observe(budget, 1, expected[budget], got / steps - 1)
        if not blind:  # (as spec/auto.py: not the first, one-step burst)
            policy.observe_burst(budget, 1, got, t, steps=steps)
        ms, tokens = ms + t, tokens + got
    return tokens / ms * ar
