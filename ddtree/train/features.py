"""The frozen target's side of drafter training: the features a drafter is conditioned on (the outputs
of its chosen target layers) and, for `--labels target`, the target's own next-token choices.

Every record is revisited many times in training, so its features are computed once where memory
allows (`precompute_features`: on the device first, then in pinned host memory) and otherwise per
batch (`target_features`, called by the recipe in drafter.py).
"""
from __future__ import annotations

import torch

from ddtree.engine.kv_cache import allocate_state_cache
from ddtree.models.transformer import CausalLM
from ddtree.ops.attention import make_batch


@torch.no_grad()
def target_features(target: CausalLM, seqs: list[torch.Tensor], layer_ids: list[int],
                    use_triton: bool | None = None, with_pred: bool = False, soft_topk: int = 0):
    """For each token sequence, [T, K*D]: the outputs of the target layers `layer_ids`, concatenated.
    One packed causal prefill over all sequences in a throwaway paged cache. On the GPU it runs the
    engine's Triton prefill kernel (the torch path attends request by request: ~10x slower for
    thousands of short sequences); elsewhere one page per sequence. Returns those and, with `with_pred`,
    each sequence's target argmax at every position (int32 [T]: the token the target would put next;
    else None each); with `soft_topk` K > 0 too, that argmax with the target's K likeliest next tokens
    and their log-probabilities: a tuple (int32 [T], int32 [T, K], float16 [T, K]) each."""
    cfg = target.config
    dev, dtype = seqs[0].device, target.lm_head.weight.dtype
    use_triton = dev.type == "cuda" if use_triton is None else use_triton
    lens = [s.shape[0] for s in seqs]
    page = 16 if use_triton else max(lens)
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // page))))
        first += len(tables[-1])
    layers = target.model.layers
    for index in cfg.attention_layers:
        attn = layers[index].self_attn
        attn.k_cache = torch.empty(first * page, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev)
        attn.v_cache = torch.empty_like(attn.k_cache)
    slots = None
    if cfg.is_hybrid:  # a throwaway recurrent-state slot per sequence
        conv, state = allocate_state_cache(cfg, len(seqs), dtype, dev)
        for i, index in enumerate(cfg.linear_layers):
            layers[index].linear_attn.conv_state, layers[index].linear_attn.recurrent_state = conv[i], state[i]
        slots = list(range(len(seqs)))
    batch = make_batch(tables, [0] * len(seqs), lens, None, page, dev, use_triton,
                       cfg.num_heads // cfg.num_kv_heads, cfg.num_kv_heads, slots)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    try:
        hidden, taps = target(torch.cat(seqs), positions, batch, taps=layer_ids)
    finally:
        for index in cfg.attention_layers:
            layers[index].self_attn.k_cache = layers[index].self_attn.v_cache = torch.empty(0)
        for index in cfg.linear_layers:
            layers[index].linear_attn.conv_state = layers[index].linear_attn.recurrent_state = torch.empty(0)
    feats = list(torch.cat(taps, dim=-1).split(lens))
    if not with_pred:
        return feats, [None] * len(seqs)
    # (in slices: 4,096 rows of the default target's logits are 1.2 GB in bf16)
    preds, top_ids, top_logp = [], [], []
    for h in hidden.split(4096):
        logits = target.compute_logits(h)
        preds.append(logits.argmax(-1).to(torch.int32))
        if soft_topk:
            top = logits.topk(soft_topk, dim=-1)  # (log-probs of the K only: no [rows, V] log-softmax)
            top_ids.append(top.indices.to(torch.int32))
            top_logp.append((top.values.float() - logits.float().logsumexp(-1, keepdim=True)).to(torch.float16))
    pred = torch.cat(preds).split(lens)
    if not soft_topk:
        return feats, list(pred)
    return feats, list(zip(pred, torch.cat(top_ids).split(lens), torch.cat(top_logp).split(lens)))


def precompute_features(target: CausalLM, records: list[dict], layer_ids: list[int], max_len: int,
                        tokens_per_batch: int = 16384, progress: bool = True,
                        max_bytes: float | None = None, host_bytes: float = 0.0,
                        with_pred: bool = False, soft_topk: int = 0) -> tuple[list[torch.Tensor | None], list]:
    """Each record's target features (on the target's device and dtype), computed once so training
    steps don't re-run the frozen target: every record is revisited many times. Shortest records first,
    up to `max_bytes` of features on the device, then up to `host_bytes` more in host memory (pinned
    where CUDA is); the rest get None (computed per batch, `make_batch_inputs`). Returns those and, with
    `with_pred`, the target's argmax tokens of the same records (on the device, 4 bytes a token; with
    `soft_topk` K its top-K too, 6K bytes a token more: `target_features`; else None each)."""
    from tqdm.auto import tqdm
    dev = target.lm_head.weight.device
    order = sorted(range(len(records)), key=lambda i: records[i]["input_ids"].shape[0])
    bar = tqdm(total=len(records), desc="target features", disable=not progress)
    feats: list[torch.Tensor | None] = [None] * len(records)
    preds: list[torch.Tensor | None] = [None] * len(records)
    row_bytes = len(layer_ids) * target.config.hidden_size * target.lm_head.weight.element_size()
    budgets = [float("inf") if max_bytes is None else max_bytes, host_bytes]  # device, then host
    tier, i, on_host = 0, 0, 0
    while i < len(order):
        group, longest = [], 0
        while i < len(order):  # length-sorted, so a group's padding (one page each) stays small
            n = min(records[order[i]]["input_ids"].shape[0], max_len)
            if group and max(longest, n) * (len(group) + 1) > tokens_per_batch:
                break
            if n * row_bytes > budgets[tier]:  # this tier is full (the rest are longer)
                if group or tier == len(budgets) - 1:
                    break
                tier += 1
                continue
            budgets[tier] -= n * row_bytes
            group.append(order[i])
            longest = max(longest, n)
            i += 1
        if not group:
            break
        seqs = [records[j]["input_ids"][:max_len].to(dev) for j in group]
        out, pred = target_features(target, seqs, layer_ids, with_pred=with_pred, soft_topk=soft_topk)
        for j, p in zip(group, pred):
            preds[j] = p
        if tier == 1:  # one pinned block per group (a pinned allocation per record would be slow)
            flat = torch.empty(sum(f.shape[0] for f in out), out[0].shape[1], dtype=out[0].dtype,
                               pin_memory=dev.type == "cuda")
            flat.copy_(torch.cat(out))
            if dev.type == "cuda":  # (torch's pinned allocator rounds a block up to a power of two)
                nbytes = flat.numel() * flat.element_size()
                budgets[1] -= (1 << (nbytes - 1).bit_length()) - nbytes
            out = flat.split([f.shape[0] for f in out])
            on_host += len(group)
        for j, f in zip(group, out):
            feats[j] = f
        bar.update(len(group))
    bar.close()
    if i < len(order) or on_host:
        rest = "; the rest per batch" if i < len(order) else ""
        print(f"[target features: {i} of {len(records)} records precomputed ({on_host} in host memory){rest}]")
    return feats, preds
