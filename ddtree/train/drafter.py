"""The DFlash training recipe (z-lab never released theirs): train a drafter on a frozen target.

Per sequence, random anchor positions a are drawn inside the response. Each anchor gives one block
[token[a], MASK x (B-1)] at positions a .. a+B-1 that sees the target features of positions < a
(injected as extra keys/values, exactly as in inference) and its whole own block (non-causal), and
nothing of other blocks. All blocks of a batch go through one forward with a boolean attention mask
(`block_attention`: plain SDPA; flex_attention with a block mask is the GPU path to add for long
sequences). The loss is cross-entropy at block index k = 1..B-1 against the token at a+k (by default
the target's own argmax after a+k-1, counted while the block's earlier tokens follow that argmax chain;
or the data's token), weighted by exp(-(k-1)/gamma) and counted only where a+k is a response token;
with `--soft-topk K` it is mixed with the CE against the target's distribution over its K likeliest
tokens there (`block_loss`).
The target (its embedding and LM head included) is frozen; only the drafter's parameters are
optimized (AdamW, linear warm-up then cosine decay, gradient clipping). Its features (and argmax
labels) come from train/features.py.

Checkpoints: the drafter in the z-lab format (`save_drafter`) plus `trainer_state.pt` (fp32 weights,
optimizer, scheduler, step), so `--resume` continues exactly.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ddtree.models.dflash import DFlashDrafter, load_drafter, random_drafter, save_drafter
from ddtree.models.transformer import CausalLM
from ddtree.train.acceptance import Mode, dflash_mode, greedy_answers, mean_tau, replay
from ddtree.train.blocks import draft_logits
from ddtree.train.features import precompute_features, target_features

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # sequences per step
    blocks_per_seq: int = 16  # anchors drawn per sequence
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.04  # fraction of steps (or an absolute count if >= 1)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 7.0
    max_len: int = 2048  # sequences are truncated to this many tokens
    seed: int = 0
    save_every: int = 500
    log_every: int = 10
    save_dtype: str = "bfloat16"
    attention: str = "sdpa"  # or "flex" (flex_attention + BlockMask; GPU only for training: no CPU backward)
    time_budget_s: float = 0.0  # > 0: the cosine schedule spans this much training time instead of `steps`
    # Target features precomputed and kept on the device up to this many GB, shortest records first (the
    # rest are computed each time a batch draws them); None: on CUDA the free memory less
    # FEATURE_RESERVE_GB, elsewhere no cap. (4 x 896 bf16 values a token for the default target: 35,000
    # answers make ~68 GB; all 50,863 every-turn prompts would make ~98 GB.)
    feature_cache_gb: float | None = None
    # Past the device cache, features kept in pinned host memory up to this many GB and copied in per
    # batch (~80 MB a step: a few ms, against a target forward per batch). Off by default: a machine's
    # usable memory (a container's limit, not /proc/meminfo's) is the user's to say.
    feature_host_gb: float = 0.0
    # Labels: "target", the target's own argmax after each context (what greedy verification accepts; an
    # LM-head pass more per record), or "data", the answer's next token (the same for greedy answers;
    # for sampled ones a draw of the target's spread, not its choice).
    labels: str = "target"
    # With target labels: also the target's K likeliest next tokens (0: off), as soft labels. Each block
    # position's loss is then (1 - soft_weight) x the CE against the argmax plus soft_weight x the CE
    # against the target's distribution over those K tokens (renormalized): DDTree builds its trees from
    # the drafter's top-k at each depth, so the ranking below the argmax counts too.
    soft_topk: int = 0
    soft_weight: float = 0.5
    # Held-out greedy answers replayed (train/acceptance.py) every this many steps, with the start and the
    # end: DFlash's and a DDTree tree's acceptance lengths in the log ("val"). 0: never.
    val_every: int = 1000


# Device memory left for training steps when the feature cache is sized by itself: the default drafter's
# training ran out of memory with 16 GB left for its steps and ran with about 79 GB (docs/training.md).
FEATURE_RESERVE_GB = 64.0


def sample_anchors(loss_mask: torch.Tensor, n: int, B: int, g: torch.Generator) -> torch.Tensor:
    """Up to n distinct anchor positions a (as a LongTensor) with a inside the response and at least
    one response label after it; positions a >= 1 so every block has some context."""
    nxt = torch.zeros_like(loss_mask)
    nxt[:-1] = loss_mask[1:]
    ok = loss_mask & nxt
    ok[0] = False
    cand = ok.nonzero().flatten()
    if cand.numel() == 0:
        return cand
    return cand[torch.randperm(cand.numel(), generator=g)[:n]].sort().values


def make_batch_inputs(records: list[dict], target: CausalLM, layer_ids: list[int], B: int, n: int,
                      g: torch.Generator, max_len: int, device, target_labels: bool = False,
                      soft_topk: int = 0) -> dict | None:
    """Pads a list of records into the tensors `draft_logits` and `block_loss` read. Labels: the data's
    next tokens, or with `target_labels` the target's argmax at the position before (records' "pred",
    computed here where missing): what greedy verification accepts. For greedy answers the two agree;
    for sampled ones the data's token is one draw of the target's spread, and the argmax is the label.
    With `soft_topk` K (target labels only) also "soft_ids" and "soft_logp" [R, N, B-1, K]: the target's
    K likeliest tokens at each label's position and their log-probabilities (records' "pred" is then
    `target_features`' tuple)."""
    rows = []
    for rec in records:
        ids, lm = rec["input_ids"][:max_len], rec["loss_mask"][:max_len]
        anchors = sample_anchors(lm, n, B, g)
        if anchors.numel():
            rows.append((ids, lm, anchors, rec.get("feats"), rec.get("pred") if target_labels else None))
    if not rows:
        return None
    R, L, N = len(rows), max(r[0].shape[0] for r in rows), max(r[2].shape[0] for r in rows)
    ids = torch.zeros(R, L, dtype=torch.long)
    lmask = torch.zeros(R, L, dtype=torch.bool)
    anchors = torch.full((R, N), -1, dtype=torch.long)
    for i, (t, m, a, _, _) in enumerate(rows):
        ids[i, :t.shape[0]], lmask[i, :m.shape[0]], anchors[i, :a.shape[0]] = t, m, a
    ids, lmask, anchors = ids.to(device), lmask.to(device), anchors.to(device)
    feat_dim = len(layer_ids) * target.config.hidden_size
    feats = torch.zeros(R, L, feat_dim, dtype=target.lm_head.weight.dtype, device=device)
    pred = torch.zeros(R, L, dtype=torch.long, device=device) if target_labels else None
    soft_topk = soft_topk if target_labels else 0
    if soft_topk:
        soft_ids = torch.zeros(R, L, soft_topk, dtype=torch.long, device=device)
        soft_logp = torch.zeros(R, L, soft_topk, dtype=torch.float32, device=device)

    def put_pred(i: int, p, n: int) -> None:
        if soft_topk:
            p, top_ids, top_logp = p
            soft_ids[i, :n], soft_logp[i, :n] = top_ids[:n], top_logp[:n]
        pred[i, :n] = p[:n]

    missing = [i for i, r in enumerate(rows) if r[3] is None or (target_labels and r[4] is None)]
    if missing:  # not precomputed: run the target now
        fs, ps = target_features(target, [ids[i, :rows[i][0].shape[0]] for i in missing], layer_ids,
                                 with_pred=target_labels, soft_topk=soft_topk)
        for i, f, p in zip(missing, fs, ps):
            feats[i, :f.shape[0]] = f
            if p is not None:
                put_pred(i, p, f.shape[0])
    skip = set(missing)
    for i, (t, _, _, f, p) in enumerate(rows):
        if i in skip:
            continue
        feats[i, :t.shape[0]].copy_(f[:t.shape[0]], non_blocking=True)  # (pinned host memory: no wait)
        if target_labels:
            put_pred(i, p, t.shape[0])
    # Labels at block index k = 1..B-1 (token a+k), valid where a is real, a+k < L and a+k is a response token.
    k = torch.arange(1, B, device=device)
    tgt = anchors.clamp(min=0)[:, :, None] + k
    inside = (anchors[:, :, None] >= 0) & (tgt < L)
    tgt = tgt.clamp(max=L - 1)
    valid = inside & lmask[:, None, :].expand(-1, N, -1).gather(2, tgt)
    if target_labels:  # the target's argmax after token a+k-1 is its choice for a+k
        labels = pred[:, None, :].expand(-1, N, -1).gather(2, tgt - 1)
        # ... given the data's tokens a+1..a+k-1: the token greedy verification accepts at k only
        # while those are the argmax chain too (always, in greedy answers; in sampled ones, up to the
        # first draw off the argmax, after which the block's labels would follow a prefix the
        # verification never sees).
        on_chain = torch.ones_like(ids, dtype=torch.int32)
        on_chain[:, 1:] = (ids[:, 1:] == pred[:, :-1]).int()
        chain = on_chain[:, None, :].expand(-1, N, -1).gather(2, tgt)  # token a+k follows the argmax
        before = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], -1)  # tokens a+1..a+k-1
        valid = valid & before.cumprod(-1).bool()
    else:
        labels = ids[:, None, :].expand(-1, N, -1).gather(2, tgt)
    ctx_len = torch.tensor([r[0].shape[0] for r in rows], device=device)
    out = {"ids": ids, "feats": feats, "ctx_len": ctx_len, "anchors": anchors, "labels": labels, "valid": valid}
    if soft_topk:  # (at the position before each label's, as the argmax)
        at = (tgt - 1)[..., None].expand(-1, -1, -1, soft_topk)
        out["soft_ids"] = soft_ids[:, None].expand(-1, N, -1, -1).gather(2, at)
        out["soft_logp"] = soft_logp[:, None].expand(-1, N, -1, -1).gather(2, at)
    return out


