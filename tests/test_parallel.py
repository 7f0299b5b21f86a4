"""Tensor parallelism (ddtree/parallel/): the target split over 2 ranks (this process and a spawned worker,
gloo on the CPU), against the same model on one rank and against transformers."""
import dataclasses
import multiprocessing
import os
import signal
import time

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.config import ModelConfig, ParallelConfig
from ddtree.parallel.shard import ELSEWHERE, ZEROS, Shard, shard_config, tensor_part
from ddtree.parallel.workers import WorkerError
from test_deepseek import VARIANTS as DEEPSEEK
from tiny import make_config, make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", page_size=4, num_pages=96)
PROMPTS = [list(range(3, 40)), list(range(100, 107)), [5], list(range(200, 290, 3))]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
# (family, overrides): 2 KV heads over 2 ranks, 1 KV head on both ranks, and a hybrid (Gated DeltaNet heads
# split). An even vocabulary is split between the ranks; the odd one (the tokenizer's 381) stays whole.
EVEN = dict(vocab_size=384)
# And routed experts, 4 of 8 on each rank; DeepSeek-V3 (MLA heads split, the latent whole; routed experts
# split, the shared expert and the dense first layer's MLP split like an MLP), with a low-rank query and
# with a full-rank one (test_deepseek.py's variants). Hybrid MoE: Qwen3.5-MoE (routed experts split, the
# gated shared expert split like an MLP, its gate whole) and Qwen3-Next (its fused Gated DeltaNet
# projections split by key-head groups, a dense MLP in layer 1); Qwen2-MoE (q/k/v biases, the gated shared
# expert, a dense MLP in layer 1).
TARGETS = {"qwen2": ("qwen2", EVEN), "qwen3": ("qwen3", EVEN), "llama": ("llama", EVEN),
           "qwen3-1kv-odd-vocab": ("qwen3", dict(num_key_value_heads=1)), "qwen3_5": ("qwen3_5", EVEN),
           "qwen3_moe": ("qwen3_moe", EVEN), "deepseek_v3": ("deepseek_v3", {**EVEN, **DEEPSEEK["q_lora"]}),
           "deepseek_v3-full-q-odd-vocab": ("deepseek_v3", DEEPSEEK["full_q"]), "qwen3_5_moe": ("qwen3_5_moe", EVEN),
           "qwen3_next-odd-vocab": ("qwen3_next", {}), "qwen2_moe": ("qwen2_moe", EVEN)}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory) -> tuple[str, str]:
    """A tiny target and a random drafter for it."""
    from ddtree.models.dflash import random_drafter, save_drafter
    family, overrides = TARGETS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(str(root / "target"), family, **overrides)
    cfg = ModelConfig.from_dir(model)
    save_drafter(random_drafter(cfg, num_layers=1, block_size=8, target_layer_ids=[0, cfg.num_layers - 1]),
                 str(root / "drafter"))
    return model, str(root / "drafter")


