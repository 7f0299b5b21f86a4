"""Routed experts (models/moe.py): tiny Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next and Qwen2-MoE targets against
transformers, and DFlash / DDTree on them against plain AR."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree import LLM, SamplingParams
from ddtree.config import ModelConfig
from tiny import make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", page_size=4, num_pages=96)
PROMPTS = [list(range(3, 40)), [5, 9, 11], list(range(200, 290, 3)), [7]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i) for i in range(4)]


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory) -> tuple[str, str]:
    from ddtree.models.dflash import random_drafter, save_drafter
    root = tmp_path_factory.mktemp("moe")
    model = make_tiny_model(str(root / "target"), "qwen3_moe")
    cfg = ModelConfig.from_dir(model)
    save_drafter(random_drafter(cfg, num_layers=1, block_size=8, target_layer_ids=[0, cfg.num_layers - 1]),
                 str(root / "drafter"))
    return model, str(root / "drafter")


def test_the_config_has_experts_in_every_other_layer(moe_pair):
    moe = ModelConfig.from_dir(moe_pair[0]).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.layers) == (8, 2, 32, [1, 3])


def test_batched_greedy_generation_equals_transformers_prompt_by_prompt(moe_pair):
    # Requests of different lengths share each forward, so one expert runs over several requests' tokens.
    from transformers import AutoModelForCausalLM
    model, _ = moe_pair
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    got = LLM(model, **ENGINE).generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_dflash_and_ddtree_commit_exactly_ar_tokens_greedy_and_seeded(moe_pair):
    from test_spec import speculation_commits_ar_tokens
    model, draft = moe_pair
    llm = LLM(model, draft=draft, spec="none", **ENGINE)
    speculation_commits_ar_tokens(llm, PROMPTS, [(GREEDY, llm.generate(PROMPTS, GREEDY)),
                                                 (SEEDED, llm.generate(PROMPTS, SEEDED))])


def test_stacked_expert_checkpoints_load_alike_and_a_missing_expert_is_named(moe_pair, tmp_path):
    # transformers may store the experts stacked ([E, 2I, D] gate|up, [E, D, I] down) or one tensor each.
    model, _ = moe_pair
    tensors = load_file(os.path.join(model, "model.safetensors"))
    stacked, lone = {}, dict(tensors)
    for layer in (1, 3):
        prefix = f"model.layers.{layer}.mlp.experts"
        pick = {p: [lone.pop(f"{prefix}.{e}.{p}.weight") for e in range(8)] for p in ("gate_proj", "up_proj", "down_proj")}
        stacked[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(pick["gate_proj"], pick["up_proj"])])
        stacked[f"{prefix}.down_proj"] = torch.stack(pick["down_proj"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(model, name), "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read())
    save_file({**lone, **stacked}, str(tmp_path / "model.safetensors"))
    assert LLM(str(tmp_path), **ENGINE).generate(PROMPTS[:2], GREEDY)[0].token_ids == \
        LLM(model, **ENGINE).generate(PROMPTS[:2], GREEDY)[0].token_ids
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model.layers.3.mlp.experts:5:up_proj"):
        LLM(str(tmp_path), **ENGINE)


def test_train_drafter_trains_against_an_moe_target_and_its_drafter_is_lossless(moe_pair, tmp_path):
    from ddtree.cli import main
    model, _ = moe_pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    out = tmp_path / "drafter"
    rc = main(["train-drafter", "--target", model, "--out", str(out), "--prompt-file", str(prompts),
               "--max-new-tokens", "8", "--steps", "3", "--batch-size", "2", "--block-size", "4",
               "--num-features", "2", "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    want = LLM(model, **ENGINE).generate(PROMPTS, GREEDY)
    got = LLM(model, draft=str(out), spec="ddtree", budget=6, topk=2, **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_grouped_products_and_one_product_per_expert_give_the_same_tokens(moe_pair, monkeypatch):
    # The device-only path (two grouped products over the held experts, which CUDA graphs capture) and
    # the host-grouped one (a product per expert used, where grouped products do not run) agree.
    from ddtree.models import moe
    model, _ = moe_pair
    want = [o.token_ids for o in LLM(model, **ENGINE).generate(PROMPTS, SEEDED)]
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda x: False)
    assert [o.token_ids for o in LLM(model, **ENGINE).generate(PROMPTS, SEEDED)] == want


@pytest.mark.parametrize("spec", [None, "ddtree"])
def test_graphed_bursts_emulated_on_cpu_equal_eager_ar(spec, moe_pair, monkeypatch):
    # MoE targets take the GPU's graphed path (CUDA graphs emulated): AR decode bursts and whole DDTree
    # steps route every row's tokens with device ops only, padding rows included.
    from emulated import fake_gpu_graphs
    model, drafter = moe_pair
    want = [o.token_ids for o in LLM(model, **ENGINE).generate(PROMPTS, SEEDED)]
    fake_gpu_graphs(monkeypatch)
    llm = LLM(model, draft=drafter if spec else None, spec=spec or "none", budget=8, topk=2, **ENGINE, max_num_seqs=3)
    assert (llm.engine.speculator.graphs if spec else llm.engine.ar.decode_graphs) is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == want


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("tokens, first", [(3, 0), (40, 0), (9, 4)])
def test_the_triton_experts_equal_one_product_per_expert(tokens, first):
    # ops/triton_moe.py over few pairs an expert (3 tokens), an expert with more pairs than a tile (40
    # tokens piled on two experts), and a rank holding experts 4-7 of 12 (pairs of the others left out);
    # widths off the column and depth tiles.
    from ddtree.models.moe import Experts
    g = torch.Generator().manual_seed(tokens)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    experts = Experts(4 if first else 8, hidden=40, width=24, first=first)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2, generator=g)
        experts.down_proj.normal_(0, 0.2, generator=g)
    experts = experts.to(dev)
    x = torch.randn(tokens, 40, generator=g).to(dev)
    chosen = torch.randint(0, 12 if first else 8, (tokens, 2), generator=g)
    if tokens > 32:
        chosen = torch.stack([torch.full((tokens,), 1), torch.randint(0, 8, (tokens,), generator=g)], 1)
        chosen[:, 1] = torch.where(chosen[:, 1] == 1, 3, chosen[:, 1])
    weights = torch.rand(tokens, 2, generator=g)
    chosen, weights = chosen.to(dev), weights.to(dev)
    want = experts._by_expert(x, chosen, weights)
    got = experts(x, chosen, weights, use_triton=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("top_k, normalise", [(2, True), (3, False)])
def test_the_triton_router_picks_torch_s_top_k_and_weights(top_k, normalise):
    from ddtree.ops.triton_moe import softmax_topk
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(top_k)).to(dev)
    experts, weights = softmax_topk(logits, top_k, normalise)
    want_w, want_e = torch.softmax(logits, -1).topk(top_k, dim=-1)
    if normalise:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(experts, want_e)
    torch.testing.assert_close(weights, want_w)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton path on the CPU: its interpreter")
def test_the_triton_path_generates_like_the_torch_path(moe_pair):
    # The whole target on the Triton kernels (attention, few-row products, routed experts), batched
    # prompts and decode steps, gives the torch path's tokens.
    model, _ = moe_pair
    prompts, params = PROMPTS[:2], SamplingParams(max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, kernels="torch", **ENGINE).generate(prompts, params)]
    assert [o.token_ids for o in LLM(model, kernels="triton", **ENGINE).generate(prompts, params)] == want


# Targets with a gated shared expert: the hybrid Qwen3.5-MoE (routed experts and the shared expert in every
# layer) and Qwen3-Next (the same, a dense MLP in layer 1, the top-k weights not renormalised, fused Gated
# DeltaNet projections), and Qwen2-MoE (attention layers with q/k/v biases, a dense MLP in layer 1, the top-k
# weights not renormalised), each with transformers' model (the oracle) and a random drafter.
@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next", "qwen2_moe"])
def shared_moe(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ddtree.models.dflash import random_drafter, save_drafter
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(str(root / "target"), request.param)
    cfg = ModelConfig.from_dir(model)
    save_drafter(random_drafter(cfg, num_layers=1, block_size=8, target_layer_ids=[0, cfg.num_layers - 1]),
                 str(root / "drafter"))
    return model, str(root / "drafter"), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def test_shared_expert_moe_configs_read_their_layer_kinds_experts_and_shared_expert():
    from tiny import make_config
    q35 = ModelConfig.from_dict(make_config("qwen3_5_moe", 384).to_dict())
    nxt = ModelConfig.from_dict(make_config("qwen3_next", 384).to_dict())
    for cfg in (q35, nxt):
        assert cfg.is_hybrid and cfg.linear_layers == [0, 1, 2] and cfg.attention_layers == [3]
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.shared_intermediate_size) == (8, 2, 48)
    assert q35.moe.layers == [0, 1, 2, 3] and q35.moe.norm_topk_prob  # (its router always renormalises)
    assert nxt.moe.layers == [0, 2, 3] and not nxt.moe.norm_topk_prob  # (mlp_only_layers=[1])
    # a multimodal checkpoint's config: its text model's
    outer = {"model_type": "qwen3_5_moe", "text_config": make_config("qwen3_5_moe", 384).to_dict()}
    assert ModelConfig.from_dict(outer).model_type == "qwen3_5_moe_text"
    q2 = make_config("qwen2_moe", 384).to_dict()
    del q2["norm_topk_prob"]  # (Qwen2-MoE's default: not renormalised)
    q2 = ModelConfig.from_dict(q2)
    assert not q2.is_hybrid and q2.qkv_bias and not q2.qk_norm and not q2.moe.norm_topk_prob
    assert (q2.moe.layers, q2.moe.shared_intermediate_size, q2.intermediate_size) == ([0, 2], 48, 128)


def test_shared_expert_moe_logprobs_and_greedy_output_equal_transformers_alone_and_batched(shared_moe):
    # Batched requests of different lengths, their prompts chunked (a hybrid's recurrent state carried between
    # chunks): the tokens, and the log-probability of each, are transformers' for each prompt alone.
    from test_hybrid import assert_idle, reference
    model, _, hf = shared_moe
    n = 12
    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)
    llm = LLM(model, **ENGINE, max_num_batched_tokens=16)
    batched = llm.generate(PROMPTS, params)
    alone = llm.generate(PROMPTS[:1], params)[0]
    for prompt, got in zip(PROMPTS, batched):
        want, logp = reference(hf, prompt, n)
        assert got.token_ids == want
        torch.testing.assert_close(torch.tensor([lp for lp, _ in got.logprobs]),
                                   logp.gather(1, torch.tensor(want)[:, None])[:, 0], atol=1e-4, rtol=0)
    assert alone.token_ids == batched[0].token_ids
    if llm.engine.allocator.num_state_slots:  # (hybrid: the recurrent state slots are free too)
        assert_idle(llm)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


@pytest.mark.parametrize("shared_moe", ["qwen3_5_moe", "qwen2_moe"], indirect=True)  # (Qwen3-Next's: Qwen3.5-MoE's)
def test_shared_expert_moe_dflash_and_ddtree_commit_exactly_ar_tokens_greedy_and_seeded(shared_moe):
    # Tree nodes see their ancestors' recurrent state only, and every node's tokens go through the experts.
    from test_spec import speculation_commits_ar_tokens
    model, draft, _ = shared_moe
    llm = LLM(model, draft=draft, spec="none", **ENGINE)
    speculation_commits_ar_tokens(llm, PROMPTS, [(GREEDY, llm.generate(PROMPTS, GREEDY)),
                                                 (SEEDED, llm.generate(PROMPTS, SEEDED))])


@pytest.mark.parametrize("shared_moe", ["qwen3_5_moe"], indirect=True)
@pytest.mark.parametrize("spec", [None, "ddtree"])
def test_hybrid_moe_graphed_bursts_emulated_on_cpu_equal_eager_ar(spec, shared_moe, monkeypatch):
    # The GPU's graphed path (CUDA graphs emulated): recurrent states and routed experts with device ops
    # only, in AR decode bursts and whole DDTree steps, padding rows included.
    from emulated import fake_gpu_graphs
    model, drafter, _ = shared_moe
    want = [o.token_ids for o in LLM(model, **ENGINE).generate(PROMPTS, SEEDED)]
    fake_gpu_graphs(monkeypatch)
    llm = LLM(model, draft=drafter if spec else None, spec=spec or "none", budget=8, topk=2, **ENGINE, max_num_seqs=3)
    assert (llm.engine.speculator.graphs if spec else llm.engine.ar.decode_graphs) is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == want


def test_a_multimodal_qwen3_5_moe_checkpoint_with_stacked_experts_loads_its_text_model(tmp_path):
    # Published Qwen3.5-MoE checkpoints are Qwen3_5MoeForConditionalGeneration (the text model under
    # model.language_model.*, beside a vision tower), their experts stacked ([E, 2I, D] gate|up, [E, D, I]
    # down) where transformers saves one tensor each: both load, and generate as transformers does.
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    from tiny import make_config
    cfg = Qwen3_5MoeConfig(text_config=make_config("qwen3_5_moe", 384).to_dict(),
                           vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=64))
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    hf.save_pretrained(str(tmp_path))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    lone = LLM(str(tmp_path), **ENGINE).generate(PROMPTS[:2], params)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for layer in range(4):
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        pick = {p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(8)] for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(pick["gate_proj"], pick["up_proj"])])
        tensors[f"{prefix}.down_proj"] = torch.stack(pick["down_proj"])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    stacked = LLM(str(tmp_path), **ENGINE).generate(PROMPTS[:2], params)
    for prompt, a, b in zip(PROMPTS, lone, stacked):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert a.token_ids == b.token_ids == want[0, len(prompt):].tolist()
