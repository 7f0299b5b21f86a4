"""The layers of hybrid models (Qwen3.5 text `qwen3_5_text`, Qwen3.5-MoE text `qwen3_5_moe_text`,
Qwen3-Next `qwen3_next`): Gated DeltaNet layers between gated full-attention layers, each followed by
the dense MLP or the MoE layer's (models/moe.py). Qwen3-Next's checkpoints fuse the Gated DeltaNet's
input projections differently; they load as Qwen3.5's (`split_grouped_projections`).

A Gated DeltaNet layer is linear attention with a recurrent state: per value head a [Dk, Dv] matrix S,
updated by each token t as

    S = exp(g_t) * S + k_t (beta_t * (v_t - S^T k_t))^T,    o_t = S^T q_t / sqrt(Dk)

(the gated delta rule), where q, k, v come out of a short causal depthwise convolution over the
projected q|k|v stream, q and k are L2-normalised, and the output is RMS-normed, gated by
SiLU(z) and projected back. Each request owns a state slot (engine/kv_cache.py): the convolution's
last K - 1 inputs and S, for every linear layer; a request's first chunk starts both from zeros, and
each chunk leaves them where its last token leaves them. A verified tree (DFlash's chain, DDTree's
tree) is different: each node starts from its parent's window and state (the root from the slot's),
so no node sees a sibling's or a cousin's tokens. The whole tree is solved at once, as a chunk of a
chain is, with the ancestor relation in place of the causal one (`_tree`); its updates are kept
(`pending`) until the accept walk has chosen a path, whose end's state the slot then takes
(`commit`), rebuilt from those updates: no state per node is ever held (`delta_rule_over` solves a
chunk and a tree alike). Full-attention layers keep the paged KV cache; their query projection also
yields a per-head output gate (sigmoid), only the first `rotary_dim` channels of a head are rotated,
and the q/k norms, like every norm of these models except the gated one, scale by 1 + weight
(`fold_norm_offsets` stores 1 + weight at load time).

Three paths compute the same thing. The torch path (the CPU) walks prompt chunks request by request,
their tokens through the recurrence a chunk at a time (`chunked_delta_rule`), and takes a verified tree
(`_tree`) or a decode step (`_decode`) for every request at once with device ops only. On the GPU a
decode step, a tree and its commit run as Triton kernels (ops/triton_gdn.py, `_triton_step`), and
prompt chunks go to flash-linear-attention's chunked delta rule where that package is installed
(`_chunks_fla`). The delta rule's torch forms live in models/delta_rule.py; its token-by-token
recurrence (`gated_delta_rule`) is the oracle in tests.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.config import ModelConfig
from ddtree.ops.attention import AttentionBatch, paged_attention, store_kv
from ddtree.ops.fused import _rms_norm, rope
from ddtree.models.delta_rule import chunked_delta_rule, delta_rule_over, end_state, gated_delta_rule, l2_normalize
from ddtree.models.transformer import DecoderLayer, PackedLinear, RMSNorm, Rotary, RowParallelLinear, project


class GatedAttention(nn.Module):
    """Full attention with an output gate and partial rotary (Qwen3.5)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # the checkpoint's q_proj holds each head's query and then its gate: 2 * head_dim rows a head
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q": 2 * self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=False)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary, self.rotary_dim = [rotary], cfg.rotary_dim or cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)  # [num_slots, Hkv, D], assigned by the runner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, batch)

    @property
    def input_projection(self) -> nn.Linear:
        return self.qkv_proj

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The layer's output from its packed q|gate, k, v projection."""
        T, D, rd = qkv.shape[0], self.head_dim, self.rotary_dim
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(T, self.num_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        if batch.use_triton:  # norms, partial rotary and the K/V store in one kernel
            from ddtree.ops.triton_qkv import qkv_rope_store
            q = qkv_rope_store(qkv, positions, self.rotary[0].cos_sin, batch.slot_mapping, self.k_cache, self.v_cache,
                               self.num_heads, self.num_kv_heads, D, self.q_norm.weight, self.k_norm.weight,
                               self.q_norm.eps, rotary_dim=rd, gated=True)
            o = paged_attention(q, None, None, self.k_cache, self.v_cache, batch, self.scale)
            return project(self.o_proj, o.flatten(1) * torch.sigmoid(gate.reshape(T, -1)), batch)
        q = _rms_norm(q, self.q_norm.weight, self.q_norm.eps)
        k = _rms_norm(k.view(T, self.num_kv_heads, D), self.k_norm.weight, self.k_norm.eps)
        cos_sin = self.rotary[0].cos_sin
        q = torch.cat([rope(q[..., :rd].contiguous(), positions, cos_sin), q[..., rd:]], dim=-1)
        k = torch.cat([rope(k[..., :rd].contiguous(), positions, cos_sin), k[..., rd:]], dim=-1)
        store_kv(k, v.view(T, self.num_kv_heads, D).contiguous(), self.k_cache, self.v_cache, batch.slot_mapping,
                 batch.use_triton)
        o = paged_attention(q.contiguous(), None, None, self.k_cache, self.v_cache, batch, self.scale)
        return project(self.o_proj, o.flatten(1) * torch.sigmoid(gate.reshape(T, -1)), batch)


@functools.cache
def fla_chunk_rule():
    """flash-linear-attention's `chunk_gated_delta_rule` (the chunked delta rule in Triton, for prompts on
    the GPU; `pip install ddtree[hybrid]`), or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


class KernelTree(NamedTuple):
    """What the Triton tree step (`GatedDeltaNet._triton_step`) keeps for `commit`."""
    mixed: torch.Tensor  # [R * N, conv_dim] the convolution's outputs (float32)
    qkv: torch.Tensor  # [R * N, conv_dim] its inputs
    d: torch.Tensor  # [R, Hv, N, Dv] the delta rule's updates
    G: torch.Tensor  # [R, Hv, N] the decay sums
    above: torch.Tensor  # [R, N, N] ancestor-or-self
    parents: torch.Tensor  # [R, N]
    prefix: torch.Tensor  # [R] tokens cached before the tree (0: the slot held nothing)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (gated delta rule) with a causal convolution; state in per-request slots."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        lin = cfg.linear
        self.cfg, self.eps = lin, cfg.rms_norm_eps
        self.key_dim, self.value_dim = lin.num_k_heads * lin.k_head_dim, lin.num_v_heads * lin.v_head_dim
        # the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, stacked: one matrix product
        self.in_proj = PackedLinear(cfg.hidden_size, {"qkv": lin.conv_dim, "z": self.value_dim, "b": lin.num_v_heads,
                                                      "a": lin.num_v_heads}, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_v_heads))
        self.norm = RMSNorm(lin.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim, cfg.hidden_size, bias=False)
        # [slots, conv_dim, K - 1] and [slots, Hv, Dk, Dv] (float32), assigned by the runner
        self.conv_state = self.recurrent_state = torch.empty(0)
        self.pending: tuple | None = None  # a verified tree's updates, for `commit`

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.attend(self.in_proj(x), positions, batch)

    @property
    def input_projection(self) -> nn.Linear:
        return self.in_proj

    def attend(self, projected: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The layer's output from its packed in-projection (q|k|v, z, b, a)."""
        lin = self.cfg
        qkv, z, b, a = projected.split([lin.conv_dim, self.value_dim, lin.num_v_heads, lin.num_v_heads], dim=-1)
        decode = batch.commit_states and projected.shape[0] == batch.state_slots.shape[0]  # one token a request
        if batch.use_triton and (decode or not batch.commit_states):
            from ddtree.ops.triton_gdn import MAX_TREE
            if decode or projected.shape[0] <= MAX_TREE * batch.state_slots.shape[0]:  # (wider: the torch solve)
                return project(self.out_proj, self._triton_step(qkv, z, b, a, positions, batch, decode), batch)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if decode:
            return self._output(self._decode(qkv, g, beta, batch.state_slots, batch.prefix_lens), z, projected.dtype)
        if not batch.commit_states:  # a verified tree: every request's nodes at once
            return self._output(self._tree(qkv, g, beta, positions, batch), z, projected.dtype)
        if projected.is_cuda and fla_chunk_rule() is not None:
            return self._output(self._chunks_fla(qkv, g, beta, batch), z, projected.dtype)
        out = projected.new_empty(projected.shape[0], lin.num_v_heads, lin.v_head_dim)
        rows = zip(batch.q_starts.tolist(), batch.q_lens.tolist(), batch.prefix_lens.tolist(),
                   batch.state_slots.tolist())
        for start, n, prefix, slot in rows:  # prompt chunks (and mixed steps): one request at a time
            window, state = self.conv_state[slot], self.recurrent_state[slot]
            if prefix == 0:  # a request's first tokens: nothing before them
                window, state = torch.zeros_like(window), torch.zeros_like(state)
            span = slice(start, start + n)
            o, self.conv_state[slot], self.recurrent_state[slot] = self._chain(qkv[span], g[span], beta[span],
                                                                                window, state)
            out[span] = o.to(out.dtype)
        return self._output(out, z, projected.dtype)

    def _chunks_fla(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    batch: AttentionBatch) -> torch.Tensor:
        """Prompt chunks (and mixed steps) on the GPU: each request's convolution over its slot's window,
        then one flash-linear-attention call solves every request's chunk from its slot's state
        (`chunk_gated_delta_rule` over variable lengths). Returns the outputs [T, Hv, Dv] (float32)."""
        lin = self.cfg
        slots, prefix = batch.state_slots, batch.prefix_lens
        lens = batch.q_lens.long()
        mixed = torch.empty(qkv.shape[0], lin.conv_dim, dtype=torch.float32, device=qkv.device)
        windows, states = self._slot_states(slots, prefix)
        for r, (start, n) in enumerate(zip(batch.q_starts.tolist(), lens.tolist())):
            mixed[start:start + n], self.conv_state[slots[r]] = self._convolve(qkv[start:start + n], windows[r])
        q, k, v = self._heads(mixed)
        cu = F.pad(lens.cumsum(0), (1, 0))
        out, final = fla_chunk_rule()(q[None], k[None], v[None], g.float()[None], beta.float()[None], scale=1.0,
                                      initial_state=states, output_final_state=True, cu_seqlens=cu)
        self.recurrent_state[slots] = final.float()
        return out[0]

    def _triton_step(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     positions: torch.Tensor, batch: AttentionBatch, decode: bool) -> torch.Tensor:
        """A decode step or a verified tree in Triton kernels (ops/triton_gdn.py), device ops only. Returns
        the gated, normed outputs [T, Hv * Dv] in the model dtype."""
        from ddtree.ops import triton_gdn
        slots, prefix = batch.state_slots, batch.prefix_lens
        weight = self.conv1d.weight[:, 0]
        common = (self.A_log, self.dt_bias, z, self.norm.weight, self.eps, self.cfg.num_k_heads)
        if decode:
            mixed = triton_gdn.conv_step(self.conv_state, slots, prefix, qkv, weight)
            return triton_gdn.delta_step(self.recurrent_state, slots, prefix, mixed, b, a, *common)
        above, depth, parents = tree_shape(batch, positions)
        mixed = triton_gdn.tree_conv(self.conv_state, slots, prefix, qkv, parents, weight)
        out, d, G = triton_gdn.tree_delta(self.recurrent_state, slots, prefix, mixed, b, a, *common, above, depth)
        self.pending = KernelTree(mixed, qkv, d, G, above, parents, prefix)
        return out

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gated = _rms_norm(out.to(dtype), self.norm.weight, self.eps).float() * F.silu(z.float().view_as(out))
        return self.out_proj(gated.to(dtype).flatten(1))

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                prefix_lens: torch.Tensor) -> torch.Tensor:
        """One token per request, every request at once and with device ops only: the windows and
        states are gathered from the requests' slots (zeros for a request's first token), advanced by
        one token and written back. Returns the outputs [R, Hv, Dv] (float32)."""
        kept = (prefix_lens > 0)[:, None, None]  # (a one-token prompt: nothing before it)
        window = torch.where(kept, self.conv_state[slots], 0)
        seq = torch.cat([window, qkv[:, :, None].to(window.dtype)], dim=-1)  # [R, C, K]
        mixed = F.silu((seq.float() * self.conv1d.weight[:, 0].float()).sum(-1))
        self.conv_state[slots] = seq[:, :, 1:]
        q, k, v = self._heads(mixed)  # [R, H, D]
        state = torch.where(kept[..., None], self.recurrent_state[slots], 0) * g.float().exp()[:, :, None, None]
        delta = (v - torch.einsum("rhkv,rhk->rhv", state, k)) * beta.float()[..., None]
        state = state + k[..., None] * delta[:, :, None, :]
        self.recurrent_state[slots] = state
        return torch.einsum("rhkv,rhk->rhv", state, q)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's outputs [..., conv_dim] as q, k [..., Hv, Dk] (L2-normalised, q scaled by
        1 / sqrt(Dk), each q/k head repeated for the value heads it serves) and v [..., Hv, Dv], float32."""
        lin, lead = self.cfg, mixed.shape[:-1]
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = lin.num_v_heads // lin.num_k_heads
        q = l2_normalize(q.view(*lead, lin.num_k_heads, -1)).repeat_interleave(repeat, dim=-2) / lin.k_head_dim ** 0.5
        k = l2_normalize(k.view(*lead, lin.num_k_heads, -1)).repeat_interleave(repeat, dim=-2)
        return q, k, v.reshape(*lead, lin.num_v_heads, -1)

    def _chain(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, window: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """n tokens in a row after (window, state): their outputs [n, Hv, Dv] and the window and state
        after the last."""
        lin, n = self.cfg, qkv.shape[0]
        mixed, window = self._convolve(qkv, window)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = lin.num_v_heads // lin.num_k_heads  # each q/k head serves this many value heads
        q = q.reshape(n, lin.num_k_heads, lin.k_head_dim).repeat_interleave(repeat, dim=1)
        k = k.reshape(n, lin.num_k_heads, lin.k_head_dim).repeat_interleave(repeat, dim=1)
        rule = gated_delta_rule if n == 1 else chunked_delta_rule
        o, state = rule(q, k, v.reshape(n, lin.num_v_heads, lin.v_head_dim), g, beta, state)
        return o, window, state

    def _convolve(self, qkv: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """n tokens' convolution after `window` [conv_dim, K - 1]: silu(conv) [n, conv_dim] (float32) and
        the window after the last, in the slots' dtype. Inputs round to that dtype first, and the product
        runs in float32, as in `_decode`, so the paths round alike."""
        seq = torch.cat([window, qkv.T], dim=-1).to(self.conv_state.dtype)  # [conv_dim, K - 1 + n]
        mixed = F.silu(F.conv1d(seq.float()[None], self.conv1d.weight.float(), groups=self.cfg.conv_dim)[0]).T
        return mixed, seq[:, seq.shape[1] - window.shape[1]:]

    def _slot_states(self, slots: torch.Tensor, prefix_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' windows [R, C, K - 1] and states [R, Hv, Dk, Dv] (float32), zeros for a request with
        nothing cached."""
        kept = (prefix_lens > 0)[:, None, None]
        return (torch.where(kept, self.conv_state[slots], 0).float(),
                torch.where(kept[..., None], self.recurrent_state[slots], 0).float())

    def _tree(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, positions: torch.Tensor,
              batch: AttentionBatch) -> torch.Tensor:
        """A verified tree of N nodes per request ([R * N] rows, ancestors before descendants), device ops
        only. A node sees its ancestors alone: its convolution reads its ancestor chain (then the slot's
        window), and the delta rule runs over the ancestor relation (`delta_rule_over`, as over a chain
        for a prompt chunk). The updates, decays and inputs are kept (`pending`) so that `commit` can
        rebuild the state at the accepted path's end without a state per node. Returns the outputs
        [R * N, Hv, Dv]."""
        lin, K = self.cfg, self.cfg.conv_kernel
        R = batch.state_slots.shape[0]
        N = qkv.shape[0] // R
        dev = qkv.device
        above, _, parent = tree_shape(batch, positions)  # [R, N, N] ancestor-or-self; [R, N]
        parent = parent.long()
        window, state = self._slot_states(batch.state_slots, batch.prefix_lens)
        # Each node's inputs at lags 0 .. K - 1: a node index (>= 0), or -m for the slot window's m-th last.
        x = qkv.view(R, N, -1).float()
        src = torch.arange(N, device=dev).expand(R, N)
        conv = torch.zeros_like(x)
        lags = []
        for j in range(K):
            lags.append(src)
            conv = conv + lag_inputs(x, window, src) * self.conv1d.weight[:, 0, K - 1 - j].float()
            src = torch.where(src >= 0, parent.gather(1, src.clamp(min=0)), src - 1)
        q, k, v = (t.transpose(1, 2) for t in self._heads(F.silu(conv)))  # [R, H, N, D]
        per_head = lambda t: t.float().view(R, N, -1).transpose(1, 2)  # noqa: E731  [R, H, N]
        out, d, G = delta_rule_over(q, k, v, per_head(g), per_head(beta), state, above)
        # (kept small: the inputs in the model's dtype, and the starting state re-read from the slot)
        self.pending = (k, d, G, above, qkv.view(R, N, -1), window, torch.stack(lags, dim=-1),
                        batch.prefix_lens > 0)
        return out.transpose(1, 2).reshape(R * N, lin.num_v_heads, lin.v_head_dim)

    def commit(self, state_slots: torch.Tensor, nodes: torch.Tensor) -> None:
        """After a verified tree: each request's slot takes the state at the end of its accepted path,
        nodes[r] (`end_state`), and the path's last K - 1 convolution inputs."""
        if isinstance(self.pending, KernelTree):
            from ddtree.ops.triton_gdn import tree_commit
            p = self.pending
            tree_commit(self.recurrent_state, self.conv_state, state_slots, p.prefix, p.mixed, p.qkv, p.d, p.G, p.above,
                        p.parents, nodes, self.cfg.conv_kernel, self.cfg.num_k_heads)
            self.pending = None
            return
        k, d, G, above, x, window, lags, kept = self.pending
        state = torch.where(kept[:, None, None, None], self.recurrent_state[state_slots], 0)
        rows = torch.arange(nodes.shape[0], device=nodes.device)
        state = end_state(state, k, d, G, above[rows, nodes], nodes)
        src = lags[rows, nodes].flip(-1)[:, 1:]  # [R, K - 1]: lags K - 2 .. 0, oldest first
        self.conv_state[state_slots] = lag_inputs(x, window, src).transpose(1, 2).to(self.conv_state.dtype)
        self.recurrent_state[state_slots] = state
        self.pending = None


