"""Where auto loses to plain AR at high concurrency, where it runs AR's own graphs (the H200).

    python benchmarks/ar_gap.py OUT_DIR [C,...] [ROUNDS] [PROMPTS]

At 53abc1a (MT-Bench, 80 prompts x 128 tokens, continuous) auto at C=64 ran only tap-free AR bursts
and still read 0.95x AR: over 3 runs its engine time was 50 ms longer (AR bursts +24 ms on the same
810 steps, prefills +6 ms, the rest, between bursts, +20 ms). This runs the two modes in turn on the
same workload (the sweep's continuous one), `ROUNDS` timed runs each (every other round reversed),
then one run of each under cProfile. Writes `ar_gap.jsonl` (a row per run: tok/s and the engine's
time split), `profile_MODE_C.txt` (top functions by own time) and prints, per concurrency, the
functions whose own time differs most between the profiled runs.

On a GPU each row also has `replay_gpu_ms`: the device time of the decode graphs' replays, from CUDA
events around each one (the events sit in the stream, so an interval is the graph's execution, not the
host's wait for it). At 0df5e9d and 89e42b6 auto's AR bursts took 1.2-1.4% longer than plain AR's on
the same steps (C=64 and 128): equal replay times put that on the host (launches, read-backs), longer
ones on the device.
"""
from __future__ import annotations

import cProfile
import itertools
import json
import os
import pstats
import sys
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.datasets import sample_prompts
from ddtree.bench.latency import sync
from ddtree.models.hub import default_draft

MODES = {"auto": ("ddtree", "auto", 4), "ar": ("none", 0, 1)}


def own_times(prof: cProfile.Profile) -> dict[str, tuple[int, float]]:
    """function -> (calls, own seconds)."""
    stats = pstats.Stats(prof).stats
    return {f"{os.path.basename(k[0])}:{k[1]}({k[2]})": (v[1], v[2]) for k, v in stats.items()}


def time_replays(engine) -> list | None:
    """Wraps the engine's decode graph pools (tapped and untapped) once so that every replay is bracketed
    by CUDA events; returns the shared list of (start, end) pairs (None without CUDA). (The events and
    the list append cost host time inside the bursts: these rows' tok/s are not those of earlier
    `ar_gap.jsonl` files; AR and auto pay alike.)"""
    if not torch.cuda.is_available():
        return None
    if getattr(engine, "_replay_events", None) is None:
        engine._replay_events, engine._replay_count = [], [0]
        for pool in {id(p): p for p in (engine.ar.decode_graphs, engine.ar.untapped_decode_graphs) if p}.values():
            # (`replay` only: `run` copies the inputs in and ends in `replay`, found on the instance)
            def timed(rows, _fn=pool.replay):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = _fn(rows)
                end.record()
                engine._replay_events.append((start, end))
                engine._replay_count[0] += 1
                return out
            pool.replay = timed
    engine._replay_count[0] = 0
    return engine._replay_events


def replay_count(engine) -> int:
    return engine._replay_count[0]


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    cs = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 128]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    n_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 80
    os.makedirs(out, exist_ok=True)
    llm = LLM(draft=default_draft(), spec="none", max_num_seqs=max(cs), num_pages=16384)
    prompts = [llm.encode_chat(r["messages"]) for r in sample_prompts("mtbench", n_prompts)]
    params = SamplingParams(max_tokens=128)
    log_path = os.path.join(out, "ar_gap.jsonl")

    def run(mode: str, c: int, prof: cProfile.Profile | None = None) -> dict:
        llm.switch_mode(*MODES[mode])
        llm.engine.scheduler.max_num_seqs = c
        events = time_replays(llm.engine)
        batch = list(itertools.islice(itertools.cycle(prompts), max(len(prompts), 2 * c)))
        sync()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        outs = llm.generate(batch, params)
        if prof:
            prof.disable()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
        replay_ms = sum(start.elapsed_time(end) for start, end in events) if events is not None else None
        if events is not None:
            events.clear()
        b = dict(llm.last_stats.get("bursts", {}))
        rest = b.get("engine_ms", 0) - sum(b.get(k, 0) for k in ("ar_ms", "prefill_ms", "spec_ms", "store_ms",
                                                                     "refeed_ms"))
        row = {"mode": mode, "C": c, "profiled": prof is not None, "wall_ms": round(wall, 2),
               "tok_per_s": round(sum(len(o.token_ids) for o in outs) / wall * 1e3, 1),
               "between_bursts_ms": round(rest, 2),
               "replay_gpu_ms": None if replay_ms is None else round(replay_ms, 2),
               "replays": None if events is None else replay_count(llm.engine),
               **{k: round(v, 2) if isinstance(v, float) else v for k, v in b.items()}}
        with open(log_path, "a") as log:  # (row by row: a run that dies keeps what it measured)
            log.write(json.dumps(row) + "\n")
        return row

    for c in cs:
        for mode in MODES:  # warm-up: graphs, kernels, the policy's first lessons
            run(mode, c)
        for r in range(rounds):
            for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                row = run(mode, c)
                print(f"C={c:3d} {mode:4s} {row['tok_per_s']:9.1f} tok/s  wall {row['wall_ms']:7.1f}  "
                      f"ar {row.get('ar_ms', 0):7.1f} ({row.get('ar_steps', 0)} steps, "
                      f"{row.get('ar_bursts', 0)} bursts)"
                      f"  prefill {row.get('prefill_ms', 0):6.1f}  between {row['between_bursts_ms']:6.1f}"
                      f"  replays {row['replay_gpu_ms']} ms GPU ({row['replays']})", flush=True)
        times = {}
        for mode in MODES:
            prof = cProfile.Profile()
            run(mode, c, prof)
            with open(os.path.join(out, f"profile_{mode}_{c}.txt"), "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            times[mode] = own_times(prof)
        diff = sorted(((times["auto"].get(k, (0, 0))[1] - times["ar"].get(k, (0, 0))[1], k) for k in
                       set(times["auto"]) | set(times["ar"])), reverse=True)
        print(f"C={c}: own time auto - AR under cProfile (ms), largest first")
        for d, k in diff[:25]:
            print(f"  {d * 1e3:8.2f}  calls {times['auto'].get(k, (0,))[0]:6d} / {times['ar'].get(k, (0,))[0]:6d}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
