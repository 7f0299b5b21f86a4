"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory (config, safetensors, tokenizer).

    config, state_dict = read_gguf("model.gguf")   # HF config.json dict and HF-named tensors
    hf_dir = convert_gguf("model.gguf", "out/")    # config.json, model.safetensors, tokenizer, ...

Quantized tensors are dequantized once, at conversion, so the engine only ever loads plain weights.
What differs by architecture (names, config, undoing llama.cpp's tensor changes) is in gguf_arch.py.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from gguf import GGUFReader
from tqdm import tqdm

from ddtree.models.gguf_arch import ARCHITECTURES, base_config, check_shapes, hf_name
from ddtree.models.gguf_read import to_torch, value
from ddtree.models.gguf_tokenizer import set_pre_tokenizer

# Written last into a converted directory; its presence means the conversion finished.
DONE_MARKER = ".ddtree-converted"


def read_gguf(path: str | GGUFReader, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """An HF config.json-style dict and an HF-named state dict for the GGUF model at `path`."""
    # Parsing the metadata of a 150k-token vocabulary takes seconds, so callers may pass a reader they hold.
    reader = path if isinstance(path, GGUFReader) else GGUFReader(path)
    path = str(reader.data.filename) if isinstance(path, GGUFReader) else path
    arch = value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}")
    spec = ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    try:
        config = base_config(reader, arch, tensors)
        spec.config(reader, arch, tensors, config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

    state: dict[str, torch.Tensor] = {}
    for name, t in tqdm(tensors.items(), desc="dequantizing", unit="tensor", disable=not progress):
        state.update(spec.fix_tensor(hf_name(name, spec.layer_names), to_torch(t), config))
    check_shapes(config, state)
    spec.finish(state, config)
    dtypes = {w.dtype for w in state.values() if w.dim() > 1}
    config["torch_dtype"] = next((n for d, n in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16"))
                                  if d in dtypes), "float32")
    return config, state


def _save_tokenizer(reader: GGUFReader, gguf_path: str, out_dir: str, eos_id: int | None) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if reader.get_field("tokenizer.ggml.model") is None:
        return  # a weights-only GGUF: the caller must bring its own tokenizer
    # Where transformers lacks the file's model config, the fast tokenizer class builds from its tokenizer keys alone.
    auto = ARCHITECTURES[value(reader, "general.architecture")].auto_tokenizer
    tok = (AutoTokenizer if auto else PreTrainedTokenizerFast).from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
    set_pre_tokenizer(tok, value(reader, "tokenizer.ggml.pre"), value(reader, "tokenizer.ggml.model"))
    if eos_id is not None and tok.eos_token_id != eos_id:
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    template = value(reader, "tokenizer.chat_template")
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
    gen = {"bos_token_id": value(reader, "tokenizer.ggml.bos_token_id")}
    stops = [value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens, types = reader.get_field("tokenizer.ggml.tokens"), reader.get_field("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        stops += [i for i, (tok, kind) in enumerate(zip(tokens.contents(), types.contents()))
                  if kind == 3 and tok in _END_OF_GENERATION]  # 3: CONTROL
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops or None
    pad = value(reader, "tokenizer.ggml.padding_token_id")
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
