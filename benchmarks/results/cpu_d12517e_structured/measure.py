"""Structured output's cost on the CPU: the default pair, constrained and free, AR and DDTree (budget 16, top-4).

    python benchmarks/results/cpu_d12517e_structured/measure.py OUT.jsonl
"""
import json
import sys
import time

import torch

from ddtree import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 150},
                                           "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                           "bio": {"type": "string"}},
          "required": ["name", "age", "languages", "bio"]}
ASKS = ["Give me a JSON record of a fictional programmer.", "Describe a made-up chef as JSON.",
        "Invent a scientist and give her record in JSON."]


def main(out: str) -> None:
    convs = [[{"role": "user", "content": a}] for a in ASKS]
    rows = []
    llm = LLM(spec="ddtree", budget=16, topk=4)
    for mode in ("none", "ddtree"):
        llm.set_mode(mode, 16 if mode == "ddtree" else None, 4 if mode == "ddtree" else None)
        for temperature in (0.0, 0.7):
            for constrained in (False, True):
                params = SamplingParams(max_tokens=64, temperature=temperature, seed=0, ignore_eos=not constrained,
                                        **({"json_schema": SCHEMA} if constrained else {}))
                tokens, seconds, accepts = 0, 0.0, []
                for conv in convs:  # one request at a time (C=1)
                    t0 = time.perf_counter()
                    o = llm.chat([conv], params)[0]
                    seconds += time.perf_counter() - t0
                    tokens += len(o.token_ids)
                    accepts += o.accept_lengths
                row = {"mode": mode, "temperature": temperature, "constrained": constrained, "tokens": tokens,
                       "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 2),
                       "mean_accept": round(sum(accepts) / len(accepts), 2) if accepts else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(torch.__version__, torch.get_num_threads())


if __name__ == "__main__":
    main(sys.argv[1])
