"""Prefix caching on a hybrid target (Qwen3.5-0.8B shapes, random weights), CPU fp32: the time to the
first token of prompts that share a 480-token head, with and without the prefix cache."""
import gc, json, sys, time
import torch
from ddtree.llm import LLM
from ddtree.sampling_params import SamplingParams

path, out = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
head = torch.randint(0, 150000, (480,), generator=g).tolist()
tails = [torch.randint(0, 150000, (24,), generator=g).tolist() for _ in range(4)]
rows = []
for rnd in range(2):
    for cache in (True, False):
        llm = LLM(path, load_format="dummy", device="cpu", dtype="float32", num_pages=256, max_num_seqs=4,
                  enable_prefix_caching=cache)
        llm.generate([head + tails[0]], SamplingParams(max_tokens=1))  # (the head's pages and state, when cached)
        for t in tails[1:]:
            t0 = time.perf_counter()
            (o,) = llm.generate([head + t], SamplingParams(max_tokens=1))
            rows.append({"round": rnd, "prefix_caching": cache, "prompt_tokens": len(head + t),
                         "cached_tokens": o.num_cached_tokens, "seconds": time.perf_counter() - t0})
            print(rows[-1], flush=True)
        del llm
        gc.collect()
with open(out, "w") as f:
    for r in rows:
        f.write(json.dumps({**r, "torch": torch.__version__, "threads": torch.get_num_threads()}) + "\n")
