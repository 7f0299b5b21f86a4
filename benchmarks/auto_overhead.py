"""Where `auto` loses time against plain AR at a batch where it should pick AR: a random model of the
default target's shapes with the shipped drafter (tau ~1, so AR wins), C requests of fixed length.

    python benchmarks/auto_overhead.py OUT_DIR [C,...]

Per concurrency: AR and auto tok/s, auto's budget histogram and bursts, the policy's learned state,
and the host seconds spent in each part of the engine step (schedule, prefill, the policy's
`hopeless` and `plan`, auto's AR bursts split into drafter catch-up / graphed decode / feature store,
speculative steps), and every graphed AR decode burst (batch, steps, host ms). `--sync-parts`: the parts wait
for the device, so their times include the device work they launch. On a CPU (`--cpu`, tiny
shapes) it only checks that the script runs.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))

from ddtree import LLM, SamplingParams  # noqa: E402
from ddtree.models.hub import DEFAULT_DRAFT_DIR  # noqa: E402


SYNC_PARTS = "--sync-parts" in sys.argv  # each timed part waits for the device before and after


def timed_parts(obj, names: list[str], acc: dict, prefix: str = "") -> None:
    """Wraps obj's methods to add their host seconds to acc[prefix + name] (with `--sync-parts`, the
    device time of the work they launch too: nothing overlaps then)."""
    sync = torch.cuda.synchronize if SYNC_PARTS and torch.cuda.is_available() else (lambda: None)
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn, _name=prefix + name, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                sync()
                acc[_name] += time.perf_counter() - t0
        setattr(obj, name, wrapper)


def trace_decode(eng, bursts: list) -> None:
    """Wraps the engine's graphed AR decode to log (batch, steps, host ms) of every burst."""
    fn = eng.ar.burst

    def wrapper(seqs, *a, **k):
        t0 = time.perf_counter()
        burst = fn(seqs, *a, **k)
        bursts.append((len(seqs), burst.steps, (time.perf_counter() - t0) * 1e3))
        return burst
    eng.ar.burst = wrapper


def burst_summary(bursts: list) -> dict:
    """Per batch size: bursts, steps, and host ms per step of the graphed AR decode."""
    out: dict = {}
    for bs, steps, ms in bursts:
        r = out.setdefault(str(bs), {"bursts": 0, "steps": 0, "ms": 0.0})
        r["bursts"] += 1
        r["steps"] += steps
        r["ms"] += ms
    for r in out.values():
        r["ms_per_step"] = round(r.pop("ms") / r["steps"], 4)
    out["in_order"] = [(bs, steps, round(ms, 2)) for bs, steps, ms in bursts]
    return out


def run(llm: LLM, prompts, params, acc: dict | None = None, bursts: list | None = None) -> dict:
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    llm.generate(prompts, params)  # warm-up
    if acc is not None:
        acc.clear()
    if bursts is not None:
        bursts.clear()
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"tok_per_s": round(n / wall, 1), "wall_s": round(wall, 4), "tokens": n,
            "stats": {k: v for k, v in llm.last_stats.items() if k in ("budget_hist", "bursts", "steps")},
            **({"decode_bursts": burst_summary(bursts)} if bursts is not None else {})}


def main() -> int:
    cpu = "--cpu" in sys.argv
    args = [a for a in sys.argv[1:] if a not in ("--cpu", "--sync-parts")]
    out = args[0] if args else "."
    out = os.path.join(out, "auto_overhead.jsonl") if os.path.isdir(out) else out
    conc = [int(c) for c in args[1].split(",")] if len(args) > 1 else [16, 64]
    if cpu:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        import tempfile

        from tiny import make_tiny_model

        from ddtree.config import ModelConfig
        from ddtree.models.dflash import random_drafter, save_drafter
        model = make_tiny_model(tempfile.mkdtemp(), "qwen2")
        draft = tempfile.mkdtemp()
        save_drafter(random_drafter(ModelConfig.from_dir(model), num_layers=1, block_size=8,
                                    target_layer_ids=[0, 1]), draft)
        kw, length = dict(device="cpu", dtype="float32"), 16
    else:
        from gpu_profile import default_shaped_model
        model, draft, kw, length = default_shaped_model(), DEFAULT_DRAFT_DIR, dict(dtype="bfloat16"), 128
    vocab = 300 if cpu else 150000
    for c in conc:
        prompts = [[(31 * i + 7 * j) % vocab + 1 for j in range(length)] for i in range(c)]
        params = SamplingParams(max_tokens=length, ignore_eos=True)
        llm = LLM(model, draft=draft, spec="none", max_num_seqs=c, **kw)
        bursts: list = []
        if not cpu:
            trace_decode(llm.engine, bursts)
        ar_acc: dict = defaultdict(float)
        timed_parts(llm.engine.ar, ["_feed"], ar_acc, "ar.")
        row = {"concurrency": c, "ar": run(llm, prompts, params, ar_acc, None if cpu else bursts)}
        row["ar"]["host_s"] = {k: round(v, 4) for k, v in sorted(ar_acc.items())}
        llm.set_mode("ddtree", "auto", 4)
        eng, spec = llm.engine, llm.engine.speculator
        if not cpu:
            trace_decode(eng, bursts)
        acc: dict = defaultdict(float)
        timed_parts(eng.scheduler, ["schedule"], acc, "scheduler.")
        timed_parts(eng.ar, ["_feed", "burst"], acc, "ar.")
        timed_parts(spec, ["_ar_burst", "decode", "ar_step"], acc, "spec.")
        timed_parts(spec.policy, ["hopeless", "plan"], acc, "policy.")
        timed_parts(spec.drafter, ["store_pending", "prepare"], acc, "drafter.")
        row["auto"] = run(llm, prompts, params, acc, None if cpu else bursts)
        row["auto"]["host_s"] = {k: round(v, 4) for k, v in sorted(acc.items())}
        row["auto"]["policy"] = spec.policy.state()
        row["auto_vs_ar"] = round(row["auto"]["tok_per_s"] / row["ar"]["tok_per_s"], 3)
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:  # row by row: a later concurrency that fails keeps this one
            f.write(json.dumps(row) + "\n")
        del eng, spec, llm  # free the KV caches before the next engine (the timing wrappers make
        gc.collect()  # reference cycles: collected, not freed on `del`)
        if not cpu:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
