"""auto's start-up cost table, timed as it is (fake requests whose pages are all the scratch page, a
256-token context) and as served requests are laid out (pages of their own, longer contexts).

    python benchmarks/table_ab.py OUT_DIR [BATCH,...] [--cpu]

On the H200 (74e819f) the table put budget 16's whole step 4.5% above budget 8's at batch 8, where the
fixed runs' steps differed by 9% (tau 2.63 and 2.48 at 7,110 and 7,330 tok/s, C=8), and it timed budget
8's verify at batch 16 at 1.77 ms in one start-up and 1.67 in another: the plan picked budget 16 at C=8
and 4 at C=16 where 8 was best. A wider tree attends with more rows over the whole context; on one
scratch page that context sits in cache. For each batch size and layout this writes (profile.jsonl in
OUT_DIR, and prints) the median ms of auto's AR step, its draft and a whole step of each budget, with
the ratios between budgets. The model is random with the default target's exact shapes and the
shipped drafter (no download); `--cpu`: a tiny model on the CPU (a smoke test: CPU times mean little).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from ddtree import LLM  # noqa: E402
from ddtree.models.hub import DEFAULT_DRAFT_DIR  # noqa: E402
from ddtree.spec.costs import AR_TIMING_BURST, wall_ms  # noqa: E402

LAYOUTS = [("scratch", False, 256), ("distinct", True, 256), ("distinct", True, 640)]  # (name, distinct, context)


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    cpu = "--cpu" in sys.argv
    out = args[0] if args else "."
    batches = [int(b) for b in args[1].split(",")] if len(args) > 1 else [1, 4, 8, 16, 32]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "profile.jsonl"), "a")
    if cpu:
        from tiny import make_tiny_model
        from ddtree.models.dflash import random_drafter, save_drafter
        model = make_tiny_model(tempfile.mkdtemp(), "qwen2", num_hidden_layers=2)
        llm = LLM(model, spec="none", device="cpu", dtype="float32")
        draft = tempfile.mkdtemp()
        save_drafter(random_drafter(llm.config, num_layers=1, block_size=8, target_layer_ids=[0, 1]), draft,
                     torch.float32)
        kw = dict(device="cpu", dtype="float32")
    else:
        from gpu_profile import default_shaped_model  # (benchmarks/, this script's folder)
        model, draft, kw = default_shaped_model(), DEFAULT_DRAFT_DIR, dict(dtype="bfloat16")
    pages = max(batches) * -(-(max(c for *_, c in LAYOUTS) + 256) // 16) + 64
    llm = LLM(model, draft=draft, spec="ddtree", budget="auto", topk=4, max_num_seqs=max(batches),
              num_pages=pages, **kw)
    spec, reps = llm.engine.speculator, 3 if cpu else 15
    budgets = [b for b in spec.budgets if b > 0]

    def ms(fn, repeat: int = 1) -> float:
        fn()
        return statistics.median(wall_ms(fn, spec.runner.device, reps, repeat))

    with torch.inference_mode():
        for bs in batches:
            for name, distinct, context in LAYOUTS:
                steps = spec.fake_steps(bs, context, distinct)
                row = {"batch": bs, "layout": name, "context": context, "ar_ms": ms(steps[0], AR_TIMING_BURST),
                       "draft_ms": ms(steps["draft"]), "step_ms": {b: ms(steps[b]) for b in budgets}}
                row["ratios"] = {f"{b}/{a}": row["step_ms"][b] / row["step_ms"][a] for a, b in zip(budgets, budgets[1:])}
                row = json.loads(json.dumps(row), parse_float=lambda x: round(float(x), 4))
                print(json.dumps(row), flush=True)
                log.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
