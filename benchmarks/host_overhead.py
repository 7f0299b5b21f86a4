"""Host (Python) time per engine step, independent of model compute, measured on the CPU.

A tiny random model (1 layer, hidden 64) stands in for the target, and the device work is stubbed
out so that what is timed is only the host code around it:

- `ar`: the GPU decode path. The CUDA graph pool is replaced by a stub returning precomputed logits,
  so a step is schedule -> pack inputs -> (stub) -> sample + read-back -> commit, as on the H200.
- `ar-eager`: the CPU path (`ModelRunner.run`: prepare inputs and attention metadata), with the
  model's forward and LM head stubbed.
- `auto-ar`: `--budget auto` on a cost table where speculation never pays, with a run's evidence of it
  (32 verify steps), so every step is plain AR's (its stub; the plan not asked): what auto's AR costs
  on the host beyond `ar`'s. (The tapped pool's stub also returns the target features a step reads out.)
- `ddtree`: the GPU speculative path (budget 16, topk 4, block 16). The step's graph pool is replaced
  by a stub returning a fixed outcome (3 draft tokens accepted + bonus), so a step is schedule ->
  drafter inputs -> (stub) -> read-back -> commit.
- `auto-spec`: `--budget auto` where speculation pays (verifying priced at an AR step), its graphed
  bursts on stubs of every budget's whole step with the same outcome as `ddtree`'s and each budget's
  E(b) in the read-back: what auto's speculation costs on the host beyond fixed DDTree's (the plan per
  burst, the E read-back and averages per step).

Each configuration runs `LLM.generate` (greedy, ignore_eos, fixed max_tokens, one prompt per request)
several times; a run's host time per decode step is (its total time - the prefill step) / decode
steps, and the table shows the median over runs. `--profile MODE BATCH` prints a cProfile of one run.

    python benchmarks/host_overhead.py [--reps 7] [--tag after] [--profile ar 64]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from ddtree.engine.engine import DECODE_BURST  # noqa: E402
from ddtree.engine.graphs import GraphPool  # noqa: E402
from ddtree.llm import LLM  # noqa: E402
from ddtree.models.dflash import random_drafter  # noqa: E402
from ddtree.sampling_params import SamplingParams  # noqa: E402
from ddtree.spec.costs import CostTable  # noqa: E402
from ddtree.spec.decode import StepOutputs  # noqa: E402
from tiny import make_tiny_model  # noqa: E402

PROMPT_LEN = 12  # <= block size: the first speculative step already takes the (stubbed) graph path
ACCEPT = 3  # draft tokens accepted per stubbed speculative step
SPEC_MODES = ("ddtree", "auto-spec")  # modes whose steps are stubbed speculative ones (ACCEPT + 1 tokens)


class _NoGraph:
    def replay(self) -> None:
        pass


class StubPool(GraphPool):
    """A `GraphPool` whose captured step is a no-op returning precomputed outputs: its host work
    (copying the inputs into the static buffers, padding) runs as on the GPU."""

    def __init__(self, out, pad: dict, widths: dict, max_batch: int = 64):
        super().__init__(lambda inp: out, max_batch, pad, widths)

    def _capture(self, bs: int) -> None:
        self.graphs[bs] = (_NoGraph(), self.fn(self._view(bs)), None)


class StubModel:
    """Stands in for the target in `ModelRunner.run`: hidden states of zeros, fixed logits."""

    def __init__(self, model, logits: torch.Tensor):
        self.model, self.logits = model, logits

    def __call__(self, input_ids, positions, batch, taps=None):
        return torch.zeros(input_ids.shape[0], 1), []

    def compute_logits(self, hidden):
        return self.logits[:hidden.shape[0]]


def make_llm(path: str, mode: str) -> LLM:
    kw = dict(device="cpu", dtype="float32", page_size=16, num_pages=2048, max_num_seqs=64,
              max_num_batched_tokens=4096, cuda_graphs=False)
    if mode.startswith("ddtree") or mode.startswith("auto"):
        llm = LLM(path, spec="none", **kw)
        llm.drafter = random_drafter(llm.config, num_layers=1, block_size=16, target_layer_ids=[0])
        if mode == "auto-ar":  # verifying costs 100 AR steps: auto plans AR (probes far apart)
            sizes = [1, 8, 64]
            llm.set_mode("ddtree", budget="auto", topk=4, cost_table=CostTable(
                sizes, [1.0] * 3, [1.0] * 3, {b: [100.0] * 3 for b in (4, 8, 16, 32)}))
            policy = llm.engine.speculator.policy  # a run's evidence: hopeless from the first step
            for _ in range(32):
                policy.observe_step(policy.budgets[0], 1, {b: 0.2 for b in policy.budgets}, 0.2)
        elif mode == "auto-spec":  # verifying costs an AR step: auto speculates from its first plan on
            sizes = [1, 8, 64]
            llm.set_mode("ddtree", budget="auto", topk=4, cost_table=CostTable(
                sizes, [1.0] * 3, [0.1] * 3, {b: [1.0] * 3 for b in (4, 8, 16, 32)}))
        else:
            llm.set_mode("ddtree", budget=16, topk=4)
    else:
        llm = LLM(path, **kw)
    engine, V = llm.engine, llm.config.vocab_size
    width = engine.speculator.width if engine.speculator is not None else 1
    max_pages = -(-(llm.config.max_position + width) // llm.engine_cfg.page_size)  # as the engine sizes them
    widths = {"block_tables": max_pages}
    logits = torch.zeros(64, V)
    logits[:, 100] = 1.0  # every row's argmax: an ordinary token
    tokens = torch.full((64,), 100, dtype=torch.long)  # (what a decode graph returns: the tokens drawn)
    if mode in SPEC_MODES:  # bursts' pages reserved as the engine reserves them with graphs
        from ddtree.spec.decode import SPEC_BURST
        engine.scheduler.decode_width += (SPEC_BURST - 1) * engine.speculator.drafter.block_size
    if mode == "ar":
        engine.ar.decode_graphs = StubPool(tokens, {"block_tables": engine.runner.scratch_page}, widths)
        engine.ar.untapped_decode_graphs = engine.ar.decode_graphs
        engine.ar.burst_steps = DECODE_BURST  # (as with graphs: pipelined bursts of AR steps)
    elif mode == "auto-ar":
        feats = torch.zeros(64, engine.speculator.drafter.feat_dim)
        engine.ar.decode_graphs = StubPool((tokens, feats), {"block_tables": engine.runner.scratch_page}, widths)
        engine.ar.untapped_decode_graphs = StubPool(tokens, {"block_tables": engine.runner.scratch_page}, widths)
        engine.ar.burst_steps = DECODE_BURST
    elif mode == "ar-eager":
        engine.runner.model = StubModel(engine.runner.model, logits)
    elif mode == "ddtree":
        spec = engine.speculator
        D = spec.depth
        packed = torch.zeros(64, 2 + D + 1, dtype=torch.long)
        packed[:, 0] = ACCEPT
        packed[:, 1] = 101
        packed[:, 2:] = torch.randint(3, V, (64, D + 1), generator=torch.Generator().manual_seed(0))
        feats = torch.zeros(64, D + 1, spec.drafter.feat_dim)
        spec.graphs = StubPool(StepOutputs(packed, feats), {"block_tables": engine.runner.scratch_page,
                                                            "ctx_slots": spec.drafter.scratch_slot}, widths)
    elif mode == "auto-spec":
        from ddtree.spec.auto import EXPECTED_SCALE
        spec = engine.speculator
        D, E = spec.depth, len(spec.budgets) - 1
        packed = torch.zeros(64, 2 + D + 1 + E, dtype=torch.long)
        packed[:, 0] = ACCEPT
        packed[:, 1] = 101
        packed[:, 2:3 + D] = torch.randint(3, V, (64, D + 1), generator=torch.Generator().manual_seed(0))
        packed[:, 3 + D:] = ACCEPT * EXPECTED_SCALE  # every budget's E(b): what the steps accept
        feats = torch.zeros(64, D + 1, spec.drafter.feat_dim)
        pad = {"block_tables": engine.runner.scratch_page, "ctx_slots": spec.drafter.scratch_slot}
        spec.step_graphs = {b: StubPool(StepOutputs(packed, feats), pad, widths) for b in spec.budgets[1:]}
        spec.draft_graphs = spec.ar_graphs = StubPool(None, pad, widths)  # (not run: graphed auto is on)
        engine.ar.decode_graphs = StubPool((tokens, torch.zeros(64, spec.drafter.feat_dim)),
                                           {"block_tables": engine.runner.scratch_page}, widths)
        engine.ar.untapped_decode_graphs = StubPool(tokens, {"block_tables": engine.runner.scratch_page}, widths)
        engine.ar.burst_steps = DECODE_BURST
    else:
        raise ValueError(mode)
    return llm


def measure(llm: LLM, batch: int, max_tokens: int, reps: int) -> tuple[float, int]:
    """Median over `reps` runs of host seconds per decode step, and decode steps per run."""
    engine = llm.engine
    prompts = [[(7 * i + j) % 300 + 3 for j in range(PROMPT_LEN)] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    step, first = engine.step, []

    def timed_step():
        t = time.perf_counter()
        out = step()
        if not first:
            first.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    per_step, steps = [], 0
    try:
        llm.generate(prompts, params)  # warm-up
        for _ in range(reps):
            first.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            total = time.perf_counter() - t0
            assert all(len(o.token_ids) == max_tokens for o in outs)
            steps = llm.last_stats["steps"] - 1
            per_step.append((total - first[0]) / steps)
    finally:
        del engine.step
    return statistics.median(per_step), steps


def commit_id() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="ar,ar-eager,ddtree")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tag", default="", help="free text stored with each row (e.g. before / after)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "host_overhead_cpu.jsonl"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--profile", nargs=2, metavar=("MODE", "BATCH"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = make_tiny_model(tempfile.mkdtemp(prefix="host_overhead_"), "qwen2", num_hidden_layers=1)

    if args.profile:
        mode, batch = args.profile[0], int(args.profile[1])
        llm = make_llm(path, mode)
        tokens = 256 if mode in SPEC_MODES else 128
        prompts = [[(7 * i + j) % 300 + 3 for j in range(PROMPT_LEN)] for i in range(batch)]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts, params)
        prof = cProfile.Profile()
        prof.runcall(llm.generate, prompts, params)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return

    commit, rows = commit_id(), []
    print(f"{'mode':>9} {'batch':>5} {'steps':>5} {'us/step':>9} {'us/token':>9} {'us/model-step':>10}")
    for mode in args.modes.split(","):
        llm = make_llm(path, mode)
        tokens_per_step = ACCEPT + 1 if mode in SPEC_MODES else 1
        for batch in map(int, args.batches.split(",")):
            max_tokens = 64 * tokens_per_step
            sec, steps = measure(llm, batch, max_tokens, args.reps)
            us = sec * 1e6
            # An engine step may run a burst of model steps: per token from the tokens really decoded
            # (all but the prefill's), and per model step (one forward of a batch's tokens).
            per_token = us * steps / (batch * (max_tokens - 1))
            row = {"commit": commit, "tag": args.tag, "device": "cpu", "mode": mode, "batch": batch,
                   "decode_steps": steps, "reps": args.reps, "host_us_per_step": round(us, 1),
                   "host_us_per_token": round(per_token, 2),
                   "host_us_per_model_step": round(per_token * batch * tokens_per_step, 1)}
            rows.append(row)
            print(f"{mode:>9} {batch:>5} {steps:>5} {us:>9.1f} {row['host_us_per_token']:>9.2f} "
                  f"{row['host_us_per_model_step']:>10.1f}", flush=True)
    if not args.no_write:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
