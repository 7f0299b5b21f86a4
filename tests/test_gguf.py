"""GGUF conversion: tiny GGUF files written the way llama.cpp writes them must convert back to their HF twins."""
from __future__ import annotations

import copy
import json
import os
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from ddtree.models.gguf import DONE_MARKER, convert_gguf, read_gguf
from tiny import make_config

VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps."
# Written the way llama.cpp names them, independently of the module under test.
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              # Qwen3-MoE: the router, and each layer's experts stacked into one tensor a projection
              "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
              "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
# Qwen2-MoE, Qwen3.5-MoE and Qwen3-Next: the shared expert and its gate
SHARED_EXPERT_NAMES = {"mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                       "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
QWEN35_NAMES = {**GGUF_NAMES, **SHARED_EXPERT_NAMES, "post_attention_layernorm": "post_attention_norm",
                "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta",
                "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
                "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",  # (whole names: no leaf)
                # Qwen3.5-MoE and Qwen3-Next: gate and up stacked together (the converter's
                # --fuse-gate-up-exps), Qwen3-Next's fused projections (in_proj_qkvz whole: older converters;
                # the current one writes it as attn_qkv and attn_gate, qwen3next_qkvz)
                "mlp.experts.gate_up_proj": "ffn_gate_up_exps", "linear_attn.in_proj_qkvz": "ssm_in",
                "linear_attn.in_proj_ba": "ssm_ba"}
HYBRID = ("qwen35", "qwen35moe", "qwen3next")
# DeepSeek-V3 (llama.cpp's deepseek2): latent attention, shared experts and the router's score bias; kv_b_proj
# whole (older converters) or as its keys' and values' halves (k_b_proj / v_b_proj: split_kv_b).
DEEPSEEK2_NAMES = {**GGUF_NAMES, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b",
                   "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                   "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
                   "self_attn.k_b_proj": "attn_k_b", "self_attn.v_b_proj": "attn_v_b",
                   "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                   "mlp.shared_experts.down_proj": "ffn_down_shexp",
                   "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
               "qwen3next": "qwen3_next", "deepseek2": "deepseek_v3"}
# One tensor stored as F16 and one as Q8_0, where a converter transform meets quantization: llama's q/k
# row permutation, the stacking of experts (Qwen3.5-MoE: gate and up in one tensor), Qwen3.5's value-head
# reordering (rows of q|k|v), Qwen3-Next's in_proj_qkvz split, DeepSeek's kv_b_proj split (SPLIT_KV_B's
# cases quantize layer 0's keys' half, make_twin; the other deepseek2 case layer 0's full-rank q_proj).
# Patterns, as a MoE layer's experts are one tensor each in HF and one stacked tensor in the GGUF.
F16_TENSOR = {"qwen3moe": r"model\.layers\.1\.mlp\.experts\.(\d+\.)?up_proj\.weight",
              "qwen2moe": r"model\.layers\.1\.mlp\.shared_expert\.up_proj\.weight",
              "qwen35": r"model\.layers\.0\.linear_attn\.out_proj\.weight",
              "qwen35moe": r"model\.layers\.1\.mlp\.shared_expert\.down_proj\.weight",
              "qwen3next": r"model\.layers\.0\.linear_attn\.in_proj_ba\.weight",
              "deepseek2": r"model\.layers\.1\.mlp\.experts\.(\d+\.)?up_proj\.weight"}
Q8_TENSOR = {"qwen3moe": r"model\.layers\.0\.mlp\.experts\.(\d+\.)?down_proj\.weight",
             "qwen2moe": r"model\.layers\.0\.mlp\.experts\.(\d+\.)?down_proj\.weight",
             "qwen35": r"model\.layers\.0\.linear_attn\.in_proj_qkv\.weight",
             "qwen35moe": r"model\.layers\.0\.mlp\.experts\.(\d+\.)?(gate|up)_proj\.weight",
             "qwen3next": r"model\.layers\.0\.linear_attn\.in_proj_qkvz\.weight"}
DENSE_F16, DENSE_Q8 = r"model\.layers\.1\.mlp\.up_proj\.weight", r"model\.layers\.0\.self_attn\.q_proj\.weight"
# DeepSeek's YaRN (mscale equal to mscale_all_dim), with beta values other than llama.cpp's defaults.
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                 "mscale": 0.7, "mscale_all_dim": 0.7, "beta_fast": 16.0, "beta_slow": 2.0}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

