"""What a switch's context store costs at C=1 (the policy learnt ~2.5-3 ms on the H200 at ed2a18c, where
the start-up table timed 0.9): auto on the default pair, MT-Bench prompts one at a time; every
`store_pending` is timed on the host up to its return (launch work), then to a synchronize (device
work), with its requests' pending entries and rows, the device work queued before it (a sync first)
and its caller, and profiled (cProfile, host time) in the same pass.

    python benchmarks/store_profile.py OUT_DIR [NUM_PROMPTS [MAX_TOKENS]]
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.datasets import sample_prompts
from ddtree.spec.context import context_of
from ddtree.spec.draft import DraftRunner


def main() -> None:
    out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    os.makedirs(out, exist_ok=True)
    llm = LLM(budget="auto")
    prompts = [llm.encode_chat(r["messages"]) for r in sample_prompts("mtbench", n)]
    params = SamplingParams(max_tokens=max_tokens)
    llm.generate(prompts[:1], params)  # warm-up
    original, rows, profiler = DraftRunner.store_pending, [], cProfile.Profile()

    def store_pending(self, seqs):
        entries = sum(len(context_of(s).pending) for s in seqs)
        pending = sum(s.num_cached - context_of(s).stored for s in seqs)
        tw = time.perf_counter()
        sync()  # (device work queued before the store: what a timer without this sync would charge it)
        t0 = time.perf_counter()
        profiler.enable()
        original(self, seqs)
        profiler.disable()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        rows.append({"batch": len(seqs), "entries": entries, "rows": pending, "caller": sys._getframe(1).f_code.co_name,
                     "queued_ms": (t0 - tw) * 1e3,
                     "host_ms": (t1 - t0) * 1e3, "to_sync_ms": (t2 - t0) * 1e3})

    DraftRunner.store_pending = store_pending
    for p in prompts:  # one at a time: C=1
        llm.generate([p], params)
    DraftRunner.store_pending = original
    with open(os.path.join(out, "stores.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(out, "stores_profile.txt"), "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(40)
    big = [r for r in rows if r["rows"] > 1]
    for r in big[:40]:
        print(r)
    if big:
        mean = lambda k: sum(r[k] for r in big) / len(big)  # noqa: E731
        print("stores", len(big), "mean queued ms %.3f, host %.3f, to sync %.3f" % (
            mean("queued_ms"), mean("host_ms"), mean("to_sync_ms")),
            "callers", sorted({r["caller"] for r in big}))


if __name__ == "__main__":
    main()
