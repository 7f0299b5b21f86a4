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

    def prepare(self, chunks: list[tuple[Sequence, int]]):
        ids, pos, slots, kv_slots = [], [], [], []
        for seq, n in chunks:
            start = seq.num_cached
            assert n > 0 and start + n <= len(seq)
            assert len(seq.block_table) * self.page_size >= start + n, "pages must be allocated first"
            ids.extend(seq.token_ids[start:start + n])
            pos.append(torch.arange(start, start + n))
            slots.append(slots_for(seq.block_table, start, start + n, self.page_size))
            kv_slots.append(slots_for(seq.block_table, 0, start + n, self.page_size).to(self.device))
        batch = AttentionBatch(q_lens=[n for _, n in chunks], prefix_lens=[s.num_cached for s, _ in chunks],
                               slot_mapping=torch.cat(slots).to(self.device), kv_slots=kv_slots)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, torch.cat(pos).to(self.device), batch

    @torch.inference_mode()
    def run(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Feeds each chunk, marks it cached, and returns the logits [len(chunks), V] (fp32) at each
        chunk's last token."""
        input_ids, positions, batch = self.prepare(chunks)
        hidden, _ = self.model(input_ids, positions, batch)
        last = torch.tensor(batch.q_lens, device=self.device).cumsum(0) - 1
        for seq, n in chunks:
            seq.num_cached += n
        return self.model.compute_logits(hidden[last]).float()
