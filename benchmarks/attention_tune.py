"""Times the Triton paged attention at the default target's head shapes (14 query / 2 KV heads of 64)
for the query widths of decoding at C=1 (1: AR; 16: the drafter block; 33: a budget-32 tree) over a
few context lengths, at every key split (flash-decoding) and query block size, to pick
`choose_splits` / `choose_block_m` by measurement. CUDA graph replays, median of 200.

    python benchmarks/attention_tune.py OUT.jsonl
"""
from __future__ import annotations

import json
import sys

import torch

from ddtree.bench.latency import median_replay_ms
from ddtree.ops.attention import uniform_batch
from ddtree.ops.triton_attention import choose_block_m, choose_splits, triton_paged_attention

H, HKV, D, PAGE = 14, 2, 64, 16


def time_graph(fn, reps: int = 200) -> float:
    """Median microseconds of one replay of fn, captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_replay_ms(g, reps) * 1e3


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "attention_tune.jsonl"
    dev = torch.device("cuda")
    rows = []
    for ctx in (256, 512, 1024, 2048):
        pages = -(-(ctx + 64) // PAGE)
        cache = torch.randn(pages * PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
        vcache = torch.randn_like(cache)
        tables = torch.arange(pages, device=dev)[None]
        for width in (1, 16, 33):
            q = torch.randn(width, H, D, device=dev, dtype=torch.bfloat16)
            mask = torch.tril(torch.ones(1, width, width, dtype=torch.bool, device=dev)) if width > 1 else None
            starts = torch.tensor([ctx], device=dev)
            default_bm = choose_block_m(width, H // HKV)
            for bm in sorted({default_bm, 8, 16}):
                for splits in (1, 2, 4, 8, 16):
                    batch = uniform_batch(tables, starts, width, mask, PAGE, True, H // HKV, HKV)
                    per = -(-width // bm)
                    batch.block_m, batch.splits = bm, splits
                    batch.blk_req = torch.zeros(per, device=dev, dtype=torch.int32)
                    batch.blk_q = torch.arange(per, device=dev, dtype=torch.int32) * bm
                    us = time_graph(lambda: triton_paged_attention(q, cache, vcache, batch, D ** -0.5))
                    row = {"ctx": ctx, "width": width, "block_m": bm, "splits": splits, "us": round(us, 2),
                           "default": bm == default_bm and splits == choose_splits(per, HKV, width)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
