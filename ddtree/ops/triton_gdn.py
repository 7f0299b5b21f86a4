"""Gated DeltaNet layers (hybrid models, models/hybrid.py) on the GPU: a decode step, a verified tree
and the commit of its accepted path, each in a few kernels that read and write the requests' state
slots in place.

The layer's in-projection yields, per token, the q|k|v stream x [conv_dim] and the raw b and a [Hv]
(beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)). Then:

- the convolution: mixed = silu(sum over lags j of w[K - 1 - j] * input j tokens back), where the
  inputs before the step's own come from the slot's window (its last K - 1 inputs). In a tree, "back"
  walks the parent chain, so a node never reads a sibling's input (`conv_step`, `tree_conv`).
- the gated delta rule per value head h, with S the [Dk, Dv] state (float32) and q, k L2-normalised
  (q also scaled by 1 / sqrt(Dk)):  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q.
  A tree solves every node at once from the slot's S0 (models/hybrid.py's `delta_rule_over`): with G
  the sum of g over a node's ancestors and itself and D[t, i] = exp(G[t] - G[i]) over ancestors i,
  the updates d solve (I + A) d = beta (v - exp(G) K S0), A[t, i] = beta_t D[t, i] (k_t . k_i) over
  strict ancestors, through (I + A)^-1 formed block by block, and o = exp(G) Q S0 + (D o QK^T) d
  (`tree_delta`). The commit rebuilds the accepted path's end state from d (`tree_commit`).
- the output: RMS norm of o (over Dv) times the norm weight, gated by silu(z), in the model dtype.

A program takes one (request, value head, BLOCK_V value columns): the columns of S are independent,
so a single request spreads over Hv * Dv / BLOCK_V programs. A tree's program reads q, k and S0 a few
key channels at a time, so only narrow tiles of them are live at once (`benchmarks/kernel_resources.py`
counts what the compiled kernel spills). The norm needs the whole head: a second kernel norms and gates
the outputs. A request whose state is fresh (nothing cached before the
step: prefix 0) starts from zero windows and states, whatever its slot holds.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ddtree.ops.triton_linear import INTERPRETED

# Matrix products in float32 on tensor cores: three TF32 products carry float32's precision (the
# interpreter computes them exactly). A tree's solve in a 16-bit model takes one TF32 product: its
# error (about 1e-3) is below the rounding of the outputs it feeds.
PRECISION: tl.constexpr = tl.constexpr("tf32x3")
MAX_TREE = 65  # the most nodes a tree kernel takes (a root and NP x NP, NP x Dk tiles in registers)
TREE_KEY_CHUNK = 32  # key channels the tree kernel reads at a time (where a head's key channels divide by it)


def key_chunk(head_dim: int) -> int:
    """Key channels a tree program reads at a time: TREE_KEY_CHUNK, or fewer where the head's key channels
    do not divide by it (16 at least: tl.dot's smallest inner size)."""
    chunk = math.gcd(head_dim, TREE_KEY_CHUNK)
    assert chunk >= 16, f"the tree kernel takes key heads of a multiple of 16 channels, got {head_dim}"
    return chunk


@triton.jit
def _gate_inputs(B, A, ALog, DtBias, row, h, ok):
    """beta and g of tokens `row` (where `ok`) and value head h from the raw in-projection outputs b and a."""
    beta = tl.sigmoid(tl.load(B + row, mask=ok, other=0.0).to(tl.float32))
    a = tl.load(A + row, mask=ok, other=0.0).to(tl.float32) + tl.load(DtBias + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    return beta, -tl.exp(tl.load(ALog + h).to(tl.float32)) * softplus


@triton.jit
def _unit_rows(x, scale):
    """Rows of x [M, D] divided by sqrt(|row|^2 + 1e-6), times `scale`."""
    return x * (tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) + 1e-6) * scale)


