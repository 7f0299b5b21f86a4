"""auto's refeed (target features of tokens already in the cache, fed again at a switch) through the refeed
graphs against the eager one, on the default pair: the features of both (max abs difference, relative to
the features' scale), each one's time (median of 5, synchronized), and the refeed cost the policy timed
at start-up.

    python benchmarks/refeed_check.py OUT_DIR [REQUESTS]

REQUESTS MT-Bench prompts are prefilled and decoded 64 tokens; then every request's whole context is fed
again (rows of 100-700 tokens, as a probe's refeed at the end of a run at C=64 on the H200), and a 2-row
refeed of each request.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.datasets import sample_prompts
from ddtree.spec.costs import wall_ms


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    os.makedirs(out, exist_ok=True)
    llm = LLM(budget="auto", max_num_seqs=64)
    eng = llm.engine
    spec, taps = eng.speculator, eng.speculator.drafter.layer_ids
    pol = spec.policy
    row = {"refeed_graph_widths": sorted(eng.refeed_graphs), "policy_refeed": {
        "fixed_ms": pol.refeed_fixed_ms, "row_ms": pol.refeed_row_ms, "forward_rows": pol.refeed_forward_rows}}
    seqs = [eng.add_request(llm.encode_chat(r["messages"]), SamplingParams(max_tokens=64, ignore_eos=True))
            for r in sample_prompts("mtbench", n)]
    while any(len(s.output_ids) < 32 for s in seqs):
        eng.step()
    whole, two = [(s, 0, s.num_cached) for s in seqs], [(s, s.num_cached - 2, 2) for s in seqs]
    for name, rows in [("whole", whole), ("two", two)]:
        with torch.inference_mode():
            eager, graphed = spec.runner.refeed(rows, taps), eng._refeed_graphed(rows, taps)
            diff = (eager.float() - graphed.float()).abs().max().item() / eager.float().abs().max().item()
            eager_ms = wall_ms(lambda: spec.runner.refeed(rows, taps), eng.device, 5)
            graphed_ms = wall_ms(lambda: eng._refeed_graphed(rows, taps), eng.device, 5)
            row[name] = {"rows": sum(r[2] for r in rows), "eager_ms": statistics.median(eager_ms),
                         "graphed_ms": statistics.median(graphed_ms), "max_diff_rel": diff}
    print(json.dumps(row, indent=1))
    with open(os.path.join(out, "refeed_check.json"), "w") as f:
        json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
