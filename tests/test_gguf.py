"""GGUF conversion: tiny GGUF files written the way llama.cpp writes them must convert back to their HF twins."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from ddtree.models.gguf import DONE_MARKER, convert_gguf, read_gguf

VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps."
# Written the way llama.cpp names them, independently of the module under test.
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# One tensor stored as F16 and one as Q8_0 (the q projection, so llama's permutation meets quantization).
F16_TENSOR, Q8_TENSOR = "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

CASES = {
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=12345.0)),
    "qwen3-headdim": ("qwen3", dict(head_dim=32, rope_theta=1e6)),
    "llama-rope3": ("llama", dict(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA3_ROPE)),
    "llama-bias-tied": ("llama", dict(attention_bias=True, tie_word_embeddings=True)),
}


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
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=eos)
    common.update(copy.deepcopy(overrides))  # transformers edits rope_scaling in place
    return {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch](**common)


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # What llama.cpp's convert_hf_to_gguf does to llama q/k rows: rotate-half pairs become interleaved.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def make_twin(tmp_path, case: str):
    """An HF checkpoint dir (the twin) and a GGUF file holding the same weights, as llama.cpp would write it."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch, overrides = CASES[case]
    tok = train_tokenizer()
    cfg = hf_config(arch, overrides, eos=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.02)
            if "norm" in name:
                p.add_(1.0)
        # The twin holds exactly what the GGUF can: fp16 values, and Q8_0's dequantized values (kept as fp16).
        params = dict(model.named_parameters())
        params[F16_TENSOR].copy_(params[F16_TENSOR].half().float())
        q8_bytes = quantize(params[Q8_TENSOR].numpy(), QType.Q8_0)  # Q8_0 is not idempotent: quantize once
        params[Q8_TENSOR].copy_(torch.from_numpy(dequantize(q8_bytes, QType.Q8_0)).half().float())
    twin = tmp_path / "twin"
    model.save_pretrained(twin)
    sd = load_file(twin / "model.safetensors")

    path = tmp_path / f"{case}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(overrides.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = overrides.get("head_dim", cfg.hidden_size // cfg.num_attention_heads)
    if "head_dim" in overrides:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    add_tokenizer(w, tok, arch)
    if "rope_scaling" in overrides:  # llama.cpp stores Llama 3 scaling as per-frequency divisors
        inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        w.add_tensor("rope_freqs.weight", (inv_freq / scaled).numpy().astype(np.float32))
    for name, t in sd.items():
        if name == "lm_head.weight":
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, *mod, leaf = name.split(".")
            gname = f"blk.{i}.{GGUF_NAMES['.'.join(mod)]}.{leaf}"
        if name == Q8_TENSOR:  # quantized blocks run along rows, so permuting rows of the bytes is the same
            t = torch.from_numpy(q8_bytes)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            t = llama_permute(t, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if name == F16_TENSOR:
            w.add_tensor(gname, t.numpy().astype(np.float16))
        elif name == Q8_TENSOR:
            w.add_tensor(gname, t.numpy(), raw_dtype=QType.Q8_0)
        else:
            w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return twin, path, sd, tok


def add_tokenizer(w: GGUFWriter, tok, arch: str) -> None:
    spec = json.loads(tok.to_str())["model"]
    by_id = sorted(spec["vocab"], key=spec["vocab"].get)
    tokens = by_id + [f"[PAD{i}]" for i in range(len(by_id), VOCAB)]
    types = [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL if i < len(by_id) else TokenType.UNUSED
             for i, t in enumerate(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
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
    assert config["model_type"] == arch and config["num_hidden_layers"] == 2
    assert config["tie_word_embeddings"] == overrides.get("tie_word_embeddings", False)
    assert config["rope_theta"] == overrides.get("rope_theta", 10000.0) and config["rms_norm_eps"] == 1e-6
    assert config.get("rope_scaling") == overrides.get("rope_scaling")
    assert config["head_dim"] == overrides.get("head_dim", 16)
    assert sorted(state) == sorted(sd)
    for name, want in sd.items():
        got = state[name]
        # Quantized tensors come back as float16; F16 stays F16; F32 stays F32, bit for bit.
        assert got.dtype == {F16_TENSOR: torch.float16, Q8_TENSOR: torch.float16}.get(name, torch.float32), name
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


@pytest.mark.parametrize("case", CASES)
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


def test_convert_replaces_an_existing_dir_whole(tmp_path):
    _, path, _, _ = make_twin(tmp_path, "qwen2-tied")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("from an older conversion")
    convert_gguf(str(path), str(out), progress=False)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["qwen2-tied.gguf", "hf", "twin"])


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gemma"):
        read_gguf(str(path))
