"""Runs the DFlash drafter for a batch of requests: append pending context, propose one block each."""
from __future__ import annotations

import torch

from ddtree.engine.sequence import Sequence
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.transformer import CausalLM
from ddtree.ops.attention import AttentionBatch, slots_for


class DraftRunner:
    def __init__(self, drafter: DFlashDrafter, target: CausalLM, num_slots: int, page_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.drafter, self.target, self.page_size, self.device = drafter, target, page_size, device
        cfg = drafter.dcfg.model
        # The drafter's own paged cache, addressed by the target's page tables (same slot space).
        self.kv_cache = torch.zeros(2, cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        for i, layer in enumerate(drafter.layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]
        self.block_size = drafter.dcfg.block_size
        self.layer_ids = drafter.dcfg.target_layer_ids

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> torch.Tensor:
        """Returns draft logits [R, block_size - 1, V] (fp32) for depths 1..block_size-1.

        Each request's block is [last token, MASK x (B-1)] at positions num_cached .. num_cached+B-1,
        attending to its whole drafter context and (non-causally) to the whole block."""
        B, dc = self.block_size, self.drafter.dcfg
        feats, ctx_pos, ctx_slots, block_pos, block_slots, kv_slots = [], [], [], [], [], []
        for seq in seqs:
            start = seq.num_cached
            n_ctx = start - seq.draft_len
            assert n_ctx == sum(f.shape[0] for f in seq.pending_features), "drafter context out of sync"
            kv = slots_for(seq.block_table, 0, start + B, self.page_size, self.device)
            if n_ctx:
                feats.extend(seq.pending_features)
                ctx_pos.append(torch.arange(seq.draft_len, start, device=self.device))
                ctx_slots.append(kv[seq.draft_len:start])
            block_pos.append(torch.arange(start, start + B, device=self.device))
            block_slots.append(kv[start:])
            kv_slots.append(kv)
        R = len(seqs)
        roots = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
        block_ids = torch.full((R, B), dc.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[:, 0] = roots
        embeds = self.target.model.embed_tokens(block_ids.flatten()) * dc.input_embedding_scale
        full = torch.ones(B, B, dtype=torch.bool, device=self.device)
        batch = AttentionBatch(q_lens=[B] * R, prefix_lens=[s.num_cached for s in seqs],
                               slot_mapping=torch.cat(block_slots), kv_slots=kv_slots, masks=[full] * R)
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        hidden = self.drafter(
            embeds, torch.cat(block_pos),
            torch.cat(feats) if feats else torch.empty(0, self.drafter.fc.in_features, device=self.device,
                                                       dtype=embeds.dtype),
            torch.cat(ctx_pos) if ctx_pos else empty, torch.cat(ctx_slots) if ctx_slots else empty, batch)
        for seq in seqs:
            seq.draft_len, seq.pending_features = seq.num_cached, []
        hidden = hidden.view(R, B, -1)[:, 1:]
        return self.drafter.logits(hidden, self.target.lm_head)
