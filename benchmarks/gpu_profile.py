"""Where the time of a decode step goes on the GPU, on a random model with the default target's exact
shapes (Qwen2.5-0.5B: 24 layers, hidden 896, vocab 151,936; no download) and the shipped drafter.

    python benchmarks/gpu_profile.py OUT_DIR

Writes to OUT_DIR (and prints):
- end-to-end AR tok/s and the graph replay time of one AR step at several batch sizes: the gap between
  them is host time the GPU waits for;
- per-kernel GPU time of one eager AR step (batch 1 and 64) and of one speculative step, from the torch
  profiler: which kernels a step is made of and what each costs;
- the GPU's busy share during graphed AR decoding at batch 1 (kernel time / wall time);
- memory after building the auto (adaptive) engine at max_num_seqs 64 and 128.
"""
from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ddtree import LLM, SamplingParams
from ddtree.bench.steps import step_times
from ddtree.bench.random_model import qwen2_config, save_random_target
from ddtree.models.hub import DEFAULT_DRAFT_DIR

OUT = "."


def emit(name: str, **row) -> None:
    line = json.dumps({"check": name, **row})
    print(line, flush=True)
    with open(os.path.join(OUT, "profile.jsonl"), "a") as f:
        f.write(line + "\n")


def kernel_table(fn, label: str, steps: int = 3) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            rows.append((dev / steps, e.count / steps, e.key[:90]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    emit(f"kernels-{label}", total_us=round(total, 1), kernels_per_step=sum(r[1] for r in rows),
         top=[{"us": round(us, 1), "n": n, "name": k} for us, n, k in rows[:25]])
    with open(os.path.join(OUT, f"kernels_{label}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))


def profiled_generate(llm: LLM, prompts, params: SamplingParams):
    """One generate after a warm-up one, under the torch profiler: (profile, wall ms, kernel ms, kernels)."""
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return prof, wall, sum(e.time_range.elapsed_us() for e in kernels) / 1e3, len(kernels)


def busy_share(llm: LLM, prompts, max_tokens: int, label: str) -> None:
    """GPU kernel time over wall time while generating (graphs on)."""
    prof, wall, busy, _ = profiled_generate(llm, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    wall, busy = wall / 1e3, busy * 1e3  # (s, us: as below)
    cpu = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CPU:
            cpu[e.key] = e.cpu_time_total
    top = sorted(cpu.items(), key=lambda kv: -kv[1])[:30]
    emit(f"busy-{label}", wall_ms=round(wall * 1e3, 2), kernel_ms=round(busy / 1e3, 2),
         busy_share=round(busy / 1e3 / (wall * 1e3), 3), tokens=len(prompts) * max_tokens,
         cpu_top_ms=[(k[:80], round(v / 1e3, 2)) for k, v in top])
    path = os.path.join(OUT, f"trace_{label}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:  # small enough to come back from $OUT
        z.write(f.read())
    os.remove(path)


def end_to_end(llm: LLM, prompts, max_tokens: int) -> float:
    """Seconds to generate `max_tokens` for each prompt (after one warm-up run of the same)."""
    P = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, P)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, P)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    global OUT
    OUT = sys.argv[1] if len(sys.argv) > 1 else "."
    d = save_random_target(qwen2_config(), tempfile.mkdtemp(), device="cuda")
    torch.cuda.empty_cache()
    emit("env", gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    llm = LLM(d, draft=DEFAULT_DRAFT_DIR, spec="none", max_num_seqs=256, dtype="bfloat16")
    prompts = [[(17 * i + j) % 150000 + 100 for j in range(128)] for i in range(256)]

    # 1. end-to-end AR vs graph replay
    for c in (1, 16, 64, 256):
        wall = end_to_end(llm, prompts[:c], 128)
        emit("ar-e2e", concurrency=c, tok_per_s=round(c * 128 / wall, 1), ms_per_step=round(wall / 128 * 1e3, 3),
             stats={k: v for k, v in llm.last_stats.items() if k != "budget_hist"})
    emit("step-times-ar", rows=step_times(llm, [1, 16, 64, 256], []))

    # 2. kernels of one eager AR decode step
    eng = llm.engine
    runner = eng.runner
    from ddtree.engine.sequence import Sequence
    for bs in (1, 64):
        seqs = [Sequence(list(range(100, 612)), SamplingParams(), None) for _ in range(bs)]
        for s in seqs:
            eng.allocator.grow(s, 520)
            s.num_cached = 512
        tables = runner.tables(seqs)
        starts = torch.full((bs,), 512, device="cuda")
        ids = torch.full((bs,), 7, device="cuda")
        kernel_table(lambda: runner.decode_logits(ids, tables, starts), f"ar-eager-b{bs}")
        for s in seqs:
            eng.allocator.release(s)

    del eng, runner, seqs, tables  # the next engines must not find the old KV cache still held

    # 3. GPU busy share, graphed AR
    busy_share(llm, prompts[:1], 64, "ar-b1")
    busy_share(llm, prompts[:64], 32, "ar-b64")

    # 4. speculative: step times, busy share, kernels of an eager step
    for budget in (32, "auto"):
        try:
            llm.set_mode("ddtree", budget, 4)
            for c in (1, 16, 64):
                wall = end_to_end(llm, prompts[:c], 128)
                emit("ddtree-e2e", budget=budget, concurrency=c, tok_per_s=round(c * 128 / wall, 1),
                     stats=llm.last_stats)
            if budget == 32:
                emit("step-times-ddtree", rows=step_times(llm, [1, 16, 64], [9, 17, 33]))
                busy_share(llm, prompts[:1], 64, "ddtree32-b1")
                spec = llm.engine.speculator
                pools = spec.graphs
                spec.graphs = None  # eager step for the kernel table
                seqs_p = [prompts[0]]

                def one():
                    llm.generate(seqs_p, SamplingParams(max_tokens=20, ignore_eos=True))
                kernel_table(one, "ddtree32-eager-gen20", steps=1)
                spec.graphs = pools
                del spec, pools  # else the next engine finds this one's KV cache still held
        except Exception as e:  # keep going: the memory check below still matters
            emit("ddtree-error", budget=budget, error=repr(e))

    # 5. memory of the auto engine
    for mns in (64, 128):
        try:
            llm.engine = None
            llm.set_mode("none")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            llm.engine_cfg.max_num_seqs = mns
            t0 = time.perf_counter()
            llm.set_mode("ddtree", "auto", 4)
            init_s = time.perf_counter() - t0
            alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            llm.generate(prompts[:mns], SamplingParams(max_tokens=32, ignore_eos=True))
            emit("auto-memory", max_num_seqs=mns, init_s=round(init_s, 1), ar_engine_gib=round(base / 2**30, 2),
                 allocated_gib=round(alloc / 2**30, 2), reserved_gib=round(reserved / 2**30, 2),
                 peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                 kv_pages=llm.engine.allocator.num_pages, budget_hist=llm.last_stats.get("budget_hist"),
                 tok_per_s=round(llm.last_stats["tokens_per_s"], 1))
        except Exception as e:
            emit("auto-memory-error", max_num_seqs=mns, error=repr(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
