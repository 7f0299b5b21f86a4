"""`ddtree bench sweep`: the DDTree budget x topk grid, plus DFlash (linear) and AR, in process.

Same measurement as `ddtree bench latency` (`run_mode`: one warm-up batch, batches of C prompts run to
completion, median over repeats), over a grid of configurations, so one run answers "which budget and
topk are fastest at each concurrency". With `--with-auto` an adaptive-budget row (mode `auto`, budget
"auto") is added. Rows carry the acceptance length histogram and, at C=1 on a dataset with categories
(MT-Bench), per-category results; all rows are appended as JSON lines.

`--interleave` keeps every mode's engine (`LLM.switch_mode`) and, at each concurrency, runs the modes in
turn, run by run: run a mode at a time and a machine's drift over minutes (several percent between
grids at high concurrency) reads as a difference between modes; in turn, a drift falls on every mode
alike. Every other round runs in reverse order. Each mode keeps its own KV cache: `--num-pages` sizes them.
"""
from __future__ import annotations

import itertools
import json
import os

from ddtree import LLM, SamplingParams
from ddtree.config import PolicyConfig
from ddtree.bench.datasets import sample_prompts
from ddtree.bench.latency import RunTally, environment, full_batches, print_table, run_mode, per_request


def check_auto(llm: LLM, topk: int | None) -> None:
    """Fails before any measurement when this build has no adaptive speculation."""
    try:
        llm.set_mode("ddtree", "auto", topk)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--with-auto needs adaptive speculation (LLM budget='auto'), which this build does "
                         f"not support: {e}") from None


def modes(args) -> list[tuple[str, str, int | str | None, int | None]]:
    """(row mode, spec, budget, topk) for every configuration to measure, in order (auto first: the
    engine is already in that mode after `check_auto`, and its start-up measurement is not repeated)."""
    out = [("auto", "ddtree", "auto", args.auto_topk)] if args.with_auto else []
    out += [] if args.no_ar else [("ar", "none", 0, 1)]
    if not args.no_dflash:
        out.append(("dflash", "dflash", None, 1))
    return out + [("ddtree", "ddtree", b, k) for b in args.budget for k in args.topk if not args.no_ddtree]


def main(args) -> int:
    from ddtree.models.hub import default_draft, is_default_model
    if args.draft is None and is_default_model(args.model):
        args.draft = default_draft()  # the default pair
    if args.draft is None:
        raise ValueError("bench sweep needs --draft (a DFlash drafter checkpoint dir)")
    if any(b < 1 for b in args.budget) or any(k < 1 for k in args.topk):
        raise ValueError(f"budgets and topk must be >= 1, got --budget {args.budget} --topk {args.topk}")
    if args.interleave and args.num_pages is None:
        # (sized from free memory on a GPU, the first engine's cache would leave the next ones none; on the
        # CPU each would take kv_cache_gb)
        raise ValueError("--interleave keeps a KV cache per mode: give --num-pages (e.g. 16384 on the H200)")
    llm = LLM(args.model, draft=args.draft, device=args.device, dtype=args.dtype, spec="none",
              max_num_seqs=max(args.concurrency), num_pages=args.num_pages,
              policy=PolicyConfig(trace=getattr(args, "policy_trace", None)),
              enable_prefix_caching=getattr(args, "enable_prefix_caching", False),
              prefix_state_snapshots=getattr(args, "prefix_state_snapshots", None))
    rows_in = sample_prompts(args.dataset, args.num_prompts)
    prompts = [llm.encode_chat(r["messages"]) for r in rows_in]
    cats = [r["category"] for r in rows_in]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature,
                            top_p=args.top_p, seed=None if args.seed < 0 else args.seed)
    if args.warmup_pass:  # (the engine is still plain AR here: no mode's state learns from this pass)
        for c in args.concurrency:
            for batch in full_batches(prompts, c):
                llm.generate(batch, per_request(params, len(batch)))
        print(f"warm-up pass: {len(prompts)} prompts at C={','.join(map(str, args.concurrency))} (AR, untimed)")
    if args.with_auto:
        check_auto(llm, args.auto_topk)
    env = environment(llm)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    results = []

    def workload(c: int):
        """(batches, warm-up prompts, per-batch labels) at concurrency c."""
        # per category only at C=1, where a batch is one prompt and its time is that category's alone
        labels = cats if c == 1 and len(set(cats)) > 1 else None
        if args.continuous and c > 1:
            # every prompt queued at once (cycled to at least 2c, so that c run for most of the time), at
            # most c running: a finished request's slot goes to the next prompt (continuous batching, as a
            # server at concurrency c), where a batch run to completion spends its end on its slowest request
            return [list(itertools.islice(itertools.cycle(prompts), max(len(prompts), 2 * c)))], prompts[:c], labels
        return full_batches(prompts, c), None, labels

    def enter(c: int) -> None:
        if args.continuous and c > 1:
            llm.engine.scheduler.max_num_seqs = c

    def record(name: str, spec: str, c: int, r: dict) -> None:
        row = {**env, "bench": "sweep", "mode": name, "spec": spec, "budget": llm.budget, "topk": llm.topk,
               # (at C=1 one request at a time either way: a --continuous run's rows all say so)
               "concurrency": c, "batching": "continuous" if args.continuous else "to completion",
               "interleaved": args.interleave, "dataset": args.dataset, "num_prompts": len(prompts),
               "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
               "top_p": args.top_p, "seed": args.seed, **r}
        results.append(row)
        with open(args.out, "a") as f:  # row by row: a long grid that dies keeps what it measured
            f.write(json.dumps(row) + "\n")
        print(f"{name:7s} budget {str(llm.budget):>4s} topk {llm.topk} C={c:3d}: "
              f"{r['output_tok_per_s']:8.1f} tok/s  tau {r['mean_accept_length'] or 1.0:.2f}", flush=True)

    if args.interleave:  # per concurrency: each mode warmed up, then the modes in turn, run by run
        for c in args.concurrency:
            batches, warmup, labels = workload(c)
            tallies = []
            for name, spec, budget, topk in modes(args):
                llm.switch_mode(spec, budget, topk)
                enter(c)
                first = batches[0] if warmup is None else warmup
                llm.generate(first, per_request(params, len(first)))  # warm-up
                tallies.append(RunTally(labels))
            turn = list(zip(modes(args), tallies))
            for rep in range(args.repeats):
                # (every other round in reverse: a mode runs after one neighbour, then after the other, not
                # always right after the same one, e.g. the slowest, whose long run may leave the GPU's
                # clocks or the host's caches otherwise)
                for (name, spec, budget, topk), tally in (turn if rep % 2 == 0 else turn[::-1]):
                    llm.switch_mode(spec, budget, topk)
                    enter(c)
                    tally.run(llm, batches, params)
            for (name, spec, budget, topk), tally in zip(modes(args), tallies):
                llm.switch_mode(spec, budget, topk)
                record(name, spec, c, tally.row(llm))
    else:
        for n, (name, spec, budget, topk) in enumerate(modes(args)):
            if not (n == 0 and name == "auto"):
                llm.set_mode(spec, budget, topk)
            for c in args.concurrency:
                batches, warmup, labels = workload(c)
                enter(c)
                record(name, spec, c, run_mode(llm, batches, params, args.repeats, labels, warmup))
    print_table(results)
    print(f"results appended to {args.out}")
    return 0
