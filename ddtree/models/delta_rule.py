"""The gated delta rule (Gated DeltaNet layers, models/hybrid.py) in torch: the token-by-token
recurrence (the oracle in tests), the whole-chunk and whole-tree solve over a predecessor relation, and
a prompt solved a chunk at a time. Per value head a [Dk, Dv] state S is updated by each token t as

    S = exp(g_t) * S + k_t (beta_t * (v_t - S^T k_t))^T,    o_t = S^T q_t / sqrt(Dk)

with q and k L2-normalised.
"""
from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), as the Gated DeltaNet kernels normalise q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over n tokens of one request, in float32: q, k [n, H, Dk] (already one per value
    head), v [n, H, Dv], g and beta [n, H], state [H, Dk, Dv]. Returns the outputs [n, H, Dv] and the
    state after the last token."""
    q = l2_normalize(q.float()) / q.shape[-1] ** 0.5
    k = l2_normalize(k.float())
    v, g, beta, state = v.float(), g.float(), beta.float(), state.float()
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


def delta_rule_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule over n tokens at once, each continuing from the tokens `above` it
    ([..., n, n], True for a token's predecessors and itself: a lower triangle for a chain, the
    ancestor-or-self relation for a tree, predecessors first), all starting from `state`
    [..., H, Dk, Dv]. q, k [..., H, n, Dk] come normalised (q also scaled), v [..., H, n, Dv], g and
    beta [..., H, n]. With G[t] the sum of g over t's predecessors and t, and D[t, i] = exp(G[t] - G[i])
    for i above t, the state after t is exp(G[t]) S0 + sum over i above t of D[t, i] k_i d_i^T, where
    the updates d solve the unit lower-triangular system
        d_t + beta_t * sum over i strictly above t of D[t, i] (k_t . k_i) d_i = beta_t (v_t - exp(G[t]) S0^T k_t),
    and the outputs are exp(G[t]) S0^T q_t + sum over i above t of D[t, i] (q_t . k_i) d_i. Returns
    (outputs [..., H, n, Dv], d, G): `end_state` rebuilds the state after any token from them."""
    n = q.shape[-2]
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    rel = above.unsqueeze(-3)  # (over the heads)
    G = (g[..., None, :] * rel.float()).sum(-1)
    D = torch.where(rel, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    lower = torch.where(rel & ~eye, beta[..., None] * D * (k @ k.transpose(-1, -2)), 0)
    rhs = beta[..., None] * (v - G.exp()[..., None] * (k @ state))
    d = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    return G.exp()[..., None] * (q @ state) + (D * (q @ k.transpose(-1, -2))) @ d, d, G


def end_state(state: torch.Tensor, k: torch.Tensor, d: torch.Tensor, G: torch.Tensor, on_path: torch.Tensor,
              end: torch.Tensor) -> torch.Tensor:
    """The state after token `end` ([...]) of a `delta_rule_over` solve, whose predecessors and itself are
    `on_path` ([..., n])."""
    Ge = G.gather(-1, end[..., None, None].expand(*G.shape[:-1], 1))  # [..., H, 1]
    weight = torch.where(on_path[..., None, :], (Ge - G).exp(), 0)
    return Ge.exp()[..., None] * state + k.transpose(-1, -2) @ (weight[..., None] * d)


CHUNK = 64  # tokens solved at once by `chunked_delta_rule`


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule` (same arguments and results) a chunk of tokens at a time: `delta_rule_over` a
    chain, with matrix products instead of a step per token."""
    q = l2_normalize(q.float()) / q.shape[-1] ** 0.5
    k = l2_normalize(k.float())
    v, g, beta, state = v.float(), g.float(), beta.float(), state.float()
    out = []
    for c0 in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[c0:c0 + chunk].transpose(0, 1) for x in (q, k, v))  # [H, C, ...]: heads first
        n = qc.shape[1]
        chain = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        o, d, G = delta_rule_over(qc, kc, vc, g[c0:c0 + chunk].T, beta[c0:c0 + chunk].T, state, chain)
        out.append(o.transpose(0, 1))
        state = end_state(state, kc, d, G, chain[-1], torch.tensor(n - 1, device=q.device))
    return torch.cat(out), state
