# logprobs on the GPU: scored requests (eager steps) beside plain ones (graphed bursts), AR vs DDTree vs auto
import json, os, time, torch
from ddtree import LLM, SamplingParams
from ddtree.bench.datasets import load_prompts
prompts = [r["messages"] for r in load_prompts("humaneval", 8)]
ps = [SamplingParams(max_tokens=64, temperature=0.7 if i % 2 else 0, seed=i, logprobs=5 if i % 4 < 2 else None) for i in range(8)]
llm = LLM(draft="ddtree/models/default_drafter", spec="none", num_pages=8192)
out = {}
for mode in [("none", None), ("ddtree", 32), ("ddtree", "auto")]:
    llm.switch_mode(mode[0], mode[1], 4 if mode[1] else None)
    llm.chat(prompts[:2], ps[:2])
    t0 = time.perf_counter(); o = llm.chat(prompts, ps); dt = time.perf_counter() - t0
    out[mode] = o
    print(mode, f"{dt:.2f}s", llm.last_stats.get("bursts"), flush=True)
ref = out[("none", None)]
res = []
for mode, o in out.items():
    for i, (a, b) in enumerate(zip(ref, o)):
        same = a.token_ids == b.token_ids
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        err = max((abs(x[0] - y[0]) for x, y in zip(a.logprobs[:n], b.logprobs[:n])), default=0.0) if a.logprobs else None
        res.append(dict(mode=str(mode), req=i, logprobs=ps[i].logprobs, T=ps[i].temperature, same_tokens=same, first_diff=n,
                        max_abs_logprob_diff=err, n_logprobs=None if b.logprobs is None else len(b.logprobs), n_tokens=len(b.token_ids)))
        print(res[-1], flush=True)
json.dump(res, open(os.environ["OUT"] + "/logprobs_gpu.json", "w"), indent=1)
