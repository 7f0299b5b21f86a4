"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one non-causal pass.

It has no embedding and no LM head of its own (it borrows the target's). Target features (the
outputs of a few target layers, concatenated) are fused once per token, ctx = hidden_norm(fc(.)),
and injected into every drafter layer as extra keys/values at the tokens' own positions. Those
context K/V live in the drafter's own paged cache, addressed by the target's page tables; the
block's K/V are written past the context and overwritten by the next step's context.

Checkpoints use the z-lab format (config.json with Qwen3 keys plus block_size, num_target_layers
and dflash_config {mask_token_id, target_layer_ids}; weights layers.*, fc, hidden_norm, norm).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ddtree.config import ModelConfig
from ddtree.models.transformer import MLP, PackedLinear, RMSNorm, Rotary, few_rows_path, project, rope_and_store
from ddtree.ops.attention import AttentionBatch, paged_attention


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass(slots=True)
class DrafterConfig:
    model: ModelConfig  # the drafter's own layer shapes (Qwen3 keys)
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    raw: dict | None = None  # the config.json, written back unchanged on save

    @classmethod
    def from_dir(cls, path: str) -> "DrafterConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_raw(json.load(f), path)

    @classmethod
    def from_raw(cls, raw: dict, path: str = "drafter") -> "DrafterConfig":
        """From a config.json's contents (`path` names it in errors)."""
        dc = raw.get("dflash_config") or {}
        get = lambda k, d=None: dc.get(k, raw.get(k, d))  # noqa: E731  dflash_config wins, like the reference
        if get("mask_token_id") is None:
            raise ValueError(f"{path}: drafter config lacks dflash_config.mask_token_id")
        types = raw.get("layer_types") or []
        if any(t == "sliding_attention" for t in types):
            raise ValueError(f"{path}: sliding-window drafter layers are not supported")
        model = ModelConfig.from_dict({**raw, "model_type": "qwen3"})
        layer_ids = get("target_layer_ids") or default_target_layer_ids(raw["num_target_layers"],
                                                                         raw["num_hidden_layers"])
        return cls(model, int(get("block_size", 16)), int(get("mask_token_id")), list(layer_ids),
                   float(get("input_embedding_scale", 1.0)), float(get("output_multiplier", 1.0)),
                   get("final_logit_softcapping"), raw)


class DraftAttention(nn.Module):
    """The target's attention shapes with q/k norms (Qwen3), q|k|v packed into one projection. A
    block's queries attend to the drafter's cached context plus the whole block (non-causal)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = cfg.qkv_bias
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = True
        self.rotary = [rotary]
        self.scale = self.head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)

    def _rows(self, x: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """x times one shard of the packed projection (training computes q and k|v of different rows)."""
        w = self.qkv_proj.weight[start:start + size]
        b = self.qkv_proj.bias[start:start + size] if self.qkv_proj.bias is not None else None
        return F.linear(x, w, b)

    def q(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self._rows(x, 0, self.q_size).view(-1, self.num_heads, self.head_dim))
        return self.rotary[0](positions, q)[0]

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._rows(x, self.q_size, 2 * self.kv_size).view(-1, 2, self.num_kv_heads, self.head_dim)
        (k,) = self.rotary[0](positions, self.k_norm(kv[:, 0]))
        return k, kv[:, 1]

    def project_store(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      use_triton: bool) -> torch.Tensor:
        """One packed projection of every row; K/V of row t into cache slot slots[t]. Returns the rows'
        rotated q [T, H, D]."""
        return rope_and_store(self, self.qkv_proj(x), positions, slots, use_triton)

    def store(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, use_triton: bool) -> None:
        """Context rows without a block (a prompt's, an AR step's): only their k|v projected, and the
        K/V written into cache slots `slots`."""
        rope_and_store(self, self._rows(x, self.q_size, 2 * self.kv_size), positions, slots, use_triton, with_q=False)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """x: the block's rows; ctx: new context rows (their K/V go into the drafter cache first);
        positions and slots: of [ctx; block]. The block's K/V go to its slots past the context."""
        n = ctx.shape[0]
        q = self.project_store(torch.cat([ctx, x]) if n else x, positions, slots, batch.use_triton)[n:]
        o = paged_attention(q, None, None, self.k_cache, self.v_cache, batch, self.scale)
        return project(self.o_proj, o.flatten(1), batch)


class DraftLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.self_attn = DraftAttention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, ctx, positions, slots, batch):
        """Returns (this layer's MLP output, the residual stream before it), as the target's layers do:
        the add is deferred into the next norm (one fused kernel instead of two)."""
        x, residual = (self.input_layernorm(h), h) if residual is None else self.input_layernorm(h, residual)
        a = self.self_attn(x, ctx, positions, slots, batch)
        if few_rows_path(h, batch):
            return self.mlp.after_norm(a, residual, self.post_attention_layernorm, batch)
        x, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(x), residual


