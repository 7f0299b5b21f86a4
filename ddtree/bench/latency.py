"""`ddtree bench latency`: offline, in-process decoding speed of AR / DFlash / DDTree (and peers).

For each mode and concurrency C, batches of C chat prompts run to completion (greedy); one warm-up
batch first (it also captures the CUDA graphs); throughput is generated tokens over wall time,
median over repeats; tau is the mean tokens committed per verify step. Optionally also the
per-step device times (AR decode step, draft step, verify step by width) and the peers
(transformers generate with dynamic and static cache, the z-lab reference dflash_generate).
Results are JSON lines, one object per measured configuration.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.config import PolicyConfig
from ddtree.bench.datasets import load_prompts
from ddtree.bench.steps import step_times


def environment(llm: LLM | None = None) -> dict:
    commit = os.environ.get("DDTREE_COMMIT")  # set where the tree travels without .git (the GPU machine)
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    cuda = torch.cuda.is_available()
    import transformers
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "commit": commit,
            "command": " ".join(["ddtree"] + sys.argv[1:]), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def full_batches(prompts: list, c: int) -> list[list]:
    """Batches of exactly c prompts (repeating prompts to fill the last), so a row labelled C ran at C."""
    n = -(-max(len(prompts), c) // c) * c
    cycled = list(itertools.islice(itertools.cycle(prompts), n))
    return [cycled[i:i + c] for i in range(0, n, c)]


def per_request(params: SamplingParams, n: int) -> SamplingParams | list[SamplingParams]:
    """A batch's params: seeded ones give request j of the batch the seed `params.seed + j`, so every
    mode and every run draws the same tokens (sampling is keyed by seed and position, and lossless), and
    their speeds compare on the same work."""
    if params.seed is None or params.greedy:
        return params
    return [dataclasses.replace(params, seed=params.seed + j) for j in range(n)]


def run_mode(llm: LLM, batches: list[list[list[int]]], params: SamplingParams, repeats: int,
             labels: list[str] | None = None, warmup: list[list[int]] | None = None) -> dict:
    """`labels`: the category of each batch (a batch holds one category), for per-category results;
    `warmup`: the untimed first call's prompts (default: the first batch)."""
    first = batches[0] if warmup is None else warmup
    llm.generate(first, per_request(params, len(first)))  # warm-up: graphs, kernels, allocator
    tally = RunTally(labels)
    for _ in range(repeats):
        tally.run(llm, batches, params)
    return tally.row(llm)


