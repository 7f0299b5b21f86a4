"""One drafter training step, timed two ways: the loss over the whole batch's logits at once (F.cross_entropy
on an fp32 copy, and the accuracy read every step: `train-drafter` before this script's commit) and
`head_loss` (the logits a chunk of rows at a time, the hidden states' gradient made in the same pass,
the accuracy read on logged steps only).

    python benchmarks/train_step_ab.py OUT_DIR [BATCH,...] [--cpu]

The step is the whole of `train`'s: inputs drawn from records (random tokens, 256 of prompt and 384 of
answer, target features precomputed), forward, loss, backward, gradient clipping, AdamW. Writes
OUT_DIR/train_step.jsonl: per batch size (sequences x 32 anchors) and loss, the median ms a step, block
positions a second and the peak device memory. The target is the default model and the drafter the
shipped one's shape; `--cpu`: a tiny model (a smoke test: CPU times mean little).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from ddtree.models.dflash import load_drafter, random_drafter  # noqa: E402
from ddtree.models.loader import load_model  # noqa: E402
from ddtree.train.drafter import draft_logits, draft_hidden, head_loss, make_batch_inputs, target_features  # noqa: E402

ANCHORS, PROMPT, ANSWER = 32, 256, 384


def plain_loss(drafter, target, inp: dict, gamma: float = 7.0):
    logits = draft_logits(drafter, target, inp["ids"], inp["feats"], inp["ctx_len"], inp["anchors"])
    w = torch.exp(-torch.arange(logits.shape[-2], device=logits.device, dtype=torch.float32) / gamma)
    ce = F.cross_entropy(logits.flatten(0, -2).float(), inp["labels"].flatten(), reduction="none")
    wv = w * inp["valid"].float()
    loss = (ce.view(inp["labels"].shape) * wv).sum() / wv.sum()
    with torch.no_grad():
        (logits.argmax(-1) == inp["labels"]).sum()
    return loss


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    cpu = "--cpu" in sys.argv
    out = args[0] if args else "."
    batches = [int(b) for b in args[1].split(",")] if len(args) > 1 else [16, 32, 64]
    os.makedirs(out, exist_ok=True)
    dev = torch.device("cpu" if cpu else "cuda")
    if cpu:
        from tiny import make_tiny_model
        target, cfg = load_model(make_tiny_model(tempfile.mkdtemp(), "qwen3", num_hidden_layers=4), dev, torch.float32)
        drafter = random_drafter(cfg, num_layers=2, block_size=16, target_layer_ids=[0, 2])
        prompt, answer, steps = 24, 40, 3
    else:
        from ddtree.models.hub import DEFAULT_DRAFT_DIR, resolve_model
        target, cfg = load_model(resolve_model(None), dev, torch.bfloat16)
        drafter = load_drafter(DEFAULT_DRAFT_DIR, cfg, dev, torch.float32)
        prompt, answer, steps = PROMPT, ANSWER, 20
    target.requires_grad_(False).eval()
    drafter = drafter.to(dev, torch.float32).train().requires_grad_(True)
    drafter.rotary.build(dev)
    dc = drafter.dcfg
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.vocab_size, (prompt + answer,), generator=g) for _ in range(64)]
    feats = target_features(target, [t.to(dev) for t in ids], dc.target_layer_ids)
    records = [{"input_ids": t, "loss_mask": torch.arange(len(t)) >= prompt, "feats": f} for t, f in zip(ids, feats)]
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0)
    log = open(os.path.join(out, "train_step.jsonl"), "a")
    for bs in batches:
        for mode in ("plain", "head"):
            times = []
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                for step in range(steps + 2):
                    pick = torch.randint(len(records), (bs,), generator=g).tolist()
                    t0 = time.perf_counter()
                    inp = make_batch_inputs([records[i] for i in pick], target, dc.target_layer_ids, dc.block_size,
                                            ANCHORS, g, 1024, dev)
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                        if mode == "plain":
                            loss = plain_loss(drafter, target, inp)
                        else:
                            hidden = draft_hidden(drafter, target, inp["ids"], inp["feats"], inp["ctx_len"],
                                                  inp["anchors"])
                    if mode == "head":
                        loss, _ = head_loss(drafter, hidden, target.lm_head, inp["labels"], inp["valid"], 7.0,
                                            with_acc=step % 10 == 0)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    opt.step()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if step >= 2:  # (the first two: allocator and autotuning warm-up)
                        times.append((time.perf_counter() - t0) * 1e3)
                ms = statistics.median(times)
                row = {"batch": bs, "anchors": ANCHORS, "loss": mode, "ms_per_step": round(ms, 2),
                       "block_positions_per_s": round(bs * ANCHORS * (dc.block_size - 1) / ms * 1e3),
                       "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None}
            except torch.OutOfMemoryError:
                row = {"batch": bs, "anchors": ANCHORS, "loss": mode, "error": "out of memory"}
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
