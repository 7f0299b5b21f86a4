"""Routed experts (Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, DeepSeek-V3): the MLP of a
mixture-of-experts layer.

A router (`gate`, one logit per expert) scores each token; the token goes to its `top_k` experts by
softmax probability, those probabilities renormalised over the k when the config says so
(`norm_topk_prob`). Each expert is a SiLU-gated MLP; the layer's output is the weighted sum of the k
experts' outputs. Qwen2-MoE, Qwen3.5-MoE and Qwen3-Next add a shared expert, a SiLU-gated MLP that
every token goes through, its output scaled by sigmoid(shared_expert_gate . x), a per-token scalar.
Experts act per token, so chain and tree verification need nothing more.

The experts' weights are stacked, `gate_up_proj` [E, 2I, D] (gate rows, then up rows) and `down_proj`
[E, D, I], as transformers stores them; checkpoints with one tensor per expert
(`experts.{e}.gate_proj.weight`, ...) load into them through `load_expert`.

On the Triton path (`kernels`), the router's softmax and top-k run as one kernel, and steps with a few
pairs an expert (decode steps, small verifies) run the experts as ops/triton_moe.py's kernels, each
chosen expert's weights read once; more pairs run as two grouped products (`torch._grouped_mm`), or a
product per expert where those do not run.

Under tensor parallelism each rank holds the experts `first` .. `first` + E - 1 (parallel/shard.py):
it adds those experts' share of each token's output, and an all-reduce over `group` sums the shares.
A shared expert's width is split like a dense MLP's and its gate is whole on every rank: the rank's
partial shared output, times the gate, joins its routed share before that one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from ddtree.config import ModelConfig
from ddtree.ops.fused import silu_mul


class Experts(nn.Module):
    group = None  # a torch.distributed process group when the experts are split across ranks

    def __init__(self, num_experts: int, hidden: int, width: int, first: int = 0):
        super().__init__()
        self.width, self.first = width, first
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))

    # (checkpoint leaf name -> the parameter and the rows of an expert's matrix it fills)
    def expert_slot(self, proj: str) -> tuple[nn.Parameter, slice]:
        w = self.width
        return {"gate_proj": (self.gate_up_proj, slice(0, w)), "up_proj": (self.gate_up_proj, slice(w, 2 * w)),
                "down_proj": (self.down_proj, slice(None))}[proj]

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Expert `expert` (the model's numbering)'s `proj` matrix from a checkpoint."""
        param, rows = self.expert_slot(proj)
        target = param.data[expert - self.first, rows]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert} {proj}: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                use_triton: bool = False) -> torch.Tensor:
        """sum over k of weights[t, k] * expert experts[t, k] (x[t]); x [T, D], experts and weights [T, k]
        (the model's expert numbers): the ranks' shares, all-reduced."""
        return self.reduce(self.share(x, experts, weights, use_triton))

    def share(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
              use_triton: bool = False) -> torch.Tensor:
        """This rank's share of forward(); pairs of experts held by other ranks are left out. With
        `use_triton`, a few pairs an expert run as the Triton kernels (ops/triton_moe.py); otherwise the
        pairs, sorted by expert, run as grouped products where those run, else one product per expert."""
        from ddtree.ops.triton_moe import experts_fit, routed_experts
        if use_triton and experts_fit(experts.numel(), self.gate_up_proj.shape[0]):
            return routed_experts(x, experts, weights, self.gate_up_proj, self.down_proj, self.first)
        return self._grouped(x, experts, weights) if grouped_mm_runs(x) else self._by_expert(x, experts, weights)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The ranks' shares `out` summed over `group`, in place (unchanged without a group)."""
        if self.group is not None:
            torch.distributed.all_reduce(out, group=self.group)
        return out

    def _sorted_pairs(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs' local expert numbers (held: this rank's count, for others' experts), the pairs in
        expert order (stable), and how many pairs each held expert takes [held] — device ops only."""
        held = self.gate_up_proj.shape[0]
        local = experts.flatten() - self.first
        local = torch.where((local >= 0) & (local < held), local, held)
        counts = torch.zeros(held + 1, dtype=torch.int32, device=local.device)
        counts.scatter_add_(0, local, torch.ones_like(local, dtype=torch.int32))
        return local, local.argsort(stable=True), counts[:held]

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every held expert over its pairs in two grouped products (`torch._grouped_mm`), with device ops
        only, so the layer can be captured in a CUDA graph. The pairs' outputs go back to pair order
        and are summed per token over k, in a fixed order."""
        T, k = experts.shape
        local, order, counts = self._sorted_pairs(experts)
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = x[order // k]
        h = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends)
        h = torch._grouped_mm(silu_mul(h), self.down_proj.transpose(1, 2), offs=ends)
        mine = (local < self.gate_up_proj.shape[0])[order, None]
        per_pair = torch.empty_like(h)
        per_pair[order] = torch.where(mine, h, 0)  # (rows past the held experts' are not written by the products)
        return (per_pair.view(T, k, -1) * weights[..., None]).sum(1)

    def _by_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same, one product per expert used, grouped on the host (where grouped products do not run)."""
        k = experts.shape[1]
        _, order, counts = self._sorted_pairs(experts)
        tokens = order // k
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            pairs = order[start:start + n]
            rows = tokens[start:start + n]
            start += n
            h = silu_mul(x[rows] @ self.gate_up_proj[e].t()) @ self.down_proj[e].t()
            out.index_add_(0, rows, h * weights.flatten()[pairs, None])
        return out


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes x's dtype on x's device (the CPU: any float; CUDA: bfloat16)."""
    return hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


class SparseMoE(nn.Module):
    """The MoE layer's MLP: the router, then the chosen experts, and the gated shared expert where the
    config has one (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from ddtree.models.transformer import MLP
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.held_experts or moe.num_experts, cfg.hidden_size, moe.intermediate_size,
                               moe.first_expert)
        self.shared = moe.shared_intermediate_size > 0
        if self.shared:
            self.shared_expert = MLP(cfg, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """The layer's output for x [T, D]; `batch` (the step's AttentionBatch) says whether the Triton
        kernels run."""
        use_triton = batch is not None and batch.use_triton
        if use_triton:  # (one kernel from the logits to each token's experts and weights)
            from ddtree.models.transformer import project
            from ddtree.ops.triton_moe import softmax_topk
            experts, weights = softmax_topk(project(self.gate, x, batch), self.top_k, self.norm_topk_prob)
        else:
            probs = torch.softmax(self.gate(x).float(), dim=-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts.share(x, experts, weights.to(x.dtype), use_triton)
        if self.shared:  # (the gate scales a token's whole row, so it may scale this rank's partial sum)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return self.experts.reduce(out)

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, batch) -> tuple:
        """(self(norm(x + residual)), x + residual): the dense MLP's fused few-rows hook, unfused here."""
        x, residual = norm(x, residual)
        return self(x, batch), residual


