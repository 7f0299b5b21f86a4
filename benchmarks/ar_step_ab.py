"""AR against auto's AR bursts at given concurrencies, the modes alternated (ar, auto, ar, auto, ...) so
that a difference that follows the mode can be told from one that follows the time (GPU clocks, heat).
Prints and writes one JSON line per run: tokens/s, AR ms per step, and the SM clock after the run.

    python benchmarks/ar_step_ab.py OUT.jsonl 64,128 [ROUNDS]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.datasets import sample_prompts
from ddtree.bench.latency import full_batches


def clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    out, concurrencies = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    from ddtree.models.hub import default_draft
    llm = LLM(draft=default_draft(), spec="none", max_num_seqs=max(concurrencies), num_pages=16384)
    prompts = [llm.encode_chat(r["messages"]) for r in sample_prompts("mtbench", 80)]
    params = SamplingParams(max_tokens=128)
    for r in range(rounds):
        for mode in ("ar", "auto"):
            llm.set_mode("ddtree", "auto", 4) if mode == "auto" else llm.set_mode("none")
            for c in concurrencies:
                batches = full_batches(prompts, c)
                llm.generate(batches[0], params)  # warm-up
                totals, gen, elapsed = {}, 0, 0.0
                for batch in batches:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs = llm.generate(batch, params)
                    torch.cuda.synchronize()
                    elapsed += time.perf_counter() - t0
                    gen += sum(len(o.token_ids) for o in outs)
                    for k, v in llm.last_stats.get("bursts", {}).items():
                        totals[k] = totals.get(k, 0) + v
                row = {"round": r, "mode": mode, "concurrency": c, "tok_per_s": gen / elapsed,
                       "ar_ms_per_step": totals.get("ar_ms", 0) / max(totals.get("ar_steps", 1), 1),
                       "clock": clock(), "bursts": {k: round(v, 1) for k, v in totals.items()}}
                print(json.dumps(row), flush=True)
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if os.environ.get("PROFILE") and r == rounds - 1 and c == max(concurrencies):
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        llm.generate(batches[0], params)
                        torch.cuda.synchronize()
                    for key in ("self_cuda_time_total", "self_cpu_time_total"):
                        print(f"--- {mode} C={c} by {key}")
                        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
