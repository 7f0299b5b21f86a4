"""Times the hybrid tree kernel (`tree_delta`: a verify's Gated DeltaNet solve, one layer) at a model's
linear-attention shapes, for every split of a head's value columns (BLOCK_V), key channels read at a time
(BLOCK_K) and warps, at a few batch sizes and tree sizes; `autotuned` rows time the launch the engine
makes (the autotuner's pick among `TREE_SPLITS`). CUDA graph replays, median of 200, random trees with many siblings a depth.

    python benchmarks/tree_tune.py OUT.jsonl [--config benchmarks/configs/qwen3.5-0.8b.json]
        [--batch 1,8] [--nodes 17,33,65] [--key-chunks 16,32,64] [--warps 2,4,8] [--baseline FILE]

`--baseline FILE` (repeatable): the ops module of another revision (`git show REV:ddtree/ops/triton_gdn.py >
FILE`), whose `tree_delta` is timed beside this tree's at the same inputs and splits, in the same run (rows
`"kernel"`: the file's stem), and checked against it. A revision whose `tree_delta` takes no `split` is timed
at its autotuned launch only (fixed splits it does not take fail, reported as such).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import pathlib
import sys

import torch

from ddtree.bench.steps import graph_us
from ddtree.ops.triton_gdn import tree_delta


def random_tree_mask(R: int, N: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self masks [R, N, N] and depths [R, N] of random trees, ancestors first."""
    above = torch.zeros(R, N, N, dtype=torch.bool)
    for r in range(R):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
        for i in range(N):
            j = i
            while j >= 0:
                above[r, i, j], j = True, parents[j]
    return above, above.sum(-1) - 1


def launcher(cfg: dict, R: int, N: int, dev: torch.device, solve=tree_delta):
    """A closure `run(split)` over random inputs of one layer's tree solve (bfloat16 model) by `solve`."""
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    DK, DV = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    g = torch.Generator().manual_seed(R * 1000 + N)
    above, depth = random_tree_mask(R, N, g)
    mixed = torch.randn(R * N, 2 * Hk * DK + Hv * DV, generator=g)
    b, a = (torch.randn(R * N, Hv, generator=g).to(torch.bfloat16) for _ in range(2))
    z = torch.randn(R * N, Hv * DV, generator=g).to(torch.bfloat16)
    state = torch.randn(R + 1, Hv, DK, DV, generator=g) * 0.1
    slots, prefix = torch.arange(1, R + 1), torch.full((R,), 100, dtype=torch.int32)
    args = [t.to(dev) for t in (state, slots, prefix, mixed, b, a)]
    args += [torch.zeros(Hv, device=dev, dtype=torch.bfloat16), torch.zeros(Hv, device=dev, dtype=torch.bfloat16),
             z.to(dev), torch.ones(DV, device=dev, dtype=torch.bfloat16), 1e-6, Hk, above.to(dev), depth.to(dev)]
    return lambda split: solve(*args) if split is None else solve(*args, split=split)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="tree_tune.jsonl")
    ap.add_argument("--config", default="benchmarks/configs/qwen3.5-0.8b.json")
    ap.add_argument("--batch", default="1,8", help="requests a step")
    ap.add_argument("--nodes", default="17,33,65", help="nodes a tree (the root included)")
    ap.add_argument("--key-chunks", default="16,32,64,128", help="BLOCK_K values to try (at most the key head's)")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--baseline", action="append", default=[],
                    help="triton_gdn.py of another revision, timed beside this one (repeatable: rows named by file stem)")
    args = ap.parse_args()
    kernels = {"current": tree_delta}
    for path in args.baseline:
        name = pathlib.Path(path).stem
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernels[name] = module.tree_delta
    with open(args.config) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    dev = torch.device("cuda")
    DV = cfg["linear_value_head_dim"]
    block_vs = [bv for bv in (16, 32, 64, 128) if bv <= DV]
    chunks = [int(x) for x in args.key_chunks.split(",") if int(x) <= cfg["linear_key_head_dim"]]
    warps = [int(x) for x in args.warps.split(",")]
    cases = itertools.product([int(x) for x in args.batch.split(",")], [int(x) for x in args.nodes.split(",")])
    with open(args.out, "w") as out:  # (a row a line as measured: a run cut short keeps its rows)
        for R, N in cases:
            runs = {name: launcher(cfg, R, N, dev, solve) for name, solve in kernels.items()}
            want = runs["current"](None)[0].float()
            splits = [None] + [dict(BLOCK_V=bv, BLOCK_K=bk, num_warps=w) for bv, bk, w in
                               itertools.product(block_vs, chunks, warps)]
            for split, (name, run) in itertools.product(splits, runs.items()):
                try:
                    err = float((run(split)[0].float() - want).abs().max())
                    us = graph_us(lambda r=run, s=split: r(s))
                except Exception as e:  # noqa: BLE001 (a split that does not compile is reported, the rest run)
                    err, us = None, f"failed: {type(e).__name__}: {str(e)[:200]}"
                row = {"kernel": name, "batch": R, "nodes": N, "autotuned": split is None, **(split or {}),
                       "us": round(us, 2) if isinstance(us, float) else us, "max_diff": err}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
