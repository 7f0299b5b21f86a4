"""A random hybrid target (Qwen3.5 text) with the shapes of a given config, and a random DFlash drafter
for it: what the GPU runs of hybrid targets measure, since no hybrid weights can be downloaded here.

    python benchmarks/random_hybrid.py CONFIG.json OUT --tokenizer DIR [--dtype bfloat16] [--sharpen 8]

CONFIG.json is a Qwen3.5 text config (or a multimodal one with a text_config); OUT/target and
OUT/drafter are written (`ddtree.bench.random_model.hybrid_pair`). `--tokenizer` takes the tokenizer
(and chat template) of another checkpoint, whose ids must fit the config's vocabulary (the default
model's, from `ddtree pull`, fits Qwen3.5's). `--sharpen` scales the LM head, so that greedy decoding
has clear margins (float32 equality runs) and a drafter trained on the target's answers gets real
acceptance.
"""
from __future__ import annotations

import argparse
import json

from ddtree.bench.random_model import hybrid_pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sharpen", type=float, default=1.0, help="LM head scale")
    ap.add_argument("--layers", default=None, help="target layers the drafter taps (default: first and middle)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="a checkpoint dir whose tokenizer the target takes")
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    print(json.dumps(hybrid_pair(args.config, args.out, args.dtype, args.sharpen, layers, args.block, args.seed,
                                 args.tokenizer)))


if __name__ == "__main__":
    main()
