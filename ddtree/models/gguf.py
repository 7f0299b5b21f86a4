"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory (config, safetensors, tokenizer).

    config, state_dict = read_gguf("model.gguf")   # HF config.json dict and HF-named tensors
    hf_dir = convert_gguf("model.gguf", "out/")    # config.json, model.safetensors, tokenizer, ...

Quantized tensors are dequantized once, at conversion, so the engine only ever loads plain weights.
The architectures are llama.cpp's `qwen2`, `qwen3`, `llama`, `qwen3moe` (Qwen3-MoE), `qwen35` (the
Qwen3.5 text model), `qwen35moe` (the Qwen3.5-MoE text model), `qwen3next` (Qwen3-Next) and
`deepseek2` (DeepSeek-V3, Kimi K2); where llama.cpp's converter (convert_hf_to_gguf.py) changes a
tensor on the way in (Llama's q/k row order, stacked experts, the norm offsets, A_log and convolution
of the Qwen3-Next family, Qwen3.5's value-head order, Qwen3-Next's in_proj_qkvz split in two,
DeepSeek's kv_b_proj split in two), the per-architecture functions below change it back.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

# Written last into a converted directory; its presence means the conversion finished.
DONE_MARKER = ".ddtree-converted"

# GGUF architecture -> the Hugging Face model class and model_type it converts to.
ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "deepseek2": ("DeepseekV3ForCausalLM", "deepseek_v3"),
}

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-layer GGUF tensor kinds -> HF module names, by architecture. A key that includes the leaf
# ("ssm_dt.bias") names the whole HF tensor.
_ATTENTION = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_DENSE = {**_ATTENTION, **_MLP, "ffn_norm": "post_attention_layernorm"}
_ROUTED = {"ffn_gate_inp": "mlp.gate",
           # stacked over the experts ([E, ...]); _split_experts makes them one tensor per expert
           "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
           "ffn_down_exps": "mlp.experts.down_proj"}
_MOE = {**_ATTENTION, "ffn_norm": "post_attention_layernorm", **_ROUTED}
# The Gated DeltaNet layers of the Qwen3-Next family (Qwen3-Next's beta/alpha and q|k|v|z: _QWEN3NEXT)
_LINEAR_ATTENTION = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                     "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
                     "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_BETA_ALPHA = {"ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b"}
