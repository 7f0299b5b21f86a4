"""Tiny random checkpoints (dense, hybrid and MoE families) with a small byte-level BPE tokenizer, built in tests."""
from __future__ import annotations

import os

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
          "Hello, world! How are you today?", "for i in range(10):\n    print(i * i)\n",
          "Ünïcödé text: naïve café, 日本語, emoji 🙂 and more.", "import numpy as np\nx = np.zeros(3)\n"] * 4


def make_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHATML
    return fast


HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # Gated DeltaNet and gated attention layers


def make_config(family: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    common.update(overrides)
    if family == "qwen2":
        return Qwen2Config(rope_theta=10000.0, **common)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, rope_theta=10000.0, **common)
    if family == "llama":
        return LlamaConfig(rope_theta=10000.0, attention_bias=False, **common)
    if family == "qwen3_5":  # hybrid: three Gated DeltaNet layers, then full attention (4 layers by default)
        from transformers import Qwen3_5TextConfig
        common["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
        return Qwen3_5TextConfig(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}, **common)
    if family in ("qwen3_5_moe", "qwen3_next"):  # hybrid (qwen3_5's layers) with routed and gated shared experts
        hybrid = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                      **{**common, "num_hidden_layers": overrides.get("num_hidden_layers", 4)})
        if family == "qwen3_5_moe":  # experts in every layer (no dense MLP)
            from transformers import Qwen3_5MoeTextConfig
            del hybrid["intermediate_size"]
            return Qwen3_5MoeTextConfig(**hybrid)
        from transformers import Qwen3NextConfig  # a dense MLP in layer 1, top-k weights not renormalised
        return Qwen3NextConfig(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, **hybrid)
    if family == "qwen3_moe":  # routed experts in every other layer, dense MLPs between
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(head_dim=16, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True,
                              **{**common, "num_hidden_layers": overrides.get("num_hidden_layers", 4)})
    if family == "qwen2_moe":  # q/k/v biases; routed and gated shared experts, a dense MLP in layer 1,
        # top-k weights not renormalised (the type's default)
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(**{"rope_theta": 10000.0, "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                 "decoder_sparse_step": 1, "mlp_only_layers": [1], **common,
                                 "num_hidden_layers": overrides.get("num_hidden_layers", 3)})
    if family == "deepseek_v3":  # MLA; a dense first layer, then routed experts in 2 groups and a shared expert
        from transformers import DeepseekV3Config
        common["num_key_value_heads"] = common["num_attention_heads"]  # (transformers' MLA: one KV head per head)
        return DeepseekV3Config(**{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                   "v_head_dim": 12, "n_routed_experts": 8, "n_shared_experts": 1,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                   "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                                   "norm_topk_prob": True, "rope_interleave": True, "num_mtp_layers": 0,
                                   **{**common, "num_hidden_layers": overrides.get("num_hidden_layers", 3)}})
    raise ValueError(family)


def make_tiny_model(path: str, family: str = "qwen2", seed: int = 0, with_tokenizer: bool = True,
                    **overrides) -> str:
    """Saves a random model (and tokenizer) to `path` and returns it."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer() if with_tokenizer else None
    vocab = overrides.pop("vocab_size", len(tok) if tok is not None else 384)  # (more rows than tokens: padding)
    eos = tok.convert_tokens_to_ids("<|im_end|>") if tok is not None else None
    cfg = make_config(family, vocab, eos_token_id=eos, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; scale up so logits are not all near-ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (matrices, and the routed experts' stacked ones)
                p.normal_(0, 0.08)
            elif "bias" in name and family not in HYBRID:
                p.normal_(0, 0.02)
            elif family in HYBRID and "norm" in name:  # (zero-centred norms: their 1 + weight is tested)
                p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.1)  # (the gated norm scales by its weight)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(path)
    return path


def make_tiny_pair(root: str, **overrides) -> tuple[str, str]:
    """A tiny Qwen3 target (4 layers) and a random block-8 DFlash drafter for it, saved under `root`."""
    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter

    model = make_tiny_model(os.path.join(root, "tiny-qwen3"), "qwen3", num_hidden_layers=4, **overrides)
    draft = os.path.join(root, "drafter")
    save_drafter(random_drafter(ModelConfig.from_dir(model), num_layers=1, block_size=8, target_layer_ids=[0, 2]),
                 draft)
    return model, draft
