"""Runs the target model over one step's tokens: builds the step's inputs and attention metadata.

A step is a list of (request, n) pairs: each request feeds its next n uncached tokens, which are
written to the paged cache at positions num_cached .. num_cached + n - 1.
"""
from __future__ import annotations

import torch

from ddtree.config import EngineConfig, ModelConfig
from ddtree.engine.kv_cache import allocate_kv_cache, pages_for_memory
from ddtree.engine.sequence import Sequence
from ddtree.models.transformer import CausalLM
from ddtree.ops.attention import AttentionBatch, slots_for


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, engine_cfg: EngineConfig,
                 device: torch.device, dtype: torch.dtype):
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.page_size = engine_cfg.page_size
        self.num_pages = engine_cfg.num_pages or self._pages_from_memory(engine_cfg)
        self.kv_cache = allocate_kv_cache(cfg.num_layers, self.num_pages, self.page_size, cfg.num_kv_heads,
                                          cfg.head_dim, dtype, device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]

    def _pages_from_memory(self, ec: EngineConfig) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - ec.gpu_memory_utilization) * total
        else:
            budget = ec.kv_cache_gb * 2**30
        return pages_for_memory(budget, self.cfg.num_layers, self.page_size, self.cfg.num_kv_heads,
                                self.cfg.head_dim, self.dtype)

    def batch_for(self, seqs: list[Sequence], q_lens: list[int],
                  masks: list[torch.Tensor] | None = None) -> AttentionBatch:
        """Metadata for feeding q_lens[i] new tokens to seqs[i], stored at its cache positions
        num_cached .. num_cached + q_len - 1 (a tree's nodes in BFS order)."""
        slots, kv_slots = [], []
        for seq, n in zip(seqs, q_lens):
            start = seq.num_cached
            assert n > 0 and len(seq.block_table) * self.page_size >= start + n, "pages must be allocated first"
            kv = slots_for(seq.block_table, 0, start + n, self.page_size, self.device)
            slots.append(kv[start:])
            kv_slots.append(kv)
        return AttentionBatch(q_lens=list(q_lens), prefix_lens=[s.num_cached for s in seqs],
                              slot_mapping=torch.cat(slots), kv_slots=kv_slots, masks=masks)

    def prepare(self, chunks: list[tuple[Sequence, int]]):
        """Inputs for feeding each request its next n uncached tokens."""
        ids, pos = [], []
        for seq, n in chunks:
            start = seq.num_cached
            assert start + n <= len(seq)
            ids.extend(seq.token_ids[start:start + n])
            pos.append(torch.arange(start, start + n))
        batch = self.batch_for([s for s, _ in chunks], [n for _, n in chunks])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.cat(pos).to(self.device), batch

    @torch.inference_mode()
    def run(self, chunks: list[tuple[Sequence, int]], taps: list[int] | None = None):
        """Feeds each chunk and marks it cached. Returns the logits [len(chunks), V] (fp32) at each
        chunk's last token, and the tapped layers' outputs concatenated per token [T, len(taps) * D]."""
        input_ids, positions, batch = self.prepare(chunks)
        hidden, tapped = self.model(input_ids, positions, batch, taps)
        last = torch.tensor(batch.q_lens, device=self.device).cumsum(0) - 1
        for seq, n in chunks:
            seq.num_cached += n
        feats = torch.cat(tapped, dim=-1) if taps else None
        return self.model.compute_logits(hidden[last]).float(), feats

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], tokens: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor,
               taps: list[int]):
        """One target forward over a tree of N nodes per request ([R, N] tokens and depths, [R, N, N]
        ancestor mask). Node i's K/V go to cache position num_cached + i; its rotary position is
        num_cached + depth. Returns logits [R, N, V] (fp32) and features [R, N, len(taps) * D]."""
        R, N = tokens.shape
        starts = torch.tensor([s.num_cached for s in seqs], device=self.device)
        positions = (starts[:, None] + depth).flatten()
        batch = self.batch_for(seqs, [N] * R, list(mask))
        hidden, tapped = self.model(tokens.flatten(), positions, batch, taps)
        logits = self.model.compute_logits(hidden).float().view(R, N, -1)
        return logits, torch.cat(tapped, dim=-1).view(R, N, -1) if taps else None

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies every layer's K/V from slots `src` to slots `dst` (all sources are read first)."""
        if src.numel():
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
