"""Host time of auto's plan where speculation is hopeless and a probe is due but never affordable: the
state a grid leaves at C=32-128 (the run-long AR streak past MAX_PROBE_EVERY, every request with a gap
whose refeed costs far more than REFEED_LOSS of the AR time), with AR bursts of ~4 steps, as at C=128
on the H200. CPU only; no model.

    python benchmarks/plan_cost.py [BATCH] [PLANS]

On the CPU machine (2 cores), batch 128, runs of 3,000 plans: 39.5-45.0 us a plan before d9cfc86 (every
plan past the due one counted every request's gap rows to price the refeed again), 9.0-18.7 from d9cfc86
to c038e9b (priced again every PROBE_EVERY AR steps), 5.4-9.8 at 149bbe0 (`priced_out`: not again before
the AR streak that would afford today's refeed).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from ddtree.engine.sequence import Sequence  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.spec.context import context_of  # noqa: E402
from ddtree.spec.draft import gap_rows  # noqa: E402
from test_adaptive import late_61b7355_policy  # noqa: E402


def main() -> int:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    plans = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    seqs = [Sequence([1] * 200, SamplingParams(), None, block_table=[0] * 16, num_cached=300) for _ in range(batch)]
    for s in seqs:
        context_of(s).open_gap(10)  # (tap-free since early in the prompt: 290 rows to feed again each)
    policy = late_61b7355_policy()  # hopeless from batch 16 up
    policy.plan(batch)
    policy.ar_streak = 2 * policy.max_probe_every  # a probe long due
    t0 = time.perf_counter()
    for _ in range(plans):
        policy.plan(batch, lambda: sum(map(gap_rows, seqs)), batch)
        policy.skip_ar(3)
    us = (time.perf_counter() - t0) / plans * 1e6
    print(f"batch {batch}: {us:.1f} us a plan over {plans} plans ({policy.plans})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
