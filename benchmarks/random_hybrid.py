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


def build(config: str, out: str, dtype: str = "bfloat16", sharpen: float = 1.0, layers: list[int] | None = None,
          block: int = 16, seed: int = 0, tokenizer: str | None = None) -> dict:
    """Writes OUT/target (random weights, the config's shapes) and OUT/drafter; returns what was built."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter
    with open(config) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text = {k: v for k, v in text.items()
            if k not in ("architectures", "model_type", "transformers_version") and not k.startswith("_")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**text), dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
        model.lm_head.weight.mul_(sharpen)
    target = os.path.join(out, "target")
    model.save_pretrained(target, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer)
        assert len(tok) <= model.config.vocab_size, "the tokenizer's ids do not fit the model's vocabulary"
        tok.save_pretrained(target)
    mc = ModelConfig.from_dir(target)
    drafter = os.path.join(out, "drafter")
    save_drafter(random_drafter(mc, num_layers=1, block_size=block, target_layer_ids=layers or [0, mc.num_layers // 2]),
                 drafter, getattr(torch, dtype))
    return {"target": target, "drafter": drafter, "layers": mc.num_layers, "linear_layers": len(mc.linear_layers),
            "params": sum(p.numel() for p in model.parameters())}


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
    print(json.dumps(build(args.config, args.out, args.dtype, args.sharpen, layers, args.block, args.seed,
                           args.tokenizer)))


if __name__ == "__main__":
    main()
