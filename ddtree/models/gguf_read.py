"""Values out of a GGUF file: metadata fields as Python values, tensors as torch tensors."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.quants import dequantize


def value(reader: GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def required(reader: GGUFReader, key: str):
    found = value(reader, key)
    if found is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return found


def f32(x: float) -> float:
    # GGUF stores floats as float32; the shortest float32 repr gives back 1e-06 rather than 9.99999997e-07.
    return float(str(np.float32(x)))


def to_torch(t) -> torch.Tensor:
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
