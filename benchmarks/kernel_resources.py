"""What a Triton kernel costs in registers, spills and instructions on a Hopper GPU, read off its compiled
code on any machine: Triton compiles it for sm_90 with the ptxas it ships, no GPU needed.

    python benchmarks/kernel_resources.py [OUT.json] [--kernel tree] [--nodes 33] [--head 128] [--key-chunk 32]
    python benchmarks/kernel_resources.py [OUT.json] --kernel attention [--head 64] [--group 7]

- `tree`: the hybrid tree kernel (`_tree_delta_kernel`) at each split the autotuner may pick
  (`TREE_SPLITS`), for trees of `--nodes` nodes and heads of `--head` key and value channels, reading
  `--key-chunk` key channels at a time (the engine's `key_chunk` unless given).
- `attention`: the paged attention of a model with `--head` channels a head and `--group` query heads a
  KV head, at the tiles an AR step, a drafter block (16 rows), a 33-node verify and a prefill choose,
  with 4 and 8 warps (`chosen` marks `choose_warps`'s pick).

A row: registers a thread, stack bytes a thread (spilled registers live there, in local memory), local
loads and stores in the code, tensor-core instructions, barriers, shared memory. A kernel that spills pays
local-memory round trips inside its dependent chains; these counts show a change's effect on that before a
GPU times it. They are those of the Triton that runs this: to read what the GPU machine's Triton builds,
put that release first on the path (`pip install --no-deps --target DIR triton==X`, `PYTHONPATH=DIR:.`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ddtree.ops.triton_attention import (DECODE_MAX_Q, _paged_attention_kernel, choose_block_m, choose_block_n,
                                         choose_rows, choose_warps)
from ddtree.ops.triton_gdn import TREE_SPLITS, _tree_delta_kernel, key_chunk

HOPPER = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {  # (bfloat16 models)
    _tree_delta_kernel: {"State": "*fp32", "Slots": "*i64", "Prefix": "*i32", "Mixed": "*fp32", "B": "*bf16",
                         "A": "*bf16", "ALog": "*bf16", "DtBias": "*bf16", "Out": "*fp32", "Mask": "*i1",
                         "Dbuf": "*fp32", "Gbuf": "*fp32"},
    _paged_attention_kernel: {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "BlockTables": "*i32",
                              "PrefixLens": "*i32", "QLens": "*i32", "QStarts": "*i32", "BlkReq": "*i32",
                              "BlkQ": "*i32", "Mask": "*u8", "Part": "*fp32", "PartML": "*fp32", "scale": "fp32"},
}
STEPS = {"ar": (1, False), "draft16": (16, True), "verify33": (33, True), "prefill": (512, False)}


def compile_for_hopper(kernel, constants: dict, warps: int, stages: int):
    """`kernel` with these constexprs (the rest: its pointers' types, or 32-bit integers), for sm_90."""
    names = kernel.arg_names
    signature = {a: "constexpr" if a in constants else POINTERS[kernel].get(a, "i32") for a in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=HOPPER, options=dict(num_warps=warps, num_stages=stages))


def compile_tree_kernel(nodes: int, head: int, block_v: int, warps: int, stages: int = 3,
                        block_k: int | None = None):
    """The launch `tree_delta` makes for trees of `nodes` nodes, heads of `head` key and value channels
    (`block_k` key channels at a time: `key_chunk`'s unless given)."""
    NP = max(16, triton.next_power_of_2(nodes - 1))
    constants = dict(DK=head, DV=head, NP=NP, LOG_NP=NP.bit_length() - 1, SOLVE="tf32", BLOCK_V=block_v,
                     BLOCK_K=block_k or key_chunk(head))
    return compile_for_hopper(_tree_delta_kernel, constants, warps, stages)


def attention_tiles(head: int, group: int, max_q: int, masked: bool) -> dict:
    """The constexprs `triton_paged_attention` picks for a batch whose longest row has `max_q` tokens."""
    group_p, head_p = triton.next_power_of_2(group), triton.next_power_of_2(head)
    block_m = choose_block_m(max_q, group)
    rows = choose_rows(block_m * group_p, head_p, 2)
    return dict(PAGE=16, GROUP=group, GROUP_P=group_p, HEAD_DIM=head, HEAD_DIM_P=head_p, BLOCK_M=block_m, ROWS=rows,
                BLOCK_N=choose_block_n(rows, head_p, 2), HAS_MASK=masked, PRECISION="tf32",
                SPLITS=16 if max_q <= DECODE_MAX_Q else 1, NUM_HEADS=2 * group)


def resources(kernel, scratch: str) -> dict:
    """Registers and stack from cuobjdump's resource table, instruction counts from its SASS."""
    with open(scratch, "wb") as f:
        f.write(kernel.asm["cubin"])
    table = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", scratch],
                           capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", scratch],
                          capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", table).groups()
    code = [line.split("*/", 1)[1] for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", line)]
    count = lambda op: sum(1 for line in code if re.search(rf"\b{op}\b", line))  # noqa: E731
    return {"registers": int(regs), "stack_bytes": int(stack), "instructions": len(code), "local_loads": count("LDL"),
            "local_stores": count("STL"), "mma": count("HMMA") + count("HGMMA"), "barriers": count("BAR"),
            "shared_bytes": kernel.metadata.shared}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--kernel", choices=["tree", "attention"], default="tree")
    ap.add_argument("--nodes", type=int, default=33, help="tree: nodes a tree")
    ap.add_argument("--head", type=int, default=None, help="channels a head (tree: 128, attention: 64)")
    ap.add_argument("--group", type=int, default=7, help="attention: query heads a KV head")
    ap.add_argument("--stages", type=int, default=3, help="tree: software pipelining stages")
    ap.add_argument("--key-chunk", type=int, default=None, help="tree: key channels at a time (key_chunk's)")
    args = ap.parse_args()
    rows, scratch = [], os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    if args.kernel == "tree":
        head = args.head or 128
        for config in TREE_SPLITS:
            block_v, warps = config.kwargs["BLOCK_V"], config.num_warps
            if block_v <= head:
                row = {"nodes": args.nodes, "head": head, "block_v": block_v, "warps": warps, "stages": args.stages,
                       "block_k": args.key_chunk or key_chunk(head)}
                kernel = compile_tree_kernel(args.nodes, head, block_v, warps, args.stages, args.key_chunk)
                rows.append(row | resources(kernel, scratch))
                print(json.dumps(rows[-1]), flush=True)
    else:
        head = args.head or 64
        for step, (max_q, masked) in STEPS.items():
            tiles = attention_tiles(head, args.group, max_q, masked)
            chosen = choose_warps(tiles["ROWS"], tiles["BLOCK_N"], tiles["HEAD_DIM_P"], 2)
            for warps in (4, 8):
                row = {"step": step, "head": head, "group": args.group, "rows": tiles["ROWS"],
                       "block_n": tiles["BLOCK_N"], "warps": warps, "chosen": warps == chosen}
                rows.append(row | resources(compile_for_hopper(_paged_attention_kernel, tiles, warps, 3), scratch))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
