"""Token sampling with per-row parameters: greedy, temperature, top-k, top-p and per-request seeds.

Rows are independent: one batch can mix greedy and sampled requests with different settings.
A seeded request draws from its own torch.Generator, so its output does not depend on what else
is in the batch.
"""
from __future__ import annotations

import torch

from ddtree.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with everything outside each row's top-k / top-p set to -inf."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         device=logits.device, dtype=torch.float32)
    logits = logits.float() / temps[:, None]
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=logits.device)
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=torch.float32)
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token if the mass strictly before it is < top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from (one-hot at the argmax for greedy rows)."""
    probs = filter_logits(logits, params).softmax(dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if greedy.any():
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `logits` [N, V]; row i uses params[i] and generators[i]."""
    assert logits.shape[0] == len(params) == len(generators)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    probs = filter_logits(logits[sampled], [params[i] for i in sampled]).softmax(dim=-1)
    unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
    if unseeded:
        tokens[[sampled[j] for j in unseeded]] = torch.multinomial(probs[unseeded], 1).squeeze(-1)
    # One draw per seeded request (a speculative step has one row per tree node of that request).
    by_gen: dict[int, tuple[torch.Generator, list[int]]] = {}
    for j, i in enumerate(sampled):
        if generators[i] is not None:
            by_gen.setdefault(id(generators[i]), (generators[i], []))[1].append(j)
    for gen, rows in by_gen.values():
        tokens[[sampled[j] for j in rows]] = torch.multinomial(probs[rows], 1, generator=gen).squeeze(-1)
    return tokens
