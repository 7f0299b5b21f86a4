"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory (config, safetensors, tokenizer).

    config, state_dict = read_gguf("model.gguf")   # HF config.json dict and HF-named tensors
    hf_dir = convert_gguf("model.gguf", "out/")    # config.json, model.safetensors, tokenizer, ...

Quantized tensors are dequantized once, at conversion, so the engine only ever loads plain weights.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

# Written last into a converted directory; its presence means the conversion finished.
DONE_MARKER = ".ddtree-converted"

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that ddtree knows")


def _value(reader: GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


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


def read_gguf(path: str | GGUFReader, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """An HF config.json-style dict and an HF-named state dict for the GGUF model at `path`."""
    # Parsing the metadata of a 150k-token vocabulary takes seconds, so callers may pass a reader they hold.
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path)
    path = str(reader.data.filename) if isinstance(path, GGUFReader) else path
    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    hidden = _value(reader, f"{arch}.embedding_length")
    n_head = _value(reader, f"{arch}.attention.head_count")
    n_kv = _value(reader, f"{arch}.attention.head_count_kv", n_head)
    head_dim = _value(reader, f"{arch}.attention.key_length", hidden // n_head)
    rope_dim = _value(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    scaling = _value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{path}: GGUF rope scaling {scaling!r} is not supported")
    has_q_bias = "blk.0.attn_q.bias" in tensors
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": _value(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _value(reader, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _value(reader, f"{arch}.context_length", 32768),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    else:
        config["attention_bias"] = has_q_bias
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if "rope_freqs.weight" in tensors:
        factors = _tensor(tensors.pop("rope_freqs.weight"))
        config["rope_scaling"] = _llama3_rope_scaling(factors, head_dim, config["rope_theta"])

    state: dict[str, torch.Tensor] = {}
    for name, t in tqdm(tensors.items(), desc="dequantizing", unit="tensor", disable=not progress):
        w = _tensor(t)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _unpermute(w, n_head if ".attn_q." in name else n_kv)
        state[_hf_name(name)] = w
    if config["attention_bias"] and arch != "qwen2":
        # HF Llama/Qwen3 give o_proj a bias whenever q/k/v have one; llama.cpp files may omit a zero one.
        for i in range(config["num_hidden_layers"]):
            state.setdefault(f"model.layers.{i}.self_attn.o_proj.bias", torch.zeros(hidden))
    _check_shapes(config, state)
    dtypes = {w.dtype for w in state.values() if w.dim() > 1}
    config["torch_dtype"] = next((n for d, n in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16"))
                                  if d in dtypes), "float32")
    return config, state


def _check_shapes(config: dict, state: dict[str, torch.Tensor]) -> None:
    h, hd, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    want = {"model.embed_tokens.weight": (config["vocab_size"], h), "lm_head.weight": (config["vocab_size"], h)}
    per_layer = {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                 "o_proj.weight": (h, q), "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h),
                 "down_proj.weight": (h, inter), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
    for name, w in state.items():
        shape = want.get(name) or per_layer.get(".".join(name.split(".")[-2:]))
        if shape is not None and tuple(w.shape) != shape:
            raise ValueError(f"GGUF tensor for {name} has shape {tuple(w.shape)}, config implies {shape}")


def _save_tokenizer(reader: GGUFReader, gguf_path: str, out_dir: str, eos_id: int | None) -> None:
    from transformers import AutoTokenizer

    if reader.get_field("tokenizer.ggml.model") is None:
        return  # a weights-only GGUF: the caller must bring its own tokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
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