class RunTally:
    """Timed runs of one mode over the same batches, added up into one results row (the median run's
    tok/s); the runs may interleave with other modes' (`LLM.switch_mode`)."""

    def __init__(self, labels: list[str] | None = None):
        self.labels = labels
        self.speeds: list[float] = []
        self.accepts: list[int] = []
        self.tokens = 0
        self.cats: dict[str, dict] = {}
        self.budget_hist: dict[str, int] = {}
        self.bursts: dict[str, float] = {}

    def run(self, llm: LLM, batches: list[list[list[int]]], params: SamplingParams) -> None:
        """One timed run: every batch once, in order."""
        gen, elapsed = 0, 0.0
        for i, batch in enumerate(batches):
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(batch, per_request(params, len(batch)))
            sync()
            dt = time.perf_counter() - t0
            elapsed += dt
            n = sum(len(o.token_ids) for o in outs)
            gen += n
            acc = [a for o in outs for a in o.accept_lengths]
            self.accepts += acc
            for b, m in llm.last_stats.get("budget_hist", {}).items():  # what `auto` chose (request-steps)
                self.budget_hist[str(b)] = self.budget_hist.get(str(b), 0) + m
            if llm.last_stats.get("bursts"):  # ... how it grouped its steps, and their share of the wall time
                for k, m in {**llm.last_stats["bursts"], "wall_ms": dt * 1e3}.items():
                    self.bursts[k] = self.bursts.get(k, 0) + m
            if self.labels:
                c = self.cats.setdefault(self.labels[i], {"tokens": 0, "time": 0.0, "accepts": []})
                c["tokens"], c["time"] = c["tokens"] + n, c["time"] + dt
                c["accepts"] += acc
        self.speeds.append(gen / elapsed)
        self.tokens = gen

    def row(self, llm: LLM) -> dict:
        """The row (with, under auto, what its policy learned by now: call it in that mode)."""
        # (the acceptance figures, budget_hist and bursts add up every run, len(runs_tok_per_s) of them;
        # generated_tokens is one run's)
        accepts, runs = self.accepts, len(self.speeds)
        row = {"output_tok_per_s": statistics.median(self.speeds), "runs_tok_per_s": self.speeds,
               "mean_accept_length": sum(accepts) / len(accepts) if accepts else None, "generated_tokens": self.tokens,
               "accept_length_hist": accept_hist(accepts)}
        if self.budget_hist:
            row["budget_hist"] = dict(sorted(self.budget_hist.items(), key=lambda kv: int(kv[0])))
        if self.bursts:
            row["bursts"] = {k: round(v, 1) if isinstance(v, float) else v for k, v in self.bursts.items()}
        policy = getattr(llm.engine.speculator, "policy", None)
        if policy is not None and hasattr(policy, "state"):  # auto: what it learned by the end
            row["policy"] = policy.state()
        if self.labels:
            row["per_category"] = {
                k: {"output_tok_per_s": c["tokens"] / c["time"], "generated_tokens": c["tokens"] // runs,
                    "mean_accept_length": sum(c["accepts"]) / len(c["accepts"]) if c["accepts"] else None}
                for k, c in self.cats.items()}
        return row


