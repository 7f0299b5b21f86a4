"""One dense decoder for the Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm) and Llama families.

Tokens of all requests in a step are flattened into one [T] sequence; the per-step
`AttentionBatch` says which tokens belong to which request and where their K/V live.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ddtree.config import ModelConfig
from ddtree.ops.attention import AttentionBatch, paged_attention, store_kv
from ddtree.ops.fused import add_rms_norm, qkv_rope, rms_norm, rope, silu_mul


# Steps of at most FUSED_ROWS tokens on the Triton path run each layer as three fused Triton products
# (ddtree/ops/triton_linear.py). One row only (`benchmarks/linear_tune.py`): at one row a layer's fused
# products beat cuBLAS and the separate ops, but at 16+ rows the tensor-core tiles lose to cuBLAS.
FUSED_ROWS = 1


def few_rows_path(x: torch.Tensor, batch: AttentionBatch) -> bool:
    from ddtree.ops.triton_linear import MAX_ROWS
    return x.shape[0] <= min(FUSED_ROWS, MAX_ROWS) and batch.use_triton


def project(layer: nn.Linear, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """layer(x): a few rows on the Triton path through the fused products' kernel, else cuBLAS."""
    if few_rows_path(x, batch):
        from ddtree.ops.triton_linear import linear
        out = linear(x, layer.weight, layer.bias)
        return layer.reduce(out) if isinstance(layer, RowParallelLinear) else out
    return layer(x)


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features may be split across tensor-parallel ranks (o_proj,
    down_proj; parallel/shard.py): each rank's product is then a partial sum, which an all-reduce over
    `group` makes whole on every rank. Without a group (one rank) it is a plain linear layer."""
    group = None  # a torch.distributed process group, set on the ranks' models

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(super().forward(x))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding, its rows split across tensor-parallel ranks by vocabulary (parallel/shard.py):
    each rank looks up the ids in its rows [start, start + rows) and gives zeros for the others, and an
    all-reduce over `group` adds the parts. Without a group (one rank) it is a plain embedding."""
    group = None

    def __init__(self, rows: int, dim: int, start: int = 0):
        super().__init__(rows, dim)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = nn.functional.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = out * inside[..., None].to(out.dtype)
        torch.distributed.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Linear):
    """The LM head, its rows split across tensor-parallel ranks by vocabulary: each rank computes the
    logits of its rows, and an all-gather over `group` puts the whole vocabulary's together, in order
    (the rank's row ranges are consecutive). Without a group it is a plain linear layer."""
    group = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = super().forward(hidden)
        if self.group is None:
            return local
        parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(self.group))]
        torch.distributed.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual) in one fused op."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, smoothed))
    elif kind == "yarn" and cfg.mla is not None:
        inv_freq = yarn_inv_freq(inv_freq, dim, cfg.rope_theta, scaling, yarn_factor(cfg))
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq


def yarn_factor(cfg: ModelConfig) -> float:
    scaling = cfg.rope_scaling
    return scaling.get("factor") or cfg.max_position / scaling["original_max_position_embeddings"]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict, factor: float) -> torch.Tensor:
    """YaRN: the frequencies of dims that turn fewer than `beta_slow` times over the original context
    are divided by `factor`, those that turn more than `beta_fast` times are kept, with a linear ramp
    between (over dim indices, the bounds rounded outwards unless `truncate` is false)."""
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for the other rotary kinds)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all = yarn_factor(cfg), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


class Rotary(nn.Module):
    """NEOX-style rotary embedding (rotate halves), cos/sin precomputed for every position."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device | str) -> None:
        inv_freq = rope_inv_freq(self.cfg).to(device)
        # Headroom past max_position: speculative nodes of a request at the limit sit a little beyond it.
        t = torch.arange(self.cfg.max_position + 256, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(self.cfg)  # [P, D]

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotates each [T, heads, D] tensor in `xs` by its token's position."""
        return tuple(rope(x, positions, self.cos_sin) for x in xs)