CASES = {
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=12345.0)),
    "qwen3-headdim": ("qwen3", dict(head_dim=32, rope_theta=1e6)),
    "llama-rope3": ("llama", dict(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA3_ROPE)),
    "llama-bias-tied": ("llama", dict(attention_bias=True, tie_word_embeddings=True)),
    "qwen3moe": ("qwen3moe", dict(rope_theta=1e6)),
    "qwen2moe": ("qwen2moe", dict(rope_theta=1e6)),
    # two key heads of three value heads each (llama.cpp reorders those), and half of each head rotated
    "qwen35-grouped": ("qwen35", dict(linear_num_key_heads=2, linear_num_value_heads=6, partial_rotary_factor=0.5)),
    "qwen35-tied": ("qwen35", dict(linear_num_key_heads=2, linear_num_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1e7, head_dim=32)),
    # tests/tiny.py's (two key heads of two value heads each) in 2 layers: a Gated DeltaNet one, then full
    # attention; Qwen3-Next as the current converter writes it, and as older ones did (in_proj_qkvz whole,
    # the shared expert's gate squeezed to a vector, no full_attention_interval: llama.cpp's default of 4)
    "qwen35moe": ("qwen35moe", dict(layer_types=["linear_attention", "full_attention"])),
    "qwen3next": ("qwen3next", dict(layer_types=["linear_attention", "full_attention"])),
    "qwen3next-ssm_in": ("qwen3next", dict(num_hidden_layers=4,
                                           layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # a dense layer, then routed experts: as the current converter writes it (kv_b_proj split, groups of
    # experts, YaRN 4x; 32 keys' channels a head: one Q8_0 block), and as older ones did (kv_b_proj whole,
    # no groups; here with a full-rank query and unnormalised routing weights)
    "deepseek2": ("deepseek2", dict(qk_nope_head_dim=32, kv_lora_rank=16, rope_parameters=DEEPSEEK_YARN,
                                    max_position_embeddings=512)),
    "deepseek2-kv_b": ("deepseek2", dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                         routed_scaling_factor=1.5)),
}
SPLIT_KV_B = {"deepseek2"}
QWEN3NEXT_LEGACY = {"qwen3next-ssm_in"}
DENSE_CASES = [c for c, (arch, _) in CASES.items() if arch not in MODEL_TYPES]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, "hello world, the lazy fox and the quick dog"] * 8, trainer)
    return tok


