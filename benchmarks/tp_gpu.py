"""Tensor parallelism on the GPU: speed on random models (no weights to download), correctness on the
default pair.

    python benchmarks/tp_gpu.py OUT.json [--layers 16]
    python benchmarks/tp_gpu.py OUT.jsonl --tp 1,2,4,8 [--shape llama-3-8b] [--dtype bfloat16]
    python benchmarks/tp_gpu.py OUT.json --check --tp 1,2 [--prompts 32] [--max-tokens 128]

The first form runs on one GPU: a world of one rank (ParallelConfig with dist_init_addr), so that every
target call is announced, its inputs broadcast and each row-parallel layer all-reduced over NCCL inside
the captured graphs, against the plain engine on the same random model.

The second is the multi-GPU run (one rank a GPU): for each tensor-parallel size, AR and DDTree (budget
32, top-4, a random drafter) at C=1 and C=64, the step times at 512 cached tokens, verify-33 over an AR
step and the all-reduces' share of an AR step; one JSON line a row with the fields device,
tensor_parallel_size, model, mode, concurrency, output_tok_per_s and command. `--shape llama-3-8b` has
32 query heads and 8 KV heads, so sizes up to 8 divide it.

The third is the multi-GPU run's correctness check: the default pair (or `--model`/`--draft`) in float32,
greedy, on HumanEval prompts, under AR and DDTree (budget 32, top-4) at each tensor-parallel size; each
size's outputs against the first size's, prompt by prompt, and DDTree's against AR's at each size.

In the first form the model is random, with Llama-3.2-1B's shapes (32 query heads, 8 KV heads) and
`--layers` layers, and a random one-layer drafter: outputs must be equal (bf16; an all-reduce over one
rank is the identity), greedy and seeded sampled, under AR and DDTree (budget 32, top-4); the times show
what the machinery costs a step. Several ranks need several GPUs (the multi-GPU issue).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.random_model import save_random_pair
from ddtree.config import ParallelConfig
from ddtree.parallel.workers import free_port

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=True, attention_bias=False)
SHAPES = {"llama-3.2-1b": (LLAMA_1B, 16),
          "llama-3-8b": ({**LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "tie_word_embeddings": False}, 32)}


def build(out: str, layers: int, shape: dict = LLAMA_1B) -> tuple[str, str]:
    from transformers import LlamaConfig
    return save_random_pair(LlamaConfig(num_hidden_layers=layers, **shape), out, [1, layers - 2])


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    llm.generate(prompts, params)  # (warm)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return outs, time.perf_counter() - t0


def runs(target: str, drafter: str, parallel: ParallelConfig | None) -> dict:
    from ddtree.bench.steps import step_times
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (37, 5, 120, 64, 9, 200, 17, 80)]
    greedy = SamplingParams(max_tokens=64, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.7, seed=i) for i in range(len(prompts))]
    res = {}
    t0 = time.perf_counter()
    with LLM(target, draft=drafter, spec="none", dtype="bfloat16", num_pages=4096, max_num_seqs=16,
             parallel=parallel) as llm:
        res["load_s"] = round(time.perf_counter() - t0, 1)
        for mode in ("none", "ddtree"):
            llm.set_mode(mode, 32 if mode == "ddtree" else None, 4 if mode == "ddtree" else None)
            for name, params in (("greedy", greedy), ("sampled", sampled)):
                outs, dt = timed_generate(llm, prompts, params)
                res[f"{mode}_{name}_tokens"] = [o.token_ids for o in outs]
                res[f"{mode}_{name}_C8_tok_s"] = round(sum(len(o.token_ids) for o in outs) / dt, 1)
            _, dt = timed_generate(llm, prompts[:1], SamplingParams(max_tokens=256, ignore_eos=True))
            res[f"{mode}_C1_tok_s"] = round(256 / dt, 1)
        if llm.tp is not None:
            res["graphs_captured_on_the_ranks"] = llm.tp.next_graph
        res["step_times"] = step_times(llm, [1, 8], [33], context=512)
    return res


def sizes_run(target: str, drafter: str, sizes: list[int], shape: str, dtype: str, out: str) -> None:
    """The multi-GPU rows (module docstring), appended to `out` as each size finishes."""
    from ddtree.bench.steps import step_times
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    for tp in sizes:
        with LLM(target, draft=drafter, spec="none", dtype=dtype, num_pages=16384, max_num_seqs=64,
                 tensor_parallel_size=tp) as llm:
            rows = []
            for mode in ("none", "ddtree"):
                llm.set_mode(mode, 32 if mode == "ddtree" else None, 4 if mode == "ddtree" else None)
                for C, tokens in ((1, 256), (64, 128)):
                    prompts = [torch.randint(0, 128000, (64,), generator=g).tolist() for _ in range(C)]
                    outs, dt = timed_generate(llm, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
                    rows.append({"mode": "ar" if mode == "none" else "ddtree b32 k4", "concurrency": C,
                                 "output_tok_per_s": round(sum(len(o.token_ids) for o in outs) / dt, 1)})
            steps = step_times(llm, [1, 64], [33], context=512)
            for s in steps:
                s["verify_33_over_ar"] = s["verify_33_ms"] / s["ar_step_ms"]
        with open(out, "a") as f:
            for row in rows:
                f.write(json.dumps({"device": device, "tensor_parallel_size": tp, "model": f"random {shape}",
                                    **row, "step_times": steps, "dtype": dtype, "torch": torch.__version__,
                                    "command": " ".join(sys.argv)}) + "\n")
        print(tp, json.dumps(rows), json.dumps(steps), flush=True)


def check_run(model: str | None, draft: str | None, sizes: list[int], n: int, max_tokens: int, dtype: str,
              device: str | None = None) -> dict:
    """The correctness check (module docstring): the tokens of every (size, mode), and how they compare."""
    from ddtree.bench.datasets import load_prompts
    from ddtree.models.hub import default_draft, is_default_model
    if draft is None and not is_default_model(model):
        raise SystemExit("--check with --model needs --draft (the shipped drafter is the default model's)")
    draft = draft or default_draft()
    rows = load_prompts("humaneval", n)
    params = SamplingParams(max_tokens=max_tokens)
    tokens = {}
    for tp in sizes:
        with LLM(model, draft=draft, spec="none", dtype=dtype, device=device, tensor_parallel_size=tp,
                 max_num_seqs=n) as llm:
            prompts = [llm.encode_chat(r["messages"]) for r in rows]
            for mode, budget, topk in (("ar", None, None), ("ddtree", 32, 4)):
                llm.set_mode("none" if mode == "ar" else mode, budget, topk)
                tokens[tp, mode] = [o.token_ids for o in llm.generate(prompts, params)]

    def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else
                      min(len(a), len(b))) for a, b in zip(got, want)]
        return {"equal": sum(f is None for f in first), "of": len(first),
                "first_difference": {rows[i]["id"]: f for i, f in enumerate(first) if f is not None}}

    out = {"model": model or "default", "draft": draft, "dtype": dtype, "prompts": n, "max_tokens": max_tokens,
           "sizes": sizes, "tokens": {f"tp{tp}_{mode}": t for (tp, mode), t in tokens.items()}}
    for tp in sizes:
        out[f"tp{tp}_ddtree_vs_ar"] = agreement(tokens[tp, "ddtree"], tokens[tp, "ar"])
        for mode in ("ar", "ddtree"):
            if tp != sizes[0]:
                out[f"tp{tp}_vs_tp{sizes[0]}_{mode}"] = agreement(tokens[tp, mode], tokens[sizes[0], mode])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=None, help="(default: the shape's)")
    ap.add_argument("--tp", default=None, help="tensor-parallel sizes, e.g. 1,2,4,8: the multi-GPU run")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--dtype", default=None, help="(default: bfloat16; float32 with --check)")
    ap.add_argument("--check", action="store_true", help="the correctness check on HumanEval (module docstring)")
    ap.add_argument("--model", default=None, help="--check: the target (default: the default model)")
    ap.add_argument("--draft", default=None, help="--check: the drafter (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=32, help="--check: HumanEval prompts")
    ap.add_argument("--max-tokens", type=int, default=128, help="--check: new tokens a prompt")
    args = ap.parse_args()
    if args.check:
        sizes = [int(n) for n in (args.tp or "1,2").split(",")]
        out = check_run(args.model, args.draft, sizes, args.prompts, args.max_tokens, args.dtype or "float32")
        out |= {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "command": " ".join(sys.argv)}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps({k: v for k, v in out.items() if k != "tokens"}, indent=1))
        return
    args.dtype = args.dtype or "bfloat16"
    shape, layers = SHAPES[args.shape]
    target, drafter = build(tempfile.mkdtemp(), args.layers or layers, shape)
    if args.tp:
        sizes_run(target, drafter, [int(n) for n in args.tp.split(",")], args.shape, args.dtype, args.out)
        return
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers or layers,
           "model": "random Llama-3.2-1B shapes", "command": " ".join(sys.argv)}
    out["plain"] = runs(target, drafter, None)
    out["world_of_one"] = runs(target, drafter, ParallelConfig(dist_init_addr=f"127.0.0.1:{free_port()}"))
    plain, tp = out["plain"], out["world_of_one"]
    out["equal"] = {k: plain[k] == tp[k] for k in plain if k.endswith("_tokens")}
    for k in [k for k in plain if k.endswith("_tokens")]:
        del plain[k], tp[k]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
