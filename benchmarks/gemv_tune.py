"""Times the Triton GEMV (ddtree/ops/triton_gemv.py) against F.linear (cuBLAS) for one token at the
default target's projection shapes, for every candidate block configuration; run on the H200.

    python benchmarks/gemv_tune.py [OUT.jsonl]

Each timing is a CUDA graph of 50 back-to-back calls (so launch cost is excluded as in the engine's
graphs), median of 20 replays, in microseconds per call. Rows: one per (shape, config), plus the
cuBLAS row of each shape, and the bandwidth each reaches.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from ddtree.bench.latency import median_replay_ms
from ddtree.ops.triton_gemv import gemv, gemv_config

# Qwen2.5-0.5B: hidden 896, 14 + 2 + 2 heads of 64, MLP 4864
SHAPES = {"qkv": (1152, 896, True), "o": (896, 896, False), "gate_up": (9728, 896, False), "down": (896, 4864, False)}
CONFIGS = [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (128, 256, 512, 1024) for w in (1, 2, 4, 8)]


def time_us(fn, calls: int = 50, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    return median_replay_ms(g, reps) * 1e3 / calls


def main() -> int:
    out = open(sys.argv[1], "w") if len(sys.argv) > 1 else None
    dev = torch.device("cuda")
    for name, (n, k, has_bias) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, w, bias)
        mb = w.numel() * 2 / 1e6
        rows = [{"shape": name, "impl": "cublas", "us": time_us(lambda: F.linear(x, w, bias))}]
        for cfg in CONFIGS:
            try:
                err = (gemv(x, w, bias, cfg).float() - ref.float()).abs().max().item()
                rows.append({"shape": name, "impl": "gemv", "config": cfg, "default": cfg == gemv_config(n, k),
                             "us": time_us(lambda c=cfg: gemv(x, w, bias, c)), "max_abs_err": err})
            except Exception as e:  # a config that does not compile (registers): skip it
                rows.append({"shape": name, "impl": "gemv", "config": cfg, "error": repr(e)[:200]})
        for r in rows:
            if "us" in r:
                r["GB_per_s"] = round(mb * 1e3 / r["us"], 1)
                r["weights_MB"] = round(mb, 2)
            line = json.dumps(r)
            if out:
                out.write(line + "\n")
        best = min((r for r in rows if r["impl"] == "gemv" and "us" in r), key=lambda r: r["us"])
        print(f"{name:8s} cublas {rows[0]['us']:7.2f} us  best gemv {best['us']:7.2f} us {best['config']} "
              f"({best['GB_per_s']} GB/s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