@triton.jit
def _conv_step_kernel(Window, Slots, stride_slots, Prefix, X, W, Out, stride_slot, stride_x, C,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    j = tl.arange(0, KP)  # window columns, oldest first
    base = Window + tl.load(Slots + r * stride_slots).to(tl.int64) * stride_slot + c[:, None] * (K - 1)
    keep = tl.load(Prefix + r) != 0
    in_window = ok[:, None] & (j[None, :] < K - 1)
    window = tl.where(keep, tl.load(base + j[None, :], mask=in_window, other=0.0).to(tl.float32), 0.0)
    shifted = tl.load(base + j[None, :] + 1, mask=in_window & (j[None, :] + 1 < K - 1), other=0.0)
    shifted = tl.where(keep, shifted, tl.zeros_like(shifted))
    x = tl.load(X + r * stride_x + c, mask=ok, other=0.0)
    w = tl.load(W + c[:, None] * K + j[None, :], mask=ok[:, None] & (j[None, :] < K - 1), other=0.0).to(tl.float32)
    xw = x.to(Window.dtype.element_ty).to(tl.float32)
    acc = tl.sum(window * w, 1) + xw * tl.load(W + c * K + K - 1, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + r * C + c, acc * tl.sigmoid(acc), mask=ok)
    new = tl.where(j[None, :] == K - 2, x[:, None].to(Window.dtype.element_ty), shifted.to(Window.dtype.element_ty))
    tl.store(base + j[None, :], new, mask=ok[:, None] & (j[None, :] < K - 1))


def conv_step(window: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor, x: torch.Tensor,
              weight: torch.Tensor) -> torch.Tensor:
    """One token per request: x [R, C] (rows of the in-projection, strided), windows [slots, C, K - 1]
    updated in place at `slots` [R] (a request with prefix[r] == 0 cached tokens starts from zeros);
    weight [C, K]. Returns silu(conv) [R, C] float32."""
    R, C = x.shape[0], window.shape[1]
    K = weight.shape[-1]
    out = torch.empty(R, C, dtype=torch.float32, device=x.device)
    block_c = 128
    _conv_step_kernel[(R, triton.cdiv(C, block_c))](
        window, slots, slots.stride(0), prefix, x, weight.contiguous(), out, window.stride(0), x.stride(0), C,
        K=K, KP=triton.next_power_of_2(K - 1), BLOCK_C=block_c)
    return out


@triton.jit
def _delta_step_kernel(State, Slots, stride_slots, Prefix, Mixed, B, A, stride_ba, ALog, DtBias, Out, stride_slot,
                       stride_head, HV, REPEAT, KEY_DIM, VALUE_OFF, C,
                       DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dk = tl.arange(0, DK)
    hk = h // REPEAT
    q = _unit_rows(tl.load(Mixed + r * C + hk * DK + dk)[None, :], 1.0 / tl.sqrt(DK * 1.0))
    k = _unit_rows(tl.load(Mixed + r * C + KEY_DIM + hk * DK + dk)[None, :], 1.0)
    beta, g = _gate_inputs(B, A, ALog, DtBias, r * stride_ba + h, h, r >= 0)
    base = State + tl.load(Slots + r * stride_slots).to(tl.int64) * stride_slot + h * stride_head
    ptrs = base + dk[:, None] * DV + dv[None, :]
    s = tl.where(tl.load(Prefix + r) != 0, tl.load(ptrs), 0.0) * tl.exp(g)
    v = tl.load(Mixed + r * C + VALUE_OFF + h * DV + dv)
    delta = (v - tl.sum(s * tl.trans(k), 0)) * beta
    s = s + tl.trans(k) * delta[None, :]
    tl.store(ptrs, s)
    tl.store(Out + (r * HV + h) * DV + dv, tl.sum(s * tl.trans(q), 0))


def delta_step(state: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor, mixed: torch.Tensor, b: torch.Tensor,
               a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
               eps: float, num_k_heads: int) -> torch.Tensor:
    """One token per request. state [slots, Hv, Dk, Dv] float32, updated in place at `slots` [R]; prefix
    [R] the tokens cached before the step (0: start from zeros); mixed [R, 2 Hk Dk + Hv Dv] the
    convolution's outputs (float32); b, a [R, Hv] and z [R, Hv Dv] rows of the in-projection (strided).
    Returns the gated, normed outputs [R, Hv Dv] in z's dtype. One program per (request, head, BLOCK_V
    value columns), then one per (request, head) norms and gates."""
    R, H, DK, DV = mixed.shape[0], state.shape[1], state.shape[2], state.shape[3]
    assert state.dtype == torch.float32 and state.stride(3) == 1 and state.stride(2) == DV and DV & (DV - 1) == 0
    raw = torch.empty(R, H * DV, dtype=torch.float32, device=z.device)
    block_v = min(DV, 32)
    _delta_step_kernel[(R, H, DV // block_v)](
        state, slots, slots.stride(0), prefix, mixed, b, a, b.stride(0), A_log, dt_bias, raw, state.stride(0),
        state.stride(1), H, H // num_k_heads, num_k_heads * DK, 2 * num_k_heads * DK, mixed.shape[1],
        DK=DK, DV=DV, BLOCK_V=block_v, num_warps=4)
    return gated_norm(raw, z, norm_weight, eps, H)


@triton.jit
def _tree_conv_kernel(Window, Slots, stride_slots, Prefix, X, stride_x, Parents, W, Out, stride_slot, N, C,
                      K: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    node = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    base = Window + tl.load(Slots + r * stride_slots).to(tl.int64) * stride_slot + c * (K - 1)
    keep = tl.load(Prefix + r) != 0
    src = node
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # input j tokens back along the ancestor chain
        # (both read, from clamped places: the interpreter takes no scalar conditions in masks)
        from_x = tl.load(X + (r * N + tl.maximum(src, 0)) * stride_x + c, mask=ok, other=0.0)
        from_window = tl.load(base + tl.minimum(tl.maximum(K - 1 + src, 0), K - 2), mask=ok, other=0.0)
        from_window = tl.where(keep, from_window.to(tl.float32), 0.0)
        x = tl.where(src >= 0, from_x.to(Window.dtype.element_ty).to(tl.float32), from_window)
        acc += x * tl.load(W + c * K + K - 1 - j, mask=ok, other=0.0).to(tl.float32)
        src = tl.where(src >= 0, tl.load(Parents + r * N + tl.maximum(src, 0)), src - 1)
    tl.store(Out + (r * N + node) * C + c, acc * tl.sigmoid(acc), mask=ok)


def tree_conv(window: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor, x: torch.Tensor, parents: torch.Tensor,
              weight: torch.Tensor) -> torch.Tensor:
    """A tree of N nodes per request: x [R * N, C] (strided rows), parents [R, N] int32 (-1: the root). Each
    node's convolution reads its ancestor chain, then the slot's window; nothing is written back.
    Returns silu(conv) [R * N, C] float32."""
    R, N = parents.shape
    C, K = window.shape[1], weight.shape[-1]
    out = torch.empty(R * N, C, dtype=torch.float32, device=x.device)
    block_c = 256
    _tree_conv_kernel[(R, N, triton.cdiv(C, block_c))](
        window, slots, slots.stride(0), prefix, x, x.stride(0), parents, weight.contiguous(), out, window.stride(0),
        N, C, K=K, BLOCK_C=block_c)
    return out


@triton.jit
def _products(q_rows, valid, root_rows, root_row, base, keep, dv, KEY_DIM, DK: tl.constexpr, DV: tl.constexpr,
              NP: tl.constexpr, SOLVE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tree program's products of the raw q, k (NP node rows each), the root's two rows and S0, summed
    over the key channels: q S0, k S0, k k^T, q k^T, root S0, k root^T, q root^T, root root^T, and the
    squared norms of the q, k and root rows."""
    qs0 = tl.zeros((NP, BLOCK_V), dtype=tl.float32)
    ks0 = tl.zeros((NP, BLOCK_V), dtype=tl.float32)
    kk = tl.zeros((NP, NP), dtype=tl.float32)
    qk = tl.zeros((NP, NP), dtype=tl.float32)
    rs0 = tl.zeros((16, BLOCK_V), dtype=tl.float32)
    kr = tl.zeros((NP, 16), dtype=tl.float32)
    qr = tl.zeros((NP, 16), dtype=tl.float32)
    rr = tl.zeros((16, 16), dtype=tl.float32)
    q_sq = tl.zeros((NP, BLOCK_K), dtype=tl.float32)
    k_sq = tl.zeros((NP, BLOCK_K), dtype=tl.float32)
    r_sq = tl.zeros((16, BLOCK_K), dtype=tl.float32)
    for c in tl.static_range(0, DK, BLOCK_K):
        ch = c + tl.arange(0, BLOCK_K)
        q = tl.load(q_rows + ch[None, :], mask=valid[:, None], other=0.0)
        k = tl.load(q_rows + KEY_DIM + ch[None, :], mask=valid[:, None], other=0.0)
        r01 = tl.load(root_rows[:, None] + ch[None, :], mask=(root_row < 2)[:, None], other=0.0)
        s0 = tl.where(keep, tl.load(base + ch[:, None] * DV + dv[None, :]), 0.0)
        qs0 = tl.dot(q, s0, qs0, input_precision=SOLVE)
        ks0 = tl.dot(k, s0, ks0, input_precision=SOLVE)
        kk = tl.dot(k, tl.trans(k), kk, input_precision=SOLVE)
        qk = tl.dot(q, tl.trans(k), qk, input_precision=SOLVE)
        rs0 = tl.dot(r01, s0, rs0, input_precision=SOLVE)
        kr = tl.dot(k, tl.trans(r01), kr, input_precision=SOLVE)
        qr = tl.dot(q, tl.trans(r01), qr, input_precision=SOLVE)
        rr = tl.dot(r01, tl.trans(r01), rr, input_precision=SOLVE)
        q_sq += q * q
        k_sq += k * k
        r_sq += r01 * r01
    return qs0, ks0, kk, qk, rs0, kr, qr, rr, tl.sum(q_sq, 1), tl.sum(k_sq, 1), tl.sum(r_sq, 1)


@triton.jit
def _tree_delta_kernel(State, Slots, stride_slots, Prefix, Mixed, B, A, stride_ba, ALog, DtBias, Out, Mask,
                       stride_mask_r, stride_mask_q, Dbuf, Gbuf, stride_slot, stride_head, HV, REPEAT, KEY_DIM,
                       VALUE_OFF, C, N, R_KEY, DK: tl.constexpr, DV: tl.constexpr, NP: tl.constexpr,
                       LOG_NP: tl.constexpr, SOLVE: tl.constexpr, BLOCK_V: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    # Node 0 (the root: ancestors come first, so it has none) is solved on its own, and the NP-row tiles
    # hold nodes 1 to N - 1: a tree of 2^m + 1 nodes (a budget of 2^m) fills them without padding.
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    i = tl.arange(0, NP)
    node = i + 1
    valid = node < N
    rows = r * N + node
    root = r * N
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    hk = h // REPEAT
    beta, g = _gate_inputs(B, A, ALog, DtBias, rows * stride_ba + h, h, valid)
    beta = tl.where(valid, beta, 0.0)
    g = tl.where(valid, g, 0.0)
    beta0, g0 = _gate_inputs(B, A, ALog, DtBias, root * stride_ba + h, h, r >= 0)
    keep = tl.load(Prefix + r) != 0
    base = State + tl.load(Slots + r * stride_slots).to(tl.int64) * stride_slot + h * stride_head
    q_rows = Mixed + rows[:, None] * C + hk * DK
    q_root = Mixed + root * C + hk * DK
    # Every product of q, k and S0, over the key channels BLOCK_K at a time (tiles of BLOCK_K columns live
    # at once, not of DK), from the raw q and k: a row's L2 norm is a scalar that factors out of its
    # products, applied after. The root's q and k are rows 0 and 1 of a 16-row tile, so that their
    # products too are tensor-core products accumulated over the chunks; each is read out once, after.
    root_row = tl.arange(0, 16)  # (0: the root's q, 1: its k, the rest zero)
    root_rows = q_root + tl.where(root_row == 1, KEY_DIM, 0)
    qs0, ks0, kk, qk, rs0, kr, qr, rr, q_sq, k_sq, r_sq = _products(
        q_rows, valid, root_rows, root_row, base, keep, dv, KEY_DIM, DK, DV, NP, SOLVE, BLOCK_V, BLOCK_K)
    q0s0 = tl.sum(tl.where(root_row[:, None] == 0, rs0, 0.0), 0)
    k0s0 = tl.sum(tl.where(root_row[:, None] == 1, rs0, 0.0), 0)
    kk0 = tl.sum(tl.where(root_row[None, :] == 1, kr, 0.0), 1)
    qk0 = tl.sum(tl.where(root_row[None, :] == 1, qr, 0.0), 1)
    q0k0 = tl.sum(tl.sum(tl.where((root_row[:, None] == 0) & (root_row[None, :] == 1), rr, 0.0), 1), 0)
    q0_sq = tl.sum(tl.where(root_row == 0, r_sq, 0.0), 0)
    k0_sq = tl.sum(tl.where(root_row == 1, r_sq, 0.0), 0)
    scale = 1.0 / tl.sqrt(DK * 1.0)
    rq = tl.rsqrt(q_sq + 1e-6) * scale
    rk = tl.rsqrt(k_sq + 1e-6)
    rq0 = tl.rsqrt(q0_sq + 1e-6) * scale
    rk0 = tl.rsqrt(k0_sq + 1e-6)
    qs0 = qs0 * rq[:, None]
    ks0 = ks0 * rk[:, None]
    kk = kk * (rk[:, None] * rk[None, :])
    qk = qk * (rq[:, None] * rk[None, :])
    kk0 = kk0 * (rk * rk0)
    qk0 = qk0 * (rq * rk0)
    q0s0 = q0s0 * rq0
    k0s0 = k0s0 * rk0
    q0k0 = q0k0 * (rq0 * rk0)
    row_mask = Mask + r * stride_mask_r + node * stride_mask_q
    above = tl.load(row_mask[:, None] + node[None, :], mask=valid[:, None] & valid[None, :], other=0) != 0
    under_root = tl.load(row_mask, mask=valid, other=0) != 0
    G = tl.sum(tl.where(above, g[None, :], 0.0), 1) + tl.where(under_root, g0, 0.0)
    D = tl.where(above, tl.exp(tl.where(above, G[:, None] - G[None, :], 0.0)), 0.0)  # (no overflow off the relation)
    D0 = tl.where(under_root, tl.exp(tl.where(under_root, G - g0, 0.0)), 0.0)
    strict = above & (i[:, None] != i[None, :])
    Amat = tl.where(strict, beta[:, None] * D * kk, 0.0)
    eG = tl.exp(G)
    d0 = beta0 * (tl.load(Mixed + root * C + VALUE_OFF + h * DV + dv) - tl.exp(g0) * k0s0)
    v = tl.load(Mixed + rows[:, None] * C + VALUE_OFF + h * DV + dv[None, :], mask=valid[:, None], other=0.0)
    rhs = beta[:, None] * (v - eG[:, None] * ks0 - (D0 * kk0)[:, None] * d0[None, :])
    # (I + A)^-1 block by block, as blocked forward substitution: with T the inverse of the diagonal blocks
    # of size s, the inverse over blocks of 2s is T - T A' T, A' holding A's lower-left quarter of each
    # 2s block. Its entries are the solve's own (no powers of A, which grow with a chain's depth).
    inverse = tl.where(i[:, None] == i[None, :], 1.0, 0.0) - \
        tl.where(((i[:, None] ^ 1) == i[None, :]) & ((i[:, None] & 1) == 1), Amat, 0.0)
    for lvl in tl.static_range(1, LOG_NP):
        quarter = ((i[:, None] >> (lvl + 1)) == (i[None, :] >> (lvl + 1))) & \
            (((i[:, None] >> lvl) & 1) == 1) & (((i[None, :] >> lvl) & 1) == 0)
        step = tl.dot(tl.where(quarter, Amat, 0.0), inverse, input_precision=SOLVE)
        inverse -= tl.dot(inverse, step, input_precision=SOLVE)
    d = tl.dot(inverse, rhs, input_precision=SOLVE)
    o = eG[:, None] * qs0 + tl.dot(D * qk, d, input_precision=SOLVE) + (D0 * qk0)[:, None] * d0[None, :]
    o0 = tl.exp(g0) * q0s0 + q0k0 * d0
    ok = valid[:, None]
    head_rows = (r * HV + h) * N
    tl.store(Dbuf + (head_rows + node[:, None]) * DV + dv[None, :], d, mask=ok)
    tl.store(Dbuf + head_rows * DV + dv, d0)
    tl.store(Out + rows[:, None] * (HV * DV) + h * DV + dv[None, :], o, mask=ok)
    tl.store(Out + root * (HV * DV) + h * DV + dv, o0)
    if vb == 0:
        tl.store(Gbuf + head_rows + node, G, mask=valid)
        tl.store(Gbuf + head_rows, g0)


# The best split of a head's value columns, and warps, depend on the tree's size and the batch: tried at
# the first call of each (outside any graph capture; the kernel writes only its own outputs). Narrow
# splits give more programs; wide ones solve each head's system fewer times (BLOCK_V 128: once, where
# the head has 128 columns). Triton's interpreter has no timer: there the first split runs.
TREE_SPLITS = [triton.Config({"BLOCK_V": bv}, num_warps=w)
               for bv, w in ((32, 4), (16, 4), (32, 8), (64, 8), (16, 2), (32, 2), (128, 4), (128, 8))]


def splits_within_head(configs, named_args, **kwargs):
    """The splits no wider than a head's value columns."""
    dv = kwargs.get("DV", named_args.get("DV"))
    return [c for c in configs if c.kwargs["BLOCK_V"] <= dv]


_tree_delta = _tree_delta_kernel if INTERPRETED else triton.autotune(
    TREE_SPLITS, key=["N", "R_KEY", "DV"],
    prune_configs_by={"early_config_prune": splits_within_head})(_tree_delta_kernel)


@triton.jit
def _gated_norm_kernel(O, Z, stride_z, NormW, Out, eps, HV, DV: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, DV)
    # rounded to the model dtype where the torch path rounds: o, the normed o, its product with the weight
    dtype = Out.dtype.element_ty
    o = tl.load(O + row * HV * DV + h * DV + dv).to(dtype).to(tl.float32)
    z = tl.load(Z + row * stride_z + h * DV + dv).to(tl.float32)
    normed = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(dtype).to(tl.float32) * tl.load(NormW + dv).to(tl.float32)
    tl.store(Out + row * HV * DV + h * DV + dv, (normed.to(dtype).to(tl.float32) * (z * tl.sigmoid(z))).to(dtype))


def gated_norm(raw: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """rms_norm(raw) * w * silu(z) per head: raw [T, Hv Dv] float32, z [T, Hv Dv] rows (strided); z's dtype."""
    out = torch.empty(raw.shape, dtype=z.dtype, device=z.device)
    _gated_norm_kernel[(raw.shape[0], heads)](raw, z, z.stride(0), norm_weight, out, eps, heads,
                                              DV=raw.shape[1] // heads)
    return out


def tree_delta(state: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor, mixed: torch.Tensor, b: torch.Tensor,
               a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
               eps: float, num_k_heads: int, above: torch.Tensor, depth: torch.Tensor, split: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree of N nodes per request (ancestors first; above [R, >=N, >=N] the ancestor-or-self mask, depth
    [R, N]), solved from the slots' states, which are only read. Arguments as `delta_step`'s, with R * N
    rows. Returns the gated, normed outputs [R * N, Hv Dv] (z's dtype), the updates d [R, Hv, N, Dv] and
    the decay sums G [R, Hv, N] (float32) that `tree_commit` needs. One program per (request, head,
    BLOCK_V value columns); then one per (node, head) norms and gates the outputs. `split` (BLOCK_V,
    BLOCK_K, num_warps) fixes the launch in place of the autotuner's pick (`benchmarks/tree_tune.py`)."""
    R, N = depth.shape
    H, DK, DV = state.shape[1], state.shape[2], state.shape[3]
    assert N <= MAX_TREE and above.stride(2) == 1 and state.stride(3) == 1 and state.stride(2) == DV
    assert DV & (DV - 1) == 0
    raw = torch.empty(R * N, H * DV, dtype=torch.float32, device=z.device)
    d = torch.empty(R, H, N, DV, dtype=torch.float32, device=z.device)
    G = torch.empty(R, H, N, dtype=torch.float32, device=z.device)
    assert INTERPRETED or DV >= 64, "the tree kernel's splits take 64 value columns a head at least"
    if split is not None:
        kernel, fixed = _tree_delta_kernel, split
    elif INTERPRETED:  # (no timer to autotune with)
        kernel, fixed = _tree_delta_kernel, dict(BLOCK_V=min(DV, 32), BLOCK_K=key_chunk(DK), num_warps=4)
    else:
        kernel, fixed = _tree_delta, dict(BLOCK_K=key_chunk(DK))
    assert DK % fixed["BLOCK_K"] == 0 and fixed["BLOCK_K"] >= 16 and fixed.get("BLOCK_V", 16) <= DV, fixed
    NP = max(16, triton.next_power_of_2(N - 1))  # (the nodes past the root)
    kernel[lambda meta: (R, H, triton.cdiv(DV, meta["BLOCK_V"]))](
        state, slots, slots.stride(0), prefix, mixed, b, a, b.stride(0), A_log, dt_bias, raw, above, above.stride(0),
        above.stride(1), d, G, state.stride(0), state.stride(1), H, H // num_k_heads, num_k_heads * DK,
        2 * num_k_heads * DK, mixed.shape[1], N, triton.next_power_of_2(R), DK=DK, DV=DV,
        NP=NP, LOG_NP=NP.bit_length() - 1, SOLVE="tf32x3" if z.dtype == torch.float32 else "tf32", **fixed)
    return gated_norm(raw, z, norm_weight, eps, H), d, G


@triton.jit
def _commit_state_kernel(State, Slots, stride_slots, Prefix, Mixed, Dbuf, Gbuf, Mask, stride_mask_r, stride_mask_q,
                         Nodes, stride_slot, stride_head, HV, REPEAT, KEY_DIM, C, N,
                         DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, DK)
    end = tl.load(Nodes + r).to(tl.int32)
    Ge = tl.load(Gbuf + (r * HV + h) * N + end)
    base = State + tl.load(Slots + r * stride_slots).to(tl.int64) * stride_slot + h * stride_head
    keep = tl.load(Prefix + r) != 0
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    ptrs = base + dk[:, None] * DV + dv[None, :]
    new = tl.exp(Ge) * tl.where(keep, tl.load(ptrs), 0.0)
    for c0 in range(0, N, CHUNK):  # the nodes CHUNK at a time (a tile of every node would not fit in registers)
        i = c0 + tl.arange(0, CHUNK)
        valid = i < N
        on_path = tl.load(Mask + r * stride_mask_r + end * stride_mask_q + i, mask=valid, other=0) != 0
        G = tl.load(Gbuf + (r * HV + h) * N + i, mask=valid, other=0.0)
        k = tl.load(Mixed + (r * N + i[:, None]) * C + KEY_DIM + (h // REPEAT) * DK + dk[None, :],
                    mask=valid[:, None], other=0.0)
        k = _unit_rows(k, 1.0) * tl.where(on_path, tl.exp(tl.where(on_path, Ge - G, 0.0)), 0.0)[:, None]
        d = tl.load(Dbuf + ((r * HV + h) * N + i[:, None]) * DV + dv[None, :], mask=valid[:, None], other=0.0)
        new += tl.dot(tl.trans(k), d, input_precision=PRECISION)
    tl.debug_barrier()
    tl.store(ptrs, new)


@triton.jit
def _commit_window_kernel(Window, Slots, stride_slots, Prefix, X, stride_x, Parents, Nodes, stride_slot, N, C,
                          K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    j = tl.arange(0, KP)  # window columns, oldest first
    src = tl.load(Nodes + r).to(tl.int32)
    srcs = tl.zeros([KP], dtype=tl.int32)
    for lag in tl.static_range(K - 1):  # column K - 2 - lag holds the input `lag` tokens back
        srcs = tl.where(j == K - 2 - lag, src, srcs)
        src = tl.where(src >= 0, tl.load(Parents + r * N + tl.maximum(src, 0)), src - 1)
    base = Window + tl.load(Slots + r * stride_slots).to(tl.int64) * stride_slot + c[:, None] * (K - 1)
    keep = tl.load(Prefix + r) != 0
    col = j[None, :] < K - 1
    from_x = tl.load(X + (r * N + tl.maximum(srcs, 0))[None, :] * stride_x + c[:, None],
                     mask=ok[:, None] & col & (srcs >= 0)[None, :], other=0.0)
    from_window = tl.load(base + tl.maximum(K - 1 + srcs, 0)[None, :], mask=ok[:, None] & col & (srcs < 0)[None, :],
                          other=0.0)
    from_window = tl.where(keep, from_window, tl.zeros_like(from_window))
    new = tl.where((srcs >= 0)[None, :], from_x.to(Window.dtype.element_ty), from_window)
    tl.debug_barrier()
    tl.store(base + j[None, :], new, mask=ok[:, None] & col)


def tree_commit(state: torch.Tensor, window: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor,
                mixed: torch.Tensor, x: torch.Tensor, d: torch.Tensor, G: torch.Tensor, above: torch.Tensor,
                parents: torch.Tensor, nodes: torch.Tensor, weight_K: int, num_k_heads: int) -> None:
    """After a verified tree: each request's slot takes the state and window at the end of its accepted
    path, node nodes[r]: exp(G_end) S0 + sum over the path of exp(G_end - G_i) k_i d_i^T, and the path's
    last K - 1 convolution inputs."""
    R, H, N, DV = d.shape
    DK = state.shape[2]
    nodes = nodes.contiguous()
    block_v = min(DV, 32)
    _commit_state_kernel[(R, H, triton.cdiv(DV, block_v))](
        state, slots, slots.stride(0), prefix, mixed, d, G, above, above.stride(0), above.stride(1), nodes,
        state.stride(0), state.stride(1), H, H // num_k_heads, num_k_heads * DK, mixed.shape[1], N,
        DK=DK, DV=DV, CHUNK=max(16, min(32, triton.next_power_of_2(N))), BLOCK_V=block_v, num_warps=4)
    C = window.shape[1]
    block_c = 256
    _commit_window_kernel[(R, triton.cdiv(C, block_c))](
        window, slots, slots.stride(0), prefix, x, x.stride(0), parents, nodes, window.stride(0), N, C,
        K=weight_K, KP=triton.next_power_of_2(weight_K - 1), BLOCK_C=block_c)
