"""llama.cpp's GGUF architectures, each as one `Architecture` record in `ARCHITECTURES`: the Hugging Face
model it converts to, its tensor names, its config, and the inverse of what llama.cpp's converter
(convert_hf_to_gguf.py) does to its tensors: Llama's q/k row order, stacked experts, the norm offsets,
A_log and convolution of the Qwen3-Next family, Qwen3.5's value-head order, Qwen3-Next's in_proj_qkvz
and DeepSeek's kv_b_proj split in two.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader

from ddtree.models.gguf_read import f32, required, to_torch, value


def _as_stored(name: str, w: torch.Tensor, config: dict):
    yield name, w


def _nothing_to_finish(state: dict[str, torch.Tensor], config: dict) -> None:
    pass


@dataclass(frozen=True)
class Architecture:
    """How ddtree converts one llama.cpp architecture to a Hugging Face model."""
    hf_class: str  # the HF model class, config.json's "architectures"
    model_type: str
    # per-layer GGUF tensor kind -> HF module name; a key that includes the leaf ("ssm_dt.bias") names the whole tensor
    layer_names: dict[str, str]
    # config(reader, arch, tensors, config) adds the architecture's keys to `base_config`'s, or refuses the file
    config: Callable[[GGUFReader, str, dict, dict], None]
    # fix_tensor(hf_name, w, config) yields the HF (name, tensor) pairs that one GGUF tensor becomes
    fix_tensor: Callable = _as_stored
    # finish(state, config) changes the whole state dict once every tensor is in: joins, missing zero tensors
    finish: Callable[[dict[str, torch.Tensor], dict], None] = _nothing_to_finish
    # transformers' AutoTokenizer first reads the file's model config, which it has for some architectures only
    auto_tokenizer: bool = True
    # its config builder reads the rope.scaling.* keys; for the others `base_config` refuses a scaled rope
    scaled_rope: bool = False


def _ffn(gguf_suffix: str, hf_module: str) -> dict[str, str]:
    """A gated MLP's three projections: ffn_gate{gguf_suffix} -> {hf_module}.gate_proj, likewise up and down."""
    return {f"ffn_{proj}{gguf_suffix}": f"{hf_module}.{proj}_proj" for proj in ("gate", "up", "down")}


# Per-layer GGUF tensor kinds -> HF module names (an `Architecture`'s layer_names are made of these).
_ATTENTION = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
}
_MLP = _ffn("", "mlp")
# (the experts come stacked ([E, ...]); _split_experts makes them one tensor per expert)
_ROUTED = {"ffn_gate_inp": "mlp.gate", **_ffn("_exps", "mlp.experts")}
_DENSE = {**_ATTENTION, **_MLP, "ffn_norm": "post_attention_layernorm"}
_MOE = {**_ATTENTION, "ffn_norm": "post_attention_layernorm", **_ROUTED}
# The Gated DeltaNet layers of the Qwen3-Next family (Qwen3-Next's beta/alpha and q|k|v|z: _QWEN3NEXT)
_LINEAR_ATTENTION = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                     "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
                     "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_BETA_ALPHA = {"ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b"}
# Both attention kinds of the hybrid models, and the norm after them
_HYBRID_ATTENTION = {**_ATTENTION, "post_attention_norm": "post_attention_layernorm", **_LINEAR_ATTENTION}
_HYBRID = {**_HYBRID_ATTENTION, **_MLP, **_BETA_ALPHA}
# Qwen's shared expert and the gate that scales its output (Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next)
_SHARED_EXPERT = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate", **_ffn("_shexp", "mlp.shared_expert")}
# Qwen2-MoE: routed experts and the shared expert in every layer
_QWEN2MOE = {**_MOE, **_SHARED_EXPERT}
# Routed experts (gate and up may come stacked together, as the converter's --fuse-gate-up-exps writes them)
# and the shared expert, in every layer of Qwen3.5-MoE and Qwen3-Next
_HYBRID_EXPERTS = {**_HYBRID_ATTENTION, **_ROUTED, "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
                   **_SHARED_EXPERT}
