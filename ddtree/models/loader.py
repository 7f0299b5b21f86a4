"""Load a target model from a Hugging Face checkpoint directory (config.json + safetensors).

    model, cfg = load_model("/path/to/hf_dir", device="cpu", dtype=torch.float32)

GGUF files and the default model are first resolved to such a directory by `ddtree.models.hub`.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from ddtree.config import ModelConfig
from ddtree.models.transformer import CausalLM, PackedLinear


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def iter_tensors(path: str):
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, path: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    seen = set()
    for name, tensor in iter_tensors(path):
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        leaf = name.rsplit(".", 2)
        if len(leaf) == 3 and leaf[1] in CausalLM.packed:
            packed_name, shard = CausalLM.packed[leaf[1]]
            module_name = f"{leaf[0]}.{packed_name}"
            module = modules[module_name]
            assert isinstance(module, PackedLinear)
            target = f"{module_name}.{leaf[2]}"
            module.load_shard(params[target], tensor, shard)
            seen.add(f"{target}:{shard}")
            continue
        if name not in params:
            raise KeyError(f"unexpected tensor {name!r} in checkpoint {path}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}")
        param.data.copy_(tensor)
        seen.add(name)
    missing = []
    for name, module in modules.items():
        if isinstance(module, PackedLinear):
            for p in ("weight", "bias") if module.bias is not None else ("weight",):
                missing += [f"{name}.{p}:{s}" for s in module.shard_offsets if f"{name}.{p}:{s}" not in seen]
    missing += [n for n, _ in model.named_parameters() if ("qkv_proj" not in n and "gate_up_proj" not in n)
                and n not in seen and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise KeyError(f"checkpoint {path} lacks tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def load_model(path: str, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[CausalLM, ModelConfig]:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    load_weights(model, path)
    model.model.rotary.build(device)
    return model.eval().requires_grad_(False), cfg
