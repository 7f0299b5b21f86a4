"""Where a draft's time goes as the batch grows, on a random model with the default target's exact
shapes and the shipped drafter (no download).

    python benchmarks/draft_profile.py OUT_DIR [BATCH,...]

auto's cost table (session 6) put its draft graph (drafter block, candidates for budget 32, E(b)) at
0.65 ms at batch 1 but 2.7 ms at 16 and 15.8 ms at 128, against 0.22 ms for the drafter block alone
at batch 1. For each batch size this writes (profile.jsonl in OUT_DIR, and prints): the graph replay
time of the drafter block's logits alone, of auto's whole draft, and of DFlash's chain draft (CUDA
events, back to back), and the per-kernel GPU time of one eager auto draft (torch profiler).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from gpu_profile import default_shaped_model, emit, kernel_table  # noqa: E402

from ddtree import LLM  # noqa: E402
from ddtree.models.hub import DEFAULT_DRAFT_DIR  # noqa: E402
from ddtree.ops.fused import graphing  # noqa: E402
from ddtree.spec.tree import chain_tree  # noqa: E402


def replay_ms(fn, reps: int = 20) -> float:
    """GPU time of one call, captured in a CUDA graph and replayed back to back."""
    with graphing():  # (the engine's graphs run the fused element-wise ops compiled)
        for _ in range(2):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 64, 128]
    d = default_shaped_model()
    emit("env", gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    llm = LLM(d, draft=DEFAULT_DRAFT_DIR, spec="ddtree", budget="auto", topk=4, max_num_seqs=max(batches),
              dtype="bfloat16")
    spec = llm.engine.speculator
    graphs, spec.draft_graphs = spec.draft_graphs, None  # fake_steps then hands out eager closures
    with torch.inference_mode():
        for bs in batches:
            steps = spec.fake_steps(bs, 256)
            inp = steps["draft"].args[0]
            row = {"batch": bs,
                   "drafter_logits_ms": replay_ms(lambda: spec.drafter.logits(inp)),
                   "auto_draft_ms": replay_ms(lambda: spec._draft(inp)),
                   "dflash_draft_ms": replay_ms(lambda: chain_tree(spec.drafter.logits(inp), inp.roots, 15))}
            emit("draft-times", **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            kernel_table(lambda: spec._draft(inp), f"auto_draft_bs{bs}")
    spec.draft_graphs = graphs
    return 0


if __name__ == "__main__":
    sys.exit(main())
