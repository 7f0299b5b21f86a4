"""Quick GPU sanity run on a random model with the default target's head shapes (no download needed):
Triton kernels at real shapes, CUDA-graph AR vs eager AR, DDTree/DFlash (graphs) vs AR, sampling.

    python benchmarks/gpu_sanity.py [float32|bfloat16]   (float32 by default: speculation must equal AR)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_checks import check_kernels  # noqa: E402  (the kernel checks at real shapes, shared)

from ddtree import LLM, SamplingParams  # noqa: E402
from ddtree.bench.steps import step_times  # noqa: E402
from ddtree.bench.random_model import qwen2_config, save_random_drafter, save_random_target  # noqa: E402


def main() -> int:
    def run(name, fn):
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:
            traceback.print_exc()
            r = {"ok": False, "error": repr(e)}
        print(json.dumps({"check": name, **r, "wall_s": round(time.perf_counter() - t0, 2)}), flush=True)

    run("kernels", check_kernels)
    # six layers of the default target's widths, a small vocabulary, weights large enough that logits seldom tie
    d = save_random_target(qwen2_config(vocab_size=384, intermediate_size=1024, num_hidden_layers=6,
                                        max_position_embeddings=4096, tie_word_embeddings=False),
                           tempfile.mkdtemp(), "float32", std=0.08, bias_std=0.02)
    dd = save_random_drafter(d, tempfile.mkdtemp(), [1, 3], dtype="float32")
    # fp32 (exact matmuls and attention): speculation must reproduce AR token for token; in bf16 the
    # batch shape changes rounding and this random model's logits tie often (see gpu_checks for bf16).
    llm = LLM(d, draft=dd, spec="none", max_num_seqs=16, dtype=sys.argv[1] if len(sys.argv) > 1 else "float32")
    prompts = [list(range(5 + i, 40 + 7 * i)) for i in range(6)]
    P = SamplingParams(max_tokens=64, ignore_eos=True)
    ar = [o.token_ids for o in llm.generate(prompts, P)]

    def eager_vs_graph():
        llm.engine_cfg.cuda_graphs = False
        llm.set_mode("none")
        eager = [o.token_ids for o in llm.generate(prompts, P)]
        llm.engine_cfg.cuda_graphs = True
        llm.set_mode("none")
        return {"identical": sum(a == b for a, b in zip(ar, eager)), "of": len(prompts)}
    run("ar-graph-vs-eager", eager_vs_graph)

    def spec(mode, budget, topk):
        def f():
            llm.set_mode(mode, budget, topk)
            outs = llm.generate(prompts, P)
            single = llm.generate(prompts[0], P)[0].token_ids
            acc = [a for o in outs for a in o.accept_lengths]
            return {"identical": sum(o.token_ids == a for o, a in zip(outs, ar)), "single_ok": single == ar[0],
                    "of": len(prompts), "tau": sum(acc) / len(acc), "pages_free": llm.engine.allocator.num_free
                    == llm.engine.allocator.num_pages}
        return f
    for mode, b, k in [("ddtree", 15, 4), ("ddtree", 32, 4), ("ddtree", 8, 2), ("dflash", None, None)]:
        run(f"{mode}-{b}-{k}-vs-ar", spec(mode, b, k))

    def oracle():
        llm.set_mode("ddtree", 32, 4)
        dr = llm.engine.speculator.drafter
        ref = {tuple(p): a for p, a in zip(prompts, ar)}
        seen = {}
        prep = dr.prepare

        def prepare(seqs, ctx_rows=None):
            seen["seqs"] = list(seqs)
            return prep(seqs, ctx_rows)

        def oracle_logits(inp):
            out = torch.full((inp.roots.shape[0], dr.block_size - 1, llm.config.vocab_size), -10.0,
                             device=inp.roots.device)
            for i, s in enumerate(seen["seqs"]):
                full = s.prompt_ids + ref[tuple(s.prompt_ids)]
                for j in range(dr.block_size - 1):
                    if len(s) + j < len(full):
                        out[i, j, full[len(s) + j]] = 10.0
            return out
        dr.prepare, dr.logits = prepare, oracle_logits
        llm.engine.speculator.graphs = None  # the oracle reads host state: run eagerly
        outs = llm.generate(prompts, P)
        acc = [a for o in outs for a in o.accept_lengths]
        return {"identical": sum(o.token_ids == a for o, a in zip(outs, ar)), "tau": sum(acc) / len(acc)}
    run("oracle-drafter", oracle)

    def sampled():
        llm.set_mode("ddtree", 16, 4)
        SP = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, top_k=50, seed=3, ignore_eos=True)
        a = llm.generate(prompts[:3], SP)
        b = llm.generate(prompts[:3], SP)
        return {"reproducible": [x.token_ids for x in a] == [x.token_ids for x in b]}
    run("sampled-ddtree", sampled)

    def times():
        llm.set_mode("ddtree", 32, 4)
        return {"rows": step_times(llm, [1, 8], [9, 17, 33])}
    run("step-times", times)

    def speed():
        out = {}
        for mode, b, k in [("none", None, None), ("ddtree", 32, 4)]:
            llm.set_mode(mode, b, k)
            llm.generate(prompts[:1], SamplingParams(max_tokens=256, ignore_eos=True))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts[:1], SamplingParams(max_tokens=256, ignore_eos=True))
            torch.cuda.synchronize()
            out[mode] = 256 / (time.perf_counter() - t0)
        return out
    run("speed-c1", speed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
