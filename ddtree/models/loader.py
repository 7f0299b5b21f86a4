"""Load a target model from a Hugging Face checkpoint directory (config.json + safetensors).

    model, cfg = load_model("/path/to/hf_dir", device="cpu", dtype=torch.float32)

GGUF files and the default model are first resolved to such a directory by `ddtree.models.hub`.
"""
from __future__ import annotations

import json
import os
import re

import torch
from torch import nn
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


def iter_tensors(path: str, part=None):
    """(name, tensor) for each checkpoint tensor; `part(name)` (tensor parallelism, parallel/shard.py)
    says which slices of it to read, so a rank reads only its own."""
    from ddtree.parallel.shard import ELSEWHERE, ZEROS
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                take = part(name) if part is not None else None
                if take is None:
                    yield name, f.get_tensor(name)
                    continue
                if take == ELSEWHERE:
                    continue
                sliced = f.get_slice(name)
                if take == ZEROS:
                    yield name, torch.zeros(sliced.get_shape(), dtype=f.get_tensor(name).dtype)
                    continue
                index = (slice(None),) * take.dim
                yield name, torch.cat([sliced[index + (slice(a, b),)] for a, b in take.ranges], dim=take.dim)


# A checkpoint tensor of one routed expert: model.layers.3.mlp.experts.17.up_proj.weight
EXPERT_TENSOR = re.compile(r"(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def load_weights(model: nn.Module, tensors, packed: dict[str, tuple[str, str]], source: str,
                 skip=lambda name: False) -> None:
    """Copies checkpoint tensors into `model`. `packed` maps a checkpoint leaf module name (q_proj)
    to (packed module name, shard) for matrices stacked into one PackedLinear. Every parameter must
    be filled exactly once and every checkpoint tensor must land somewhere."""
    from ddtree.models.moe import Experts
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    seen = set()
    for name, tensor in tensors:
        if skip(name):
            continue
        expert = EXPERT_TENSOR.fullmatch(name)
        if expert is not None:  # one expert's matrix, into the layer's stacked experts (models/moe.py)
            module = modules.get(expert["experts"])
            if not isinstance(module, Experts):
                raise KeyError(f"unexpected tensor {name!r} in checkpoint {source}")
            module.load_expert(int(expert["index"]), expert["proj"], tensor)
            seen.add(f"{expert['experts']}:{int(expert['index']) - module.first}:{expert['proj']}")
            continue
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1] in packed:
            packed_name, shard = packed[parts[1]]
            module_name = f"{parts[0]}.{packed_name}" if parts[0] else packed_name
            module = modules.get(module_name)
            if not isinstance(module, PackedLinear):
                raise KeyError(f"unexpected tensor {name!r} in checkpoint {source}")
            target = f"{module_name}.{parts[2]}"
            module.load_shard(params[target], tensor, shard)
            seen.add(f"{target}:{shard}")
            continue
        if name not in params:
            raise KeyError(f"unexpected tensor {name!r} in checkpoint {source}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name} in {source}: checkpoint {tuple(tensor.shape)} "
                             f"vs model {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        seen.add(name)
    missing = []
    for pname in params:
        module_name = pname.rsplit(".", 1)[0]
        module = modules[module_name]
        if isinstance(module, Experts) and pname not in seen:  # (stacked in the checkpoint, or one per expert)
            missing += [f"{module_name}:{e}:{proj}" for e in range(module.gate_up_proj.shape[0])
                        for proj in ("gate_proj", "up_proj", "down_proj")
                        if f"{module_name}:{e}:{proj}" not in seen and module.expert_slot(proj)[0] is params[pname]]
        elif isinstance(module, PackedLinear):
            missing += [f"{pname}:{s}" for s in module.shard_offsets if f"{pname}:{s}" not in seen]
        elif pname not in seen:
            missing.append(pname)
    if missing:
        raise KeyError(f"checkpoint {source} lacks tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def text_model_tensors(tensors):
    """A multimodal checkpoint's text model (Qwen3.5: `model.language_model.*` and the LM head) under the
    text model's names; the vision tower and multi-token-prediction heads are left out."""
    for name, tensor in tensors:
        if name.startswith(("model.visual.", "mtp.")):
            continue
        yield text_model_name(name), tensor


def beyond_layers(name: str, cfg: ModelConfig) -> bool:
    """Whether `name` is a tensor of a layer past the decoder's: DeepSeek-V3's multi-token-prediction
    layers (`model.layers.{num_hidden_layers}.*` on), which ddtree does not run."""
    if cfg.mla is None or not name.startswith("model.layers."):
        return False
    return int(name.split(".", 3)[2]) >= cfg.num_layers


def text_model_name(name: str) -> str:
    return name.replace("model.language_model.", "model.", 1)


def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Random weights of a checkpoint's scale, generated where the model lives: matrices (and stacked
    experts, convolutions) N(0, 0.02), norm weights 1, other vectors (biases, decay parameters) 0."""
    first = next(model.parameters())
    gen = torch.Generator(first.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)


def load_model(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               shard=None, random_weights: bool = False) -> tuple[CausalLM, ModelConfig]:
    """The model and its config; with `shard` (a parallel.shard.Shard), that tensor-parallel rank's
    part of it and the part's config. `random_weights`: the config's shapes with random weights and no
    checkpoint read (speed measurements of models whose weights are not at hand)."""
    cfg = ModelConfig.from_dir(path)
    part = None
    if shard is not None:
        from ddtree.parallel.shard import shard_config, tensor_part
        full, cfg = cfg, shard_config(cfg, shard)
        part = lambda name: tensor_part(text_model_name(name), full, shard)  # noqa: E731
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)  # (in the target dtype before any memory is taken)
    model = model.to_empty(device=device)
    tied = cfg.tie_word_embeddings
    if tied:
        del model.lm_head.weight  # re-tied after loading so the shared tensor is filled once
    if random_weights:
        fill_random(model)
        model.tie_weights()
        model.model.rotary.build(device)
        return model.eval().requires_grad_(False), cfg
    tensors = text_model_tensors(iter_tensors(path, part))
    if cfg.is_hybrid:
        from ddtree.models.hybrid import fold_norm_offsets, split_grouped_projections
        tensors = fold_norm_offsets(split_grouped_projections(tensors, cfg))
    load_weights(model, tensors, CausalLM.packed, path,
                 skip=lambda n: "rotary_emb" in n or (tied and n == "lm_head.weight") or beyond_layers(n, cfg))
    model.tie_weights()
    model.model.rotary.build(device)
    return model.eval().requires_grad_(False), cfg