def test_two_ranks_equal_one_rank_and_transformers_under_ar_dflash_and_ddtree(target):
    # AR greedy and seeded sampled outputs on 2 ranks equal 1 rank's (and transformers' greedy); DFlash and
    # DDTree on 2 ranks, their drafter a noisy oracle of AR's output (accepts deep and along side
    # branches, so K/V moves and hybrid state commits run on every rank), commit exactly AR's tokens.
    from transformers import AutoModelForCausalLM

    from test_spec import speculation_commits_ar_tokens
    model, draft = target
    one = LLM(model, **ENGINE)
    want, want_seeded = one.generate(PROMPTS, GREEDY), one.generate(PROMPTS, SEEDED)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert want[0].token_ids == hf_out[0, len(PROMPTS[0]):].tolist()
    with LLM(model, draft=draft, spec="none", tensor_parallel_size=2, **ENGINE) as llm:
        vocab = llm.config.vocab_size
        assert llm.shard_config.vocab_part == (None if vocab % 2 else (0, vocab // 2))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
        assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == [o.token_ids for o in want_seeded]
        speculation_commits_ar_tokens(llm, PROMPTS, [(GREEDY, want), (SEEDED, want_seeded)])


def test_each_rank_reads_a_tiling_share_of_every_split_tensor(target):
    # The ranks' slices of each checkpoint tensor cover it exactly once (KV heads fewer than the ranks:
    # each rank the one its query heads share); row-parallel biases live on rank 0 only. MLA: the latent
    # projections, their norms and the router are whole on both ranks, and the per-head tensors split
    # between heads (kv_b_proj's rows: each head's key part, then its value part).
    from ddtree.models.loader import iter_tensors, text_model_name
    model, _ = target
    cfg = ModelConfig.from_dir(model)
    mla = cfg.mla
    per_head = mla and {"q_proj": mla.qk_nope_head_dim + mla.qk_rope_head_dim, "o_proj": mla.v_head_dim,
                        "q_b_proj": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                        "kv_b_proj": mla.qk_nope_head_dim + mla.v_head_dim}
    for name, tensor in iter_tensors(model):
        name = text_model_name(name)
        parts = [tensor_part(name, cfg, Shard(r, 2)) for r in range(2)]
        module = name.rsplit(".", 2)[-2]
        if mla and module in ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm", "gate"):
            assert parts == [None, None], name
        if parts[0] is None and parts[1] is None:
            continue
        if ZEROS in parts:
            assert parts == [None, ZEROS], name
            continue
        if ELSEWHERE in parts:  # a routed expert's tensor: on exactly one rank
            assert None in parts, name
            continue
        dim = parts[0].dim
        got = sorted(rng for p in parts for rng in p.ranges)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")) and cfg.num_kv_heads < 2:
            assert got[0] == got[1] == (0, tensor.shape[dim]), name
            continue
        assert got[0][0] == 0 and got[-1][1] == tensor.shape[dim], name
        assert all(a[1] == b[0] for a, b in zip(got, got[1:])), (name, got)
        if mla and module in per_head:  # (each rank: num_heads / 2 whole heads)
            assert got[1][0] == cfg.num_heads // 2 * per_head[module], (name, got)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_worker_starts(tiny_qwen2):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's num_attention_heads 4"):
        LLM(tiny_qwen2, tensor_parallel_size=3, **ENGINE)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("ddtree-tp")]
    with pytest.raises(ValueError, match="positive"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="dist_init_addr"):
        ParallelConfig(tensor_parallel_size=4, nnodes=2)
    full = ModelConfig.from_dir(tiny_qwen2)
    cfg = shard_config(full, Shard(1, 2))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, 1, 64)
    assert full.vocab_size % 2 and cfg.vocab_part is None  # (ranks that do not divide the vocabulary: the
    even = dataclasses.replace(full, vocab_size=384)  # embedding and the LM head stay whole)
    assert shard_config(even, Shard(1, 2)).vocab_part == (192, 384)
    from ddtree.config import MoEConfig
    moe = dataclasses.replace(full, moe=MoEConfig(num_experts=6, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                                  layers=[1]))
    assert shard_config(moe, Shard(1, 2)).moe.first_expert == 3
    with pytest.raises(ValueError, match="num_experts 6"):
        shard_config(moe, Shard(0, 4))
    deepseek = ModelConfig.from_dict(make_config("deepseek_v3", 384).to_dict())  # (4 heads, 8 experts, shared 32)
    part = shard_config(deepseek, Shard(1, 2))
    assert (part.num_heads, part.num_kv_heads, part.head_dim, part.intermediate_size) == (2, 1, 40, 64)
    assert (part.moe.first_expert, part.moe.held_experts, part.moe.shared_intermediate_size) == (4, 4, 16)
    with pytest.raises(ValueError, match="num_attention_heads 4, .*num_experts 8, shared experts' width 32"):
        shard_config(deepseek, Shard(0, 64))


def test_a_deepseek_moe_layer_sums_its_shared_and_routed_shares_in_one_all_reduce(monkeypatch):
    # The shared experts' partial output joins the routed experts' share before the layer's all-reduce.
    from ddtree.models.loader import fill_random
    from ddtree.models.transformer import CausalLM
    from ddtree.parallel.workers import bind_group
    cfg = shard_config(ModelConfig.from_dict(make_config("deepseek_v3", 384).to_dict()), Shard(0, 2))
    model = CausalLM(cfg)
    fill_random(model)
    bind_group(model, "step")
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group: calls.append(group))
    out = model.model.layers[1].mlp(torch.randn(5, cfg.hidden_size))
    assert out.shape == (5, cfg.hidden_size) and calls == ["step"]


def worker() -> multiprocessing.Process:
    (proc,) = [p for p in multiprocessing.active_children() if p.name.startswith("ddtree-tp-rank1")]
    return proc


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_worker_fails_the_next_call_with_a_clear_error_in_bounded_time(how, tiny_qwen2):
    llm = LLM(tiny_qwen2, tensor_parallel_size=2, parallel=None, **ENGINE) if how == "killed" else \
        LLM(tiny_qwen2, parallel=ParallelConfig(tensor_parallel_size=2, timeout_s=5), **ENGINE)
    try:
        llm.generate(PROMPTS[:1], GREEDY)
        proc = worker()
        os.kill(proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 exited" if how == "killed" else "collective among the ranks"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkerError):  # and stays failed
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        if how == "hung":
            os.kill(proc.pid, signal.SIGKILL)
        llm.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("ddtree-tp")]


def test_a_world_of_one_runs_the_ranks_machinery_and_equals_the_plain_engine(tiny_qwen2):
    # dist_init_addr with one rank: the process joins a group of one, its row-parallel layers all-reduce
    # over it and every target call is announced, with nobody to hear them; the output is unchanged.
    from ddtree.parallel.workers import free_port
    want = LLM(tiny_qwen2, **ENGINE).generate(PROMPTS, SEEDED)
    with LLM(tiny_qwen2, parallel=ParallelConfig(dist_init_addr=f"127.0.0.1:{free_port()}"), **ENGINE) as llm:
        assert llm.tp is not None
        assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == [o.token_ids for o in want]
