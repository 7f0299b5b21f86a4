"""The candidate-levels Triton kernel (ops/triton_tree.py) against the torch sorts (spec/tree.py
`_levels`) on the H200, in one process, on a random model with the default target's exact shapes and
the shipped drafter (no download).

    python benchmarks/tree_kernel_ab.py OUT_DIR [BATCH,...]

For each batch size, writes to OUT_DIR/profile.jsonl (and prints):
- whether the kernel's candidates equal the torch sorts' bit for bit on the drafter's real logits;
- the graph replay ms of auto's draft (drafter block, candidates for budget 32, E(b)) and of whole
  speculative steps of budget 8 and 32, with the kernel off and on;
- the per-kernel GPU time of one eager whole step of budget 8 with the kernel on (what is left).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from draft_profile import replay_ms  # noqa: E402
from gpu_profile import default_shaped_model, emit, kernel_table  # noqa: E402

import ddtree.spec.tree as tree  # noqa: E402
from ddtree import LLM  # noqa: E402
from ddtree.models.hub import DEFAULT_DRAFT_DIR  # noqa: E402


def same_candidates(spec, inp) -> bool:
    """The kernel's candidates for budget 32 equal the torch sorts' on this draft."""
    logits = spec.drafter.logits(inp)
    out = {}
    for on in (False, True):
        tree.TREE_KERNEL = on
        c = tree.candidates(logits, spec.budget, spec.topk)
        out[on] = (c.score, c.parent, c.rank, c.order)
    return all(torch.equal(a, b) for a, b in zip(out[False], out[True]))


def main() -> int:
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 8, 16, 32]
    d = default_shaped_model()
    emit("env", gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    llm = LLM(d, draft=DEFAULT_DRAFT_DIR, spec="ddtree", budget="auto", topk=4, max_num_seqs=max(batches),
              dtype="bfloat16")
    spec = llm.engine.speculator
    spec.draft_graphs = spec.ar_graphs = None  # fake_steps then hands out eager closures
    spec.step_graphs = {}
    with torch.inference_mode():
        for bs in batches:
            steps = spec.fake_steps(bs, 256)
            inp = steps["draft"].args[0]
            row = {"batch": bs, "equal": same_candidates(spec, inp)}
            for on in (False, True):
                tree.TREE_KERNEL = on
                tag = "kernel" if on else "torch"
                row[f"draft_{tag}_ms"] = replay_ms(lambda: spec._draft(inp))
                for b in (8, 32):
                    row[f"step{b}_{tag}_ms"] = replay_ms(lambda: spec._whole_step(b, inp))
            emit("tree-kernel-ab", **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            if bs in (1, 8):
                tree.TREE_KERNEL = True
                kernel_table(lambda: spec._whole_step(8, inp), f"step8_kernel_bs{bs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