def lag_inputs(x: torch.Tensor, window: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Convolution inputs [R, M, C] picked by `src` [R, M]: row src of x [R, N, C] where src >= 0, else the
    slot window's (-src)-th last column (window [R, C, K - 1]); float32."""
    K = window.shape[2] + 1
    from_x = x.gather(1, src.clamp(min=0)[..., None].expand(-1, -1, x.shape[2])).float()
    from_window = window.gather(2, (K - 1 + src).clamp(0, K - 2)[:, None, :].expand(-1, x.shape[2], -1))
    return torch.where((src >= 0)[..., None], from_x, from_window.transpose(1, 2).float())


def tree_shape(batch: AttentionBatch, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verified tree's ancestor-or-self relation [R, N, N], depths [R, N] and parents [R, N] (-1: a
    root; both int32), computed by the first linear layer and kept on the batch for the others."""
    if batch.tree is None:
        R = batch.state_slots.shape[0]
        N = positions.shape[0] // R
        above = tree_ancestors(batch, positions, R, N)
        depth = positions.view(R, N) - batch.prefix_lens[:, None].long()
        batch.tree = (above, depth.int(), tree_parent(above, depth).int())
    return batch.tree


def tree_ancestors(batch: AttentionBatch, positions: torch.Tensor, R: int, N: int) -> torch.Tensor:
    """The ancestor-or-self relation of each request's N nodes [R, N, N] (no mask: a chain)."""
    if batch.mask is not None:
        return batch.mask[:, :N, :N].bool()
    return torch.ones(N, N, dtype=torch.bool, device=positions.device).tril().expand(R, N, N)


def tree_parent(above: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Each node's parent [R, N] (-1 for a root): its deepest ancestor other than itself."""
    N = above.shape[-1]
    strict = above & ~torch.eye(N, dtype=torch.bool, device=above.device)
    deepest, parent = torch.where(strict, depth[:, None, :], -1).max(-1)
    return torch.where(deepest >= 0, parent, -1)


class HybridDecoderLayer(DecoderLayer):
    """A Gated DeltaNet or a gated full-attention layer, then the MLP or the MoE layer's (the dense layer's
    forward)."""

    def __init__(self, cfg: ModelConfig, index: int, rotary: Rotary):
        nn.Module.__init__(self)
        if cfg.layer_types[index] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, rotary)
        self.add_norms_and_mlp(cfg, index)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn


def split_grouped_projections(tensors, cfg: ModelConfig):
    """Checkpoint tensors with Qwen3-Next's fused Gated DeltaNet projections rewritten as Qwen3.5's four.
    Its `in_proj_qkvz` holds a group of rows per key head: the head's q (Dk rows), k (Dk), then v and z of
    the value heads it serves (r = Hv / Hk heads of Dv rows each); `in_proj_ba` a group of 2r rows per key
    head, b then a of those value heads. Regrouped: in_proj_qkv (every q, every k, every v), in_proj_z,
    in_proj_b and in_proj_a, value heads in the same order. `cfg` gives the heads held (the rank's, under
    tensor parallelism, whose rows are whole groups: parallel/shard.py)."""
    lin = cfg.linear
    r = lin and lin.num_v_heads // lin.num_k_heads
    for name, tensor in tensors:
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            prefix = name[:-len("in_proj_qkvz.weight")]
            q, k, v, z = tensor.view(lin.num_k_heads, -1, tensor.shape[-1]).split(
                [lin.k_head_dim, lin.k_head_dim, r * lin.v_head_dim, r * lin.v_head_dim], dim=1)
            yield prefix + "in_proj_qkv.weight", torch.cat([t.flatten(0, 1) for t in (q, k, v)])
            yield prefix + "in_proj_z.weight", z.flatten(0, 1)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            prefix = name[:-len("in_proj_ba.weight")]
            b, a = tensor.view(lin.num_k_heads, 2 * r, tensor.shape[-1]).split([r, r], dim=1)
            yield prefix + "in_proj_b.weight", b.flatten(0, 1)
            yield prefix + "in_proj_a.weight", a.flatten(0, 1)
        else:
            yield name, tensor


def fold_norm_offsets(tensors):
    """Checkpoint tensors with Qwen3.5's zero-centred RMSNorm weights (they scale by 1 + weight) stored as
    1 + weight, computed in float32 before the model's dtype rounds it, so those norms run as plain
    RMSNorms. The gated norm inside a Gated DeltaNet layer scales by its weight and is left alone."""
    for name, tensor in tensors:
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor
