"""Triton kernels for the attention entry point: paged attention with causal or per-request masks,
the KV store and the KV compaction after a tree verify.

One attention kernel serves decode (q = 1), tree verify (q = budget + 1, ancestor mask), the
drafter block (full mask) and prefill (causal). A program handles BLOCK_M query tokens of one
request for all query heads that share one KV head (GQA), so each K/V tile read from the paged
cache is used by the whole head group. Every input is a device tensor of fixed shape, so the
launch can be captured in a CUDA graph. Under TRITON_INTERPRET=1 the kernels run on the CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ddtree.ops.attention import AttentionBatch  # (the metadata these kernels read)


def plan_blocks(q_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    req, qs = [], []
    for r, n in enumerate(q_lens):
        for s in range(0, n, block_m):
            req.append(r)
            qs.append(s)
    return req, qs


# The widest row of a decode-width batch: a verify tree of budget 64 plus its root. Wider rows are prefill
# (128-row tiles, no key splits); a budget-64 tree treated as prefill walks the keys serially in ~10 programs
# a layer, more than twice as slow a verify as the split decode tiles.
DECODE_MAX_Q = 65


def choose_block_m(max_q: int, group: int) -> int:
    # tl.dot needs >= 16 rows: BLOCK_M tokens x (group padded to a power of two) heads. Up to 64 rows
    # for decode widths (a verify tree, the drafter block): more programs, each splitting the keys, which
    # run faster than 128-row tiles there (`benchmarks/attention_tune.py`). Prefill fills the GPU with
    # 128-row tiles.
    g = triton.next_power_of_2(group)
    bm = max(1, 16 // g)
    most = 128 if max_q > DECODE_MAX_Q else 64
    while bm < max_q and bm * g < most:
        bm *= 2
    return bm


@triton.jit
def _channels_ok(d, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """Which of the padded channels d = 0 .. HEAD_DIM_P - 1 are the head's: a constant all-true mask at a
    power-of-two width, which the compiler folds away (the loads and stores compile as unmasked ones)."""
    if HEAD_DIM_P == HEAD_DIM:
        ok = tl.full([HEAD_DIM_P], 1, tl.int1)
    else:
        ok = d < HEAD_DIM
    return ok


# (Not specialized on the page-table width: Triton would compile a variant for each batch whose widest
# table is a multiple of 16 pages, mid-run in an eager prefill or refeed, where a compile stalls the step.)
@triton.jit(do_not_specialize=["stride_bt", "stride_mr", "stride_mi"])
def _paged_attention_kernel(
        Q, K, V, Out, BlockTables, PrefixLens, QLens, QStarts, BlkReq, BlkQ, Mask,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_bt,
        stride_mr, stride_mi, scale, Part, PartML,
        PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr):
    # A program takes ROWS of a query block's BLOCK_M x GROUP_P rows (tokens x the KV head's query
    # heads): all of them, or for wide heads a slice (choose_rows), SLICES programs sharing the block.
    SLICES: tl.constexpr = BLOCK_M * GROUP_P // ROWS
    pid = tl.program_id(0)
    kvh = tl.program_id(1) // SLICES
    sp = tl.program_id(2)  # which slice of the keys (flash-decoding split; 0 of 1 when not split)
    r = tl.load(BlkReq + pid)
    q0 = tl.load(BlkQ + pid)
    prefix = tl.load(PrefixLens + r)
    qlen = tl.load(QLens + r)
    qstart = tl.load(QStarts + r)
    kv_len = prefix + qlen

    rows = tl.program_id(1) % SLICES * ROWS + tl.arange(0, ROWS)
    tok = q0 + rows // GROUP_P  # query index within the request
    g = rows % GROUP_P
    head = kvh * GROUP + g
    row_ok = (tok < qlen) & (g < GROUP)
    # Channels padded to a power of two: the padding loads as zeros (adding nothing to q . k, and
    # giving zero output columns) and is never stored.
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = _channels_ok(d, HEAD_DIM, HEAD_DIM_P)
    q = tl.load(Q + (qstart + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], tl.float32)
    # Causal rows never look past their own token; masked rows are bounded by the request length.
    if HAS_MASK:
        end = kv_len
    else:
        end = tl.minimum(kv_len, prefix + q0 + BLOCK_M)
    # This program's slice of the keys, whole BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, end)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(BlockTables + r * stride_bt + n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE  # int64: slot * row stride passes 2^31 in big caches
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        j = n - prefix  # index among the new tokens (negative: the cached prefix)
        if HAS_MASK:
            new_ok = tl.load(Mask + r * stride_mr + tok[:, None] * stride_mi + j[None, :],
                             mask=row_ok[:, None] & (j[None, :] >= 0) & n_ok[None, :], other=0)
            allowed = (j[None, :] < 0) | (new_ok != 0)
        else:
            allowed = j[None, :] <= tok[:, None]
        allowed = allowed & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
        tl.store(Out + (qstart + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partial results [T, H, SPLITS, D] and (max, sum) [T, H, SPLITS, 2], merged by _combine
        idx = ((qstart + tok) * NUM_HEADS + head).to(tl.int64) * SPLITS + sp
        tl.store(Part + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PartML + idx * 2, m_i, mask=row_ok)
        tl.store(PartML + idx * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(Out, Part, PartML, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_P: tl.constexpr, SPLITS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    base = (t * NUM_HEADS + h).to(tl.int64) * SPLITS
    s = tl.arange(0, SPLITS)
    m = tl.load(PartML + (base + s) * 2)
    l = tl.load(PartML + (base + s) * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = _channels_ok(d, HEAD_DIM, HEAD_DIM_P)
    acc = tl.load(Part + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l * w, 0), 1e-30)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


SHARED_BYTES = 220 * 2**10  # a program's shared memory: sm90 gives a block up to 227 KB


def _fits(rows: int, block_n: int, head_dim: int, itemsize: int) -> bool:
    """Whether a program's operands fit in shared memory: its rows of q, a K and a V tile, the float32
    scores (head_dim: the padded width the kernel's tiles take)."""
    return (rows * head_dim + 2 * block_n * head_dim) * itemsize + rows * block_n * 4 <= SHARED_BYTES


def choose_rows(rows: int, head_dim: int, itemsize: int) -> int:
    """Query rows a program, of a block's `rows` (tile height x padded head group): all of them, halved
    (down to tl.dot's 16) only while even 16-key tiles would not fit beside them. MLA's 576 channels (1024
    padded) in bfloat16 take 64 rows a program; head widths up to 256 keep whole blocks of up to 128 rows
    (every block of a group of at most 128 heads)."""
    while rows > 16 and not _fits(rows, 16, head_dim, itemsize):
        rows //= 2
    return rows


def choose_block_n(rows: int, head_dim: int, itemsize: int) -> int:
    """Keys per tile: 64, halved while a program's operands would not fit in shared memory; head_dim 256
    in float32 (hybrid Qwen3.5 models) takes 32."""
    bn = 64
    while bn > 16 and not _fits(rows, bn, head_dim, itemsize):
        bn //= 2
    return bn


# Of a thread's 255 registers, the most a program's tiles may take at 4 warps (the rest: addresses, masks,
# softmax state); and the query rows of one warp group's tensor-core tile.
TILE_REGISTERS = 128
WARP_GROUP_ROWS = 64


def choose_warps(rows: int, block_n: int, head_dim: int, itemsize: int) -> int:
    """Warps a program, 4 or 8. Its tiles (the rows of q, a K and a V tile, the float32 accumulator and
    scores) over 4 warps' threads give its registers a thread; 8 warps halve that where it passes
    TILE_REGISTERS and the program has a warp group's rows or more. A program of fewer rows keeps 4 warps
    even where it spills: 8 warps would only split its few rows' products further
    (docs/performance-history.md has the timings behind the rule)."""
    tiles = (rows + 2 * block_n) * head_dim * itemsize + rows * (head_dim + block_n) * 4
    registers = tiles // (4 * 32 * 4)
    return 8 if registers > TILE_REGISTERS and rows >= WARP_GROUP_ROWS else 4


def choose_splits(num_blocks: int, num_kv_heads: int, max_q: int) -> int:
    """Split the keys across programs when the grid alone cannot fill the GPU (decode, verify)."""
    if max_q > DECODE_MAX_Q:
        return 1
    want = 2 * 132 // max(1, num_blocks * num_kv_heads)
    return max(1, min(16, triton.next_power_of_2(want) if want > 1 else 1))


def variant_shapes(max_tokens: int, group: int, num_kv_heads: int) -> list[list[int]]:
    """Eager batches (each a list of rows' token counts) of at most `max_tokens` tokens that between them
    compile every kernel variant (tile height, key splits) such a batch can pick: warmed up ahead of
    serving, no batch compiles one mid-run. Per tile height, a longest row as short as picks it, then
    one-token rows (the fewest tokens a tile) added until the splits, which only shrink as the tiles
    grow, reach one."""
    shortest: dict[int, int] = {}  # tile height -> the shortest longest row that picks it
    for q in range(min(max_tokens, DECODE_MAX_Q + 1), 0, -1):  # (one past the decode widths: prefill tiles)
        shortest[choose_block_m(q, group)] = q
    shapes = []
    for bm, q in shortest.items():
        seen = set()
        for extra in range(max_tokens - q + 1):  # one-token rows besides the longest
            splits = choose_splits(-(-q // bm) + extra, num_kv_heads, q)
            if splits not in seen:
                seen.add(splits)
                shapes.append([q] + [1] * extra)
            if splits == 1:
                break
    return shapes


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: "AttentionBatch",
                           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; caches: [slots, Hkv, D]. The new tokens' K/V must already be stored."""
    T, H, D = q.shape
    D_P = triton.next_power_of_2(D)  # (the kernels' tiles: any head width, padded with masked channels)
    Hkv = k_cache.shape[1]
    group = H // Hkv
    out = torch.empty_like(q) if out is None else out
    mask = meta.mask
    splits = meta.splits
    block_rows = meta.block_m * triton.next_power_of_2(group)
    rows = choose_rows(block_rows, D_P, q.element_size())
    block_n = choose_block_n(rows, D_P, q.element_size())
    grid = (meta.blk_req.shape[0], Hkv * (block_rows // rows), splits)
    if splits > 1:
        part = torch.empty(T, H, splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, H, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = part_ml = out
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.prefix_lens, meta.q_lens, meta.q_starts,
        meta.blk_req, meta.blk_q, mask.view(torch.uint8) if mask is not None else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        meta.block_tables.stride(0), mask.stride(0) if mask is not None else 0,
        mask.stride(1) if mask is not None else 0, scale, part, part_ml,
        PAGE=meta.page_size, GROUP=group, GROUP_P=triton.next_power_of_2(group), HEAD_DIM=D, HEAD_DIM_P=D_P,
        BLOCK_M=meta.block_m, ROWS=rows, BLOCK_N=block_n, HAS_MASK=mask is not None,
        # fp32 models get exact products (tests, parity); tf32 would round them like bf16 does.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=splits, NUM_HEADS=H,
        num_warps=choose_warps(rows, block_n, D_P, q.element_size()))
    if splits > 1:
        _combine_kernel[(T, H)](out, part, part_ml, out.stride(0), out.stride(1), NUM_HEADS=H, HEAD_DIM=D,
                                HEAD_DIM_P=D_P, SPLITS=splits)
    return out


@triton.jit
def _store_kv_kernel(K, V, KC, VC, Slots, stride_kt, stride_vt, stride_cs, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    tl.store(KC + slot * stride_cs + offs, tl.load(K + t * stride_kt + offs, mask=ok), mask=ok)
    tl.store(VC + slot * stride_cs + offs, tl.load(V + t * stride_vt + offs, mask=ok), mask=ok)


def triton_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """K and V of T new tokens ([T, Hkv, D], contiguous rows) into their cache slots, one launch."""
    T = k.shape[0]
    row = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(T, row), v.reshape(T, row)
    _store_kv_kernel[(T,)](k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0), v2.stride(0), k_cache.stride(0),
                           ROW=row, BLOCK=triton.next_power_of_2(row))


@triton.jit
def _move_kv_kernel(Cache, Src, Dst, n_moves, stride_layer, stride_s, ROW: tl.constexpr, BLOCK: tl.constexpr):
    layer = tl.program_id(0)  # K and V of every layer: the cache is viewed as [2 * layers, slots, row]
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    base = Cache + layer.to(tl.int64) * stride_layer
    for i in range(n_moves):  # in order: a node's source index is never below an earlier destination
        src = tl.load(Src + i).to(tl.int64)
        dst = tl.load(Dst + i).to(tl.int64)
        tl.store(base + dst * stride_s + offs, tl.load(base + src * stride_s + offs, mask=ok), mask=ok)


def triton_move_kv(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache: [2, layers, slots, Hkv, D]; copies slot src[i] -> dst[i] in every layer, in order."""
    two, layers, slots = kv_cache.shape[:3]
    flat = kv_cache.view(two * layers, slots, -1)
    row = flat.shape[-1]
    _move_kv_kernel[(two * layers,)](flat, src, dst, src.shape[0], flat.stride(0), flat.stride(1),
                                     ROW=row, BLOCK=triton.next_power_of_2(row))
