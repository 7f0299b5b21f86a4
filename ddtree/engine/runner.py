"""Runs the target model over one step's tokens: builds the step's inputs and attention metadata.

A step is a list of (request, n) pairs: each request feeds its next n uncached tokens, which are
written to the paged cache at positions num_cached .. num_cached + n - 1.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ddtree.config import EngineConfig, ModelConfig
from ddtree.engine.kv_cache import allocate_kv_cache, allocate_state_cache, pages_for_memory
from ddtree.engine.sequence import Sequence
from ddtree.models.transformer import CausalLM
from ddtree.ops.attention import make_batch, pack_rows, uniform_batch


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, engine_cfg: EngineConfig,
                 device: torch.device, dtype: torch.dtype, logit_rows: int = 0, tp=None):
        """`logit_rows`: the most rows of logits one forward produces; they and a full prefill chunk's
        activations are kept out of the GPU memory the KV cache takes. `tp` (parallel/workers.py): the
        model is rank 0's shard, and every forward and cache operation is mirrored to the other ranks."""
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.page_size = engine_cfg.page_size
        self.max_num_batched_tokens = engine_cfg.max_num_batched_tokens  # (a forward's activations are sized for it)
        self.use_triton = engine_cfg.use_triton(device)
        self.heads_per_kv = cfg.num_heads // cfg.num_kv_heads
        self.kv_parts = 1 if cfg.mla is not None else 2  # (MLA caches one vector a token, its keys and values)
        self.num_pages = engine_cfg.num_pages or self._pages_from_memory(engine_cfg, logit_rows)
        # One page more than the allocator hands out: the scratch page, where padding rows of a
        # fixed-shape (CUDA graph) step write their K/V.
        self.kv_cache = allocate_kv_cache(len(cfg.attention_layers), self.num_pages + 1, self.page_size,
                                          cfg.num_kv_heads, cfg.head_dim, dtype, device, self.kv_parts)
        self.scratch_page = self.num_pages
        self.num_slots = (self.num_pages + 1) * self.page_size
        # Hybrid models: a recurrent-state slot per request that may run (engine/kv_cache.py). One slot more:
        # the scratch slot, which the padding rows of a graphed step advance; then the prefix cache's snapshots.
        self.state_cache = allocate_state_cache(cfg, self._state_slots(engine_cfg), dtype, device) if cfg.is_hybrid \
            else None
        self.scratch_state_slot = engine_cfg.max_num_seqs
        self.snapshot_slots = list(range(engine_cfg.max_num_seqs + 1, self._state_slots(engine_cfg)))
        self.bind_cache()
        self.tp = tp
        if tp is not None:  # the workers build the same caches over their shards
            self.tp_id = tp.add_runner(self, dataclasses.replace(engine_cfg, num_pages=self.num_pages))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, taps: list[int] | None):
        """The target's forward (`CausalLM.forward`), run by every tensor-parallel rank."""
        if self.tp is None:
            return self.model(input_ids, positions, batch, taps)
        self.tp.call("forward", self.tp_id, input_ids, positions, batch, taps)
        with self.tp.guard():
            return self.model(input_ids, positions, batch, taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of hidden states [T, D] (the target's, or a drafter's through the target's
        head); every rank computes its rows when the vocabulary is split (parallel/shard.py)."""
        if self.tp is None or self.model.lm_head.group is None:
            return self.model.compute_logits(hidden)
        self.tp.call("logits", self.tp_id, hidden)
        with self.tp.guard():
            return self.model.compute_logits(hidden)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's token embeddings of `ids` (a drafter's block inputs), as `logits`."""
        embed_tokens = self.model.model.embed_tokens
        if self.tp is None or embed_tokens.group is None:
            return embed_tokens(ids)
        self.tp.call("embed", self.tp_id, ids)
        with self.tp.guard():
            return embed_tokens(ids)

    def all_reduce(self, x: torch.Tensor, times: int = 1) -> torch.Tensor:
        """Sums `x` over the tensor-parallel ranks `times` times, as the row-parallel layers of a step do
        (the collectives' share of a step is measured with it: bench/steps.py)."""
        from ddtree.models.transformer import RowParallelLinear
        group = next((m.group for m in self.model.modules() if isinstance(m, RowParallelLinear)), None)
        if group is None:
            return x
        if self.tp is not None:
            self.tp.call("all_reduce", self.tp_id, x, times)
        with self.tp.guard() if self.tp is not None else contextlib.nullcontext():
            for _ in range(times):
                torch.distributed.all_reduce(x, group=group)
        return x

    def bind_cache(self) -> None:
        """Points the model's attention layers at this runner's KV cache (again: `LLM.switch_mode` keeps
        engines of several modes over one model; CUDA graphs hold their own engine's cache anyway)."""
        layers = self.model.model.layers
        for i, index in enumerate(self.cfg.attention_layers):
            layers[index].self_attn.k_cache = self.kv_cache[0, i]
            layers[index].self_attn.v_cache = self.kv_cache[-1, i]  # (MLA: the K cache again)
        for i, index in enumerate(self.cfg.linear_layers):
            layers[index].linear_attn.conv_state = self.state_cache[0][i]
            layers[index].linear_attn.recurrent_state = self.state_cache[1][i]

    def _state_slots(self, ec: EngineConfig) -> int:
        """Hybrid models: the requests' state slots, the scratch slot and the prefix cache's snapshots."""
        return ec.max_num_seqs + 1 + ec.state_snapshots(self.cfg.is_hybrid)

    def _state_bytes(self, ec: EngineConfig) -> int:
        """Hybrid models: the recurrent-state cache's size (`allocate_state_cache`), 0 for dense ones."""
        if not self.cfg.is_hybrid:
            return 0
        lin, slots = self.cfg.linear, self._state_slots(ec)
        per_slot = lin.conv_dim * (lin.conv_kernel - 1) * self.dtype.itemsize + \
            lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4
        return len(self.cfg.linear_layers) * slots * per_slot

    def _pages_from_memory(self, ec: EngineConfig, logit_rows: int) -> int:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks the allocator holds but does not use are free for the cache
            free, total = torch.cuda.mem_get_info(self.device)
            # A step's logits in the model dtype plus their fp32 copy (sampling, AR read-out), twice:
            # once in the CUDA graphs' pool, once in eager steps' cached blocks; and a prefill chunk's
            # widest activation (the MLP's gate|up) in fp32.
            activations = 2 * logit_rows * self.cfg.vocab_size * (4 + self.dtype.itemsize) + \
                ec.max_num_batched_tokens * 2 * self.cfg.intermediate_size * 4
            budget = free - (1 - ec.gpu_memory_utilization) * total - activations - self._state_bytes(ec)
        else:
            budget = ec.kv_cache_gb * 2**30
        return pages_for_memory(budget, len(self.cfg.attention_layers), self.page_size, self.cfg.num_kv_heads,
                                self.cfg.head_dim, self.dtype, self.kv_parts)

    def prepare(self, chunks: list[tuple[Sequence, int]]):
        """Inputs for feeding each request its next n uncached tokens."""
        return self._inputs([(seq, seq.num_cached, n) for seq, n in chunks])

    def _inputs(self, rows: list[tuple[Sequence, int, int]]):
        """Token ids, positions and attention metadata for feeding each request its tokens at positions
        start .. start + n - 1, (request, start, n) per row."""
        ids, pos = [], []
        for seq, start, n in rows:
            assert start + n <= len(seq)
            ids.extend(seq.tokens(start, start + n))
            pos.extend(range(start, start + n))
        batch = make_batch([s.block_table for s, _, _ in rows], [start for _, start, _ in rows],
                           [n for _, _, n in rows], None, self.page_size, self.device, self.use_triton,
                           self.heads_per_kv, self.cfg.num_kv_heads,
                           [s.state_slot for s, _, _ in rows] if self.cfg.is_hybrid else None)
        ids_pos = torch.tensor([ids, pos], dtype=torch.long).to(self.device)  # one host->device copy
        return ids_pos[0], ids_pos[1], batch

    @torch.inference_mode()
    def refeed(self, rows: list[tuple[Sequence, int, int]], taps: list[int]) -> torch.Tensor:
        """The tapped layers' outputs [sum of n, len(taps) * D] at tokens already in the cache, (request,
        start, n) per row: AR steps or prefills that did not read them out (auto, speculative/auto.py), in
        forwards of at most `max_num_batched_tokens` tokens. Their K/V are not written again: the writes
        go to the scratch page, so every query attends to the cached K/V exactly as those steps left them."""
        out, part, size = [], [], 0
        for seq, start, n in rows:
            while n:
                take = min(n, self.max_num_batched_tokens - size)
                part.append((seq, start, take))
                start, n, size = start + take, n - take, size + take
                if size == self.max_num_batched_tokens:
                    out.append(self._refeed(part, taps))
                    part, size = [], 0
        if part:
            out.append(self._refeed(part, taps))
        return torch.cat(out)

    def _refeed(self, rows: list[tuple[Sequence, int, int]], taps: list[int]) -> torch.Tensor:
        input_ids, positions, batch = self._inputs(rows)
        base = self.scratch_page * self.page_size
        batch.slot_mapping = base + torch.arange(len(input_ids), device=self.device) % self.page_size
        _, tapped = self.forward(input_ids, positions, batch, taps)
        return torch.cat(tapped, dim=-1)

    @torch.inference_mode()
    def run(self, chunks: list[tuple[Sequence, int]], taps: list[int] | None = None):
        """Feeds each chunk and marks it cached. Returns the logits [len(chunks), V] (fp32) at each
        chunk's last token, and the tapped layers' outputs concatenated per token [T, len(taps) * D]."""
        input_ids, positions, batch = self.prepare(chunks)
        hidden, tapped = self.forward(input_ids, positions, batch, taps)
        last = (batch.q_starts + batch.q_lens - 1).long()
        for seq, n in chunks:
            seq.num_cached += n
        feats = torch.cat(tapped, dim=-1) if taps else None
        return self.logits(hidden[last]).float(), feats

    def verify(self, block_tables: torch.Tensor, starts: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor,
               mask: torch.Tensor, taps: list[int] | None, state_slots: torch.Tensor | None = None):
        """One target forward over a tree of N nodes per request ([R, N] tokens and depths, [R, N, N]
        ancestor mask); device ops only. Node i's K/V go to cache position start + i; its rotary
        position is start + depth. Returns logits [R, N, V] (model dtype) and features [R, N, len(taps) * D].
        Hybrid models (`state_slots`): each node's recurrent state is its ancestors' alone, kept until
        `commit_states` picks the accepted path's."""
        R, N = tokens.shape
        batch = uniform_batch(block_tables, starts, N, mask, self.page_size, self.use_triton, self.heads_per_kv,
                              self.cfg.num_kv_heads)
        batch.state_slots, batch.commit_states = state_slots, state_slots is None
        capturing = starts.is_cuda and torch.cuda.is_current_stream_capturing()
        if state_slots is not None and mask is not None and not capturing:
            # (hybrid models solve a tree with its ancestors before its descendants: a lower-triangular mask)
            assert not bool(mask.triu(1).any()), "tree nodes must follow their ancestors"
        positions = (starts[:, None] + depth).flatten()
        hidden, tapped = self.forward(tokens.flatten(), positions, batch, taps)
        # In the model dtype: greedy verification only needs the argmax (exact in bf16), and fp32
        # logits of a large batch's trees would be gigabytes; the sampler converts what it samples.
        logits = self.logits(hidden).view(R, N, -1)
        return logits, torch.cat(tapped, dim=-1).view(R, N, -1) if taps else None

    def prefill_rows(self, ids: torch.Tensor, starts: torch.Tensor, block_tables: torch.Tensor, last: torch.Tensor,
                     taps: list[int] | None):
        """A prompt chunk per request, padded to the width of `ids` [R, T] (causal, at positions starts ..
        starts + T - 1; padding tokens come after the real ones, so no real token attends to them, and
        their K/V land in the request's last page past its real tokens or in the scratch page); device
        ops only. Returns the logits (fp32) at row `last` of each request [R, V] and the features of
        every row [R, T, len(taps) * D] (an empty tensor without taps)."""
        R, T = ids.shape
        batch = uniform_batch(block_tables, starts, T, None, self.page_size, self.use_triton, self.heads_per_kv,
                              self.cfg.num_kv_heads)
        positions = (starts[:, None] + torch.arange(T, device=ids.device)).flatten()
        hidden, tapped = self.forward(ids.flatten(), positions, batch, taps)
        at = hidden.view(R, T, -1).gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        feats = torch.cat(tapped, dim=-1).view(R, T, -1) if taps else hidden.new_zeros(0)
        return self.logits(at).float(), feats

    @torch.inference_mode()
    def decode_logits(self, ids: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """AR decode, device ops only: one token per request at position `starts`. Returns [R, V] fp32."""
        return self.decode_features(ids, block_tables, starts, None)[0].float()

    def decode_features(self, ids: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor,
                        taps: list[int] | None, state_slots: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`decode_logits` in the model dtype (the sampler reads any), and the tapped layers' outputs
        [R, len(taps) * D] (None without taps). Hybrid models: the requests' `state_slots` advance."""
        batch = uniform_batch(block_tables, starts, 1, None, self.page_size, self.use_triton, self.heads_per_kv,
                              self.cfg.num_kv_heads)
        batch.state_slots = state_slots
        hidden, tapped = self.forward(ids, starts, batch, taps)
        return self.logits(hidden), torch.cat(tapped, dim=-1) if taps else None

    def commit_states(self, state_slots: torch.Tensor, nodes: torch.Tensor) -> None:
        """Hybrid models, after a verify: each request's recurrent state becomes the one its tree left at
        node nodes[r] (the last accepted one), in every linear layer."""
        if self.tp is not None:
            self.tp.call("commit_states", self.tp_id, state_slots, nodes)
        for index in self.cfg.linear_layers:
            self.model.model.layers[index].linear_attn.commit(state_slots, nodes)

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """Hybrid models: the recurrent states and convolution windows of slots `src` into slots `dst`, in
        every linear layer (the prefix cache's snapshots, taken and given back)."""
        if self.tp is not None:
            self.tp.call("copy_states", self.tp_id, src, dst)
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for cache in self.state_cache:  # [layers, slots, ...]
            cache[:, d] = cache[:, s]

    def tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Page tables [R, P] on the device (unused entries: the scratch page)."""
        return pack_rows([s.block_table for s in seqs], [], self.scratch_page, self.device)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies every layer's K/V from slots `src` to slots `dst` (all sources are read first)."""
        if not src.numel():
            return
        if self.tp is not None:
            self.tp.call("move_kv", self.tp_id, src, dst)
        if self.use_triton:
            from ddtree.ops.triton_attention import triton_move_kv
            triton_move_kv(self.kv_cache, src.int(), dst.int())
        else:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
