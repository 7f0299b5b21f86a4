"""Where a multi-prompt prefill spends its time on the GPU (random model of the default target's
shapes, the shipped drafter; no download). On the H200 at a6a15cd an eager one cost ~20 ms of host
time per step whatever the batch (the `prefill_ms` of the sweep's rows at C=2..16), against ~1.7 ms
for a graphed single-prompt one; since 4a24bbf such steps replay prefill graphs too.

    python benchmarks/prefill_profile.py OUT_DIR

Writes OUT_DIR/profile.jsonl (and prints): ms per `generate(max_tokens=1)` call (schedule, prefill,
first token) by batch, plain AR and auto (taps, context stored), on the prefill graphs and eager;
the ops with the most host time in such a call (torch profiler); and the cost of auto's context
store for requests holding many one-row pending features against one block each.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.dirname(__file__))

from gpu_profile import default_shaped_model, emit, profiled_generate  # noqa: E402

from ddtree import LLM, SamplingParams  # noqa: E402
from ddtree.spec.context import context_of  # noqa: E402
from ddtree.models.hub import DEFAULT_DRAFT_DIR  # noqa: E402


def prompts_of(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 150000) for _ in range(rng.randrange(40, 300))] for _ in range(n)]


def ms_per_call(llm: LLM, batches: list[list[list[int]]]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(batches[0], params)
    times = []
    for b in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(b, params)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def host_table(llm: LLM, batch: list[list[int]], label: str) -> None:
    prof, wall, busy, kernels = profiled_generate(llm, batch, SamplingParams(max_tokens=1, ignore_eos=True))
    rows = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:30]
    emit(f"host-{label}", wall_ms=round(wall, 2), kernel_ms=round(busy, 2), kernels=kernels,
         self_cpu_top=[(e.key[:70], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in rows])
    total = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                   key=lambda e: -e.cpu_time_total)[:30]
    emit(f"host-total-{label}", total_cpu_top=[(e.key[:70], e.count, round(e.cpu_time_total / 1e3, 2))
                                               for e in total])


def store_cost(llm: LLM) -> None:
    """Auto's store of pending context: 128 requests each holding its prompt's features and 30 one-row
    features (an AR stretch), against the same rows as one block per request."""
    from ddtree.engine.sequence import Sequence
    eng = llm.engine
    drafter = eng.speculator.drafter
    ps, feat = eng.runner.page_size, drafter.feat_dim
    for layout in ("rows", "blocks"):
        times = []
        for rep in range(6):
            seqs = []
            for i in range(128):
                s = Sequence(list(range(100, 260)), SamplingParams(), None)
                s.block_table = list(range(i * 16, i * 16 + 16))
                s.num_cached = 190
                prompt = torch.randn(160, feat, device="cuda", dtype=torch.bfloat16)
                steps = torch.randn(30, feat, device="cuda", dtype=torch.bfloat16)
                context_of(s).replace(0, [prompt] + ([steps[j:j + 1] for j in range(30)] if layout == "rows"
                                                     else [steps]))
                seqs.append(s)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            drafter.store_pending(seqs)
            host = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            if rep:
                times.append((host, (time.perf_counter() - t0) * 1e3))
        emit("store", layout=layout, requests=128, rows_each=190, page_size=ps,
             host_ms=round(statistics.median(t[0] for t in times), 2),
             synced_ms=round(statistics.median(t[1] for t in times), 2))


def main() -> int:
    torch._logging.set_logs(recompiles=True)
    d = default_shaped_model()
    emit("env", gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    sizes = (1, 2, 4, 16, 64)
    for spec in ("none", "auto"):
        kw = {"spec": "ddtree", "budget": "auto", "topk": 4} if spec == "auto" else {"spec": "none"}
        # (a fixed cache: the first engine's memory is not all back when the second starts)
        llm = LLM(d, draft=DEFAULT_DRAFT_DIR, max_num_seqs=64, dtype="bfloat16", num_pages=8192, **kw)
        graphs = llm.engine.ar.prefill_graphs
        for graphed in (True, False):
            llm.engine.ar.prefill_graphs = graphs if graphed else {}  # (none: every prefill eager)
            for r in sizes:
                batches = [prompts_of(r, 1000 * r + k) for k in range(8)]
                emit("prefill", spec=spec, graphed=graphed, batch=r, ms=ms_per_call(llm, batches))
            for r in (2, 16):
                host_table(llm, prompts_of(r, 7), f"{spec}-{'graphed' if graphed else 'eager'}-{r}")
        llm.engine.ar.prefill_graphs = graphs
        if spec == "auto":
            store_cost(llm)
        del llm
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
