"""`ddtree bench acceptance`: a drafter's greedy DFlash and DDTree acceptance lengths without timing.

The target answers the prompts greedily once (plain AR), then train/acceptance.py replays every mode's
verify steps against those answers: one drafter pass a step, no target forward. The same tau as
`bench latency`'s greedy rows (step for step, in float32; tests/test_train.py), at a fraction of the
cost, so a drafter can be judged on the CPU. Rows: JSON lines with the environment of `bench latency`.
"""
from __future__ import annotations

import json
import os
import time

from ddtree import LLM
from ddtree.bench.datasets import sample_prompts
from ddtree.bench.latency import environment, parse_budgets
from ddtree.train.acceptance import Mode, dflash_mode, greedy_answers, mean_tau, replay


def main(args) -> int:
    from ddtree.models.hub import default_draft, is_default_model
    if args.draft is None and is_default_model(args.model):
        args.draft = default_draft()
    if args.draft is None:
        raise ValueError("bench acceptance needs --draft (a DFlash drafter checkpoint dir)")
    budgets = parse_budgets(args.budget)
    if "auto" in budgets:
        raise ValueError("bench acceptance replays fixed trees: budget 'auto' has no acceptance of its own")
    llm = LLM(args.model, draft=args.draft, device=args.device, dtype=args.dtype, spec="none",
              max_num_seqs=args.num_prompts)
    env = environment(llm)
    t0 = time.perf_counter()
    records = greedy_answers(llm, [r["messages"] for r in sample_prompts(args.dataset, args.num_prompts)],
                             args.max_tokens)
    t_answers = time.perf_counter() - t0
    drafter = llm.drafter
    modes = [dflash_mode(drafter)] + [Mode(b, k) for b in budgets for k in args.topk]
    t0 = time.perf_counter()
    got = replay(drafter, llm.net, records, modes)
    t_replay = time.perf_counter() - t0
    rows = []
    for m in modes:
        steps = [n for per in got[m] for n in per]
        rows.append({**env, "mode": "dflash" if m.label == "dflash" else "ddtree", "budget": m.budget, "topk": m.topk,
                     "dataset": args.dataset, "num_prompts": len(records), "max_tokens": args.max_tokens,
                     "draft": args.draft, "mean_accept_length": round(mean_tau(got[m]), 4), "steps": len(steps),
                     "answer_tokens": sum(int(r["loss_mask"].sum()) for r in records),
                     "answers_s": round(t_answers, 1), "replay_s": round(t_replay, 1)})
        print(f"{m.name:18s} tau {rows[-1]['mean_accept_length']:.3f} over {len(steps)} steps", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"results appended to {args.out}")
    return 0