_HYBRID = {**_ATTENTION, **_MLP, "post_attention_norm": "post_attention_layernorm", **_LINEAR_ATTENTION, **_BETA_ALPHA}
# Routed experts (gate and up may come stacked together, as the converter's --fuse-gate-up-exps writes them)
# and Qwen's shared expert with the gate that scales its output, in every layer of Qwen3.5-MoE and Qwen3-Next
_HYBRID_EXPERTS = {**_ATTENTION, "post_attention_norm": "post_attention_layernorm", **_LINEAR_ATTENTION, **_ROUTED,
                   "ffn_gate_up_exps": "mlp.experts.gate_up_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# Qwen3-Next keeps HF's fused in_proj_ba (ssm_ba); its in_proj_qkvz comes whole (ssm_in, older converters)
# or as attn_qkv and attn_gate, which _join_qkvz joins back.
_QWEN3NEXT = {**_HYBRID_EXPERTS, "ssm_in": "linear_attn.in_proj_qkvz", "ssm_ba": "linear_attn.in_proj_ba"}
_MLA = {"attn_norm": "input_layernorm", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        **_MLP, "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
        # kv_b_proj's two halves as llama.cpp's converter names them before renaming; _join_kv_b joins them
        "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
        "ffn_gate_inp": "mlp.gate", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_LAYER_NAMES = {"qwen2": _DENSE, "qwen3": _DENSE, "llama": _DENSE, "qwen3moe": _MOE, "qwen35": _HYBRID,
                "qwen35moe": {**_HYBRID_EXPERTS, **_BETA_ALPHA}, "qwen3next": _QWEN3NEXT, "deepseek2": _MLA}


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, rest = parts[1], parts[2]
        kind, _, leaf = rest.partition(".")
        if rest in layer_names:
            return f"model.layers.{layer}.{layer_names[rest]}"
        if kind in layer_names and leaf in ("weight", "bias"):
            return f"model.layers.{layer}.{layer_names[kind]}.{leaf}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that ddtree knows")


def _value(reader: GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str):
    value = _value(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return value


def _f32(x: float) -> float:
    # GGUF stores floats as float32; the shortest float32 repr gives back 1e-06 rather than 9.99999997e-07.
    return float(str(np.float32(x)))


def _tensor(t) -> torch.Tensor:
    """The tensor in torch (row-major, reversed-ne) order: F32/F16/BF16 as stored, quantized as float16."""
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (QType.F32, QType.F16):
        out = torch.from_numpy(np.array(t.data))
    elif t.tensor_type == QType.BF16:
        out = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    else:
        # Quantized values are an fp16 scale times small integers, which float16 keeps almost exactly.
        full = dequantize(t.data, t.tensor_type)
        half = full.astype(np.float16)
        out = torch.from_numpy(half if np.isfinite(half).all() else full)
    out = out.reshape(shape)
    return out.float() if out.dim() == 1 else out


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half, second
    # half) to interleaved pairs for its GPT-J style rope on `llama`; this is the inverse reshape.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_rope_scaling(factors: torch.Tensor, head_dim: int, theta: float) -> dict:
    """Recover Llama 3.x rope scaling from the per-frequency divisors llama.cpp stores as `rope_freqs`."""
    factor, low, high, old_ctx = float(factors.max()), 1.0, 4.0, 8192  # llama.cpp's (and Meta's) defaults
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            expected.append(1.0)
        elif wavelen > old_ctx / low:
            expected.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if not torch.allclose(factors.float(), torch.tensor(expected), rtol=1e-4):
        raise ValueError("GGUF rope_freqs do not match Llama 3 rope scaling; ddtree cannot map them to a config")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old_ctx}


def _base_config(reader: GGUFReader, arch: str, tensors: dict) -> dict:
    """The config keys every architecture has: sizes, attention heads, rope, norms, special tokens."""
    hidden = _value(reader, f"{arch}.embedding_length")
    n_head = _value(reader, f"{arch}.attention.head_count")
    scaling = _value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and arch != "deepseek2":  # (deepseek2's YaRN: _deepseek2_rope)
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    return {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": ARCHITECTURES[arch][1],
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": _value(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _value(reader, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _value(reader, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": _value(reader, f"{arch}.attention.key_length", hidden // n_head),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _value(reader, f"{arch}.context_length", 32768),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
    }


def _whole_head_rope(reader: GGUFReader, arch: str, config: dict) -> None:
    rope_dim = _value(reader, f"{arch}.rope.dimension_count", config["head_dim"])
    if rope_dim != config["head_dim"]:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {config['head_dim']}) "
                         f"are not supported for {arch}")


def _dense_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    _whole_head_rope(reader, arch, config)
    config["attention_bias"] = arch == "qwen2" or "blk.0.attn_q.bias" in tensors
    if arch != "qwen2":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if "rope_freqs.weight" in tensors:
        factors = _tensor(tensors.pop("rope_freqs.weight"))
        config["rope_scaling"] = _llama3_rope_scaling(factors, config["head_dim"], config["rope_theta"])


def _moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen3-MoE: routed experts in every layer."""
    _whole_head_rope(reader, arch, config)
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    _routed_experts(reader, arch, tensors, config)


def _routed_experts(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Softmax-routed experts in every layer: llama.cpp's qwen3moe, qwen35moe and qwen3next have no dense
    layers, and they renormalise the top-k routing weights (the file does not say so)."""
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense:
        raise ValueError(f"GGUF {arch} layers {dense} have no expert router; llama.cpp's {arch} has experts "
                         "in every layer")
    # (ffn_down_exps' ggml shape is [width, hidden, experts])
    width = _value(reader, f"{arch}.expert_feed_forward_length") or int(tensors["blk.0.ffn_down_exps.weight"].shape[0])
    config.update({
        "num_experts": _required(reader, f"{arch}.expert_count"),
        "num_experts_per_tok": _required(reader, f"{arch}.expert_used_count"),
        "moe_intermediate_size": width,
        # llama.cpp's qwen3moe always renormalises the top-k routing weights; the file does not say so.
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    })
    if config["intermediate_size"] is None:  # (the width of dense MLPs, which this model has none of)
        config["intermediate_size"] = width


