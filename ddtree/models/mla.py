"""Multi-head latent attention (DeepSeek-V3) over the paged KV cache.

Each token's keys and values come from one compressed vector: the latent c = norm(x W_DKV) of
`kv_lora_rank` channels, from which head h's key part k_h = c W_UK[h] and value v_h = c W_UV[h]
(`kv_b_proj`), plus k_pe, `qk_rope_head_dim` rotated channels shared by every head. The cache holds
c | k_pe per token: one "KV head" of width kv_lora_rank + qk_rope_head_dim (ModelConfig's head_dim).

The key part of kv_b_proj is absorbed into the query: q_nope[h] . (c W_UK[h]) = (q_nope[h] W_UK[h]^T) . c,
so each head's query becomes (q_nope[h] W_UK[h]^T) | q_pe[h] and attention is multi-query attention over
the cached vectors, with the existing `paged_attention` and the masks of the step's `AttentionBatch`
(causal, tree, drafter block) unchanged. The V cache is the K cache (the runner allocates one); the
first kv_lora_rank channels of each head's output are its attention-weighted latent, which W_UV[h]
takes to the head's values before o_proj.

Under tensor parallelism (parallel/shard.py) each rank holds num_heads / N heads, their rows of
q_b_proj (or q_proj) and kv_b_proj and their columns of o_proj, whose all-reduce sums the heads'
outputs; the latent projections are whole, and every rank caches the same latent vectors.

The input projection packs the query's (q_proj, or q_a_proj when the query is low-rank) and
kv_a_proj_with_mqa's rows, so the decoder layer's few-rows path fuses it with the input norm.
"""
from __future__ import annotations

import torch
from torch import nn

from ddtree.config import ModelConfig
from ddtree.ops.attention import AttentionBatch, paged_attention, store_kv
from ddtree.ops.fused import rope

# The low-rank projections' norms (q_a_layernorm, kv_a_layernorm) use this epsilon, whatever the config's.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary):
        super().__init__()
        from ddtree.models.transformer import PackedLinear, RMSNorm, RowParallelLinear
        m = cfg.mla
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, 1, cfg.head_dim
        self.nope, self.pe, self.rank, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        self.q_lora_rank = m.q_lora_rank
        q_width = m.q_lora_rank or cfg.num_heads * (self.nope + self.pe)
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q": q_width, "kv": self.rank + self.pe}, bias=False)
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, cfg.num_heads * (self.nope + self.pe), bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, cfg.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.scale = m.scale
        # Interleaved rotary pairs (2i, 2i + 1) become the pairs (i, i + D/2) that `rope` rotates when the
        # channels are put evens first, then odds, in q_pe and k_pe alike (their dot products are unchanged).
        self.interleaved = m.rope_interleave
        self.k_cache = self.v_cache = torch.empty(0)  # [num_slots, 1, kv_lora_rank + qk_rope_head_dim], by the runner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, batch)

    @property
    def input_projection(self) -> nn.Linear:
        """The product `attend` starts from (the few-rows path fuses the layer's norm into it)."""
        return self.qkv_proj

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # (views only: no index tensor, so CUDA graphs can capture it)
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return rope(x, positions, self.rotary[0].cos_sin)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Attention output after o_proj, from the packed query | kv_a projection (see the module docstring)."""
        T, H = qkv.shape[0], self.num_heads
        q, kv = qkv.split([qkv.shape[1] - self.rank - self.pe, self.rank + self.pe], dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(T, H, self.nope + self.pe)
        latent = self.kv_a_layernorm(kv[:, :self.rank].contiguous())
        k_pe = self._rotate(kv[:, None, self.rank:], positions)
        cached = torch.cat([latent[:, None], k_pe], dim=-1)  # [T, 1, rank + pe]
        store_kv(cached, cached, self.k_cache, self.v_cache, batch.slot_mapping, batch.use_triton)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("thn,hnc->thc", q[..., :self.nope], w[:, :self.nope])
        q = torch.cat([q_latent, self._rotate(q[..., self.nope:], positions)], dim=-1)  # [T, H, rank + pe]
        o = paged_attention(q, None, None, self.k_cache, self.v_cache, batch, self.scale)
        values = torch.einsum("thc,hvc->thv", o[..., :self.rank], w[:, self.nope:])  # [T, H, v_head_dim]
        return self.o_proj(values.reshape(T, H * self.v_dim))