class DFlashDrafter(nn.Module):
    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, dcfg: DrafterConfig, target_hidden: int):
        super().__init__()
        cfg = dcfg.model
        self.dcfg = dcfg
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList([DraftLayer(cfg, self.rotary) for _ in range(cfg.num_layers)])
        self.fc = nn.Linear(len(dcfg.target_layer_ids) * target_hidden, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                ctx_positions: torch.Tensor, ctx_slots: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """block_embeds: [Tb, D] embedded block tokens; features: [Tc, K*D_target] target features of
        context tokens not yet in the drafter cache. Returns the normed block hidden states [Tb, D]."""
        ctx = self.hidden_norm(self.fc(features))
        n = ctx.shape[0]
        rows_pos = torch.cat([ctx_positions, positions]) if n else positions  # the layers project [ctx; block]
        rows_slots = torch.cat([ctx_slots, batch.slot_mapping]) if n else batch.slot_mapping
        h, residual = block_embeds, None
        for layer in self.layers:
            h, residual = layer(h, residual, ctx, rows_pos, rows_slots, batch)
        return self.norm(h, residual)[0]

    def store_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      use_triton: bool = False) -> None:
        """Target features of context tokens [Tc, K*D_target] -> every layer's K/V in the drafter cache
        at `slots`, without drafting a block (what forward() does first)."""
        ctx = self.hidden_norm(self.fc(features))
        for layer in self.layers:
            layer.self_attn.store(ctx, positions, slots, use_triton)

    def logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
               float32: bool = True) -> torch.Tensor:
        """Logits [..., V] of hidden states [..., D] through the target's LM head: float32, or with
        `float32=False` the head's own dtype where no multiplier or soft cap needs the float32 math
        (a draft reads them once, in ops/triton_topk.py; a float32 copy is gigabytes at a large batch)."""
        # As rows of a 2-D product: a strided 3-D input (the block's rows past the root) makes matmul
        # a batched product, whose kernel is many times slower than the plain one.
        logits = lm_head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
        cap, scale = self.dcfg.final_logit_softcapping, self.dcfg.output_multiplier
        if not float32 and not cap and scale == 1.0:
            return logits
        logits = logits.float() * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def load_drafter(path: str, target_cfg: ModelConfig, device, dtype) -> DFlashDrafter:
    from ddtree.models.loader import iter_tensors, load_weights

    dcfg = DrafterConfig.from_dir(path)
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        raise ValueError(f"{path}: target_layer_ids {bad} out of range for a {target_cfg.num_layers}-layer target")
    if dcfg.model.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"{path}: drafter hidden_size {dcfg.model.hidden_size} != target {target_cfg.hidden_size}")
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg, target_cfg.hidden_size)
    drafter = drafter.to_empty(device=device).to(dtype)
    load_weights(drafter, iter_tensors(path), DFlashDrafter.packed, path, skip=lambda n: "rotary_emb" in n)
    drafter.rotary.build(device)
    return drafter.eval().requires_grad_(False)


def drafter_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """Weights under z-lab names (q/k/v and gate/up unpacked)."""
    out = {}
    unpack = {packed: [(leaf, shard) for leaf, (p, shard) in DFlashDrafter.packed.items() if p == packed]
              for packed, _ in DFlashDrafter.packed.values()}
    modules = dict(drafter.named_modules())
    for name, p in drafter.state_dict().items():
        module, leaf = name.rsplit(".", 1)
        packed = module.rsplit(".", 1)[-1]
        if packed in unpack:
            for ckpt_name, shard in unpack[packed]:
                off, size = modules[module].shard_offsets[shard]
                out[f"{module[:-len(packed)]}{ckpt_name}.{leaf}"] = p[off:off + size]
        else:
            out[name] = p
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_drafter(drafter: DFlashDrafter, path: str, dtype: torch.dtype | None = None) -> None:
    """The z-lab format. With an 8-bit float `dtype` only the matrices are stored in it (the norms'
    vectors, a few KB, stay bfloat16): loaders cast the values exactly, into bf16 or fp32 parameters."""
    os.makedirs(path, exist_ok=True)
    sd = drafter_state_dict(drafter)
    if dtype is not None:
        small, big = dtype.itemsize == 1, torch.finfo(dtype).max  # (8-bit floats: saturate, no inf)
        sd = {k: v.to(torch.bfloat16) if small and v.dim() < 2 else v.clamp(-big, big).to(dtype)
              for k, v in sd.items()}
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(drafter.dcfg.raw, f, indent=2)


def drafter_config_dict(target_cfg: ModelConfig, num_layers: int = 1, block_size: int = 16,
                        num_features: int = 5, mask_token_id: int | None = None,
                        intermediate_size: int | None = None, num_heads: int | None = None,
                        num_kv_heads: int | None = None, head_dim: int | None = None,
                        target_layer_ids: list[int] | None = None) -> dict:
    """A z-lab style config.json for a new drafter on `target_cfg`."""
    layer_ids = target_layer_ids or default_target_layer_ids(target_cfg.num_layers, num_features)
    mask = mask_token_id if mask_token_id is not None else target_cfg.vocab_size - 1
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target_cfg.hidden_size, "intermediate_size": intermediate_size or target_cfg.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads or target_cfg.num_heads,
        "num_key_value_heads": num_kv_heads or target_cfg.num_kv_heads, "head_dim": head_dim or target_cfg.head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps, "rope_theta": target_cfg.rope_theta,
        "max_position_embeddings": target_cfg.max_position, "vocab_size": target_cfg.vocab_size,
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "block_size": block_size, "num_target_layers": target_cfg.num_layers,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layer_ids},
        "torch_dtype": "bfloat16",
    }


def random_drafter(target_cfg: ModelConfig, seed: int = 0, std: float = 0.05, **kw) -> DFlashDrafter:
    """A randomly initialized drafter (tests; the starting point of training)."""
    raw = drafter_config_dict(target_cfg, **kw)
    dcfg = DrafterConfig(ModelConfig.from_dict(raw), raw["block_size"], raw["dflash_config"]["mask_token_id"],
                         raw["dflash_config"]["target_layer_ids"], raw=raw)
    g = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(dcfg, target_cfg.hidden_size)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.fill_(1.0)
    drafter.rotary.build("cpu")
    return drafter