def hf_config(arch: str, overrides: dict, eos: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=eos)
    common.update(copy.deepcopy(overrides))  # transformers edits rope_scaling in place
    if arch == "qwen3moe":  # routed experts in every layer, as llama.cpp's qwen3moe has them
        return Qwen3MoeConfig(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, **common)
    if arch == "qwen2moe":  # tests/tiny.py's, with experts in every layer, as llama.cpp's qwen2moe has them
        return make_config("qwen2_moe", VOCAB, mlp_only_layers=[],
                           **{k: v for k, v in common.items() if k != "vocab_size"})
    if arch == "deepseek2":  # tests/tiny.py's DeepSeek-V3 (8 experts in 2 groups, one shared), in 2 layers
        return make_config("deepseek_v3", VOCAB, **{k: v for k, v in common.items() if k != "vocab_size"})
    if arch == "qwen35moe":  # tests/tiny.py's: 8 experts and a shared one in every layer; the multimodal rope's
        # split, as Qwen3.5-MoE checkpoints have it
        cfg = make_config("qwen3_5_moe", VOCAB, **{k: v for k, v in common.items() if k != "vocab_size"})
        cfg.rope_parameters["mrope_section"] = [2, 1, 1]
        return cfg
    if arch == "qwen3next":  # tests/tiny.py's, with what llama.cpp's qwen3next runs: experts in every layer,
        # top-k weights renormalised
        cfg = make_config("qwen3_next", VOCAB, **{k: v for k, v in common.items() if k != "vocab_size"})
        cfg.mlp_only_layers, cfg.norm_topk_prob = [], True
        return cfg
    if arch == "qwen35":  # a Gated DeltaNet layer, then a gated full-attention one; 8 rotated channels a head
        rope = {"rope_type": "default", "rope_theta": common.pop("rope_theta", 10000.0),
                "partial_rotary_factor": common.pop("partial_rotary_factor", 0.25), "mrope_section": [2, 1, 1]}
        return Qwen3_5TextConfig(**{"head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
                                    "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"],
                                    "rope_parameters": rope, **common})
    return {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch](**common)


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # What llama.cpp's convert_hf_to_gguf does to llama q/k rows: rotate-half pairs become interleaved.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def qwen35_to_gguf(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """What llama.cpp's converter does to a Qwen3.5 (or Qwen3.5-MoE) text model's tensor (rows may be Q8_0
    bytes): value heads from grouped by key head to tiled (the r-th of every group together), then what it
    does to the whole Qwen3-Next family (qwen3next_to_gguf)."""
    n_k, n_v, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qk = 2 * n_k * cfg.linear_key_head_dim

    def tiled(x, head):
        return x.reshape(n_k, n_v // n_k, head, *x.shape[1:]).transpose(0, 1).reshape(x.shape)

    if "linear_attn." in name and n_k != n_v:
        if "in_proj_qkv" in name or "conv1d" in name:
            t = torch.cat([t[:qk], tiled(t[qk:], dv)])
        elif "in_proj_z" in name:
            t = tiled(t, dv)
        elif any(k in name for k in ("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
            t = tiled(t, 1)
        elif "out_proj" in name:
            t = tiled(t.T, dv).T
    return qwen3next_to_gguf(name, t, cfg)


def qwen3next_to_gguf(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """What llama.cpp's converter does to every tensor of the Qwen3-Next family (Qwen3.5's classes derive
    from Qwen3-Next's): the convolution squeezed, A_log as -exp(A_log), 1 added to the zero-centred norms."""
    if "conv1d" in name:
        t = t.squeeze(1)
    if name.endswith("A_log"):
        t = -torch.exp(t)
    elif name.endswith("norm.weight") and "linear_attn" not in name:
        t = t + 1
    return t


def qwen3next_qkvz(sd: dict, cfg) -> dict:
    """in_proj_qkvz as llama.cpp's current converter writes it: HF's groups of rows per key head (q, k,
    then the v and z of its value heads) as in_proj_qkv (every q, every k, every v) and in_proj_z."""
    out = {}
    for name, t in sd.items():
        if name.endswith("in_proj_qkvz.weight"):
            r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
            sizes = [cfg.linear_key_head_dim] * 2 + [r * cfg.linear_value_head_dim] * 2
            q, k, v, z = (p.flatten(0, 1) for p in t.view(cfg.linear_num_key_heads, -1, t.shape[-1]).split(sizes, 1))
            out[name.replace("qkvz", "qkv")], out[name.replace("qkvz", "z")] = torch.cat([q, k, v]), z
        else:
            out[name] = t
    return out


def split_kv_b(sd: dict, cfg) -> dict:
    """kv_b_proj as llama.cpp's current converter writes it: per head, the keys' rows transposed
    (k_b_proj [heads, kv_lora_rank, nope]) and the values' rows (v_b_proj [heads, v_head_dim, kv_lora_rank])."""
    out = {}
    for name, t in sd.items():
        if name.endswith("kv_b_proj.weight"):
            heads = t.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            out[name.replace("kv_b_proj", "k_b_proj")] = heads[:, :cfg.qk_nope_head_dim].transpose(1, 2)
            out[name.replace("kv_b_proj", "v_b_proj")] = heads[:, cfg.qk_nope_head_dim:]
        else:
            out[name] = t
    return out