def accept_hist(accepts: list[int]) -> dict[str, int]:
    """Counts of tokens committed per verify step, {"1": n1, "2": n2, ...} (JSON keys are strings)."""
    counts: dict[int, int] = {}
    for a in accepts:
        counts[a] = counts.get(a, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def run_peers(llm: LLM, prompts: list[list[int]], max_tokens: int, draft: str | None) -> list[dict]:
    """transformers generate (dynamic and static cache) and the reference dflash_generate, batch 1."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=llm.dtype).to(llm.device).eval()
    eos = llm.config.eos_token_ids
    results = []

    def timed(gen_one) -> dict:
        gen_one(prompts[0])  # warm-up (compiles the static-cache forward)
        n, t = 0, 0.0
        for p in prompts:
            sync()
            t0 = time.perf_counter()
            n += gen_one(p)
            sync()
            t += time.perf_counter() - t0
        return {"output_tok_per_s": n / t, "generated_tokens": n}

    def hf_gen(cache):
        def one(p):
            ids = torch.tensor([p], device=llm.device)
            kw = {"cache_implementation": "static"} if cache == "static" else {}
            out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0], **kw)
            return out.shape[1] - len(p)
        return one

    with torch.inference_mode():
        results.append({"mode": "hf-dynamic", **timed(hf_gen("dynamic"))})
        results.append({"mode": "hf-static", **timed(hf_gen("static"))})
    if draft:
        from dflash.model import DFlashDraftModel, dflash_generate
        ref = DFlashDraftModel.from_pretrained(draft, dtype=llm.dtype).to(llm.device).eval()
        accepts = []

        def one(p):
            res = dflash_generate(ref, hf, torch.tensor([p], device=llm.device), max_new_tokens=max_tokens,
                                  stop_token_ids=eos, temperature=0.0, return_stats=True)
            accepts.extend(res.acceptance_lengths)
            return res.num_output_tokens
        row = {"mode": "dflash-reference", **timed(one)}
        row["mean_accept_length"] = sum(accepts) / len(accepts) if accepts else None
        results.append(row)
    del hf
    return results


def parse_budgets(text: str | list) -> list[int | str]:
    """--budget: comma-separated budgets, each an integer >= 1 or "auto"."""
    items = text if isinstance(text, list) else [x.strip() for x in text.split(",") if x.strip()]
    out = [x if x == "auto" else int(x) if str(x).isdigit() and int(x) >= 1 else None for x in items]
    if not out or None in out:
        raise ValueError(f"--budget: expected comma-separated integers >= 1 or 'auto', got {text!r}")
    return out


def main(args) -> int:
    from ddtree.models.hub import default_draft, is_default_model
    if args.draft is None and is_default_model(args.model):
        args.draft = default_draft()  # the default pair
    llm = LLM(args.model, draft=args.draft, device=args.device, dtype=args.dtype, spec="none",
              max_num_seqs=max(args.concurrency), num_pages=args.num_pages,
              policy=PolicyConfig(trace=getattr(args, "policy_trace", None)),
              enable_prefix_caching=getattr(args, "enable_prefix_caching", False),
              prefix_state_snapshots=getattr(args, "prefix_state_snapshots", None))
    env = environment(llm)
    rows_in = load_prompts(args.dataset, args.num_prompts)
    prompts = [llm.encode_chat(r["messages"]) for r in rows_in]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=None if args.seed < 0 else args.seed)
    budgets = parse_budgets(args.budget)
    modes = [("ar", "none", 0, 1)]
    if args.draft:
        modes.append(("dflash", "dflash", None, 1))
        modes += [("auto" if b == "auto" else "ddtree", "ddtree", b, k) for b in budgets for k in args.topk]
    results = []
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for name, spec, budget, topk in modes:
        llm.set_mode(spec, budget, topk)
        for c in args.concurrency:
            batches = full_batches(prompts, c)
            r = run_mode(llm, batches, params, args.repeats)
            row = {**env, "mode": name, "budget": llm.budget, "topk": llm.topk, "concurrency": c,
                   "dataset": args.dataset, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                   "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, **r}
            if name == "auto":  # the step costs measured at start-up that `auto` chose from
                row["cost_table"] = llm.engine.speculator.policy.table.as_dict()
            results.append(row)
            print(f"{name:7s} budget {str(llm.budget):>4s} topk {llm.topk} C={c:3d}: {r['output_tok_per_s']:8.1f} tok/s"
                  f"  tau {r['mean_accept_length'] or 1.0:.2f}", flush=True)
        if args.step_times and (spec != "none" or not args.draft):
            widths = sorted({b + 1 for b in budgets if b != "auto"}
                            | {llm.drafter.dcfg.block_size if llm.drafter else 1})
            for st in step_times(llm, args.concurrency, widths if spec != "none" else []):
                row = {**env, "mode": f"step-times-{name}", "budget": llm.budget, "topk": llm.topk,
                       "dataset": None, **st}
                results.append(row)
                print("step times", json.dumps(st), flush=True)
    if args.peers:
        for r in run_peers(llm, prompts[:args.peer_prompts], args.max_tokens, args.draft):
            row = {**env, "budget": 0, "topk": 0, "concurrency": 1, "dataset": args.dataset,
                   "num_prompts": args.peer_prompts, "max_tokens": args.max_tokens, **r}
            row.setdefault("mean_accept_length", None)
            results.append(row)
            print(f"{r['mode']:16s} C=  1: {r['output_tok_per_s']:8.1f} tok/s", flush=True)
    with open(args.out, "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print_table(results)
    print(f"results appended to {args.out}")
    return 0


def print_table(results: list[dict]) -> None:
    ar = {r["concurrency"]: r["output_tok_per_s"] for r in results if r["mode"] == "ar"}
    print(f"\n{'mode':18s} {'budget':>6s} {'topk':>4s} {'C':>4s} {'tok/s':>9s} {'tau':>5s} {'vs AR':>6s}")
    for r in results:
        if "output_tok_per_s" not in r:
            continue
        base = ar.get(r["concurrency"])
        ratio = f"{r['output_tok_per_s'] / base:.2f}x" if base else ""
        tau = f"{r['mean_accept_length']:.2f}" if r.get("mean_accept_length") else "-"
        print(f"{r['mode']:18s} {str(r['budget']):>6s} {r['topk']:4d} {r['concurrency']:4d} "
              f"{r['output_tok_per_s']:9.1f} {tau:>5s} {ratio:>6s}")
