"""Times the Triton paged attention at a model's head shapes (default: the default target's 14 query / 2 KV
heads of 64) for the query widths of decoding at C=1 (1: AR; 16: the drafter block; 33: a budget-32 tree)
over a few context lengths, at every key split (flash-decoding), query block size and warps (4, 8), to pick
`choose_splits` / `choose_block_m` / `choose_warps` by measurement. CUDA graph replays, median of 200.

    python benchmarks/attention_tune.py OUT.jsonl [--heads 14,2,64] [--contexts 256,512,1024,2048]
        [--widths 1,16,33] [--chosen]

`--chosen`: only the block size and splits the engine picks, each at both warps (a quick check of
`choose_warps`).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from ddtree.bench.steps import graph_us
from ddtree.ops.attention import uniform_batch
import ddtree.ops.triton_attention as attention
from ddtree.ops.triton_attention import choose_block_m, choose_splits, triton_paged_attention

PAGE = 16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="attention_tune.jsonl")
    ap.add_argument("--heads", default="14,2,64", help="query heads, KV heads, channels a head")
    ap.add_argument("--contexts", default="256,512,1024,2048")
    ap.add_argument("--widths", default="1,16,33", help="query rows of one request (past 65: prefill tiles)")
    ap.add_argument("--chosen", action="store_true", help="only the engine's block size and splits")
    args = ap.parse_args()
    H, HKV, D = (int(x) for x in args.heads.split(","))
    widths = [int(w) for w in args.widths.split(",")]
    dev = torch.device("cuda")
    chosen_warps = attention.choose_warps
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        pages = -(-(ctx + max(widths)) // PAGE)
        cache = torch.randn(pages * PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
        vcache = torch.randn_like(cache)
        tables = torch.arange(pages, device=dev)[None]
        for width in widths:
            q = torch.randn(width, H, D, device=dev, dtype=torch.bfloat16)
            mask = torch.tril(torch.ones(1, width, width, dtype=torch.bool, device=dev)) if width > 1 else None
            starts = torch.tensor([ctx], device=dev)
            default_bm = choose_block_m(width, H // HKV)
            for bm in [default_bm] if args.chosen else sorted({default_bm, 8, 16}):
                per = -(-width // bm)
                for splits in [choose_splits(per, HKV, width)] if args.chosen else (1, 2, 4, 8, 16):
                    batch = uniform_batch(tables, starts, width, mask, PAGE, True, H // HKV, HKV)
                    batch.block_m, batch.splits = bm, splits
                    batch.blk_req = torch.zeros(per, device=dev, dtype=torch.int32)
                    batch.blk_q = torch.arange(per, device=dev, dtype=torch.int32) * bm
                    for warps in (4, 8):
                        attention.choose_warps = lambda *shape, w=warps: w  # noqa: E731
                        try:
                            us = graph_us(lambda: triton_paged_attention(q, cache, vcache, batch, D ** -0.5))
                        finally:
                            attention.choose_warps = chosen_warps
                        d_p = triton.next_power_of_2(D)  # (the engine's pick for these tiles)
                        tile = attention.choose_rows(bm * triton.next_power_of_2(H // HKV), d_p, 2)
                        pick = chosen_warps(tile, attention.choose_block_n(tile, d_p, 2), d_p, 2)
                        row = {"heads": [H, HKV, D], "ctx": ctx, "width": width, "block_m": bm, "splits": splits,
                               "warps": warps, "us": round(us, 2),
                               "default": bm == default_bm and splits == choose_splits(per, HKV, width) and warps == pick}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