def _hybrid_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """The hybrid models (Qwen3.5 text, Qwen3.5-MoE text, Qwen3-Next): the Gated DeltaNet dims (llama.cpp's
    `ssm.*` keys), which layers are full attention (every `full_attention_interval`-th, as llama.cpp
    decides), and the rotated share of a head."""
    if _value(reader, f"{arch}.nextn_predict_layers", 0):
        raise ValueError(f"GGUF {arch} files with multi-token-prediction layers are not supported")
    n_layers, n_v = config["num_hidden_layers"], _required(reader, f"{arch}.ssm.time_step_rank")
    every = _value(reader, f"{arch}.full_attention_interval", 4)
    layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    recurrent = ["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention" for i in range(n_layers)]
    if recurrent != layer_types:
        raise ValueError(f"GGUF {arch} tensors give layer kinds {recurrent}, full_attention_interval {every} "
                         f"gives {layer_types}")
    fused = [i for i, kind in enumerate(layer_types)
             if kind == "full_attention" and f"blk.{i}.attn_qkv.weight" in tensors]
    if fused:  # (attn_qkv names the Gated DeltaNet's q|k|v projection here)
        raise ValueError(f"GGUF {arch} full-attention layers {fused} have a fused attn_qkv, which is not supported")
    rope_dim = _value(reader, f"{arch}.rope.dimension_count", config["head_dim"])
    rope = {"rope_type": "default", "rope_theta": config["rope_theta"],
            "partial_rotary_factor": rope_dim / config["head_dim"]}
    sections = _value(reader, f"{arch}.rope.dimension_sections")
    if sections is not None:  # (the multimodal rope's split, inert for text alone; llama.cpp pads it to 4)
        rope["mrope_section"] = list(sections[:3])
    config.update({
        "attention_bias": False,
        "layer_types": layer_types,
        "linear_num_key_heads": _required(reader, f"{arch}.ssm.group_count"),
        "linear_num_value_heads": n_v,
        "linear_key_head_dim": _required(reader, f"{arch}.ssm.state_size"),
        "linear_value_head_dim": _required(reader, f"{arch}.ssm.inner_size") // n_v,
        "linear_conv_kernel_dim": _required(reader, f"{arch}.ssm.conv_kernel"),
        "rope_parameters": rope,
    })


