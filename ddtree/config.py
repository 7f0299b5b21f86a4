"""Configuration dataclasses: the model's shape (read from a Hugging Face config.json) and the engine's knobs."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_moe",
                         "qwen2_moe", "deepseek_v3")
# Gated DeltaNet layers between full-attention ones (models/hybrid.py)
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
QWEN_MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next", "qwen2_moe")  # softmax-routed experts (`qwen_moe`)


@dataclass(slots=True)
class MoEConfig:
    """Routed experts (models/moe.py): `num_experts` SiLU-gated MLPs of width `intermediate_size`, of
    which a router picks `top_k` per token, in the layers `layers` (the others have the dense MLP)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: list[int]
    # Tensor parallelism: the rank holds `held_experts` of them (None: all), from `first_expert` on
    first_expert: int = 0
    held_experts: int | None = None
    # DeepSeek-V3 routing ("sigmoid"): sigmoid scores, biased by a learnt correction when choosing, the
    # choice limited to the `topk_group` best of `n_group` expert groups, the weights times
    # `routed_scaling_factor`.
    # A shared SiLU-gated MLP of width `shared_intermediate_size` (0: none) runs on every token: with
    # "sigmoid" routing DeepSeek-V3's `shared_experts`, added as is; with "softmax" routing Qwen's
    # `shared_expert` (Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next), scaled by sigmoid(`shared_expert_gate` . x).
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0


