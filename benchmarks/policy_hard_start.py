"""auto's policy in the simulator (tests/policy_sim.py) on a hard start at batch 1: a first prompt with
nothing accepted, 3,500 tokens near break-even, then easy text; the H200's batch-1 costs (AR 0.87 ms, a
whole step 1.58-1.66 ms) and refeeds of 25 ms a forward. Prints, per text and switch cost, the policy's
tokens per ms over the best fixed mode's (AR or a budget), mean and worst over the seeds.

    python benchmarks/policy_hard_start.py [SEEDS]
"""
from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from policy_sim import HardStart, run_fixed, run_policy  # noqa: E402

TOKENS = 10000


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    print(f"{'accepted':>12} {'switch ms':>9} {'mean':>6} {'worst':>6}")
    for accepted, switch in itertools.product([(0.6, 1.6), (0.3, 1.3), (0.8, 1.2)], [1.2, 2.4, 4.0]):
        ratios = []
        for seed in range(seeds):
            r = HardStart(1, 0.87, {4: 1.58, 8: 1.6, 16: 1.61, 32: 1.66}, switch_ms=switch, accepted=accepted,
                          seed=seed, over=1.0, refeed_ms=(25.0, 0.002), readout=0.01)
            best = max(run_fixed(r, b, TOKENS) for b in [0, *r.step_ms])
            ratios.append(run_policy(r, TOKENS)[0] / best)
        print(f"{str(accepted):>12} {switch:>9} {sum(ratios) / len(ratios):>6.3f} {min(ratios):>6.3f}")


if __name__ == "__main__":
    main()