# Qwen3-Next keeps HF's fused in_proj_ba (ssm_ba); its in_proj_qkvz comes whole (ssm_in, older converters)
# or as attn_qkv and attn_gate, which _join_qkvz joins back.
_QWEN3NEXT = {**_HYBRID_EXPERTS, "ssm_in": "linear_attn.in_proj_qkvz", "ssm_ba": "linear_attn.in_proj_ba"}
_MLA = {"attn_norm": "input_layernorm", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        **_MLP, "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
        # kv_b_proj's two halves as llama.cpp's converter names them before renaming; _join_kv_b joins them
        "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
        **_ROUTED, "exp_probs_b.bias": "mlp.gate.e_score_correction_bias", **_ffn("_shexp", "mlp.shared_experts")}


_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    """The HF name of a GGUF tensor: a top-level one, or a layer's by its kind in `layer_names`."""
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


def base_config(reader: GGUFReader, arch: str, tensors: dict) -> dict:
    """The config keys every architecture has: sizes, attention heads, rope, norms, special tokens."""
    hidden = value(reader, f"{arch}.embedding_length")
    n_head = value(reader, f"{arch}.attention.head_count")
    scaling = value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and not ARCHITECTURES[arch].scaled_rope:
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    return {
        "architectures": [ARCHITECTURES[arch].hf_class],
        "model_type": ARCHITECTURES[arch].model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": value(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": value(reader, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": value(reader, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": value(reader, f"{arch}.attention.key_length", hidden // n_head),
        "hidden_act": "silu",
        "rms_norm_eps": f32(value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": f32(value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": value(reader, f"{arch}.context_length", 32768),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": value(reader, "tokenizer.ggml.eos_token_id"),
    }


def _whole_head_rope(reader: GGUFReader, arch: str, config: dict) -> None:
    rope_dim = value(reader, f"{arch}.rope.dimension_count", config["head_dim"])
    if rope_dim != config["head_dim"]:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {config['head_dim']}) "
                         f"are not supported for {arch}")


def _dense_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    _whole_head_rope(reader, arch, config)
    config["attention_bias"] = arch == "qwen2" or "blk.0.attn_q.bias" in tensors
    if arch != "qwen2":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if "rope_freqs.weight" in tensors:
        factors = to_torch(tensors.pop("rope_freqs.weight"))
        config["rope_scaling"] = _llama3_rope_scaling(factors, config["head_dim"], config["rope_theta"])


def _moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen3-MoE: routed experts in every layer."""
    _whole_head_rope(reader, arch, config)
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    _routed_experts(reader, arch, tensors, config)


def _routed_experts(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Softmax-routed experts in every layer: llama.cpp's qwen2moe, qwen3moe, qwen35moe and qwen3next have
    no dense layers; all but qwen2moe renormalise the top-k routing weights (the file does not say so)."""
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense:
        raise ValueError(f"GGUF {arch} layers {dense} have no expert router; llama.cpp's {arch} has experts "
                         "in every layer")
    # (ffn_down_exps' ggml shape is [width, hidden, experts])
    width = value(reader, f"{arch}.expert_feed_forward_length") or int(tensors["blk.0.ffn_down_exps.weight"].shape[0])
    config.update({
        "num_experts": required(reader, f"{arch}.expert_count"),
        "num_experts_per_tok": required(reader, f"{arch}.expert_used_count"),
        "moe_intermediate_size": width,
        "norm_topk_prob": arch != "qwen2moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    })
    if config["intermediate_size"] is None:  # (the width of dense MLPs, which this model has none of)
        config["intermediate_size"] = width


def _hybrid_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """The hybrid models (Qwen3.5 text, Qwen3.5-MoE text, Qwen3-Next): the Gated DeltaNet dims (llama.cpp's
    `ssm.*` keys), which layers are full attention (every `full_attention_interval`-th, as llama.cpp
    decides), and the rotated share of a head."""
    if value(reader, f"{arch}.nextn_predict_layers", 0):
        raise ValueError(f"GGUF {arch} files with multi-token-prediction layers are not supported")
    n_layers, n_v = config["num_hidden_layers"], required(reader, f"{arch}.ssm.time_step_rank")
    every = value(reader, f"{arch}.full_attention_interval", 4)
    layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    recurrent = ["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention" for i in range(n_layers)]
    if recurrent != layer_types:
        raise ValueError(f"GGUF {arch} tensors give layer kinds {recurrent}, full_attention_interval {every} "
                         f"gives {layer_types}")
    fused = [i for i, kind in enumerate(layer_types)
             if kind == "full_attention" and f"blk.{i}.attn_qkv.weight" in tensors]
    if fused:  # (attn_qkv names the Gated DeltaNet's q|k|v projection here)
        raise ValueError(f"GGUF {arch} full-attention layers {fused} have a fused attn_qkv, which is not supported")
    rope_dim = value(reader, f"{arch}.rope.dimension_count", config["head_dim"])
    rope = {"rope_type": "default", "rope_theta": config["rope_theta"],
            "partial_rotary_factor": rope_dim / config["head_dim"]}
    sections = value(reader, f"{arch}.rope.dimension_sections")
    if sections is not None:  # (the multimodal rope's split, inert for text alone; llama.cpp pads it to 4)
        rope["mrope_section"] = list(sections[:3])
    config.update({
        "attention_bias": False,
        "layer_types": layer_types,
        "linear_num_key_heads": required(reader, f"{arch}.ssm.group_count"),
        "linear_num_value_heads": n_v,
        "linear_key_head_dim": required(reader, f"{arch}.ssm.state_size"),
        "linear_value_head_dim": required(reader, f"{arch}.ssm.inner_size") // n_v,
        "linear_conv_kernel_dim": required(reader, f"{arch}.ssm.conv_kernel"),
        "rope_parameters": rope,
    })


def _deepseek2_rope(reader: GGUFReader, arch: str, theta: float) -> dict:
    """The rope_parameters of a deepseek2 file: plain, or YaRN as llama.cpp's converter writes it."""
    scaling = value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise ValueError(f"GGUF deepseek2 rope scaling {scaling!r} is not supported (only 'yarn')")
    ext = value(reader, f"{arch}.rope.scaling.yarn_ext_factor", 1.0)
    if ext != 1.0:  # (the checkpoint's extrapolation_factor, which transformers' YaRN does not take)
        raise ValueError(f"GGUF deepseek2 rope.scaling.yarn_ext_factor {ext} is not supported (only 1)")
    # The converter stores 0.1 * mscale_all_dim as the log multiplier; llama.cpp divides by 0.1 in float32.
    log_mul = np.float32(value(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    return {
        "rope_type": "yarn", "rope_theta": theta,
        "factor": f32(required(reader, f"{arch}.rope.scaling.factor")),
        "original_max_position_embeddings": required(reader, f"{arch}.rope.scaling.original_context_length"),
        # (the checkpoint's, which newer converters write when it has them; llama.cpp's defaults otherwise)
        "beta_fast": f32(value(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": f32(value(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        "mscale_all_dim": f32(log_mul / np.float32(0.1)),
        # The checkpoint's attention_factor where the converter wrote one; otherwise cos and sin unscaled, as
        # llama.cpp's deepseek2 runs them and DeepSeek's configs (mscale equal to mscale_all_dim) give.
        "attention_factor": f32(value(reader, f"{arch}.rope.scaling.yarn_attn_factor", 1.0)),
    }


def _deepseek2_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """DeepSeek-V3 / Kimi K2: multi-head latent attention, leading dense layers, then sigmoid-routed
    experts (in groups, with a score bias) and shared experts. llama.cpp's converter writes kv_b_proj
    as attn_k_b / attn_v_b with the per-head sizes as key/value_length_mla (older converters: attn_kv_b
    whole, the sizes as key/value_length); attn_k_b / attn_v_b without the *_mla sizes (an unmerged
    early MLA converter's files) are refused."""
    n_layers = config["num_hidden_layers"]
    if value(reader, f"{arch}.nextn_predict_layers", 0):
        raise ValueError("GGUF deepseek2 files with multi-token-prediction (nextn) layers are not supported")
    if value(reader, f"{arch}.attention.temperature_scale", 0.0):
        raise ValueError("GGUF deepseek2 attention temperature scaling is not supported")
    gating = value(reader, f"{arch}.expert_gating_func")
    if gating != 2:  # (llama.cpp's sigmoid)
        said = ("no expert_gating_func (llama.cpp then routes by softmax, as DeepSeek-V2 files want)"
                if gating is None else f"expert_gating_func {gating}")
        raise ValueError(f"GGUF deepseek2 file has {said}; ddtree's deepseek_v3 routes by sigmoid (2) only")
    split = "blk.0.attn_k_b.weight" in tensors
    k_mla, v_mla = (value(reader, f"{arch}.attention.{k}_length_mla") for k in ("key", "value"))
    if split and not (k_mla and v_mla):
        raise ValueError("GGUF deepseek2 file has attn_k_b/attn_v_b but no key_length_mla/value_length_mla "
                         "(an early MLA converter's file, which llama.cpp does not load either)")
    if not split and "blk.0.attn_kv_b.weight" not in tensors:
        raise ValueError("GGUF deepseek2 file has neither attn_kv_b nor attn_k_b/attn_v_b")
    k_head = k_mla or required(reader, f"{arch}.attention.key_length")
    v_head = v_mla or required(reader, f"{arch}.attention.value_length")
    rope = required(reader, f"{arch}.rope.dimension_count")
    lead = value(reader, f"{arch}.leading_dense_block_count", 0)
    routed = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if routed != list(range(lead, n_layers)):
        raise ValueError(f"GGUF deepseek2 layers {routed} have expert routers; leading_dense_block_count {lead} "
                         f"implies layers {lead} to {n_layers - 1}")
    groups = value(reader, f"{arch}.expert_group_count", 1)  # (absent: llama.cpp routes without groups)
    width = required(reader, f"{arch}.expert_feed_forward_length")
    q_rank = None if "blk.0.attn_q.weight" in tensors else required(reader, f"{arch}.attention.q_lora_rank")
    config.update({
        "num_key_value_heads": config["num_attention_heads"],  # (the converter writes 1 for MLA files)
        "head_dim": rope,  # (transformers' deepseek_v3 names the rotary width head_dim)
        "attention_bias": False,
        "q_lora_rank": q_rank,  # (None: the query comes from one projection, attn_q)
        "kv_lora_rank": required(reader, f"{arch}.attention.kv_lora_rank"),
        "qk_nope_head_dim": k_head - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head,
        # llama.cpp rotates deepseek2's q/k rope channels in adjacent pairs, and the converter keeps their order
        "rope_interleave": True,
        "rope_parameters": _deepseek2_rope(reader, arch, config["rope_theta"]),
        "n_routed_experts": required(reader, f"{arch}.expert_count"),
        "num_experts_per_tok": required(reader, f"{arch}.expert_used_count"),
        "n_shared_experts": required(reader, f"{arch}.expert_shared_count"),
        "moe_intermediate_size": width,
        "first_k_dense_replace": lead,
        "n_group": max(groups, 1),
        "topk_group": value(reader, f"{arch}.expert_group_used_count", 1) if groups > 1 else 1,
        "scoring_func": "sigmoid",
        # absent keys (or a zero scale): llama.cpp neither scales nor renormalises the routing weights
        "routed_scaling_factor": f32(value(reader, f"{arch}.expert_weights_scale", 0.0) or 1.0),
        "norm_topk_prob": bool(value(reader, f"{arch}.expert_weights_norm", False)),
        "num_nextn_predict_layers": 0,
    })
    if config["intermediate_size"] is None:  # (the width of the dense layers' MLPs, when there are none)
        config["intermediate_size"] = width


def _hybrid_moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen3.5-MoE text and Qwen3-Next: the hybrid layers, routed experts in every layer, and a shared
    expert whose output sigmoid(shared_expert_gate . x) scales."""
    _hybrid_config(reader, arch, tensors, config)
    _routed_experts(reader, arch, tensors, config)
    scale = value(reader, f"{arch}.expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):  # (llama.cpp would scale the routing weights; the HF models do not)
        raise ValueError(f"GGUF {arch} expert_weights_scale {scale} is not supported")
    _shared_expert(reader, arch, tensors, config)


def _qwen2moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen2-MoE: q/k/v biases where the file has them, routed experts and a shared expert in every layer."""
    _whole_head_rope(reader, arch, config)
    config["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    _routed_experts(reader, arch, tensors, config)
    _shared_expert(reader, arch, tensors, config)


def _shared_expert(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen's shared expert, whose output sigmoid(shared_expert_gate . x) scales, in every layer."""
    unshared = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_up_shexp.weight" not in tensors]
    if unshared:
        raise ValueError(f"GGUF {arch} layers {unshared} have no shared expert; llama.cpp's {arch} has one in "
                         "every layer")
    config["shared_expert_intermediate_size"] = (value(reader, f"{arch}.expert_shared_feed_forward_length")
                                                or int(tensors["blk.0.ffn_down_shexp.weight"].shape[0]))


def _qwen35moe_config(reader: GGUFReader, arch: str, tensors: dict, config: dict) -> None:
    """Qwen3.5-MoE text: as Qwen3-Next, less the keys Qwen3_5MoeTextConfig lacks (a dense MLP width and
    the routing switches)."""
    _hybrid_moe_config(reader, arch, tensors, config)
    for key in ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        del config[key]


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


def _chain(*fixes):
    """One tensor fix that applies `fixes` in turn to every tensor each yields."""
    def fix(name: str, w: torch.Tensor, config: dict):
        out = [(name, w)]
        for f in fixes:
            out = [pair for n, t in out for pair in f(n, t, config)]
        yield from out
    return fix


def _halves(state: dict[str, torch.Tensor], config: dict, module: str, halves: tuple[str, str], whole: str,
            refusal: str):
    """Per layer, the two tensors that llama.cpp's converter splits `module`'s `whole` into, taken out of
    `state`: yields (layer, first half, second half, the whole's name) for each layer that has them. A layer
    with one half alone, or with the halves and the whole, is refused (`refusal`, formatted with the layer)."""
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.{module}."
        first, second = (state.pop(prefix + half, None) for half in halves)
        if first is None and second is None:
            continue
        if first is None or second is None or prefix + whole in state:
            raise ValueError(refusal.format(layer=i))
        yield i, first, second, prefix + whole


def _join_qkvz(state: dict[str, torch.Tensor], config: dict) -> None:
    """Each Qwen3-Next linear layer's in_proj_qkvz from the halves llama.cpp's converter splits it into:
    attn_qkv (every key head's q, then every k, then every v) and attn_gate (z). HF groups the rows by
    key head: its q, its k, then the v and then the z of the value heads it serves."""
    n_k, d_k = config["linear_num_key_heads"], config["linear_key_head_dim"]
    v_rows = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    for _, qkv, z, name in _halves(state, config, "linear_attn", ("in_proj_qkv.weight", "in_proj_z.weight"),
                                   "in_proj_qkvz.weight",
                                   "GGUF qwen3next layer {layer} needs attn_qkv and attn_gate, or ssm_in alone"):
        parts = qkv.split([n_k * d_k, n_k * d_k, v_rows]) + (z,)
        grouped = torch.cat([p.reshape(n_k, -1, p.shape[-1]) for p in parts], dim=1)
        state[name] = grouped.reshape(-1, qkv.shape[-1])


def _join_kv_b(state: dict[str, torch.Tensor], config: dict) -> None:
    """Each layer's kv_b_proj from the halves llama.cpp's converter splits it into: per head, its first
    qk_nope_head_dim rows (the keys' part) transposed, as attn_k_b [heads, kv_lora_rank, nope], and its
    other v_head_dim rows (the values'), as attn_v_b [heads, v_head_dim, kv_lora_rank]."""
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    for i, k_b, v_b, name in _halves(state, config, "self_attn", ("k_b_proj.weight", "v_b_proj.weight"),
                                     "kv_b_proj.weight",
                                     "GGUF deepseek2 layer {layer} needs attn_k_b and attn_v_b, or attn_kv_b alone"):
        if tuple(k_b.shape) != (heads, rank, nope) or tuple(v_b.shape) != (heads, v, rank):
            raise ValueError(f"GGUF deepseek2 layer {i}: attn_k_b {tuple(k_b.shape)} / attn_v_b {tuple(v_b.shape)}, "
                             f"config implies {(heads, rank, nope)} / {(heads, v, rank)}")
        joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope + v, rank]
        state[name] = joined.reshape(heads * (nope + v), rank)


def _finish_deepseek2(state: dict[str, torch.Tensor], config: dict) -> None:
    _join_kv_b(state, config)
    # llama.cpp routes without a score bias where exp_probs_b is absent; HF's router always adds one.
    for i in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        state.setdefault(f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(config["n_routed_experts"]))


def _zero_o_proj_bias(state: dict[str, torch.Tensor], config: dict) -> None:
    # HF Llama/Qwen3 give o_proj a bias whenever q/k/v have one; llama.cpp files may omit a zero one.
    if config["attention_bias"]:
        for i in range(config["num_hidden_layers"]):
            state.setdefault(f"model.layers.{i}.self_attn.o_proj.bias", torch.zeros(config["hidden_size"]))


def _ffn_shapes(module: str, width: int, hidden: int) -> dict[str, tuple]:
    """A gated MLP's three projection shapes, `width` its inner size."""
    return {f"{module}.gate_proj.weight": (width, hidden), f"{module}.up_proj.weight": (width, hidden),
            f"{module}.down_proj.weight": (hidden, width)}


def _shapes(config: dict) -> dict[str, tuple]:
    """Each HF tensor's shape as the config implies it, by name less the layer and expert numbers."""
    h, hd, vocab = config["hidden_size"], config["head_dim"], config["vocab_size"]
    inter = config.get("intermediate_size")  # (None: no dense MLP, Qwen3.5-MoE)
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    gated = 2 if "layer_types" in config else 1  # (the hybrid models' q_proj also yields the output gate)
    want = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
            "self_attn.q_proj.weight": (gated * q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,), **_ffn_shapes("mlp", inter, h)}
    experts = config.get("num_experts", config.get("n_routed_experts"))
    if experts:
        width = config["moe_intermediate_size"]
        want.update({"mlp.gate.weight": (experts, h), **_ffn_shapes("mlp.experts.*", width, h)})
    if "kv_lora_rank" in config:  # (DeepSeek's multi-head latent attention and shared experts)
        heads, q_rank, rank = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        shared = config["n_shared_experts"] * config["moe_intermediate_size"]
        want.update({
            "self_attn.q_proj.weight": (heads * (nope + rope), h), "self_attn.q_a_proj.weight": (q_rank, h),
            "self_attn.q_a_layernorm.weight": (q_rank,), "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h), "self_attn.kv_a_layernorm.weight": (rank,),
            "self_attn.kv_b_proj.weight": (heads * (nope + v), rank), "self_attn.o_proj.weight": (h, heads * v),
            "mlp.gate.e_score_correction_bias": (experts,), **_ffn_shapes("mlp.shared_experts", shared, h)})
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
        want.update({**_ffn_shapes("mlp.shared_expert", shared, h), "mlp.shared_expert_gate.weight": (1, h)})
    return want


def check_shapes(config: dict, state: dict[str, torch.Tensor]) -> None:
    """Refuses a state dict with a tensor whose shape the config does not imply."""
    want = _shapes(config)
    for name, w in state.items():
        key = re.sub(r"\.experts\.\d+\.", ".experts.*.", re.sub(r"^model\.layers\.\d+\.", "", name))
        shape = want.get(key)
        if shape is not None and tuple(w.shape) != shape:
            raise ValueError(f"GGUF tensor for {name} has shape {tuple(w.shape)}, config implies {shape}")


ARCHITECTURES = {
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", _DENSE, _dense_config),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", _DENSE, _dense_config, finish=_zero_o_proj_bias),
    "llama": Architecture("LlamaForCausalLM", "llama", _DENSE, _dense_config, fix_tensor=_unpermute_qk,
                          finish=_zero_o_proj_bias),
    "qwen3moe": Architecture("Qwen3MoeForCausalLM", "qwen3_moe", _MOE, _moe_config, fix_tensor=_split_experts,
                             finish=_zero_o_proj_bias),
    "qwen2moe": Architecture("Qwen2MoeForCausalLM", "qwen2_moe", _QWEN2MOE, _qwen2moe_config,
                             fix_tensor=_chain(_split_experts, _shared_expert_gate)),
    "qwen35": Architecture("Qwen3_5ForCausalLM", "qwen3_5_text", _HYBRID, _hybrid_config,
                           fix_tensor=_chain(_undo_qwen3next, _regroup_v_heads)),
    "qwen35moe": Architecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", {**_HYBRID_EXPERTS, **_BETA_ALPHA},
                              _qwen35moe_config, fix_tensor=_chain(_split_experts, _shared_expert_gate,
                                                                   _undo_qwen3next, _regroup_v_heads)),
    "qwen3next": Architecture("Qwen3NextForCausalLM", "qwen3_next", _QWEN3NEXT, _hybrid_moe_config,
                              fix_tensor=_chain(_split_experts, _shared_expert_gate, _undo_qwen3next),
                              finish=_join_qkvz, auto_tokenizer=False),
    "deepseek2": Architecture("DeepseekV3ForCausalLM", "deepseek_v3", _MLA, _deepseek2_config,
                              fix_tensor=_split_experts, finish=_finish_deepseek2, auto_tokenizer=False,
                              scaled_rope=True),  # (YaRN: _deepseek2_rope)
}
