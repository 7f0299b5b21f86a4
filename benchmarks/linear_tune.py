"""Times the few-row Triton products (ddtree/ops/triton_linear.py) against cuBLAS plus the eager fused
ops they replace, at the default target's layer shapes, for every candidate block configuration and
for 1..64 rows; run on the H200.

    python benchmarks/linear_tune.py [OUT.jsonl [ROWS,...]]   (rows: default 1,16,33,64)

Each timing is a CUDA graph of 50 back-to-back calls (launch cost excluded, as in the engine's
graphs), median of 20 replays, in microseconds per call. Prints per row count the best configuration
of each shape kind (`linear_config`'s table: q|k|v and o share one, gate|up one, down one) and a
layer's total against cuBLAS + the separate norm / SiLU kernels.
"""
from __future__ import annotations

import json
import sys
from itertools import product

import torch
import torch.nn.functional as F

from ddtree.bench.steps import graph_us
from ddtree.ops.fused import add_rms_norm, silu_mul
from ddtree.ops.triton_linear import Config, linear, linear_config, norm_linear

# Qwen2.5-0.5B: hidden 896, 14 + 2 + 2 heads of 64, MLP 4864. kind: which row of linear_config's table
SHAPES = {"qkv": (1152, 896, "norm+bias", "small"), "o": (896, 896, "plain", "small"),
          "gate_up": (2 * 4864, 896, "norm+glu", "wide"), "down": (896, 4864, "plain", "deep")}
ROWS = [1, 16, 33, 64]  # one per tile height (1, 16, 32 and 64 rows share compiled kernels)


def configs(m: int) -> list[Config]:
    if m == 1:
        return [Config(*c) for c in product((1, 2, 4, 8), (512, 1024), (1, 2))]
    return [Config(*c) for c in product((16, 32), (64, 128), (2, 4), (1, 4, 8))]  # (split-K: more programs)


def calls(name: str, m: int, dev):
    """(ours(config), baseline()) closures for one shape at m rows."""
    n, k, kind, _ = SHAPES[name]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x, res = (torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(2))
    gamma = torch.ones(k, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if kind == "norm+bias" else None
    if kind == "plain":
        return (lambda c: linear(x, w, None, c)), (lambda: F.linear(x, w))
    glu = kind == "norm+glu"

    def base():
        h, _ = add_rms_norm(x, res, gamma, 1e-6)
        y = F.linear(h, w, bias)
        return silu_mul(y) if glu else y
    return (lambda c: norm_linear(x, res, gamma, 1e-6, w, bias, glu, c)[0]), base


def main() -> int:
    out = open(sys.argv[1], "w") if len(sys.argv) > 1 else None
    dev = torch.device("cuda")
    for m in [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else ROWS:
        best: dict[str, dict] = {}
        base_total = default_total = 0.0
        per_kind: dict[str, dict[Config, float]] = {}
        for name, (n, k, kind, table_kind) in SHAPES.items():
            ours, base = calls(name, m, dev)
            want = base().float()
            err = ((ours(None).float() - want).abs().max() / want.abs().max()).item()  # bf16 tensor-core path check
            row = {"rows": m, "shape": name, "impl": "cublas+ops", "us": graph_us(base, calls=50, reps=20),
                   "triton_rel_err": err}
            base_total += row["us"]
            rows = [row]
            default = linear_config(m, n // 2 if kind == "norm+glu" else n, k)
            for cfg in dict.fromkeys(configs(m) + [default]):
                try:
                    rows.append({"rows": m, "shape": name, "impl": "triton", "config": list(cfg),
                                 "default": cfg == default, "us": graph_us(lambda c=cfg: ours(c), calls=50, reps=20)})
                except Exception as e:  # a config that does not compile (registers, shared memory): skip it
                    rows.append({"rows": m, "shape": name, "impl": "triton", "config": list(cfg), "error": repr(e)[:200]})
            ok = [r for r in rows if r["impl"] == "triton" and "us" in r]
            default_total += next(r["us"] for r in ok if r["default"])
            for r in ok:
                per_kind.setdefault(table_kind, {}).setdefault(Config(*r["config"]), 0.0)
                per_kind[table_kind][Config(*r["config"])] += r["us"]
            best[name] = min(ok, key=lambda r: r["us"])
            print(f"rows {m:2d} {name:8s} cublas+ops {row['us']:7.2f} us  best {best[name]['us']:7.2f} us "
                  f"{best[name]['config']}  rel err {err:.1e}", flush=True)
            for r in rows:
                if out:
                    out.write(json.dumps(r) + "\n")
        table = {kind: min(cfgs.items(), key=lambda kv: kv[1])[0] for kind, cfgs in per_kind.items()}
        best_total = sum(min(cfgs.values()) for cfgs in per_kind.values())
        line = {"rows": m, "layer_us_cublas_ops": round(base_total, 2), "layer_us_default": round(default_total, 2),
                "layer_us_best": round(best_total, 2), "table": {k: list(v) for k, v in table.items()}}
        print(json.dumps(line), flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