def add_deepseek2_metadata(w: GGUFWriter, cfg, split: bool) -> None:
    """The keys llama.cpp's converter writes for a DeepSeek-V3 checkpoint; `split`: the current converter
    (MLA as multi-query attention over the latent, the per-head sizes as *_mla, expert groups, YaRN betas,
    expert_weights_norm only when true), else an older one (the per-head sizes as key/value_length)."""
    w.add_head_count_kv(1 if split else cfg.num_key_value_heads)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if split:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob or not split:
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rope = cfg.rope_parameters
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if split:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def stack_experts(sd: dict) -> dict:
    """Each layer's experts as one [E, ...] tensor a projection, as llama.cpp's converter stacks them."""
    out, experts = {}, {}
    for name, t in sd.items():
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+\.weight)", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
        else:
            out[name] = t
    for name, by_expert in experts.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def gguf_name(arch: str, name: str) -> str:
    top = {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight"}
    if name in top:
        return top[name]
    _, _, i, rest = name.split(".", 3)
    names = QWEN35_NAMES if arch in HYBRID else {"deepseek2": DEEPSEEK2_NAMES,
                                                  "qwen2moe": {**GGUF_NAMES, **SHARED_EXPERT_NAMES}}.get(arch, GGUF_NAMES)
    if rest in names:
        return f"blk.{i}.{names[rest]}"
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{i}.{names[module]}.{leaf}"


def make_twin(tmp_path, case: str):
    """An HF checkpoint dir (the twin) and a GGUF file holding the same weights, as llama.cpp would write it."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch, overrides = CASES[case]
    f16, q8 = F16_TENSOR.get(arch, DENSE_F16), Q8_TENSOR.get(arch, DENSE_Q8)
    tok = train_tokenizer()
    cfg = hf_config(arch, overrides, eos=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() >= 2 else 0.02)
            if "norm" in name:
                p.add_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (DeepSeek's router bias: a buffer, zero at first)
                b.normal_(0, 0.1)
    twin = tmp_path / "twin"
    model.save_pretrained(twin)
    # The twin holds exactly what the GGUF can: fp16 values, Q8_0's dequantized values (kept as fp16), and
    # Qwen3.5 norm weights w whose 1 + w is exact in float32.
    sd, q8_bytes = load_file(twin / "model.safetensors"), {}
    for name, t in sd.items():
        if re.fullmatch(f16, name):
            sd[name] = t.half().float()
        elif re.fullmatch(q8, name):
            q8_bytes[name] = quantize(t.numpy(), QType.Q8_0)  # Q8_0 is not idempotent: quantize once
            sd[name] = torch.from_numpy(dequantize(q8_bytes[name], QType.Q8_0)).half().float()
        elif arch in HYBRID and name.endswith("norm.weight") and "linear_attn" not in name:
            sd[name] = (t + 1) - 1
    if case in SPLIT_KV_B:  # layer 0's keys' half of kv_b_proj as Q8_0, blocks along each head's key channels
        heads = sd["model.layers.0.self_attn.kv_b_proj.weight"].view(
            cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)  # (a view into sd)
        k_b = "model.layers.0.self_attn.k_b_proj.weight"
        q8_bytes[k_b] = quantize(heads[:, :cfg.qk_nope_head_dim].transpose(1, 2).contiguous().numpy(), QType.Q8_0)
        dequantized = torch.from_numpy(dequantize(q8_bytes[k_b], QType.Q8_0)).half().float()
        heads[:, :cfg.qk_nope_head_dim] = dequantized.transpose(1, 2)
    save_file(sd, twin / "model.safetensors", metadata={"format": "pt"})

    path = tmp_path / f"{case}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if hasattr(cfg, "intermediate_size"):  # (Qwen3.5-MoE's config has none; the converter then writes none)
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(overrides.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = overrides.get("head_dim", cfg.hidden_size // cfg.num_attention_heads)
    if arch == "deepseek2":
        add_deepseek2_metadata(w, cfg, split=case in SPLIT_KV_B)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
    if arch != "deepseek2" and ("head_dim" in overrides or arch in MODEL_TYPES):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("qwen3moe", "qwen2moe", "qwen35moe", "qwen3next"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch in HYBRID:  # llama.cpp's names for the Gated DeltaNet dims
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        if case not in QWEN3NEXT_LEGACY:
            w.add_full_attention_interval(2)
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        if "mrope_section" in cfg.rope_parameters:
            w.add_rope_dimension_sections(cfg.rope_parameters["mrope_section"] + [0])  # (padded to 4)
    add_tokenizer(w, tok, arch)
    if "rope_scaling" in overrides:  # llama.cpp stores Llama 3 scaling as per-frequency divisors
        inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        w.add_tensor("rope_freqs.weight", (inv_freq / scaled).numpy().astype(np.float32))
    # Quantized blocks run along rows, so the converter's row permutations and stacking act on the Q8_0
    # bytes as on the values.
    tensors = {name: torch.from_numpy(q8_bytes[name]) if name in q8_bytes else t for name, t in sd.items()}
    if arch in ("qwen3moe", "qwen2moe", "qwen35moe", "qwen3next", "deepseek2"):
        tensors = stack_experts(tensors)
    if arch == "qwen35moe":  # gate and up in one [E, 2I, D] tensor a layer, the gate's rows first
        for gate in [n for n in tensors if n.endswith("experts.gate_proj.weight")]:
            up = tensors.pop(gate.replace("gate_proj", "up_proj"))
            tensors[gate.replace("gate_proj", "gate_up_proj")] = torch.cat([tensors.pop(gate), up], dim=1)
    if arch == "qwen3next" and case not in QWEN3NEXT_LEGACY:
        tensors = qwen3next_qkvz(tensors, cfg)
    if case in SPLIT_KV_B:
        tensors = split_kv_b(tensors, cfg)
        tensors.update({name: torch.from_numpy(b) for name, b in q8_bytes.items() if name not in sd})
    for name, t in tensors.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            t = llama_permute(t, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        elif arch in ("qwen35", "qwen35moe"):
            t = qwen35_to_gguf(name, t, cfg)
        elif arch == "qwen3next":
            t = qwen3next_to_gguf(name, t, cfg)
            if case in QWEN3NEXT_LEGACY and name.endswith("shared_expert_gate.weight"):
                t = t.squeeze(0)
        if t.dtype == torch.uint8:
            w.add_tensor(gguf_name(arch, name), t.numpy(), raw_dtype=QType.Q8_0)
        elif re.fullmatch(f16, name):
            w.add_tensor(gguf_name(arch, name), t.numpy().astype(np.float16))
        else:
            w.add_tensor(gguf_name(arch, name), t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return twin, path, sd, tok


def add_tokenizer(w: GGUFWriter, tok, arch: str, pre: str | None = None) -> None:
    spec = json.loads(tok.to_str())["model"]
    by_id = sorted(spec["vocab"], key=spec["vocab"].get)
    tokens = by_id + [f"[PAD{i}]" for i in range(len(by_id), VOCAB)]
    types = [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL if i < len(by_id) else TokenType.UNUSED
             for i, t in enumerate(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or ("qwen2" if arch.startswith("qwen") else "llama-bpe"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_chat_template(CHATML)


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_read_gguf_gives_the_twin_state_dict_and_config(tmp_path, case):
    twin, path, sd, _ = make_twin(tmp_path, case)
    config, state = read_gguf(str(path))
    arch, overrides = CASES[case]
    assert config["model_type"] == MODEL_TYPES.get(arch, arch)
    assert config["num_hidden_layers"] == overrides.get("num_hidden_layers", 2)
    assert config["tie_word_embeddings"] == overrides.get("tie_word_embeddings", False)
    assert config["rope_theta"] == overrides.get("rope_theta", 10000.0) and config["rms_norm_eps"] == 1e-6
    assert config.get("rope_scaling") == overrides.get("rope_scaling")
    with open(twin / "config.json") as f:
        hf = json.load(f)
    assert config["head_dim"] == (hf["head_dim"] if arch == "deepseek2" else overrides.get("head_dim", 16))
    if arch == "qwen3moe":
        assert config["num_experts"] == hf["num_local_experts"]
        for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step"):
            assert config[key] == hf[key], key
    if arch in HYBRID:
        for key in ("layer_types", "rope_parameters", "linear_num_key_heads", "linear_num_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            assert config[key] == hf[key], key
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):  # the config keys of the twin's type, and no others
        for key in ("qkv_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            assert config.get(key) == hf.get(key), key
    if arch == "deepseek2":
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "num_key_value_heads", "intermediate_size", "rope_interleave", "n_routed_experts",
                    "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                    "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"):
            assert config[key] == hf[key], key
        for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                    "beta_slow", "mscale_all_dim"):  # (the twin's mscale, equal to mscale_all_dim, is not stored)
            assert config["rope_parameters"].get(key) == hf["rope_parameters"].get(key), key
    assert sorted(state) == sorted(sd)
    lossy = F16_TENSOR.get(arch, DENSE_F16), Q8_TENSOR.get(arch, DENSE_Q8)
    for name, want in sd.items():
        got = state[name]
        # Quantized tensors come back as float16; F16 stays F16; F32 stays F32, bit for bit (but A_log, which
        # comes back from -exp(A_log) within float32 rounding).
        assert got.dtype == (torch.float16 if any(re.fullmatch(p, name) for p in lossy) else torch.float32), name
        if name.endswith("A_log"):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        else:
            assert torch.equal(got.float(), want), name


@pytest.mark.parametrize("case", list(CASES))
def test_converted_dir_gives_the_twin_logits_and_tokenizer(tmp_path, case):
    twin, path, _, tok = make_twin(tmp_path, case)
    out = convert_gguf(str(path), str(tmp_path / "hf"), progress=False)
    assert sorted(os.listdir(tmp_path)) == sorted([f"{case}.gguf", "hf", "twin"])  # no temp dirs left over
    assert os.path.exists(os.path.join(out, DONE_MARKER))
    ids = torch.tensor(tok.encode(TEXT).ids)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(twin, ids), rtol=0, atol=1e-5)

    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(out)
    assert converted.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT).ids
    assert converted.decode(converted.encode("naïve café 日本")) == "naïve café 日本"
    assert converted.eos_token == "<|im_end|>"
    prompt = converted.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(out, "generation_config.json")) as f:  # eos first, then the other end-of-text token
        assert json.load(f)["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]


@pytest.mark.parametrize("case", DENSE_CASES)
def test_ddtree_model_on_converted_dir_matches_transformers(tmp_path, case):
    loader = pytest.importorskip("ddtree.models.loader")
    from ddtree.ops.attention import make_batch

    _, path, _, tok = make_twin(tmp_path, case)
    out = convert_gguf(str(path), str(tmp_path / "hf"), progress=False)
    model, cfg = loader.load_model(out, device="cpu", dtype=torch.float32)
    ids = torch.tensor(tok.encode(TEXT).ids)
    n = len(ids)
    for layer in model.model.layers:  # a one-request cache laid out in position order
        layer.self_attn.k_cache = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim)
        layer.self_attn.v_cache = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim)
    batch = make_batch([list(range(n))], [0], [n], None, 1, torch.device("cpu"))  # page size 1: slot = position
    with torch.no_grad():
        hidden, _ = model(ids, torch.arange(n), batch)
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, hf_logits(out, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [c for c in CASES if c not in DENSE_CASES])
def test_ddtree_generates_transformers_tokens_on_converted_moe_and_hybrid_dirs(tmp_path, case):
    from transformers import AutoModelForCausalLM

    from ddtree import LLM, SamplingParams

    _, path, _, tok = make_twin(tmp_path, case)
    out = convert_gguf(str(path), str(tmp_path / "hf"), progress=False)
    ids, n = tok.encode(TEXT).ids, 6
    llm = LLM(out, device="cpu", dtype="float32", page_size=4)
    got = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))[0]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    want = ref.sequences[0, len(ids):].tolist()
    logp = torch.log_softmax(torch.cat(ref.logits).float(), -1).gather(1, torch.tensor(want)[:, None])[:, 0]
    assert got.token_ids == want
    torch.testing.assert_close(torch.tensor([lp for lp, _ in got.logprobs]), logp, atol=1e-4, rtol=0)


def test_convert_replaces_an_existing_dir_whole(tmp_path):
    _, path, _, _ = make_twin(tmp_path, "qwen2-tied")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("from an older conversion")
    convert_gguf(str(path), str(out), progress=False)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["qwen2-tied.gguf", "hf", "twin"])


SPLIT_TEXT = "Hello world's 1234567 你好世界かな!!! ..\n\n  x"
# The pieces llama.cpp's split for each `tokenizer.ggml.pre` cuts SPLIT_TEXT into (src/llama-vocab.cpp, src/unicode.cpp):
# DeepSeek-V3 isolates digit triples and Han/kana runs before words; Kimi-K2 keeps contractions on their word and
# splits Han from kana.
EXPECTED_SPLITS = {
    "deepseek-v3": ["Hello", " world", "'s", " ", "123", "456", "7", " ", "你好世界かな", "!!!", " ..\n\n", " ", " x"],
    "kimi-k2": ["Hello", " world's", " ", "123", "456", "7", " ", "你好世界", "かな", "!!!", " ..\n\n", " ", " x"],
}


def write_tokenizer_gguf(path, arch: str, pre: str) -> None:
    """A GGUF holding only the tiny tokenizer, under `arch` and `pre`."""
    w = GGUFWriter(str(path), arch)
    add_tokenizer(w, train_tokenizer(), arch, pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", list(EXPECTED_SPLITS))
def test_deepseek2_tokenizer_splits_text_the_way_its_pre_names(tmp_path, pre):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from ddtree.models.gguf import _save_tokenizer

    path = tmp_path / "t.gguf"
    write_tokenizer_gguf(path, "deepseek2", pre)
    _save_tokenizer(GGUFReader(str(path)), str(path), str(tmp_path / "hf"), None)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT)
    assert [SPLIT_TEXT[a:b] for _, (a, b) in pieces] == EXPECTED_SPLITS[pre]
    assert tok.decode(tok.encode(SPLIT_TEXT, add_special_tokens=False)) == SPLIT_TEXT


def test_unknown_pre_on_a_generic_tokenizer_warns_by_name(tmp_path):
    from gguf import GGUFReader

    from ddtree.models.gguf import _save_tokenizer

    path = tmp_path / "t.gguf"
    write_tokenizer_gguf(path, "deepseek2", "no-such-pre")
    with pytest.warns(UserWarning, match="'no-such-pre'"):
        _save_tokenizer(GGUFReader(str(path)), str(path), str(tmp_path / "hf"), None)


def assert_refused(w: GGUFWriter, path, reason: str) -> None:
    """Write the stub file `w` holds and check that reading it raises a ValueError matching `reason`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=reason):
        read_gguf(str(path))