def block_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float, with_acc: bool = True,
               soft: tuple[torch.Tensor, torch.Tensor] | None = None, soft_weight: float = 0.5):
    """Weighted CE (weight exp(-(k-1)/gamma) at block index k) and per-index accuracy [B-1] (None without
    `with_acc`: an argmax over the whole batch's logits, read only on logged steps). With `soft`, the
    target's top-K (ids, log-probs) at each position: the CE is (1 - soft_weight) x the CE against
    `labels` plus soft_weight x the CE against the target's distribution renormalized over its K."""
    Bm1 = logits.shape[-2]
    w = torch.exp(-torch.arange(Bm1, device=logits.device, dtype=torch.float32) / gamma)
    if soft is None:
        ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)
    else:  # -log q(x) = logsumexp - logit(x): one logsumexp for both terms
        z = logits.float()
        lse = z.logsumexp(-1)
        hard = lse - z.gather(-1, labels[..., None]).squeeze(-1)
        ids, logp = soft
        p = logp.float().softmax(-1)
        soft_ce = lse - (p * z.gather(-1, ids)).sum(-1)
        ce = (1 - soft_weight) * hard + soft_weight * soft_ce
    wv = w * valid.float()
    loss = (ce * wv).sum() / wv.sum().clamp(min=1e-6)
    if not with_acc:
        return loss, None
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
        acc = hit.flatten(0, -2).sum(0).float() / valid.flatten(0, -2).sum(0).clamp(min=1).float()
    return loss, acc


