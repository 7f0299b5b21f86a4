"""Runs the DFlash drafter for a batch of requests: append pending context, propose one block each.

Host side (`prepare`) lays each request's pending target features out in a padded [R, C, K*D]
buffer (padding rows go to a scratch cache slot); the device side (`logits`) is shape-static, so
the speculative step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import COLUMNS, sampling_columns
from ddtree.engine.sequence import Sequence
from ddtree.speculative.context import context_of
from ddtree.models.dflash import DFlashDrafter
from ddtree.ops.attention import pack_rows, uniform_batch


@dataclass(slots=True)
class StepInputs:
    """Everything a speculative step reads on the device, one row per request."""
    roots: torch.Tensor  # [R] last committed token (the block's first token, the tree's root)
    starts: torch.Tensor  # [R] num_cached: the root's position
    block_tables: torch.Tensor  # [R, P] page ids
    ctx_feats: torch.Tensor  # [R, C, K*D] target features not yet in the drafter cache (padded)
    ctx_pos: torch.Tensor  # [R, C] their positions
    ctx_slots: torch.Tensor  # [R, C] their cache slots (padding: the scratch slot)
    draw: torch.Tensor  # [R, COLUMNS] sampling settings (engine/sampler.py `sampling_columns`)
    state_slots: torch.Tensor | None = None  # [R] hybrid targets: each request's recurrent-state slot


def pending_count(seq: Sequence) -> int:
    """Rows of target features the request holds pending."""
    return context_of(seq).pending_count()


def pending_rows(seqs: list[Sequence]) -> torch.Tensor | None:
    """The requests' pending features [T, K*D], in order (None: nothing pending). An AR burst keeps
    (buffer, i, n) entries, not a view per request: cutting 2R views after every burst adds host time to
    every AR step at a large batch, where bursts are a few steps long. Nor are they cut here: each
    distinct source (a burst's buffer, a tensor) goes into one cat and every row comes out of it in one
    gather, where a view per entry and a cat of them all pay host time per entry, and short bursts leave
    dozens of entries a request while requests wait for a slot. Where the
    rows wanted are a small share of their buffers' (the engine storing the few requests whose context
    piled up), the views again: the cat would copy whole buffers for a few rows."""
    assert not any(has_gap(s) for s in seqs), "a gap in the drafter context: refeed it first"
    entries = [f for s in seqs for f in context_of(s).pending]
    if not entries:
        return None
    sources, base = [], {}  # the distinct sources, and where each one's rows start in their cat
    firsts, counts, stacked = [], [], 0  # each entry's first row in the cat and its row count
    for f in entries:
        src, i, n = f if isinstance(f, tuple) else (f, 0, f.shape[0])
        if id(src) not in base:  # (ids are unique here: every source is alive until the end)
            base[id(src)] = stacked
            sources.append(src.flatten(0, 1) if src.dim() == 3 else src)
            stacked += sources[-1].shape[0]
        firsts.append(base[id(src)] + i * (src.shape[1] if src.dim() == 3 else 0))
        counts.append(n)
    total = sum(counts)
    if 4 * total < stacked:
        return torch.cat([f[0][f[1], :f[2]] if isinstance(f, tuple) else f for f in entries])
    flat = torch.cat(sources) if len(sources) > 1 else sources[0]
    if total == stacked and len(sources) == len(entries):
        return flat  # (each source whole, once, in order: the cat is the answer)
    # row r of entry e is flat[firsts[e] + r]: one index built from per-entry lists, not per-row ones
    first, count = torch.tensor([firsts, counts], device=flat.device)
    shift = torch.repeat_interleave(first - (count.cumsum(0) - count), count, output_size=total)
    return flat[shift + torch.arange(total, device=flat.device)]


STORE_WARM_ROWS = 160  # pending rows a request may hold at a store: auto.PENDING_ROWS (128) and a burst's


def store_shape(rows: int) -> int:
    """`rows` rounded up to a store's shape: a multiple of 16 up to 128, then one of 4 shapes an octave
    (at most a quarter more rows). A product over a row count cuBLAS has not seen yet costs milliseconds of
    host time; padded, stores come in few shapes, each run once ahead of serving
    (`DraftRunner.warm_stores`)."""
    step = max(16, 1 << max(0, (rows - 1).bit_length() - 3))
    return -(-rows // step) * step


def has_gap(seq: Sequence) -> bool:
    """Whether some of the request's cached positions were never read out for the drafter."""
    ctx = seq.draft_context
    return seq.num_cached > seq.num_prefix_drafted if ctx is None else ctx.has_gap(seq.num_cached)