@pytest.mark.parametrize("arch", ["gemma", "phi3"])
def test_unsupported_architecture_is_refused_by_name(tmp_path, arch):
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    assert_refused(w, path, arch)


@pytest.mark.parametrize("keys, tensor, reason", [
    ({"nextn_predict_layers": 1}, None, "multi-token-prediction"),
    ({}, None, "no expert_gating_func"),  # (llama.cpp takes softmax then)
    ({"expert_gating_func": int(ExpertGatingFuncType.SOFTMAX)}, None, "expert_gating_func 1"),
    ({"expert_gating_func": int(ExpertGatingFuncType.SIGMOID)}, "blk.0.attn_k_b.weight", "key_length_mla"),
])
def test_deepseek2_files_ddtree_cannot_map_exactly_are_refused(tmp_path, keys, tensor, reason):
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), "deepseek2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    for key, value in keys.items():
        w.add_uint32(f"deepseek2.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    if tensor:
        w.add_tensor(tensor, np.zeros((2, 4, 8), np.float32))
    assert_refused(w, path, reason)


@pytest.mark.parametrize("arch, keys, tensors, reason", [
    ("qwen3next", {}, ["blk.0.ssm_a", "blk.1.attn_qkv.weight"], "fused attn_qkv"),
    ("qwen35moe", {}, ["blk.0.ssm_a", "blk.0.ffn_gate_inp.weight"], r"layers \[1\] have no expert router"),
    ("qwen3next", {"expert_weights_scale": 2.5},
     ["blk.0.ssm_a", "blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"], "expert_weights_scale"),
])
def test_hybrid_moe_files_ddtree_cannot_map_exactly_are_refused(tmp_path, arch, keys, tensors, reason):
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_full_attention_interval(2)
    for key in ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size", "ssm.conv_kernel",
                "expert_count", "expert_used_count", "expert_feed_forward_length"):
        w.add_uint32(f"{arch}.{key}", 2)
    for key, value in keys.items():
        w.add_float32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for name in tensors:
        w.add_tensor(name, np.zeros((2, 8), np.float32))
    assert_refused(w, path, reason)