class Router(nn.Module):
    """DeepSeek-V3's router: a logit per expert, and the learnt bias added to the scores when choosing."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class GroupRoutedMoE(nn.Module):
    """DeepSeek-V3's MoE layer: group-limited routing over sigmoid scores, and shared experts.

    Each token's scores are sigmoid(router logits); the choice ranks them plus e_score_correction_bias.
    The experts form `n_group` equal groups, a group ranked by the sum of its two best biased scores; the
    token's `top_k` experts are the best among the `topk_group` best groups. Their weights are the
    unbiased scores, renormalised over the k when `norm_topk_prob`, times `routed_scaling_factor`. A
    dense SiLU-gated MLP (`shared_experts`) runs on every token and its output is added.

    Under tensor parallelism the shared experts' width is split like a dense MLP's: the rank's partial
    shared output (its down_proj product, not reduced) is added to its routed experts' share, and one
    all-reduce sums both."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from ddtree.models.transformer import MLP
        moe = cfg.moe
        self.moe = moe
        self.gate = Router(moe.num_experts, cfg.hidden_size)
        self.experts = Experts(moe.held_experts or moe.num_experts, cfg.hidden_size, moe.intermediate_size,
                               moe.first_expert)
        if moe.shared_intermediate_size:
            self.shared_experts = MLP(cfg, moe.shared_intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, k], weights [T, k] float32) of each token."""
        moe, T = self.moe, x.shape[0]
        scores = torch.sigmoid(x.float() @ self.gate.weight.float().t())
        biased = scores + self.gate.e_score_correction_bias.float()
        grouped = biased.view(T, moe.n_group, -1)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros(T, moe.n_group, dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, -1)
        experts = biased.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * moe.routed_scaling_factor

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self.experts.share(x, experts, weights.to(x.dtype), batch is not None and batch.use_triton)
        if self.moe.shared_intermediate_size:
            out = out + self.shared_experts.partial(x)
        return self.experts.reduce(out)

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, batch) -> tuple:
        """(self(norm(x + residual)), x + residual): the dense MLP's fused few-rows hook, unfused here."""
        x, residual = norm(x, residual)
        return self(x, batch), residual
