"""Where a graphed speculative step's wall time goes at C=1, on a random model with the default
target's exact shapes and the shipped drafter (no download).

    python benchmarks/spec_overhead.py OUT_DIR

For AR, DFlash and DDTree (budget 32, topk 4), one request at a time, it writes (profile.jsonl in
OUT_DIR, and prints):
- end-to-end tok/s and wall ms per step;
- the GPU time of one replay of the whole-step graph (CUDA events, back to back) and the host time
  the replay call itself takes (the graph launch);
- the host time of a burst split by part: graph launches (`GraphPool.run`: input copies + launch),
  the next step's inputs (`_next_inputs`), waits for read-backs, and commits. If the waits are near
  zero the host is the bottleneck; if they are large, the GPU is.
- per-request time outside decode steps: a 1-token generation (prefill + first step).
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))

from auto_overhead import timed_parts  # noqa: E402
from gpu_profile import busy_share, default_shaped_model, emit  # noqa: E402

from ddtree import LLM, SamplingParams  # noqa: E402
from ddtree.models.hub import DEFAULT_DRAFT_DIR  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "."


def replay_times(pool, rows: int = 1, reps: int = 50) -> dict:
    """GPU ms per replay (events around `reps` back-to-back replays) and host ms per replay call."""
    for _ in range(3):
        pool.replay(rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(reps):
        t0 = time.perf_counter()
        pool.replay(rows)
        host += time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return {"gpu_ms": round(start.elapsed_time(end) / reps, 4), "launch_ms": round(host * 1e3 / reps, 4)}


def request_overhead(llm: LLM, prompt: list[int], label: str) -> None:
    P = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(3):
        llm.generate([prompt], P)
    torch.cuda.synchronize()
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        llm.generate([prompt], P)
    torch.cuda.synchronize()
    emit("one-token-request", mode=label, ms=round((time.perf_counter() - t0) * 1e3 / n, 3))


def main() -> int:
    d = default_shaped_model()
    emit("env", gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    prompt = [(17 * j) % 150000 + 100 for j in range(128)]
    llm = LLM(d, draft=DEFAULT_DRAFT_DIR, spec="none", max_num_seqs=16, dtype="bfloat16")
    if len(sys.argv) > 2:  # modes to skip
        skip = set(sys.argv[2].split(","))
    else:
        skip = set()
    P = SamplingParams(max_tokens=256, ignore_eos=True)
    for mode, budget, topk in (("none", None, None), ("dflash", None, None), ("ddtree", 32, 4)):
        if mode in skip:
            continue
        llm.set_mode(mode, budget, topk)
        request_overhead(llm, prompt, mode)
        llm.generate([prompt], P)
        torch.cuda.synchronize()
        eng = llm.engine
        spec = eng.speculator
        acc: dict = defaultdict(float)
        if spec is not None:
            timed_parts(spec, ["_next_inputs", "_commit_burst_step"], acc)
            timed_parts(spec.graphs, ["run"], acc)
            timed_parts(spec.readback, ["result"], acc)
            steps_before = spec.stats.steps
        t0 = time.perf_counter()
        llm.generate([prompt], P)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        row = {"mode": mode, "tok_per_s": round(256 / wall, 1), "wall_ms": round(wall * 1e3, 2),
               "stats": {k: v for k, v in llm.last_stats.items() if k != "budget_hist"}}
        if spec is not None:
            steps = spec.stats.steps - steps_before
            row["steps"] = steps
            row["host_ms_per_step"] = {k: round(v * 1e3 / steps, 4) for k, v in acc.items()}
            row["wall_ms_per_step"] = round(wall * 1e3 / steps, 4)
            row["replay"] = replay_times(spec.graphs)
        else:
            row["replay"] = replay_times(eng.ar.decode_graphs)
        emit("spec-overhead", **row)
        busy_share(llm, [prompt], 128, f"c1-{mode}")
        os.system(f"python3 {os.path.dirname(__file__)}/trace_gaps.py {OUT}/trace_c1-{mode}.json.gz --top 25 "
                  f"> {OUT}/gaps_{mode}.json 2>&1")
        del eng, spec  # else the next engine finds this one's KV cache still held
    return 0


if __name__ == "__main__":
    sys.exit(main())
