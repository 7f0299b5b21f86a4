"""Token sampling with per-row parameters: greedy, temperature, top-k, top-p and per-request seeds.

Rows are independent: one batch can mix greedy and sampled requests with different settings.
A seeded request draws from its own torch.Generator, so its output does not depend on what else
is in the batch.
"""
from __future__ import annotations

import torch

from ddtree.sampling_params import SamplingParams


class RowSampler:
    """One batch's sampling settings as device tensors, built once: a burst of decode steps samples the
    same requests every step, and building these from host lists each step would mean host-to-device
    copies that wait for the GPU, stalling the pipelined steps."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None], device,
                 every_row: bool = False):
        """`every_row`: filter greedy rows too (temperature 1), for `filter_logits`."""
        self.rows = len(params)
        sampled = [i for i, p in enumerate(params) if every_row or not p.greedy]
        self.sampled = torch.tensor(sampled, dtype=torch.long, device=device) if sampled else None
        if not sampled:
            return
        sp = [params[i] for i in sampled]
        self.temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in sp], dtype=torch.float32,
                                  device=device)
        self.filtered = not all(p.top_k == 0 and p.top_p >= 1.0 for p in sp)
        if self.filtered:  # top_k 0: no cap (the vocabulary's size is only known from the logits)
            self.top_k = torch.tensor([p.top_k if p.top_k > 0 else 2**62 for p in sp], device=device)
            self.top_p = torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=device)
        # rows (among the sampled) drawing from the global generator, and one group per seeded request
        # (a speculative step has one row per tree node of that request)
        unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
        self.unseeded = self._pair(unseeded, sampled, device)
        by_gen: dict[int, tuple[torch.Generator, list[int]]] = {}
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                by_gen.setdefault(id(generators[i]), (generators[i], []))[1].append(j)
        self.seeded = [(gen, *self._pair(js, sampled, device)) for gen, js in by_gen.values()]

    @staticmethod
    def _pair(local: list[int], sampled: list[int], device):
        """(indices among the sampled rows, the same rows in the batch) as device tensors, or None."""
        if not local:
            return None
        return (torch.tensor(local, dtype=torch.long, device=device),
                torch.tensor([sampled[j] for j in local], dtype=torch.long, device=device))

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits, temperature-scaled, outside each row's top-k / top-p set -inf."""
        logits = logits.float() / self.temps[:, None]
        if not self.filtered:
            return logits
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= self.top_k.clamp(max=vocab)[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token if the mass strictly before it is < top_p (the first token is always kept).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill((mass_before >= self.top_p[:, None]) & (ranks > 0), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits` [N, V] (N = the batch's rows); device ops only."""
        assert logits.shape[0] == self.rows
        tokens = logits.argmax(dim=-1)
        if self.sampled is None:
            return tokens
        probs = self.filter(logits[self.sampled]).softmax(dim=-1)
        if self.unseeded is not None:
            local, rows = self.unseeded
            tokens[rows] = torch.multinomial(probs[local], 1).squeeze(-1)
        for gen, local, rows in self.seeded:
            tokens[rows] = torch.multinomial(probs[local], 1, generator=gen).squeeze(-1)
        return tokens


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with everything outside each row's top-k / top-p set to -inf."""
    return RowSampler(params, [None] * len(params), logits.device, every_row=True).filter(logits)


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
    return RowSampler(params, generators, logits.device)(logits)
