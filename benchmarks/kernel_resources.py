"""What the hybrid tree kernel costs in registers, spills and instructions on a Hopper GPU, read off its
compiled code on any machine: Triton compiles it for sm_90 with the ptxas it ships, no GPU needed.

    python benchmarks/kernel_resources.py [--nodes 33] [--head 128] [--stages 3] [OUT.json]

One row per split the autotuner may pick (`TREE_SPLITS`): registers a thread, stack bytes a thread
(spilled registers live there, in local memory), local loads and stores in the code, tensor-core
instructions, barriers, shared memory. A kernel that spills pays local-memory round trips inside its
dependent chain of products; these counts show a change's effect on that before a GPU times it.
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

from ddtree.ops.triton_gdn import TREE_SPLITS, _tree_delta_kernel

HOPPER = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"State": "*fp32", "Slots": "*i64", "Prefix": "*i32", "Mixed": "*fp32", "B": "*bf16", "A": "*bf16",
            "ALog": "*bf16", "DtBias": "*bf16", "Out": "*fp32", "Mask": "*i1", "Dbuf": "*fp32", "Gbuf": "*fp32"}


def compile_tree_kernel(nodes: int, head: int, block_v: int, warps: int, stages: int):
    """`_tree_delta_kernel` for a bfloat16 model's trees of `nodes` nodes and heads of `head` key and value
    channels, compiled for sm_90 (the launch `tree_delta` makes)."""
    NP = max(16, triton.next_power_of_2(nodes - 1))
    constants = dict(DK=head, DV=head, NP=NP, LOG_NP=NP.bit_length() - 1, SOLVE="tf32", BLOCK_V=block_v,
                     BLOCK_K=min(head, 32))
    names = _tree_delta_kernel.arg_names
    constants = {k: v for k, v in constants.items() if k in names}  # (earlier versions take no BLOCK_K)
    signature = {a: "constexpr" if a in constants else POINTERS.get(a, "i32") for a in names}
    source = ASTSource(_tree_delta_kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=HOPPER, options=dict(num_warps=warps, num_stages=stages))


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
            "local_stores": count("STL"), "mma": count("HMMA"), "barriers": count("BAR"),
            "shared_bytes": kernel.metadata.shared}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--nodes", type=int, default=33)
    ap.add_argument("--head", type=int, default=128, help="key and value channels a head")
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    rows, scratch = [], os.path.join(tempfile.mkdtemp(), "tree.cubin")
    for config in TREE_SPLITS:
        block_v, warps = config.kwargs["BLOCK_V"], config.num_warps
        if block_v > args.head:
            continue
        row = {"nodes": args.nodes, "head": args.head, "block_v": block_v, "warps": warps, "stages": args.stages}
        row.update(resources(compile_tree_kernel(args.nodes, args.head, block_v, warps, args.stages), scratch))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
