"""Random checkpoints with a real model's shapes, for GPU checks and timings that need no download:
a target (a Hugging Face directory, random weights) and a random DFlash drafter for it."""
from __future__ import annotations

import math
import os

import torch

# Qwen2.5-0.5B, the default target: 24 layers, hidden 896, 14 query and 2 KV heads of 64, MLP 4864
DEFAULT_TARGET_SHAPES = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             tie_word_embeddings=True)


def qwen2_config(**overrides):
    """A Qwen2 config of the default target's shapes, with `overrides`."""
    from transformers import Qwen2Config
    return Qwen2Config(**{**DEFAULT_TARGET_SHAPES, **overrides})


def save_random_target(config, out: str, dtype: str = "bfloat16", std: float = 0.02, bias_std: float = 0.0,
                       sharpen: float = 1.0, seed: int = 0, device: str = "cpu") -> str:
    """Writes a causal LM of `config` to `out` (safetensors) and returns `out`: every matrix drawn from
    N(0, std), biases from N(0, bias_std) where that is set, the rest as transformers initialises it,
    and the LM head scaled by `sharpen` (clearer margins between the likeliest tokens)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, std)
            elif bias_std and name.endswith("bias"):
                p.normal_(0, bias_std)
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_random_drafter(target: str, out: str, layers: list[int], block: int = 16, dtype: str = "bfloat16") -> str:
    """Writes a random one-layer DFlash drafter for the checkpoint at `target`, tapping its `layers`."""
    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter
    cfg = ModelConfig.from_dir(target)
    save_drafter(random_drafter(cfg, num_layers=1, block_size=block, target_layer_ids=layers), out,
                 getattr(torch, dtype))
    return out


def save_random_pair(config, out: str, layers: list[int], block: int = 16, dtype: str = "bfloat16",
                     **weights) -> tuple[str, str]:
    """OUT/target (`save_random_target` with `weights`) and OUT/drafter tapping `layers` of it."""
    target = save_random_target(config, os.path.join(out, "target"), dtype, **weights)
    return target, save_random_drafter(target, os.path.join(out, "drafter"), layers, block, dtype)


def num_parameters(path: str) -> int:
    """Parameters stored in a checkpoint directory's safetensors files."""
    from safetensors import safe_open
    n = 0
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                n += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return n


def hybrid_pair(config: str, out: str, dtype: str = "bfloat16", sharpen: float = 1.0,
                layers: list[int] | None = None, block: int = 16, seed: int = 0, tokenizer: str | None = None) -> dict:
    """A random Qwen3.5 text target with the shapes of the config file `config` (a text config, or a
    multimodal one with a text_config) in OUT/target, with the tokenizer of the checkpoint `tokenizer`
    if given, and a random drafter tapping `layers` (default: the first and the middle one) in
    OUT/drafter; returns what was built."""
    import json

    from transformers import Qwen3_5TextConfig

    from ddtree.config import ModelConfig
    with open(config) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text = {k: v for k, v in text.items()
            if k not in ("architectures", "model_type", "transformers_version") and not k.startswith("_")}
    target = save_random_target(Qwen3_5TextConfig(**text), os.path.join(out, "target"), dtype, sharpen=sharpen,
                                seed=seed)
    mc = ModelConfig.from_dir(target)
    if tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer)
        assert len(tok) <= mc.vocab_size, "the tokenizer's ids do not fit the model's vocabulary"
        tok.save_pretrained(target)
    drafter = save_random_drafter(target, os.path.join(out, "drafter"), layers or [0, mc.num_layers // 2], block,
                                  dtype)
    return {"target": target, "drafter": drafter, "layers": mc.num_layers, "linear_layers": len(mc.linear_layers),
            "params": num_parameters(target)}
