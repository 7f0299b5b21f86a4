"""Mixture-of-experts targets on the GPU: a model with a published config's shapes and random weights
(`load_format="dummy"`: nothing but config.json is read), so its speed can be measured without its
weights.

    python benchmarks/moe_gpu.py benchmarks/configs/qwen3-30b-a3b.json OUT.json [--layers 24]

(the whole Qwen3-30B-A3B shape is 61 GB of bfloat16 weights: it fits an 80 GB H100 with a small KV cache)

bfloat16, CUDA graphs (the experts' grouped products run on the device), a random one-layer drafter
(acceptance near one: the per-step costs are what is measured). Writes the step times at 512 cached
tokens (an AR step, a draft, a verify of 17, 33 and 65 nodes) at C=1 and 64, verify-33 over an AR step,
and output tokens per second of AR and DDTree (budget 32, top-4) at C=1 and 64, greedy and at T=0.7
(64-token prompts, 128 new tokens); once with the Triton experts kernels where a step's pairs fit them,
once with grouped products at every width.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import tempfile
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.steps import step_profiles, step_times
from ddtree.config import ModelConfig
from ddtree.models.dflash import random_drafter, save_drafter


def throughput(llm: LLM, vocab: int, C: int, temperature: float, tokens: int = 128) -> float:
    g = torch.Generator().manual_seed(C)
    prompts = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(C)]
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature, seed=i) for i in range(C)]
    llm.generate(prompts, params)  # warm: every graph this batch needs is captured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    return round(C * tokens / (time.perf_counter() - t0), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--experts", default="triton,grouped", help="the routed experts' paths to measure, in turn")
    ap.add_argument("--profile", action="store_true", help="also kernel time by name at C=1 (AR step, verify 33)")
    ap.add_argument("--layers", type=int, default=None,
                    help="fewer layers than the config's, each of its shapes (where the whole model does not fit)")
    args = ap.parse_args()
    sizes = [int(c) for c in args.concurrency.split(",")]
    work = tempfile.mkdtemp()
    target = os.path.join(work, "target")
    os.makedirs(target)
    with open(args.config) as f:
        config = json.load(f)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = ModelConfig.from_dir(target)
    drafter = os.path.join(work, "drafter")
    save_drafter(random_drafter(cfg, num_layers=1, block_size=16, target_layer_ids=[1, cfg.num_layers // 2]),
                 drafter, torch.bfloat16)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": args.config,
           "layers": cfg.num_layers,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    import ddtree.ops.triton_moe as triton_moe
    fits = triton_moe.experts_fit
    for experts in args.experts.split(","):  # the routed experts' kernels at decode widths, one engine each
        # ("grouped": grouped products at every width, as where the Triton kernels do not run)
        triton_moe.experts_fit = fits if experts == "triton" else (lambda pairs, held: False)
        llm = LLM(target, draft=drafter, spec="ddtree", budget=32, topk=4, dtype="bfloat16", load_format="dummy",
                  max_num_seqs=max(sizes))
        out["params"] = sum(p.numel() for p in llm.net.parameters())
        out["graphs"] = llm.engine.speculator.graphs is not None
        rows = step_times(llm, sizes, [17, 33, 65], context=512)
        for row in rows:
            row["verify_33_over_ar"] = round(row["verify_33_ms"] / row["ar_step_ms"], 3)
            row["experts"] = experts
        out.setdefault("step_times", []).extend(rows)
        print(json.dumps(rows), flush=True)
        if args.profile:  # where an AR step and a 33-node verify at C=1 spend their time
            out[f"{experts}_profile_C1"] = step_profiles(llm, 1, [33], context=512)
            for name, table in out[f"{experts}_profile_C1"].items():
                print(name, table, sep="\n", flush=True)
        for mode, budget in (("none", None), ("ddtree", 32)):
            llm.set_mode(mode, budget, 4 if budget else None)
            for C, T in itertools.product(sizes, (0.0, 0.7)):
                key = f"{experts}_{mode}_T{T}_C{C}_tok_s"
                out[key] = throughput(llm, cfg.vocab_size, C, T)
                print(key, out[key], flush=True)
        del llm
        gc.collect()  # (the engine's reference cycles hold its weights until collected)
        torch.cuda.empty_cache()
    triton_moe.experts_fit = fits
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
