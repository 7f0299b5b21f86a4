"""A drafter's greedy acceptance lengths, replayed offline against the target's own greedy answers.

Under greedy verification the committed text is the target's greedy continuation whatever the drafter
proposes. With that continuation known, a verify step needs no target forward: a tree node is accepted
when its path spells the next tokens of the answer, and the step commits the accepted path plus one
token. So one packed target pass gives every answer's features, and each replayed step is one drafter
pass over all answers and modes at once (DFlash's chain and DDTree's trees share it):

    answer   t0 t1 t2 t3 t4 t5 ...      (t0: the first response token, the prefill's own output)
    step 1:  root t0, context < t0; the drafts match t1 t2, not t3 -> tau 3, the next root is t3
    step 2:  root t3, context < t3; ...

This is what the engine's greedy `accept_lengths` measure (the engine's features come from its own
verify forwards, so bf16 rounding can move a tie), at a small part of its cost: the CPU check of a
drafter change, and the held-out score logged while training (`train-drafter --val-prompt-file`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.models.dflash import DFlashDrafter
from ddtree.models.transformer import CausalLM
from ddtree.speculative.tree import build_tree
from ddtree.speculative.verify import walk
from ddtree.train.blocks import block_logits, fuse_features
from ddtree.train.features import target_features


@dataclass(frozen=True, slots=True)
class Mode:
    budget: int  # tree nodes past the root
    topk: int  # children per node at most (1: a chain)
    label: str | None = None

    @property
    def name(self) -> str:
        return self.label or f"ddtree-b{self.budget}-k{self.topk}"


def dflash_mode(drafter: DFlashDrafter) -> Mode:
    """DFlash linear: the chain of the whole block's argmax drafts."""
    return Mode(drafter.dcfg.block_size - 1, 1, "dflash")


@torch.no_grad()
def replay(drafter: DFlashDrafter, target: CausalLM, records: list[dict], modes: list[Mode],
           max_rows: int = 64, features: list[torch.Tensor] | None = None) -> dict[Mode, list[list[int]]]:
    """Each mode's tokens committed (accepted + 1) at each step of each of `records` ({"input_ids",
    "loss_mask"}: a prompt followed by the target's greedy answer). A record's replay starts at its
    first response token and ends when its answer has no token left to predict: its last step commits
    only what the answer has left (as max_tokens cuts the engine's). `features`: the records' target features if
    already computed (`target_features`); `max_rows`: (record, mode) replays per drafter pass."""
    dc = drafter.dcfg
    B, dev = dc.block_size, target.lm_head.weight.device
    for m in modes:
        if not (1 <= m.budget and 1 <= m.topk) or (m.topk == 1 and m.budget > B - 1):
            raise ValueError(f"bad replay mode {m}: budget >= 1, topk >= 1, and a chain of at most {B - 1}")
    seqs = [r["input_ids"].to(dev) for r in records]
    starts = [int(r["loss_mask"].int().argmax()) for r in records]
    if features is None:
        features, _ = target_features(target, seqs, dc.target_layer_ids)
    ctx = [fuse_features(drafter, f) for f in features]
    # One replay per (record, mode): its next root position.
    rows = [(i, m) for i in range(len(records)) if records[i]["loss_mask"].any() and starts[i] >= 1 for m in modes]
    pos = {row: starts[row[0]] for row in rows}
    out: dict[Mode, list[list[int]]] = {m: [[] for _ in records] for m in modes}
    while True:
        active = [row for row in rows if pos[row] < seqs[row[0]].shape[0] - 1]
        if not active:
            return out
        for chunk in (active[i:i + max_rows] for i in range(0, len(active), max_rows)):
            _step(drafter, target, chunk, pos, seqs, ctx, B, dev, out)


def _step(drafter, target, chunk, pos, seqs, ctx, B, dev, out) -> None:
    """One replayed verify step for each (record, mode) row of `chunk`: draft, build, accept, advance."""
    R = len(chunk)
    L = max(seqs[i].shape[0] for i, _ in chunk)
    ids = torch.zeros(R, L, dtype=torch.long, device=dev)
    c = torch.zeros(R, L, ctx[0].shape[-1], dtype=ctx[0].dtype, device=dev)
    for r, (i, _) in enumerate(chunk):
        n = seqs[i].shape[0]
        ids[r, :n], c[r, :n] = seqs[i], ctx[i]
    lens = torch.tensor([seqs[i].shape[0] for i, _ in chunk], device=dev)
    anchors = torch.tensor([[pos[row]] for row in chunk], device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        logits = block_logits(drafter, target, ids, c, lens, anchors)[:, 0]  # [R, B-1, V]
    # The answer's token after each position (-1 past its end: matches no draft).
    nxt = torch.full((R, L + B + 1), -1, dtype=torch.long, device=dev)
    nxt[:, :L] = torch.where(torch.arange(L, device=dev)[None] < lens[:, None], ids, -1)
    for mode in {m for _, m in chunk}:
        sel = [r for r, (_, m) in enumerate(chunk) if m == mode]
        idx = torch.tensor(sel, device=dev)
        a = anchors[idx, 0]
        tree = build_tree(logits[idx], ids[idx].gather(1, a[:, None])[:, 0], mode.budget, mode.topk)
        # pred[n]: the token the target puts after node n's path if that path is the answer's.
        pred = nxt[idx].gather(1, a[:, None] + tree.depth + 1)
        accepted = walk(tree, pred).length.tolist()
        for r, n in zip(sel, accepted):
            row = chunk[r]
            n = min(n + 1, seqs[row[0]].shape[0] - 1 - pos[row])  # (the last step: what the answer has left)
            pos[row] += n
            out[mode][row[0]].append(n)


def mean_tau(lengths: list[list[int]]) -> float:
    """Tokens committed per step, pooled over records (as `bench latency` pools requests)."""
    steps = [n for per_record in lengths for n in per_record]
    return sum(steps) / max(1, len(steps))


def greedy_answers(llm, conversations: list[list[dict]], max_tokens: int) -> list[dict]:
    """Records of the target's greedy answers to chat conversations (the engine, plain AR)."""
    from ddtree import SamplingParams
    records = []
    for res in llm.chat(conversations, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False):
        ids = list(res.prompt_token_ids) + list(res.token_ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(res.prompt_token_ids):] = True
        records.append({"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": mask})
    return records
