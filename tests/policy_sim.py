"""A synthetic serving loop for `Policy` (speculative/policy.py), driven as speculative/auto.py drives it on the GPU:
plain AR's steps where the batch size is hopeless (each request's drafter context then has a gap, fed
through the target again at a switch), else the plan's budget: AR bursts that read out the context, or
speculative bursts of SPEC_BURST steps. The text's difficulty changes every segment and the drafter is
overconfident and noisy; the same text runs under plain AR and every fixed budget, so the policy's
tokens per ms can be compared with theirs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ddtree.speculative.costs import CostTable
from ddtree.speculative.policy import Policy

AR_BURST = 16  # (ddtree/engine/ar.py DECODE_BURST)
SPEC_BURST = 8  # (ddtree/speculative/decode.py)
SHARE = {4: 0.6, 8: 0.8, 16: 0.92, 32: 1.0}  # a budget's accepted length, as a share of budget 32's
REFEED = (20.0, 0.005)  # ms: a refeed's eager forward, and per row (the H200's, roughly)


@dataclass
class Regime:
    """One batch size's costs (ms) and its text: segments of `segment` tokens whose mean accepted
    length (budget 32) is drawn from `accepted` (uniform); the drafter's E is `over` x that, times
    log-normal noise of `noise`, per step. `readout`: an AR step that reads out the drafter's context
    costs this share more than plain AR's."""
    batch: int
    ar_ms: float
    step_ms: dict[int, float]  # a whole speculative step (draft and verify) by budget
    switch_ms: float  # a switch from AR: the AR stretch's context store
    accepted: tuple[float, float] = (0.2, 2.6)
    segment: int = 48
    over: float = 1.4
    noise: float = 0.5
    seed: int = 0
    readout: float = 0.05
    refeed_ms: tuple[float, float] = REFEED
    difficulty: list[float] = field(default_factory=list)  # per segment, drawn as the text grows

    def mean_accepted(self, pos: float, budget: int) -> float:
        pos = int(pos)
        while len(self.difficulty) <= pos // self.segment:
            self.difficulty.append(random.Random(self.seed * 7919 + len(self.difficulty)).uniform(*self.accepted))
        return self.difficulty[pos // self.segment] * SHARE[budget]

    def table(self) -> CostTable:
        return CostTable([self.batch], [self.ar_ms], [0.0], {b: [ms] for b, ms in self.step_ms.items()},
                         [self.switch_ms])


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
    """Tokens per ms of always `budget` (0: plain AR) over the first `tokens` tokens of the text."""
    pos, ms = 0, 0.0
    while pos < tokens:
        if budget == 0:
            pos, ms = pos + 1, ms + r.ar_ms
        else:
            pos, ms = pos + 1 + r.mean_accepted(pos, budget), ms + r.step_ms[budget]
    return pos * r.batch / ms


def new_policy(table: CostTable, budgets, refeed=REFEED) -> Policy:
    policy = Policy(table, [0, *budgets], burst_steps=SPEC_BURST)
    policy.costs.set_refeed(*refeed)
    return policy


def run_policy(r: Regime, tokens: int, policy: Policy | None = None) -> tuple[float, Policy]:
    """Tokens per ms of the policy over the same text (every request of the batch at one position)."""
    policy = policy or new_policy(r.table(), r.step_ms, r.refeed_ms)
    noise = random.Random(r.seed + 1)
    pos, ms, from_ar, gap = 0.0, 0.0, False, 0  # (the prefill stored the prompts' context)
    while pos < tokens:
        if policy.hopeless(r.batch):  # plain AR's steps
            pos, ms, gap = pos + AR_BURST, ms + AR_BURST * r.ar_ms, gap + AR_BURST
            continue
        budget = policy.plan(r.batch, lambda: (gap * r.batch, tokens - pos))
        if budget == 0:
            if gap:  # (AR stays plain where a switch refeeds anyway)
                pos, ms, gap = pos + AR_BURST, ms + AR_BURST * r.ar_ms, gap + AR_BURST
                continue
            ar = AR_BURST * r.ar_ms * (1 + r.readout)
            policy.observe_burst(0, r.batch, AR_BURST, AR_BURST * r.batch, ar)
            pos, ms, from_ar = pos + AR_BURST, ms + ar, True
            continue
        if gap:
            refeed = r.refeed_ms[0] + gap * r.batch * r.refeed_ms[1]
            policy.observe_refeed(gap * r.batch, refeed)
            ms, gap, from_ar = ms + refeed, 0, True
        if from_ar:
            policy.observe_store(r.batch, r.switch_ms)
            ms, from_ar = ms + r.switch_ms, False
        start, t = pos, 0.0
        steps = SPEC_BURST if policy.acceptance.known else 1
        for _ in range(steps):
            accepted = r.mean_accepted(int(pos), budget)
            expected = {b: r.over * r.mean_accepted(int(pos), b) * noise.lognormvariate(0, r.noise) for b in r.step_ms}
            policy.observe_step(budget, r.batch, {b: e * r.batch for b, e in expected.items()}, accepted * r.batch)
            pos, t = pos + 1 + accepted, t + r.step_ms[budget]
        policy.observe_burst(budget, r.batch, steps, (pos - start) * r.batch, t if steps > 1 else None)
        ms += t
    return pos * r.batch / ms, policy


# ----------------------------------------------------------------------------- batches run to completion

# A cost table auto measured on the H200 for the default pair (ms), with a switch's store; where it comes
# from: docs/auto.md (the H200 table).
H200_TABLE = CostTable(
    [1, 2, 4, 8, 16, 32, 64, 128],
    [0.871, 1.065, 1.064, 1.067, 1.104, 1.168, 1.267, 1.412],
    [0.552, 0.586, 0.604, 0.653, 0.780, 1.034, 1.559, 2.554],
    {4: [1.296, 1.279, 1.300, 1.363, 1.473, 1.779, 2.395, 3.104],
     8: [1.398, 1.290, 1.352, 1.580, 1.665, 2.073, 2.956, 4.677],
     16: [1.313, 1.335, 1.451, 1.642, 2.087, 2.824, 4.646, 7.479],
     32: [1.460, 1.432, 1.678, 2.018, 2.682, 4.635, 7.344, 12.981]},
    [2.02, 2.04, 2.08, 2.16, 2.32, 2.64, 3.28, 4.56])


@dataclass
class Batches:
    """`batches` batches of `concurrency` requests run to completion, as `ddtree bench sweep` runs them:
    each request wants a length drawn from `lengths` and has text of its own (segments as in `Regime`);
    a switch from AR stores `switch_ms` + `switch_row_ms` per request, and feeds gaps again at REFEED."""
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
    readout: float = 0.0  # an AR step that reads out the drafter's context costs this share more than plain AR's

    def mean_accepted(self, request: int, pos: float, budget: int) -> float:
        rng = random.Random(f"{self.seed}-{request}-{int(pos) // self.segment}")
        return rng.uniform(*self.accepted) * SHARE[budget]

    def length(self, request: int) -> int:
        return random.Random(f"{self.seed}-{request}-length").randint(*self.lengths)

    def step_ms(self, budget: int, batch: int) -> float:
        t = self.table
        return t.ar_ms(batch) if budget == 0 else t.draft_ms(batch) + t.verify_ms(budget, batch)


def run_batches(w: Batches, budget: int | None, policy: Policy | None = None) -> float:
    """Tokens per ms over all the batches: AR (`budget` 0), a fixed budget, or (`budget` None) the policy
    driving bursts as the engine does (a burst ends a step after a request finishes)."""
    if budget is None:
        policy = policy or new_policy(w.table, SHARE)
    noise = random.Random(w.seed + 1)
    tokens, ms = 0.0, 0.0
    for k in range(w.batches):
        ids = [k * w.concurrency + i for i in range(w.concurrency)]
        want = {i: w.length(i) for i in ids}
        pos = {i: 0.0 for i in ids}
        gap = dict.fromkeys(ids, 0)  # rows each request's drafter context lacks
        from_ar = False
        while any(pos[i] < want[i] for i in ids):
            live = [i for i in ids if pos[i] < want[i]]
            B = len(live)
            if budget is not None:
                b, plain = budget, False
            elif policy.hopeless(B):
                b, plain = 0, True
            else:
                b = policy.plan(B, lambda: (sum(gap[i] for i in live), sum(want[i] - pos[i] for i in live) / B))
                plain = b == 0 and any(gap[i] for i in live)
            if b == 0:
                n = 0
                for _ in range(1 if budget is not None else AR_BURST):
                    n += 1
                    for i in live:
                        pos[i] += 1
                        gap[i] += plain
                    if any(pos[i] >= want[i] for i in live):
                        break
                step = n * w.step_ms(0, B) * (1 if plain or budget is not None else 1 + w.readout)
                if budget is None and not plain:
                    policy.observe_burst(0, B, n, n * B, step)
                tokens, ms, from_ar = tokens + n * B, ms + step, from_ar or not plain
                continue
            extra = 0.0
            if budget is None:
                rows = sum(gap[i] for i in live)
                if rows:
                    extra += REFEED[0] + rows * REFEED[1]
                    policy.observe_refeed(rows, extra)
                    gap.update(dict.fromkeys(live, 0))
                if from_ar or rows:
                    store = w.switch_ms + w.switch_row_ms * B
                    policy.observe_store(B, store)
                    extra += store
            t, got, n = 0.0, 0.0, 0
            steps = 1 if budget is not None or not policy.acceptance.known else SPEC_BURST
            for _ in range(steps):
                n += 1
                acc = {i: w.mean_accepted(i, pos[i], b) for i in live}
                if budget is None:
                    e = {c: sum(w.over * w.mean_accepted(i, pos[i], c) * noise.lognormvariate(0, w.noise)
                                for i in live) for c in SHARE}
                    policy.observe_step(b, B, e, sum(acc.values()))
                for i in live:
                    pos[i] += 1 + acc[i]
                got, t = got + sum(1 + a for a in acc.values()), t + w.step_ms(b, B)
                if any(pos[i] >= want[i] for i in live):
                    break
            if budget is None:
                policy.observe_burst(b, B, n, got, t if n >= 4 else None)
            tokens, ms, from_ar = tokens + got, ms + extra + t, False
    return tokens / ms


# ----------------------------------------------------------------------------- noisy bursts, one batch size

def run_noisy_bursts(advantage: float, seed: int, plans: int = 3000, sigma: float = 0.3) -> float:
    """Tokens per ms over AR's at batch 1, where a speculative burst realizes `advantage` x AR's rate
    times log-normal noise of `sigma` (the spread of bursts at C=1 on the H200; its verify steps accept
    that evenly) and the drafter's E says nothing about it."""
    ar = 0.87
    table = CostTable([1], [ar], [0.55], {b: [1.45] for b in SHARE}, [2.5])
    policy = new_policy(table, SHARE)
    rng = random.Random(seed)
    ms = tokens = 0.0
    from_ar = False  # (the prefill stored the prompt's context)
    for _ in range(plans):
        budget = 0 if policy.hopeless(1) else policy.plan(1)
        if budget == 0:
            policy.observe_burst(0, 1, AR_BURST, AR_BURST)
            ms, tokens, from_ar = ms + AR_BURST * ar, tokens + AR_BURST, True
            continue
        if from_ar:  # a switch: the AR stretch's context store first
            policy.observe_store(1, 2.5)
            ms, from_ar = ms + 2.5, False
        steps = SPEC_BURST if policy.acceptance.known else 1
        expected = {b: 1.5 * rng.lognormvariate(0, 0.3) for b in SHARE}
        t = steps * 2.0
        got = t * advantage / ar * rng.lognormvariate(0, sigma)
        for _ in range(steps):  # (what the burst's verify steps accepted, evenly)
            policy.observe_step(budget, 1, expected, got / steps - 1)
        policy.observe_burst(budget, 1, steps, got, t if steps > 1 else None)
        ms, tokens = ms + t, tokens + got
    return tokens / ms * ar