def gap_rows(seq: Sequence) -> int:
    """Rows of the request's context a switch would feed again, an open gap's included."""
    return context_of(seq).gap_rows_at(seq.num_cached)


def gaps(seqs: list[Sequence]) -> list[tuple[Sequence, int, int, int]]:
    """Every (request, index in its pending entries, start, n) of a gap, in order (open ones closed)."""
    for s in seqs:
        context_of(s).close_gap(s.num_cached)
    return [(s, j, start, n) for s in seqs for j, start, n in context_of(s).gaps()]


class DraftRunner:
    def __init__(self, drafter: DFlashDrafter, target: ModelRunner, num_slots: int, page_size: int,
                 device: torch.device, dtype: torch.dtype, scratch_slot: int, use_triton: bool = False):
        self.drafter, self.target, self.page_size, self.device = drafter, target, page_size, device
        cfg = drafter.dcfg.model
        # The drafter's own paged cache, addressed by the target's page tables (same slot space).
        self.kv_cache = torch.zeros(2, cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        self.bind_cache()
        self.block_size = drafter.dcfg.block_size
        self.layer_ids = drafter.dcfg.target_layer_ids
        self.scratch_slot = scratch_slot
        self.use_triton = use_triton
        self.heads_per_kv = cfg.num_heads // cfg.num_kv_heads
        self.feat_dim = drafter.fc.in_features
        self.dtype = dtype
        self.hybrid_target = target.cfg.is_hybrid  # (its requests hold recurrent-state slots)

    def bind_cache(self) -> None:
        """Points the drafter's attention layers at this runner's cache (again: see `ModelRunner.bind_cache`)."""
        for i, layer in enumerate(self.drafter.layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]

    def prepare(self, seqs: list[Sequence], ctx_rows: int | None = None) -> StepInputs:
        """Host -> device inputs. Consumes each request's pending features (the drafter cache will hold
        them after the step). `ctx_rows` pads the context to a fixed width (CUDA graphs)."""
        counts = []
        for seq in seqs:
            n = seq.num_cached - context_of(seq).stored
            assert n == pending_count(seq), "drafter context out of sync"
            counts.append(n)
        R, C, ps = len(seqs), max(ctx_rows or 0, max(counts), 1), self.page_size
        # Positions and slots as host lists and the features in one cat + one indexed write: a few tensor
        # ops per step instead of a dozen per request (the host cost of a large batch).
        pos, slots, pending, rows = [], [], pending_rows(seqs), []
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            table, new = seq.block_table, range(context_of(seq).stored, seq.num_cached)
            pos += [*new] + [0] * (C - n)
            slots += [table[q // ps] * ps + q % ps for q in new] + [self.scratch_slot] * (C - n)
            rows += range(i * C, i * C + n)
            context_of(seq).take(seq.num_cached)
        feats = torch.zeros(R * C, self.feat_dim, dtype=self.dtype, device=self.device)
        if pending is not None:
            feats[torch.tensor(rows, device=self.device)] = pending
        pos_slots = torch.tensor([pos, slots], dtype=torch.long).view(2, R, C).to(self.device)
        draw = sampling_columns([s.params for s in seqs], [s.seed for s in seqs])
        slots = [[s.state_slot for s in seqs]] if self.hybrid_target else []  # (hybrid targets)
        req = pack_rows([s.block_table for s in seqs],
                        [[s.last_token for s in seqs], [s.num_cached for s in seqs]] + draw + slots,
                        self.scratch_slot // self.page_size, self.device)
        width = 2 + COLUMNS + len(slots)  # (the page tables follow)
        return StepInputs(req[:, 0], req[:, 1], req[:, width:], feats.view(R, C, -1), pos_slots[0], pos_slots[1],
                          req[:, 2:2 + COLUMNS], req[:, 2 + COLUMNS] if slots else None)

    def store_chunks(self, chunks: list[tuple[Sequence, int]], feats: torch.Tensor) -> None:
        """Prompt chunks' target features [sum of n, K*D] (an eager prefill's), into the drafter cache."""
        for (seq, _), f in zip(chunks, feats.split([n for _, n in chunks])):
            context_of(seq).add(f)
        self.store_pending([seq for seq, _ in chunks])

    def mark_stored(self, seqs: list[Sequence]) -> None:
        """The requests' context is in the drafter cache up to their cached tokens (a prefill graph
        stored it)."""
        for seq in seqs:
            assert not context_of(seq).pending, "drafter context rows left behind a prefill"
            context_of(seq).take(seq.num_cached)

    def store_pending(self, seqs: list[Sequence]) -> None:
        """Moves every request's pending target features into the drafter cache now, outside a draft
        (an AR stretch's, or a prompt's after an eager prefill: more rows than a draft's context).
        Positions and slots are computed on the device: a prompt may have thousands of rows."""
        counts = [s.num_cached - context_of(s).stored for s in seqs]
        total = sum(counts)
        assert total == sum(pending_count(s) for s in seqs), "drafter context out of sync"
        if not total:
            return
        dev = self.device
        req = pack_rows([s.block_table for s in seqs], [[context_of(s).stored for s in seqs], counts],
                        self.scratch_slot // self.page_size, dev)
        firsts, n = req[:, 0], req[:, 1]
        row = torch.repeat_interleave(torch.arange(len(seqs), device=dev), n, output_size=total)
        pos = torch.arange(total, device=dev) - (n.cumsum(0) - n)[row] + firsts[row]
        ps = self.page_size
        slots = req[:, 2:][row, pos // ps] * ps + pos % ps  # (one page-table entry per row, not a table copy)
        feats, pad = pending_rows(seqs), store_shape(total) - total
        if pad:  # (padding rows: zero features, written to the scratch slot)
            feats = torch.cat([feats, feats.new_zeros(pad, feats.shape[1])])
            pos = torch.cat([pos, pos.new_zeros(pad)])
            slots = torch.cat([slots, slots.new_full((pad,), self.scratch_slot)])
        self.drafter.store_context(feats, pos, slots, self.use_triton)
        for seq in seqs:
            context_of(seq).take(seq.num_cached)

    @torch.inference_mode()
    def warm_stores(self, max_batch: int, max_chunk: int) -> None:
        """Every store shape run once, on the scratch slot (`store_shape`), up to the most rows a store
        can have: `max_batch` requests' pending rows at a switch (auto.PENDING_ROWS and a burst's,
        STORE_WARM_ROWS), or a prompt chunk of `max_chunk` rows after an eager prefill."""
        most_rows, shapes, n = max(max_batch * STORE_WARM_ROWS, max_chunk), [], 1
        while not shapes or shapes[-1] < most_rows:
            shapes.append(store_shape(n))
            n = shapes[-1] + 1
        for n in shapes:
            self.store_context(torch.zeros(n, self.feat_dim, dtype=self.dtype, device=self.device),
                               torch.zeros(n, dtype=torch.long, device=self.device),
                               torch.full((n,), self.scratch_slot, dtype=torch.long, device=self.device))

    def store_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Target features [T, K*D] of context rows at `positions` into the drafter cache at `slots`
        (auto's own AR step's, which stores its row: the CPU path); device ops only."""
        self.drafter.store_context(feats, positions, slots, self.use_triton)

    def logits(self, inp: StepInputs) -> torch.Tensor:
        """Draft logits [R, B-1, V] for depths 1..B-1 (the model's dtype; float32 for a drafter with an
        output multiplier or a soft cap); device ops only.

        Each request's block is [root, MASK x (B-1)] at positions start .. start+B-1, attending to its
        whole drafter context and (non-causally) to the whole block."""
        B, dc = self.block_size, self.drafter.dcfg
        R = inp.roots.shape[0]
        block_ids = torch.full((R, B), dc.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[:, 0] = inp.roots
        embeds = self.target.embed(block_ids.flatten()) * dc.input_embedding_scale
        full = torch.ones(R, B, B, dtype=torch.bool, device=self.device)
        batch = uniform_batch(inp.block_tables, inp.starts, B, full, self.page_size, self.use_triton,
                              self.heads_per_kv, self.drafter.dcfg.model.num_kv_heads)
        block_pos = (inp.starts[:, None] + torch.arange(B, device=self.device)).flatten()
        hidden = self.drafter(embeds, block_pos, inp.ctx_feats.flatten(0, 1), inp.ctx_pos.flatten(),
                              inp.ctx_slots.flatten(), batch)
        return self.drafter.logits(hidden.view(R, B, -1)[:, 1:], self.target.logits, float32=False)