def _deepseek2_rope(reader: GGUFReader, arch: str, theta: float) -> dict:
    """The rope_parameters of a deepseek2 file: plain, or YaRN as llama.cpp's converter writes it."""
    scaling = _value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise ValueError(f"GGUF deepseek2 rope scaling {scaling!r} is not supported (only 'yarn')")
    ext = _value(reader, f"{arch}.rope.scaling.yarn_ext_factor", 1.0)
    if ext != 1.0:  # (the checkpoint's extrapolation_factor, which transformers' YaRN does not take)
        raise ValueError(f"GGUF deepseek2 rope.scaling.yarn_ext_factor {ext} is not supported (only 1)")
    # The converter stores 0.1 * mscale_all_dim as the log multiplier; llama.cpp divides by 0.1 in float32.
    log_mul = np.float32(_value(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    return {
        "rope_type": "yarn", "rope_theta": theta,
        "factor": _f32(_required(reader, f"{arch}.rope.scaling.factor")),
        "original_max_position_embeddings": _required(reader, f"{arch}.rope.scaling.original_context_length"),
        # (the checkpoint's, which newer converters write when it has them; llama.cpp's defaults otherwise)
        "beta_fast": _f32(_value(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _f32(_value(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        "mscale_all_dim": _f32(log_mul / np.float32(0.1)),
        # The checkpoint's attention_factor where the converter wrote one; otherwise cos and sin unscaled, as
        # llama.cpp's deepseek2 runs them and DeepSeek's configs (mscale equal to mscale_all_dim) give.
        "attention_factor": _f32(_value(reader, f"{arch}.rope.scaling.yarn_attn_factor", 1.0)),
    }


def _deepseek2_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """DeepSeek-V3 / Kimi K2: multi-head latent attention, leading dense layers, then sigmoid-routed
    experts (in groups, with a score bias) and shared experts. llama.cpp's converter writes kv_b_proj
    as attn_k_b / attn_v_b with the per-head sizes as key/value_length_mla (older converters: attn_kv_b
    whole, the sizes as key/value_length); attn_k_b / attn_v_b without the *_mla sizes (an unmerged
    early MLA converter's files) are refused."""
    n_layers = config["num_hidden_layers"]
    if _value(reader, f"{arch}.nextn_predict_layers", 0):
        raise ValueError("GGUF deepseek2 files with multi-token-prediction (nextn) layers are not supported")
    if _value(reader, f"{arch}.attention.temperature_scale", 0.0):
        raise ValueError("GGUF deepseek2 attention temperature scaling is not supported")
    gating = _value(reader, f"{arch}.expert_gating_func")
    if gating != 2:  # (llama.cpp's sigmoid)
        said = ("no expert_gating_func (llama.cpp then routes by softmax, as DeepSeek-V2 files want)"
                if gating is None else f"expert_gating_func {gating}")
        raise ValueError(f"GGUF deepseek2 file has {said}; ddtree's deepseek_v3 routes by sigmoid (2) only")
    split = "blk.0.attn_k_b.weight" in tensors
    k_mla, v_mla = (_value(reader, f"{arch}.attention.{k}_length_mla") for k in ("key", "value"))
    if split and not (k_mla and v_mla):
        raise ValueError("GGUF deepseek2 file has attn_k_b/attn_v_b but no key_length_mla/value_length_mla "
                         "(an early MLA converter's file, which llama.cpp does not load either)")
    if not split and "blk.0.attn_kv_b.weight" not in tensors:
        raise ValueError("GGUF deepseek2 file has neither attn_kv_b nor attn_k_b/attn_v_b")
    k_head = k_mla or _required(reader, f"{arch}.attention.key_length")
    v_head = v_mla or _required(reader, f"{arch}.attention.value_length")
    rope = _required(reader, f"{arch}.rope.dimension_count")
    lead = _value(reader, f"{arch}.leading_dense_block_count", 0)
    routed = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if routed != list(range(lead, n_layers)):
        raise ValueError(f"GGUF deepseek2 layers {routed} have expert routers; leading_dense_block_count {lead} "
                         f"implies layers {lead} to {n_layers - 1}")
    groups = _value(reader, f"{arch}.expert_group_count", 1)  # (absent: llama.cpp routes without groups)
    width = _required(reader, f"{arch}.expert_feed_forward_length")
    q_rank = None if "blk.0.attn_q.weight" in tensors else _required(reader, f"{arch}.attention.q_lora_rank")
    config.update({
        "num_key_value_heads": config["num_attention_heads"],  # (the converter writes 1 for MLA files)
        "head_dim": rope,  # (transformers' deepseek_v3 names the rotary width head_dim)
        "attention_bias": False,
        "q_lora_rank": q_rank,  # (None: the query comes from one projection, attn_q)
        "kv_lora_rank": _required(reader, f"{arch}.attention.kv_lora_rank"),
        "qk_nope_head_dim": k_head - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head,
        # llama.cpp rotates deepseek2's q/k rope channels in adjacent pairs, and the converter keeps their order
        "rope_interleave": True,
        "rope_parameters": _deepseek2_rope(reader, arch, config["rope_theta"]),
        "n_routed_experts": _required(reader, f"{arch}.expert_count"),
        "num_experts_per_tok": _required(reader, f"{arch}.expert_used_count"),
        "n_shared_experts": _required(reader, f"{arch}.expert_shared_count"),
        "moe_intermediate_size": width,
        "first_k_dense_replace": lead,
        "n_group": max(groups, 1),
        "topk_group": _value(reader, f"{arch}.expert_group_used_count", 1) if groups > 1 else 1,
        "scoring_func": "sigmoid",
        # absent keys (or a zero scale): llama.cpp neither scales nor renormalises the routing weights
        "routed_scaling_factor": _f32(_value(reader, f"{arch}.expert_weights_scale", 0.0) or 1.0),
        "norm_topk_prob": bool(_value(reader, f"{arch}.expert_weights_norm", False)),
        "num_nextn_predict_layers": 0,
    })
    if config["intermediate_size"] is None:  # (the width of the dense layers' MLPs, when there are none)
        config["intermediate_size"] = width


def _hybrid_moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen3.5-MoE text and Qwen3-Next: the hybrid layers, routed experts in every layer, and a shared
    expert whose output sigmoid(shared_expert_gate . x) scales."""
    _hybrid_config(reader, arch, tensors, config)
    _routed_experts(reader, arch, tensors, config)
    scale = _value(reader, f"{arch}.expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):  # (llama.cpp would scale the routing weights; the HF models do not)
        raise ValueError(f"GGUF {arch} expert_weights_scale {scale} is not supported")
    unshared = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_up_shexp.weight" not in tensors]
    if unshared:
        raise ValueError(f"GGUF {arch} layers {unshared} have no shared expert; llama.cpp's {arch} has one in "
                         "every layer")
    config["shared_expert_intermediate_size"] = (_value(reader, f"{arch}.expert_shared_feed_forward_length")
                                                 or int(tensors["blk.0.ffn_down_shexp.weight"].shape[0]))
    if arch == "qwen35moe":  # (Qwen3_5MoeTextConfig has no dense MLP width and no routing switches)
        for key in ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            del config[key]


_CONFIGS = {"qwen2": _dense_config, "qwen3": _dense_config, "llama": _dense_config,
            "qwen3moe": _moe_config, "qwen35": _hybrid_config, "qwen35moe": _hybrid_moe_config,
            "qwen3next": _hybrid_moe_config, "deepseek2": _deepseek2_config}


def _unpermute_qk(name: str, w: torch.Tensor, config: dict):
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        w = _unpermute(w, config["num_attention_heads"])
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        w = _unpermute(w, config["num_key_value_heads"])
    yield name, w


def _split_experts(name: str, w: torch.Tensor, config: dict):
    """llama.cpp stacks a layer's experts into one [E, ...] tensor (gate_up_proj: gate and up together,
    [E, 2I, D], the gate's rows first); HF checkpoints hold one tensor each."""
    if ".mlp.experts." not in name:
        yield name, w
        return
    prefix, proj, leaf = name.rsplit(".", 2)
    stacked = dict(zip(("gate_proj", "up_proj"), w.chunk(2, dim=1))) if proj == "gate_up_proj" else {proj: w}
    for proj, projections in stacked.items():
        for e, one in enumerate(projections.unbind(0)):
            yield f"{prefix}.{e}.{proj}.{leaf}", one.clone()


def _shared_expert_gate(name: str, w: torch.Tensor, config: dict):
    # HF's shared_expert_gate is a [1, hidden] matrix; older converters squeezed it to [hidden].
    yield name, (w.reshape(1, -1) if name.endswith("mlp.shared_expert_gate.weight") else w)


def _group_v_heads(w: torch.Tensor, dim: int, config: dict, head: int) -> torch.Tensor:
    """Dimension `dim` of `w` (value heads of `head` channels each) from llama.cpp's order back to HF's.
    HF groups the value heads by the key head they share ([k0: v0 .. v(r-1)], [k1: ...]); llama.cpp's
    converter tiles them (the first of every group, then the second, ...) so that ggml can broadcast
    the key heads."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    w = w.movedim(dim, 0)
    grouped = w.reshape(n_v // n_k, n_k, head, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    return grouped.movedim(0, dim).contiguous()


def _undo_qwen3next(name: str, w: torch.Tensor, config: dict):
    """The inverse of what llama.cpp's converter does to every tensor of the Qwen3-Next family (its
    Qwen3.5 classes derive from Qwen3-Next's): zero-centred RMSNorm weights (the model scales by
    1 + weight) are stored as 1 + weight, A_log as -exp(A_log), the convolution without its middle axis
    of 1."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w.float() - 1.0  # (exact for stored values from 0.5 up: the model's 1 + weight is the stored value)
    elif name.endswith(".A_log"):
        w = torch.log(-w.double()).float()
    elif name.endswith("conv1d.weight"):
        w = w.unsqueeze(1)  # [channels, kernel] -> HF's depthwise Conv1d [channels, 1, kernel]
    yield name, w


def _regroup_v_heads(name: str, w: torch.Tensor, config: dict):
    """What the converter's Qwen3.5 classes (not Qwen3-Next's) add: the value heads tiled when there are
    more value heads than key heads, back in HF's grouped order (`_group_v_heads`)."""
    if ".linear_attn." in name and config["linear_num_value_heads"] != config["linear_num_key_heads"]:
        qk, dv = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"], config["linear_value_head_dim"]
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # (q and k rows are not reordered)
            w = torch.cat([w[:qk], _group_v_heads(w[qk:], 0, config, dv)])
        elif name.endswith("in_proj_z.weight"):
            w = _group_v_heads(w, 0, config, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
            w = _group_v_heads(w, 0, config, 1)
        elif name.endswith("out_proj.weight"):
            w = _group_v_heads(w, 1, config, dv)
    yield name, w


def _join_qkvz(state: dict[str, torch.Tensor], config: dict) -> None:
    """Each Qwen3-Next linear layer's in_proj_qkvz from the halves llama.cpp's converter splits it into:
    attn_qkv (every key head's q, then every k, then every v) and attn_gate (z). HF groups the rows by
    key head: its q, its k, then the v and then the z of the value heads it serves."""
    n_k, d_k = config["linear_num_key_heads"], config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.linear_attn."
        qkv, z = state.pop(prefix + "in_proj_qkv.weight", None), state.pop(prefix + "in_proj_z.weight", None)
        if qkv is None and z is None:
            continue
        if qkv is None or z is None or prefix + "in_proj_qkvz.weight" in state:
            raise ValueError(f"GGUF qwen3next layer {i} needs attn_qkv and attn_gate, or ssm_in alone")
        parts = qkv.split([n_k * d_k, n_k * d_k, value]) + (z,)
        grouped = torch.cat([p.reshape(n_k, -1, p.shape[-1]) for p in parts], dim=1)
        state[prefix + "in_proj_qkvz.weight"] = grouped.reshape(-1, qkv.shape[-1])


def _join_kv_b(state: dict[str, torch.Tensor], config: dict) -> None:
    """Each layer's kv_b_proj from the halves llama.cpp's converter splits it into: per head, its first
    qk_nope_head_dim rows (the keys' part) transposed, as attn_k_b [heads, kv_lora_rank, nope], and its
    other v_head_dim rows (the values'), as attn_v_b [heads, v_head_dim, kv_lora_rank]."""
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.self_attn."
        k_b, v_b = state.pop(prefix + "k_b_proj.weight", None), state.pop(prefix + "v_b_proj.weight", None)
        if k_b is None and v_b is None:
            continue
        if k_b is None or v_b is None or prefix + "kv_b_proj.weight" in state:
            raise ValueError(f"GGUF deepseek2 layer {i} needs attn_k_b and attn_v_b, or attn_kv_b alone")
        if tuple(k_b.shape) != (heads, rank, nope) or tuple(v_b.shape) != (heads, v, rank):
            raise ValueError(f"GGUF deepseek2 layer {i}: attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)}, "
                             f"config implies {(heads, rank, nope)} / {(heads, v, rank)}")
        joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope + v, rank]
        state[prefix + "kv_b_proj.weight"] = joined.reshape(heads * (nope + v), rank)


def _as_stored(name: str, w: torch.Tensor, config: dict):
    yield name, w


def _chain(*fixes):
    """One tensor fix that applies `fixes` in turn to every tensor each yields."""
    def fix(name: str, w: torch.Tensor, config: dict):
        out = [(name, w)]
        for f in fixes:
            out = [pair for n, t in out for pair in f(n, t, config)]
        yield from out
    return fix


_TENSOR_FIXES = {"llama": _unpermute_qk, "qwen3moe": _split_experts,
                 "qwen35": _chain(_undo_qwen3next, _regroup_v_heads),
                 "qwen35moe": _chain(_split_experts, _shared_expert_gate, _undo_qwen3next, _regroup_v_heads),
                 "qwen3next": _chain(_split_experts, _shared_expert_gate, _undo_qwen3next),
                 "deepseek2": _split_experts}


def read_gguf(path: str | GGUFReader, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """An HF config.json-style dict and an HF-named state dict for the GGUF model at `path`."""
    # Parsing the metadata of a 150k-token vocabulary takes seconds, so callers may pass a reader they hold.
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path)
    path = str(reader.data.filename) if isinstance(path, GGUFReader) else path
    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    try:
        config = _base_config(reader, arch, tensors)
        _CONFIGS[arch](reader, arch, tensors, config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    fix = _TENSOR_FIXES.get(arch, _as_stored)

    state: dict[str, torch.Tensor] = {}
    for name, t in tqdm(tensors.items(), desc="dequantizing", unit="tensor", disable=not progress):
        state.update(fix(_hf_name(name, _LAYER_NAMES[arch]), _tensor(t), config))
    if config["attention_bias"] and arch in ("llama", "qwen3", "qwen3moe"):
        # HF Llama/Qwen3 give o_proj a bias whenever q/k/v have one; llama.cpp files may omit a zero one.
        for i in range(config["num_hidden_layers"]):
            state.setdefault(f"model.layers.{i}.self_attn.o_proj.bias", torch.zeros(config["hidden_size"]))
    _check_shapes(config, state)
    if arch == "qwen3next":
        _join_qkvz(state, config)
    if arch == "deepseek2":
        _join_kv_b(state, config)
        # llama.cpp routes without a score bias where exp_probs_b is absent; HF's router always adds one.
        for i in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
            bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            state.setdefault(bias, torch.zeros(config["n_routed_experts"]))
    dtypes = {w.dtype for w in state.values() if w.dim() > 1}
    config["torch_dtype"] = next((n for d, n in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16"))
                                  if d in dtypes), "float32")
    return config, state


def _shapes(config: dict) -> dict[str, tuple]:
    """Each HF tensor's shape as the config implies it, by name less the layer and expert numbers."""
    h, hd, vocab = config["hidden_size"], config["head_dim"], config["vocab_size"]
    inter = config.get("intermediate_size")  # (None: no dense MLP, Qwen3.5-MoE)
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    gated = 2 if "layer_types" in config else 1  # (the hybrid models' q_proj also yields the output gate)
    want = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
            "self_attn.q_proj.weight": (gated * q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,), "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    experts = config.get("num_experts", config.get("n_routed_experts"))
    if experts:
        width = config["moe_intermediate_size"]
        want.update({"mlp.gate.weight": (experts, h), "mlp.experts.*.gate_proj.weight": (width, h),
                     "mlp.experts.*.up_proj.weight": (width, h), "mlp.experts.*.down_proj.weight": (h, width)})
    if "kv_lora_rank" in config:  # (DeepSeek's multi-head latent attention and shared experts)
        heads, q_rank, rank = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        shared = config["n_shared_experts"] * config["moe_intermediate_size"]
        want.update({
            "self_attn.q_proj.weight": (heads * (nope + rope), h), "self_attn.q_a_proj.weight": (q_rank, h),
            "self_attn.q_a_layernorm.weight": (q_rank,), "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h), "self_attn.kv_a_layernorm.weight": (rank,),
            "self_attn.kv_b_proj.weight": (heads * (nope + v), rank), "self_attn.o_proj.weight": (h, heads * v),
            "mlp.gate.e_score_correction_bias": (experts,), "mlp.shared_experts.gate_proj.weight": (shared, h),
            "mlp.shared_experts.up_proj.weight": (shared, h), "mlp.shared_experts.down_proj.weight": (h, shared)})
    if "linear_num_key_heads" in config:
        n_v, d_v = config["linear_num_value_heads"], config["linear_value_head_dim"]
        conv = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + n_v * d_v
        want.update({"linear_attn.in_proj_qkv.weight": (conv, h), "linear_attn.in_proj_z.weight": (n_v * d_v, h),
                     "linear_attn.in_proj_a.weight": (n_v, h), "linear_attn.in_proj_b.weight": (n_v, h),
                     "linear_attn.A_log": (n_v,), "linear_attn.dt_bias": (n_v,),
                     "linear_attn.conv1d.weight": (conv, 1, config["linear_conv_kernel_dim"]),
                     "linear_attn.norm.weight": (d_v,), "linear_attn.out_proj.weight": (h, n_v * d_v),
                     # (Qwen3-Next's fused projections)
                     "linear_attn.in_proj_qkvz.weight": (conv + n_v * d_v, h),
                     "linear_attn.in_proj_ba.weight": (2 * n_v, h)})
    if "shared_expert_intermediate_size" in config:
        shared = config["shared_expert_intermediate_size"]
        want.update({"mlp.shared_expert.gate_proj.weight": (shared, h), "mlp.shared_expert.up_proj.weight": (shared, h),
                     "mlp.shared_expert.down_proj.weight": (h, shared), "mlp.shared_expert_gate.weight": (1, h)})
    return want


def _check_shapes(config: dict, state: dict[str, torch.Tensor]) -> None:
    want = _shapes(config)
    for name, w in state.items():
        key = re.sub(r"\.experts\.\d+\.", ".experts.*.", re.sub(r"^model\.layers\.\d+\.", "", name))
        shape = want.get(key)
        if shape is not None and tuple(w.shape) != shape:
            raise ValueError(f"GGUF tensor for {name} has shape {tuple(w.shape)}, config implies {shape}")


def _save_tokenizer(reader: GGUFReader, gguf_path: str, out_dir: str, eos_id: int | None) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if reader.get_field("tokenizer.ggml.model") is None:
        return  # a weights-only GGUF: the caller must bring its own tokenizer
    # AutoTokenizer first reads the file's model config, which transformers has for some architectures
    # only (not for deepseek2 or qwen3next); the fast tokenizer class builds from the file's tokenizer keys alone.
    auto = _value(reader, "general.architecture") not in ("deepseek2", "qwen3next")
    tok = (AutoTokenizer if auto else PreTrainedTokenizerFast).from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
    if eos_id is not None and tok.eos_token_id != eos_id:
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    template = _value(reader, "tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.save_pretrained(out_dir)
    saved = os.listdir(out_dir)
    if template and "chat_template.jinja" not in saved:
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            if "chat_template" not in json.load(f):
                with open(os.path.join(out_dir, "chat_template.jinja"), "w") as g:
                    g.write(template)


# Control tokens llama.cpp also ends generation on, as HF generation configs list them (Qwen: im_end and endoftext).
_END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _generation_config(reader: GGUFReader) -> dict:
    gen = {"bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id")}
    stops = [_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens, types = reader.get_field("tokenizer.ggml.tokens"), reader.get_field("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        stops += [i for i, (tok, kind) in enumerate(zip(tokens.contents(), types.contents()))
                  if kind == 3 and tok in _END_OF_GENERATION]  # 3: CONTROL
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops or None
    pad = _value(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = pad
    return gen


def convert_gguf(gguf_path: str, out_dir: str, progress: bool = True) -> str:
    """Write `gguf_path` as a Hugging Face checkpoint into `out_dir` (replaced atomically); return out_dir."""
    from safetensors.torch import save_file

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        reader = GGUFReader(gguf_path)
        config, state = read_gguf(reader, progress=progress)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(_generation_config(reader), f, indent=2)
        if progress:
            tqdm.write(f"writing {len(state)} tensors to {out_dir}/model.safetensors")
        weights = os.path.join(tmp, "model.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, weights, metadata={"format": "pt"})
        # save_file makes it owner-only; give it the mode the umask gave our directory, as other files get.
        os.chmod(weights, os.stat(tmp).st_mode & 0o666)
        del state
        if progress:
            tqdm.write("converting the tokenizer")
        _save_tokenizer(reader, gguf_path, tmp, config["eos_token_id"])
        with open(os.path.join(tmp, DONE_MARKER), "w") as f:
            json.dump({"source": os.path.abspath(gguf_path)}, f)
        if os.path.exists(out_dir):  # os.replace cannot overwrite a non-empty directory
            old = f"{out_dir}.old-{os.getpid()}"
            os.replace(out_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
