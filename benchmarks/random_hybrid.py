"""A random hybrid target (Qwen3.5 text) with the shapes of a given config, and a random DFlash drafter
for it: what the GPU runs of the hybrid issue measure, since no hybrid weights can be downloaded here.

    python benchmarks/random_hybrid.py CONFIG.json OUT --tokenizer DIR [--dtype bfloat16] [--sharpen 8]

CONFIG.json is a Qwen3.5 text config (or a multimodal one with a text_config); OUT/target and
OUT/drafter are written. `--tokenizer` takes the tokenizer (and chat template) of another checkpoint,
whose ids must fit the config's vocabulary (the default model's, from `ddtree pull`, fits Qwen3.5's).
`--sharpen` scales the LM head, so that greedy decoding has clear margins (float32 equality runs) and
a drafter trained on the target's answers gets real acceptance.
"""
from __future__ import annotations

import argparse
import json
import os

import torch


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
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter
    with open(args.config) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "transformers_version")}
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**text), dtype=getattr(torch, args.dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
        model.lm_head.weight.mul_(args.sharpen)
    target = os.path.join(args.out, "target")
    model.save_pretrained(target, safe_serialization=True)
    if args.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        assert len(tok) <= model.config.vocab_size, "the tokenizer's ids do not fit the model's vocabulary"
        tok.save_pretrained(target)
    mc = ModelConfig.from_dir(target)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else [0, mc.num_layers // 2]
    drafter = os.path.join(args.out, "drafter")
    save_drafter(random_drafter(mc, num_layers=1, block_size=args.block, target_layer_ids=layers), drafter,
                 getattr(torch, args.dtype))
    print(json.dumps({"target": target, "drafter": drafter, "layers": mc.num_layers,
                      "linear_layers": len(mc.linear_layers), "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