def lr_lambda(cfg: TrainConfig):
    """LR factor at a step: linear warm-up, then cosine down to min_lr_ratio. With a time budget the
    cosine runs over the fraction of the budget spent (second argument) instead of over the steps."""
    warm = int(cfg.warmup if cfg.warmup >= 1 else round(cfg.warmup * cfg.steps))

    def f(step: int, time_frac: float | None = None) -> float:
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, time_frac if time_frac is not None else (step - warm) / max(1, cfg.steps - warm))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


# Dtypes a drafter may be saved in. float8_e4m3fn halves the file (the default drafter's 24 MiB limit then
# holds twice the parameters): matrices only, the norms stay bfloat16, and training runs with its rounding
# (`quantized`) so that the shipped weights are the ones trained.
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float8_e4m3fn": torch.float8_e4m3fn}


def save_dtype(name: str) -> torch.dtype:
    if name not in SAVE_DTYPES:
        raise ValueError(f"unknown drafter save dtype {name!r}; use one of {sorted(SAVE_DTYPES)}")
    return SAVE_DTYPES[name]


def round_to(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w rounded to `dtype`'s values (saturating at its largest), kept in w's dtype; the gradient passes
    straight through the rounding."""
    big = torch.finfo(dtype).max
    q = w.detach().clamp(-big, big).to(dtype).to(w.dtype)
    return w + (q - w.detach())


class _Forward(torch.nn.Module):
    """`draft_logits` as a module's forward, for torch.func.functional_call (the quantized pass)."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, target, *args, **kw):
        return draft_logits(self.drafter, target, *args, **kw)


def quantized(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's parameters with its matrices rounded to an 8-bit `dtype` (as `save_drafter`
    stores them), for functional_call; other dtypes: the parameters as they are."""
    small = dtype.itemsize == 1
    return {f"drafter.{n}": round_to(p, dtype) if small and p.dim() == 2 else p for n, p in drafter.named_parameters()}


def save_checkpoint(out: str, drafter: DFlashDrafter, opt, sched, step: int, cfg: TrainConfig,
                    trained_s: float = 0.0) -> None:
    save_drafter(drafter, out, save_dtype(cfg.save_dtype))
    state = {"step": step, "drafter": {k: v.detach().float().cpu() for k, v in drafter.state_dict().items()},
             "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "config": asdict(cfg),
             "trained_s": trained_s}
    tmp = os.path.join(out, STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(out, STATE_FILE))


def _feature_cache_bytes(cfg: TrainConfig, dev: torch.device) -> float | None:
    if cfg.feature_cache_gb is not None:
        return cfg.feature_cache_gb * 2**30
    if dev.type != "cuda":
        return None
    torch.cuda.empty_cache()  # (the data generation's engine is gone: its blocks back to the driver)
    free, _ = torch.cuda.mem_get_info(dev)
    return max(free - FEATURE_RESERVE_GB * 2**30, 0.0)


def _check_memory_budgets(cache_gb: float | None, host_gb: float) -> None:
    for name, gb in (("feature cache", cache_gb), ("feature host memory", host_gb)):
        if gb is not None and not gb >= 0:  # (NaN too: every comparison with it is False)
            raise ValueError(f"{name} must be >= 0 GB, got {gb}")


def validate(drafter: DFlashDrafter, target: CausalLM, records: list[dict], features: list[torch.Tensor],
             dtype: torch.dtype) -> dict[str, float]:
    """Held-out acceptance lengths (train/acceptance.py) of the drafter as it would be saved in `dtype`:
    DFlash's chain and a budget-32 top-4 tree."""
    import copy

    d = copy.deepcopy(drafter).eval()
    with torch.no_grad():
        rounded = quantized(d, dtype)
        for name, p in d.named_parameters():
            p.copy_(rounded[f"drafter.{name}"])
    res = replay(d, target, records, [dflash_mode(d), Mode(32, 4)], features=features)
    return {m.name: round(mean_tau(v), 4) for m, v in res.items()}


def train(target: CausalLM, records: list[dict], out: str, cfg: TrainConfig, drafter: DFlashDrafter | None = None,
          resume: bool = False, num_layers: int = 1, block_size: int = 16, target_layer_ids: list[int] | None = None,
          progress: bool = True, stop_at: int | None = None, time_limit_s: float | None = None,
          deadline: float | None = None, val_records: list[dict] | None = None, **drafter_kw) -> DFlashDrafter:
    """Trains (or resumes training) a drafter for `target` on `records` and writes checkpoints to `out`.
    `stop_at` / `time_limit_s` (seconds of this call) / `deadline` (a time.time() value) end the run
    early with a checkpoint (the schedule still spans cfg.steps or cfg.time_budget_s), for sessions
    shorter than the whole run; `resume=True` picks it up again. With cfg.time_budget_s the run ends
    when that much training time (summed over resumed runs) is spent. `val_records`: held-out greedy
    answers, replayed every cfg.val_every steps (`validate`). With an 8-bit cfg.save_dtype the forward
    runs on the matrices rounded to it (straight-through gradients), the weights it saves.
    Returns the trained drafter (fp32 master weights on the target's device)."""
    from tqdm.auto import tqdm

    dev = target.lm_head.weight.device
    target.requires_grad_(False).eval()
    if not records:
        raise ValueError("no training records")
    if cfg.attention not in ("sdpa", "flex"):
        raise ValueError(f"attention must be 'sdpa' or 'flex', got {cfg.attention!r}")
    if cfg.labels not in ("target", "data"):
        raise ValueError(f"labels must be 'target' or 'data', got {cfg.labels!r}")
    if not 0 <= cfg.soft_topk <= target.config.vocab_size or (cfg.soft_topk and cfg.labels != "target"):
        raise ValueError(f"soft_topk needs labels 'target' (the target is the teacher) and 0 <= K <= the "
                         f"vocabulary ({target.config.vocab_size}), got {cfg.soft_topk} with labels {cfg.labels!r}")
    if not 0.0 <= cfg.soft_weight <= 1.0:
        raise ValueError(f"soft_weight must be in [0, 1], got {cfg.soft_weight}")
    _check_memory_budgets(cfg.feature_cache_gb, cfg.feature_host_gb)
    target_labels = cfg.labels == "target"
    start, trained_before = 0, 0.0
    state = None
    if resume and os.path.exists(os.path.join(out, STATE_FILE)):
        state = torch.load(os.path.join(out, STATE_FILE), weights_only=True)
        drafter = load_drafter(out, target.config, dev, torch.float32)
        drafter.load_state_dict(state["drafter"])
        start, trained_before = state["step"], state.get("trained_s", 0.0)
        was = state.get("config", {}).get("labels", "data")  # (runs before --labels used the data's)
        if was != cfg.labels:
            print(f"[resumed with --labels {cfg.labels}; steps 1-{start} used {was}]")
        soft = tuple(state.get("config", {}).get(k, d) for k, d in (("soft_topk", 0), ("soft_weight", 0.5)))
        if soft != (cfg.soft_topk, cfg.soft_weight):
            print(f"[resumed with --soft-topk {cfg.soft_topk} --soft-weight {cfg.soft_weight}; steps 1-{start} "
                  f"used {soft[0]} and {soft[1]}]")
    elif drafter is None:
        kw = dict(num_layers=num_layers, block_size=block_size, target_layer_ids=target_layer_ids)
        drafter = random_drafter(target.config, seed=cfg.seed, std=0.02, **kw, **drafter_kw)
    drafter = drafter.to(dev, torch.float32).train().requires_grad_(True)
    drafter.rotary.build(dev)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    lr_at = lr_lambda(cfg)
    timed = cfg.time_budget_s > 0
    os.makedirs(out, exist_ok=True)
    dc = drafter.dcfg
    feats, preds = precompute_features(target, records, dc.target_layer_ids, cfg.max_len, progress=progress,
                                       max_bytes=_feature_cache_bytes(cfg, dev),
                                       host_bytes=cfg.feature_host_gb * 2**30, with_pred=target_labels,
                                       soft_topk=cfg.soft_topk)  # (checked above: K > 0 only with target labels)
    log = open(os.path.join(out, LOG_FILE), "a")
    wdtype = save_dtype(cfg.save_dtype)
    forward = _Forward(drafter)
    val_feats = None
    if val_records and cfg.val_every:
        val_feats = [f for i in range(0, len(val_records), 64)
                     for f in target_features(target, [r["input_ids"].to(dev) for r in val_records[i:i + 64]],
                                              dc.target_layer_ids)[0]]

    def log_validation(step: int) -> None:
        if val_feats is not None:
            t = time.perf_counter()
            rec = {"step": step, "val": validate(drafter, target, val_records, val_feats, wdtype),
                   "val_records": len(val_records), "val_s": round(time.perf_counter() - t, 2)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            tqdm.write(json.dumps(rec))

    log_validation(start)
    done = start
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train-drafter", disable=not progress)
    t0 = time.perf_counter()
    trained = lambda: trained_before + time.perf_counter() - t0  # noqa: E731
    for step in bar:
        if timed:  # the schedule follows the share of the time budget spent
            if trained() >= cfg.time_budget_s:
                save_checkpoint(out, drafter, opt, sched, step, cfg, trained())
                tqdm.write(f"[time budget of {cfg.time_budget_s:.0f} s spent at step {step}]")
                break
            for group in opt.param_groups:
                group["lr"] = cfg.lr * lr_at(step, trained() / cfg.time_budget_s)
        # Per-step generator: a resumed run draws the same batches as an uninterrupted one.
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        pick = torch.randint(len(records), (cfg.batch_size,), generator=g).tolist()
        batch = [{**records[i], "feats": feats[i], "pred": preds[i]} for i in pick]
        inp = make_batch_inputs(batch, target, dc.target_layer_ids, dc.block_size, cfg.blocks_per_seq, g, cfg.max_len,
                                dev, target_labels, cfg.soft_topk)
        if inp is None:
            sched.step()
            continue
        done = step + 1
        logged = done % cfg.log_every == 0 or done == cfg.steps or step == start
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = torch.func.functional_call(
                forward, quantized(drafter, wdtype),
                (target, inp["ids"], inp["feats"], inp["ctx_len"], inp["anchors"]), {"flex": cfg.attention == "flex"})
        soft = (inp["soft_ids"], inp["soft_logp"]) if "soft_ids" in inp else None
        loss, acc = block_loss(logits, inp["labels"], inp["valid"], cfg.gamma, logged, soft, cfg.soft_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if not timed:
            sched.step()
        if logged:
            rec = {"step": done, "loss": round(loss.item(), 5), "lr": opt.param_groups[0]["lr"],
                   "grad_norm": round(float(gnorm), 4), "acc": [round(x, 4) for x in acc.tolist()],
                   "elapsed_s": round(trained(), 2)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}")
            tqdm.write(json.dumps(rec))
        early = (stop_at is not None and done >= stop_at) or \
            (time_limit_s is not None and time.perf_counter() - t0 > time_limit_s) or \
            (deadline is not None and time.time() > deadline)
        if done % cfg.save_every == 0 or done == cfg.steps or early:
            save_checkpoint(out, drafter, opt, sched, done, cfg, trained())
        if cfg.val_every and done % cfg.val_every == 0 and not early and done != cfg.steps:
            log_validation(done)
        if early:
            tqdm.write(f"[stopped at step {done} of {cfg.steps}; continue with --resume]")
            break
    bar.close()
    log_validation(done)
    log.close()
    return drafter


def main(args) -> int:
    """`ddtree train-drafter`: generate (or reuse) the data, then train and checkpoint into args.out."""
    import gc

    from ddtree.config import default_device, parse_dtype
    from ddtree.models.loader import load_model
    from ddtree.train.data import (as_conversation, generate_dataset, load_dataset, read_prompt_file,
                                   sharegpt_prompts)

    from ddtree.models.hub import resolve_model

    if not args.gen_temperature >= 0:  # (before any model loads; NaN too)
        raise ValueError(f"--gen-temperature must be >= 0, got {args.gen_temperature}")
    _check_memory_budgets(args.feature_cache_gb, args.feature_host_gb)
    if args.prompt_repeats < 1 or (args.prompt_repeats > 1 and not args.gen_temperature):
        raise ValueError(f"--prompt-repeats must be 1, or more with --gen-temperature > 0 (greedy answers to the "
                         f"same prompt are the same answer); got {args.prompt_repeats}")
    device = torch.device(args.device or default_device())
    dtype = parse_dtype(args.dtype, device.type)
    args.target = resolve_model(args.target)  # a checkpoint dir (a .gguf is converted once)
    os.makedirs(args.out, exist_ok=True)
    llm = None

    def make_llm():
        from ddtree import LLM
        return LLM(args.target, device=str(device), dtype=dtype, spec="none", max_num_seqs=args.max_num_seqs,
                   kv_cache_gb=args.kv_cache_gb)
    data_path = args.data or os.path.join(args.out, "data.pt")
    if os.path.exists(data_path):
        records = load_dataset(data_path)
        print(f"[{len(records)} records from {data_path}]")
        if args.skip_prompts or args.prompts is not None or args.gen_temperature or args.prompt_repeats > 1:
            print("[--prompts / --skip-prompts / --gen-temperature / --prompt-repeats ignored: the data exists; "
                  "they choose the prompts to answer and how]")
    else:
        if args.prompt_file:
            prompts = read_prompt_file(args.prompt_file)
        else:
            prompts = sharegpt_prompts(every=args.every_turn)
        prompts = [p for p in prompts[args.skip_prompts:][:args.prompts] for _ in range(args.prompt_repeats)]
        if not prompts:
            raise ValueError("no prompts")
        llm = make_llm()
        records = generate_dataset(args.target, prompts, data_path, args.max_new_tokens, batch_size=args.gen_batch_size,
                                   max_prompt_tokens=args.max_prompt_tokens, llm=llm,
                                   time_limit_s=args.gen_time_limit * 60 if args.gen_time_limit else None,
                                   temperature=args.gen_temperature, seed=args.seed)
        print(f"[{len(records)} records, {sum(r['loss_mask'].sum().item() for r in records)} response tokens "
              f"-> {data_path}]")
    if args.data_only:
        return 0
    val_records = None
    if args.val_data and args.val_data.endswith((".pt", ".npz")):  # greedy answers made before
        val_records = load_dataset(args.val_data)[:args.val_prompts]
    elif args.val_data:
        convs = [as_conversation(p) for p in read_prompt_file(args.val_data)[:args.val_prompts]]
        val_records = greedy_answers(llm or make_llm(), convs, args.val_max_tokens)
    if val_records is not None:
        print(f"[{len(val_records)} held-out answers for validation]")
    llm = None
    gc.collect()
    for path in args.extra_data:
        more = load_dataset(path)
        print(f"[+ {len(more)} records from {path}]")
        records = records + more
    target, _ = load_model(args.target, device, dtype)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, blocks_per_seq=args.blocks_per_seq, lr=args.lr,
                      warmup=args.warmup, gamma=args.gamma, max_len=args.max_len, seed=args.seed,
                      save_every=args.save_every, save_dtype=args.save_dtype, attention=args.attention,
                      time_budget_s=(args.time_budget or 0) * 60, feature_cache_gb=args.feature_cache_gb,
                      feature_host_gb=args.feature_host_gb, labels=args.labels, val_every=args.val_every,
                      soft_topk=args.soft_topk, soft_weight=args.soft_weight)
    kw = {}
    if args.intermediate_size:
        kw["intermediate_size"] = args.intermediate_size
    if args.num_features and not args.target_layer_ids:
        kw["num_features"] = args.num_features
    init = None
    if args.grow and not args.init:
        raise ValueError("--grow needs --init (the drafter to grow)")
    if args.init:  # a warm start; its shape (layers, block, taps) is the checkpoint's, unless grown
        init = load_drafter(args.init, target.config, device, torch.float32)
        if args.grow:
            from ddtree.train.grow import grow_drafter
            m = init.dcfg.model
            init = grow_drafter(init, args.num_layers, args.intermediate_size or m.intermediate_size, seed=args.seed)
            print(f"[grown: {m.num_layers} layers x MLP {m.intermediate_size} -> {args.num_layers} x "
                  f"{init.dcfg.model.intermediate_size}]")
    train(target, records, args.out, cfg, drafter=init, resume=args.resume, num_layers=args.num_layers,
          block_size=args.block_size,
          target_layer_ids=args.target_layer_ids or None, stop_at=args.stop_at,
          time_limit_s=args.time_limit * 60 if args.time_limit else None, deadline=args.deadline,
          val_records=val_records, **kw)
    print(f"[drafter saved to {args.out}]")
    return 0