class PackedLinear(nn.Linear):
    """A linear layer holding several checkpoint matrices stacked along the output dim (q|k|v, gate|up)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets, off = {}, 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (off, size)
            off += size

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        off, size = self.shard_offsets[shard]
        assert loaded.shape[0] == size, (shard, loaded.shape, size)
        param.data[off:off + size].copy_(loaded)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.scale = self.head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)  # [num_slots, Hkv, D], assigned by the runner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, batch)

    @property
    def input_projection(self) -> nn.Linear:
        """The product `attend` starts from (the few-rows path fuses the layer's norm into it)."""
        return self.qkv_proj

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Attention output after o_proj, from the packed q|k|v projection."""
        q = rope_and_store(self, qkv, positions, batch.slot_mapping, batch.use_triton)
        o = paged_attention(q, None, None, self.k_cache, self.v_cache, batch, self.scale)
        return project(self.o_proj, o.flatten(1), batch)


def rope_and_store(attn: nn.Module, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   use_triton: bool, with_q: bool = True) -> torch.Tensor:
    """From rows of a packed q|k|v projection (`attn`: the target's or the drafter's attention): the
    rotated q [T, H, D], after the Qwen3 q/k norms if it has them, with row t's K/V written to cache
    slot slots[t]. With Triton one kernel does it all (norms, rotary, the cache writes).
    `with_q=False`: the rows hold k|v only (context rows that need no query), and q comes back empty."""
    qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    eps = attn.q_norm.eps if attn.qk_norm else 0.0
    heads, q_size = (attn.num_heads, attn.q_size) if with_q else (0, 0)
    if use_triton and attn.head_dim % 2 == 0:  # (the rotary pairs of a whole head)
        from ddtree.ops.triton_qkv import qkv_rope_store
        return qkv_rope_store(qkv, positions, attn.rotary[0].cos_sin, slots, attn.k_cache, attn.v_cache,
                              heads, attn.num_kv_heads, attn.head_dim, qn, kn, eps)
    q, k, v = qkv_rope(qkv, positions, attn.rotary[0].cos_sin, q_size, attn.kv_size, attn.head_dim, qn, kn, eps)
    store_kv(k, v, attn.k_cache, attn.v_cache, slots, use_triton)
    return q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        """A SiLU-gated MLP of `width` (default: the config's intermediate_size)."""
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_up_proj = PackedLinear(cfg.hidden_size, {"gate": width, "up": width}, bias=False)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: AttentionBatch | None = None) -> torch.Tensor:
        """(batch: as the routed experts' forward takes it; a dense MLP's kernels do not depend on it)"""
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) before down_proj's all-reduce: this rank's partial sum under tensor parallelism."""
        return nn.functional.linear(silu_mul(self.gate_up_proj(x)), self.down_proj.weight)

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: "RMSNorm",
                   batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual) for a few rows: the residual add, the norm and
        SiLU-and-mul inside the products (ddtree/ops/triton_linear.py)."""
        from ddtree.ops.triton_linear import norm_linear
        act, residual = norm_linear(x, residual, norm.weight, norm.eps, self.gate_up_proj.weight, glu=True)
        return project(self.down_proj, act, batch), residual


class DecoderLayer(nn.Module):
    fused_few_rows = True  # few-token steps may take `few_rows` (it fuses this layer's projections)

    def __init__(self, cfg: ModelConfig, rotary: Rotary, index: int = 0):
        super().__init__()
        if cfg.mla is not None:
            from ddtree.models.mla import MLAttention
            self.self_attn = MLAttention(cfg, rotary)
        else:
            self.self_attn = Attention(cfg, rotary)
        self.add_norms_and_mlp(cfg, index)

    def add_norms_and_mlp(self, cfg: ModelConfig, index: int) -> None:
        if cfg.moe is not None and index in cfg.moe.layers:
            from ddtree.models.moe import SparseMoE, GroupRoutedMoE
            self.mlp = GroupRoutedMoE(cfg) if cfg.moe.scoring == "sigmoid" else SparseMoE(cfg)
            self.fused_few_rows = False  # (the fused few-rows step packs the dense MLP's products)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The layer's token mixer: attention here."""
        return self.self_attn

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it, this layer's input); the
        first two sum to the layer's output. Deferring the add lets it fuse with the next layer's
        norm, which returns the sum, the previous layer's output, for free (the drafter's taps)."""
        if self.fused_few_rows and few_rows_path(h, batch):
            return self.few_rows(h, residual, positions, batch)
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        entering = residual
        x, residual = self.post_attention_layernorm(self.mixer(x, positions, batch), residual)
        return self.mlp(x, batch), residual, entering

    def few_rows(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward() for a few tokens: norms, residual adds and SiLU run inside the projections."""
        from ddtree.ops.triton_linear import norm_linear
        mixer, ln1 = self.mixer, self.input_layernorm
        proj = mixer.input_projection
        projected, entering = norm_linear(h, residual, ln1.weight, ln1.eps, proj.weight, proj.bias)
        out, residual = self.mlp.after_norm(mixer.attend(projected, positions, batch), entering,
                                            self.post_attention_layernorm, batch)
        return out, residual, entering


def decoder_layer(cfg: ModelConfig, index: int, rotary: Rotary) -> nn.Module:
    if cfg.is_hybrid:
        from ddtree.models.hybrid import HybridDecoderLayer
        return HybridDecoderLayer(cfg, index, rotary)
    return DecoderLayer(cfg, rotary, index)


class TransformerModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary = Rotary(cfg)
        start, end = cfg.vocab_part or (0, cfg.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(end - start, cfg.hidden_size, start)
        self.layers = nn.ModuleList([decoder_layer(cfg, i, self.rotary) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The target model. Parameter names follow Hugging Face, with q/k/v and gate/up packed."""

    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
              "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"), "in_proj_b": ("in_proj", "b"),
              "in_proj_a": ("in_proj", "a"),
              "q_a_proj": ("qkv_proj", "q"), "kv_a_proj_with_mqa": ("qkv_proj", "kv")}  # (MLA: models/mla.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = TransformerModel(cfg)
        start, end = cfg.vocab_part or (0, cfg.vocab_size)
        self.lm_head = VocabParallelLMHead(cfg.hidden_size, end - start, bias=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                taps: list[int] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final-normed hidden states [T, D] and, for each layer id in `taps`, that
        decoder layer's output (the residual stream, as transformers' hidden_states[l + 1])."""
        h, residual = self.model.embed_tokens(input_ids), None
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            h, residual, entering = layer(h, residual, positions, batch)
            if taps and i - 1 in taps:  # layer i - 1's output, summed by layer i's first norm
                tapped[i - 1] = entering
        hidden, tapped[len(self.model.layers) - 1] = self.model.norm(h, residual)
        return hidden, [tapped[t] for t in taps or []]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