@dataclass(slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3, models/mla.py). The KV cache holds one vector per token:
    the latent `kv_lora_rank` channels, then the rotated `qk_rope_head_dim` key channels shared by all
    heads (ModelConfig's num_kv_heads 1 and head_dim their sum)."""
    q_lora_rank: int | None  # None: q comes from one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are channels (2i, 2i + 1), not (i, i + D/2)
    scale: float  # the softmax scale


@dataclass(slots=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model: query/key heads, value heads, and the causal
    convolution's kernel over q|k|v."""
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False  # Llama with attention_bias also biases o_proj; Qwen2 does not
    rope_scaling: dict | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Hybrid models: each layer's kind ("linear_attention" or "full_attention"), the linear layers'
    # shape, the rotated share of an attention head, and the attention output gate.
    layer_types: list[str] | None = None
    linear: LinearAttentionConfig | None = None
    rotary_dim: int | None = None  # None: the whole head
    attn_output_gate: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    # Tensor parallelism: this rank's rows [start, end) of the embedding and the LM head (parallel/shard.py)
    vocab_part: tuple[int, int] | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None

    @property
    def attention_layers(self) -> list[int]:
        """The layers with a KV cache."""
        return [i for i, t in enumerate(self.layer_types or ["full_attention"] * self.num_layers)
                if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        """The layers with a recurrent state (hybrid models)."""
        return [i for i, t in enumerate(self.layer_types or []) if t == "linear_attention"]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        text = cfg.get("text_config")
        if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES and isinstance(text, dict):
            # a multimodal checkpoint (Qwen3.5's): its text model, which models/loader.py loads alone; the
            # top-level flag decides tying, false when absent (as in transformers)
            text = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
            text.setdefault("eos_token_id", cfg.get("eos_token_id"))
            return cls.from_dict(text)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; ddtree supports {SUPPORTED_MODEL_TYPES}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        hybrid = model_type in HYBRID_MODEL_TYPES
        rope = cfg.get("rope_parameters") or {}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        extra = {}
        if hybrid:
            every = cfg.get("full_attention_interval", 4)
            extra = dict(
                layer_types=cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                                       for i in range(cfg["num_hidden_layers"])],
                linear=LinearAttentionConfig(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                                             cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
                                             cfg["linear_conv_kernel_dim"]),
                rotary_dim=int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
                attn_output_gate=True)
            if cfg.get("attention_bias", False):
                raise ValueError(f"{model_type}: attention_bias is not supported")
        if model_type in QWEN_MOE_MODEL_TYPES:
            extra["moe"] = qwen_moe(cfg, model_type)
        if model_type == "deepseek_v3":
            extra.update(deepseek_v3_parts(cfg, rope))
            head_dim = extra["mla"].kv_lora_rank + extra["mla"].qk_rope_head_dim
        rope_scaling = extra.pop("rope_scaling", cfg.get("rope_scaling"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or dense_width(cfg),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if model_type == "deepseek_v3" else cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias is false; Llama only with
            # attention_bias; Qwen3 never.
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
            or (model_type == "llama" and bool(cfg.get("attention_bias", False))),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or hybrid,
            o_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=eos,
            **extra,
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        mc = cls.from_dict(cfg)
        gen = os.path.join(path, "generation_config.json")
        if os.path.exists(gen):  # generation_config often lists more stop ids than config.json
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            for e in [eos] if isinstance(eos, int) else (eos or []):
                if e not in mc.eos_token_ids:
                    mc.eos_token_ids.append(e)
        return mc


def qwen_moe(cfg: dict, model_type: str) -> MoEConfig:
    """The routed experts of a Qwen MoE config: softmax top-k routing; experts in every
    `decoder_sparse_step`-th layer but those of `mlp_only_layers` (Qwen3.5-MoE has neither: every layer),
    and a shared expert where `shared_expert_intermediate_size` is set. Qwen3.5-MoE's router always
    renormalises the k weights (its config has no `norm_topk_prob`); Qwen2-MoE's `norm_topk_prob`
    defaults to false, the others' to true."""
    experts, step = cfg.get("num_experts") or cfg.get("num_local_experts"), cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return MoEConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                     model_type == "qwen3_5_moe_text" or bool(cfg.get("norm_topk_prob", model_type != "qwen2_moe")),
                     [i for i in range(cfg["num_hidden_layers"])
                      if i not in dense and experts > 0 and (i + 1) % step == 0],
                     shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)


def dense_width(cfg: dict) -> int:
    """ModelConfig.intermediate_size for a config without one (Qwen3.5-MoE: no dense MLP anywhere): a
    token's routed experts' total width, the widest activation of a layer (the runner's memory
    estimate) and a new drafter's default MLP width."""
    return cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]


def deepseek_v3_parts(cfg: dict, rope: dict) -> dict:
    """ModelConfig's fields particular to a DeepSeek-V3 config: MLA, the routed and shared experts, the
    rotary width. Settings ddtree does not run raise ValueError."""
    scaling = cfg.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"deepseek_v3: rope type {kind!r} is not supported (only 'default' and 'yarn')")
    if kind == "yarn" and "original_max_position_embeddings" not in scaling:
        raise ValueError("deepseek_v3: yarn rope scaling needs original_max_position_embeddings")
    if cfg.get("attention_bias", False):
        raise ValueError("deepseek_v3: attention_bias is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"deepseek_v3: hidden_act {cfg.get('hidden_act')!r} is not supported (only 'silu')")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"deepseek_v3: scoring_func {cfg.get('scoring_func')!r} / moe_layer_freq "
                         f"{cfg.get('moe_layer_freq')} are not supported (only 'sigmoid' / 1)")
    experts, groups = cfg.get("n_routed_experts") or 0, cfg.get("n_group") or 1
    if experts and (experts % groups or experts // groups < 2):
        raise ValueError(f"deepseek_v3: n_routed_experts {experts} do not split into n_group {groups} groups "
                         "of 2 or more")
    nope, pe = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + pe) ** -0.5
    if kind == "yarn" and scaling.get("mscale_all_dim"):  # YaRN's mscale, on every channel of q . k
        factor = scaling.get("factor") or \
            cfg.get("max_position_embeddings", 32768) / scaling["original_max_position_embeddings"]
        if factor > 1:
            scale *= (0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0) ** 2
    mla = MLAConfig(cfg.get("q_lora_rank"), cfg["kv_lora_rank"], nope, pe, cfg["v_head_dim"],
                    bool(cfg.get("rope_interleave", True)), scale)
    first_moe = cfg.get("first_k_dense_replace") or 0
    moe = MoEConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                    bool(cfg.get("norm_topk_prob", True)),
                    [i for i in range(cfg["num_hidden_layers"]) if i >= first_moe] if experts else [],
                    scoring="sigmoid", n_group=groups, topk_group=cfg.get("topk_group") or 1,
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"])
    return dict(mla=mla, moe=moe, rotary_dim=pe, rope_scaling=scaling if kind == "yarn" else None)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    # bf16 matmuls are fast on GPUs; on CPU fp32 is both faster and exact enough for parity tests.
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def parse_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


@dataclass(slots=True, frozen=True)
class PolicyConfig:
    """`budget="auto"`'s tunables (the policy: speculative/policy.py; why each value: docs/auto.md)."""
    budgets: tuple[int, ...] = (4, 8, 16, 32)
    """Speculative budgets the plan chooses among (each capped by what the drafter's tree holds); AR is always one."""
    margin: float = 1.05
    """How many times the current mode's tokens per ms the other mode (AR or speculation) must reach to take over."""
    spread: float = 3.0
    """Optimism in accepted tokens, over the root of 1 + the verified request-steps, where `hopeless` is judged."""
    text_spread: float = 0.7
    """... and over the batch size squared: one request's text may be far easier than the run's so far."""
    probe_share: float = 0.01
    """On AR where speculation could win, a probe once the AR time since the last verify is its loss over this."""
    horizon: int = 128
    """Tokens a text's acceptance is taken to hold for: a switch pays back over them; on AR, a probe after as many."""
    decay: float = 0.1
    """Weight of a new sample in the learnt step-cost corrections, after a plain mean over the first ones."""
    trace: str | None = None
    """A file that gets one JSON line per plan (what the plan saw and chose); None: no trace."""

    def __post_init__(self):
        if not self.budgets or min(self.budgets) < 1 or self.margin < 1 or not 0 < self.probe_share <= 1:
            raise ValueError(f"invalid policy settings: {self}")


@dataclass(slots=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: sized from memory (GPU) or a fixed budget (CPU)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # prefill tokens per step (long prompts are chunked)
    max_model_len: int | None = None  # None: the model's max_position
    kv_cache_gb: float = 2.0  # CPU: memory for the KV cache when num_pages is None
    gpu_memory_utilization: float = 0.85
    cuda_graphs: bool = True  # decode steps replay CUDA graphs on GPU (eager is for debugging only)
    # The kernels: "auto" (Triton on a GPU, torch ops elsewhere), "torch" (the reference ops everywhere, to
    # debug) or "triton" (also on the CPU, in Triton's interpreter: TRITON_INTERPRET=1 set before start).
    kernels: str = "auto"
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # budget "auto"
    # Requests that begin with the tokens of an earlier one reuse its full pages of K/V (engine/kv_cache.py).
    enable_prefix_caching: bool = True
    # Hybrid targets under prefix caching: recurrent-state snapshots kept, one a cached prompt prefix (the
    # state after its last full page), each the size of a running request's state; None: max_num_seqs.
    prefix_state_snapshots: int | None = None

    def __post_init__(self):
        if self.prefix_state_snapshots is not None and self.prefix_state_snapshots < 0:
            raise ValueError(f"prefix_state_snapshots must be >= 0, got {self.prefix_state_snapshots}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', got {self.kernels!r}")

    def state_snapshots(self, hybrid: bool) -> int:
        """Recurrent-state snapshots the prefix cache keeps (0: a dense target, or no prefix caching)."""
        if not (hybrid and self.enable_prefix_caching):
            return 0
        return self.max_num_seqs if self.prefix_state_snapshots is None else self.prefix_state_snapshots

    def use_triton(self, device: torch.device) -> bool:
        """Whether the Triton kernels run on `device`."""
        if self.kernels == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels='triton' off a GPU runs Triton's interpreter: set TRITON_INTERPRET=1 "
                             "before starting")
        return self.kernels == "triton" or (self.kernels == "auto" and device.type == "cuda")


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism (parallel/): the model split over `tensor_parallel_size` ranks, one process
    each, `nnodes` hosts with the same number of ranks on each. Rank 0 (on node 0) runs the engine.
    `dist_init_addr` ("host:port") is where the ranks meet: on one host a free local port by default;
    every node of a multi-host run must be given node 0's."""
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    timeout_s: float = 60.0  # a collective that waits longer for a rank fails (a hung or lost worker)

    def __post_init__(self):
        n = self.tensor_parallel_size
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if self.nnodes < 1 or n % self.nnodes:
            raise ValueError(f"tensor_parallel_size {n} must be a multiple of nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("a run over several nodes needs dist_init_addr (node 0's host:port)")

    @property
    def distributed(self) -> bool:
        """Whether the ranks' machinery runs: over several ranks, or over one when `dist_init_addr` is
        given (a world of one, whose collectives and their CUDA graphs can be checked on one GPU)."""
        return self.tensor_parallel_size > 1 or self.dist_init_addr is not None

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes
