"""Tensor parallelism's split of a model (Megatron style): which heads and channels a rank holds, and
which slices of each checkpoint tensor it reads.

Attention: each of N ranks takes num_heads / N query heads with their KV heads: num_kv_heads / N of
them, or, with fewer KV heads than ranks, the one KV head its query heads share (that head is then
held by every rank whose query heads use it). q/k/v and gate/up are split by output rows
(column-parallel); o_proj and down_proj by input columns (row-parallel): each rank's product is a
partial sum, all-reduced to the full output (`RowParallelLinear` in models/transformer.py), and a
row-parallel bias is added on rank 0 only. Gated DeltaNet layers (hybrid models) split their key and
value heads alike, the convolution's channels with them, and their recurrent state with the heads.
Qwen3-Next's fused in_proj_qkvz and in_proj_ba hold one group of rows per key head (its q, k, and
its value heads' v and z; its value heads' b and a), so a rank's key heads are one block of rows.
Routed experts (MoE layers) are split whole: each rank holds E / N experts and adds its experts' share
of each token's output, and an all-reduce sums the shares (the router is whole on every rank, and the
tokens are already on every rank, so no all-to-all is needed). Qwen's gated shared expert splits like
an MLP, its one-row gate whole on every rank (SparseMoE).
Multi-head latent attention (DeepSeek-V3, models/mla.py) splits its query heads alike: q_proj (or
q_b_proj) and kv_b_proj by rows, head by head (kv_b_proj's rows are each head's key part, then its
value part, so a rank's heads are one block of rows), o_proj by input columns. The latent projections
(q_a_proj, kv_a_proj_with_mqa) and their norms are whole on every rank, and so is the cached latent
vector, one KV head that every rank holds. DeepSeek-V3's shared experts and its first, dense layers'
MLPs split like any MLP; the router and its e_score_correction_bias are whole, and the shared experts'
partial output joins the routed experts' share before the layer's one all-reduce (GroupRoutedMoE).
The embedding and the LM head are split by vocabulary rows where the ranks divide the vocabulary
(`VocabParallelEmbedding`, `VocabParallelLMHead`), and are whole on every rank otherwise; the norms are
whole on every rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddtree.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    size: int


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape of rank `shard.rank`'s part of the model (its local heads and MLP width)."""
    n = shard.size
    problems = []
    if cfg.num_heads % n:
        problems.append(f"num_attention_heads {cfg.num_heads}")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads {cfg.num_kv_heads} (nor does it divide {n})")
    if cfg.intermediate_size % n:
        problems.append(f"intermediate_size {cfg.intermediate_size}")
    if cfg.linear is not None and (cfg.linear.num_k_heads % n or cfg.linear.num_v_heads % n):
        problems.append(f"linear attention heads {cfg.linear.num_k_heads}/{cfg.linear.num_v_heads}")
    if cfg.moe is not None and cfg.moe.num_experts % n:
        problems.append(f"num_experts {cfg.moe.num_experts}")
    if cfg.moe is not None and cfg.moe.shared_intermediate_size % n:
        problems.append(f"shared experts' width {cfg.moe.shared_intermediate_size} (shared_expert_intermediate_size, "
                        f"or n_shared_experts x moe_intermediate_size)")
    if problems:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {', '.join(problems)}")
    linear = cfg.linear and dataclasses.replace(cfg.linear, num_k_heads=cfg.linear.num_k_heads // n,
                                                num_v_heads=cfg.linear.num_v_heads // n)
    moe = cfg.moe and dataclasses.replace(cfg.moe, held_experts=cfg.moe.num_experts // n,
                                          first_expert=shard.rank * cfg.moe.num_experts // n,
                                          shared_intermediate_size=cfg.moe.shared_intermediate_size // n)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(cfg.num_kv_heads // n, 1),
                               intermediate_size=cfg.intermediate_size // n, linear=linear, moe=moe,
                               eos_token_ids=list(cfg.eos_token_ids), vocab_part=vocab_part(cfg, shard))


def vocab_part(cfg: ModelConfig, shard: Shard) -> tuple[int, int] | None:
    """Rank `shard.rank`'s rows of the embedding and the LM head; None (whole) if the ranks do not divide
    the vocabulary."""
    if shard.size == 1 or cfg.vocab_size % shard.size:
        return None
    rows = cfg.vocab_size // shard.size
    return shard.rank * rows, (shard.rank + 1) * rows


@dataclass(frozen=True, slots=True)
class Take:
    """The part of a checkpoint tensor a rank reads: these [start, end) ranges along `dim`, in order."""
    dim: int
    ranges: tuple[tuple[int, int], ...]


ZEROS = "zeros"  # a row-parallel bias on ranks other than 0
ELSEWHERE = "elsewhere"  # a routed expert's tensor that another rank holds


def tensor_part(name: str, cfg: ModelConfig, shard: Shard) -> Take | str | None:
    """What rank `shard.rank` holds of the checkpoint tensor `name` (text-model names, as loaded): a
    `Take`, ZEROS, or None for the whole tensor. `cfg` is the full model's config."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = vocab_part(cfg, shard)
        return part and Take(0, (part,))
    if shard.size == 1 or ".layers." not in name:
        return None
    r, n = shard.rank, shard.size
    leaf = name.rsplit(".", 2)
    module, kind = leaf[-2], leaf[-1]

    def rows(start: int, size: int, dim: int = 0) -> Take:  # the rank's share of `size` rows after `start`
        return Take(dim, ((start + r * size // n, start + (r + 1) * size // n),))

    if ".experts." in name:  # routed experts: whole experts, E / n a rank (expert parallelism)
        per = cfg.moe.num_experts // n
        index = name.split(".experts.", 1)[1].split(".", 1)[0]
        if index.isdigit():  # (one tensor per expert)
            return None if r * per <= int(index) < (r + 1) * per else ELSEWHERE
        return Take(0, ((r * per, (r + 1) * per),))  # (stacked: [E, ...])
    mla = cfg.mla
    if mla is not None and ".self_attn." in name:  # MLA: heads split, the latent projections whole
        H = cfg.num_heads
        if module in ("q_proj", "q_b_proj"):
            return rows(0, H * (mla.qk_nope_head_dim + mla.qk_rope_head_dim))
        if module == "kv_b_proj":  # (each head's rows: its key part, then its value part)
            return rows(0, H * (mla.qk_nope_head_dim + mla.v_head_dim))
        if module == "o_proj":
            return rows(0, H * mla.v_head_dim, dim=1)
        return None  # q_a_proj, kv_a_proj_with_mqa and their norms
    D = cfg.head_dim
    if module == "q_proj":  # (gated attention: each head's query, then its gate)
        return rows(0, cfg.num_heads * D * (2 if cfg.attn_output_gate else 1))
    if module in ("k_proj", "v_proj"):
        if cfg.num_kv_heads >= n:
            return rows(0, cfg.num_kv_heads * D)
        head = r * cfg.num_kv_heads // n
        return Take(0, ((head * D, (head + 1) * D),))
    if module == "o_proj":
        return (None if r == 0 else ZEROS) if kind == "bias" else rows(0, cfg.num_heads * D, dim=1)
    if module in ("gate_proj", "up_proj", "down_proj"):  # a dense MLP, or the shared expert(s) of an MoE layer
        width = cfg.moe.shared_intermediate_size if ".shared_expert" in name else cfg.intermediate_size
        return rows(0, width, dim=1 if module == "down_proj" else 0)
    lin = cfg.linear
    if lin is None or ".linear_attn." not in name:
        return None
    keys, values = lin.num_k_heads * lin.k_head_dim, lin.num_v_heads * lin.v_head_dim
    if module in ("in_proj_qkv", "conv1d"):  # q | k | v channels
        q, k, v = rows(0, keys), rows(keys, keys), rows(2 * keys, values)
        return Take(0, q.ranges + k.ranges + v.ranges)
    if module == "in_proj_z":
        return rows(0, values)
    if module in ("in_proj_qkvz", "in_proj_ba"):  # (Qwen3-Next: each key head's group of rows in turn)
        return rows(0, 2 * keys + 2 * values if module == "in_proj_qkvz" else 2 * lin.num_v_heads)
    if module in ("in_proj_a", "in_proj_b") or kind in ("dt_bias", "A_log"):
        return rows(0, lin.num_v_heads)
    if module == "out_proj":
        return rows(0, values, dim=1)
    return None  # the gated norm: per value channel of a head, the same on every rank
