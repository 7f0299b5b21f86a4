"""DeepSeek-V3 (models/mla.py, moe.py GroupRoutedMoE): tiny targets against transformers, and DFlash /
DDTree on them against plain AR."""
import math
import os

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.config import EngineConfig, ModelConfig
from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sequence import Sequence
from ddtree.models.loader import load_model
from test_models import all_logits
from tiny import make_config, make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", page_size=4, num_pages=96)
PROMPTS = [list(range(3, 40)), [5, 9, 11], list(range(200, 290, 3)), [7]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
# A low-rank query and interleaved rotary pairs; a full-rank query and rotary halves; YaRN rotary scaling.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {"q_lora": {}, "full_q": {"q_lora_rank": None, "rope_interleave": False}, "yarn": {"rope_parameters": YARN}}


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_tiny_model(str(root / name), "deepseek_v3", **kw) for name, kw in VARIANTS.items()}


def test_the_config_caches_one_latent_vector_per_token(targets):
    cfg = ModelConfig.from_dir(targets["q_lora"])
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 32 + 8, 8)
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.v_head_dim) == (24, 32, 12)
    assert cfg.mla.scale == pytest.approx((16 + 8) ** -0.5)
    moe = cfg.moe
    assert (moe.layers, moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == ([1, 2], 8, 2, 2, 1)
    assert (moe.routed_scaling_factor, moe.shared_intermediate_size, moe.scoring) == (2.5, 32, "sigmoid")
    assert ModelConfig.from_dir(targets["full_q"]).mla.q_lora_rank is None
    yarn = ModelConfig.from_dir(targets["yarn"])  # (YaRN's mscale_all_dim scales q . k on every channel)
    assert yarn.mla.scale == pytest.approx((16 + 8) ** -0.5 * (0.1 * 0.7 * math.log(4.0) + 1) ** 2)
    model, cfg = load_model(targets["q_lora"])
    runner = ModelRunner(model, cfg, EngineConfig(page_size=4, num_pages=8), torch.device("cpu"), torch.float32)
    assert runner.kv_cache.shape == (1, 3, 9 * 4, 1, 40)  # (one cached vector a token: V is the K cache)
    runner.bind_cache()
    attn = model.model.layers[0].self_attn
    assert attn.v_cache.data_ptr() == attn.k_cache.data_ptr() == runner.kv_cache[0, 0].data_ptr()


@pytest.mark.parametrize("setting", [{"rope_scaling": {"type": "dynamic", "factor": 4.0}},
                                     {"rope_scaling": {"type": "yarn", "factor": 4.0}}, {"attention_bias": True},
                                     {"n_group": 3}, {"scoring_func": "softmax"}])
def test_unsupported_settings_raise_a_clear_error(setting):
    raw = {**make_config("deepseek_v3", 384).to_dict(), **setting}
    with pytest.raises(ValueError, match="deepseek_v3"):
        ModelConfig.from_dict(raw)


def test_routing_equals_transformers_router(targets):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(targets["q_lora"], dtype=torch.float32).eval()
    ours, _ = load_model(targets["q_lora"])
    x = torch.randn(64, 64)
    with torch.no_grad():
        _, ref_w, ref_e = hf.model.layers[2].mlp.gate(x)
        got_e, got_w = ours.model.layers[2].mlp.route(x)
    ref_e, order = ref_e.sort(-1)
    got_e, got_order = got_e.sort(-1)
    assert torch.equal(got_e, ref_e)
    torch.testing.assert_close(got_w.gather(1, got_order), ref_w.gather(1, order))
    assert ((ref_e // 4)[:, 0] == (ref_e // 4)[:, 1]).all()  # (topk_group 1: both experts of one group)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_prefill_and_stepwise_decode(targets, variant):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(targets[variant], dtype=torch.float32).eval()
    ours, cfg = load_model(targets[variant])
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (21,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(ours, cfg, EngineConfig(page_size=4, num_pages=16), torch.device("cpu"), torch.float32)
    seq = Sequence(ids, SamplingParams(), None)
    PageAllocator(16, 4).grow(seq, len(ids))
    with torch.no_grad():
        got = [all_logits(runner, seq, 13)]  # prefill a prefix (crosses pages), then one token at a time
        got += [all_logits(runner, seq, 1) for _ in range(len(ids) - 13)]
    got = torch.cat(got)
    assert (got - ref).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", ["q_lora", "full_q"])
def test_batched_greedy_generation_equals_transformers_prompt_by_prompt(targets, variant):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(targets[variant], dtype=torch.float32).eval()
    got = LLM(targets[variant], **ENGINE).generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_dflash_and_ddtree_commit_exactly_ar_tokens_greedy_and_seeded(targets, tmp_path):
    from ddtree.models.dflash import random_drafter, save_drafter
    from test_spec import speculation_commits_ar_tokens
    model = targets["q_lora"]
    cfg = ModelConfig.from_dir(model)
    save_drafter(random_drafter(cfg, num_layers=1, block_size=8, target_layer_ids=[0, cfg.num_layers - 1]),
                 str(tmp_path / "drafter"))
    llm = LLM(model, draft=str(tmp_path / "drafter"), spec="none", **ENGINE)
    speculation_commits_ar_tokens(llm, PROMPTS, [(GREEDY, llm.generate(PROMPTS, GREEDY)),
                                                 (SEEDED, llm.generate(PROMPTS, SEEDED))])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_the_triton_path_generates_the_torch_paths_tokens(targets, spec, tmp_path):
    # The cached vector (32 + 8 channels: not a power of two) in the Triton kernels, by the interpreter:
    # K/V stores and attention over prompt chunks and decode steps (AR), or over verified trees (DDTree),
    # commit the torch path's greedy tokens.
    from ddtree.models.dflash import random_drafter, save_drafter
    model, prompts = targets["q_lora"], PROMPTS[1:2]
    cfg = ModelConfig.from_dir(model)
    save_drafter(random_drafter(cfg, num_layers=1, block_size=4, target_layer_ids=[0, cfg.num_layers - 1]),
                 str(tmp_path / "drafter"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, spec="none", kernels="torch", **ENGINE).generate(prompts, params)]
    llm = LLM(model, draft=str(tmp_path / "drafter"), spec=spec, budget=4, kernels="triton", **ENGINE)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_multi_token_prediction_layers_past_the_decoder_are_left_out(targets, tmp_path):
    # DeepSeek-V3 checkpoints store their MTP modules as layers num_hidden_layers onwards.
    import os
    import shutil
    from safetensors.torch import load_file, save_file
    model = targets["q_lora"]
    tensors = load_file(os.path.join(model, "model.safetensors"))
    extra = {n.replace(".layers.2.", ".layers.3.", 1): t.clone() for n, t in tensors.items() if ".layers.2." in n}
    shutil.copy(os.path.join(model, "config.json"), tmp_path / "config.json")
    save_file({**tensors, **extra, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)},
              str(tmp_path / "model.safetensors"))
    ours, _ = load_model(str(tmp_path))
    want, _ = load_model(model)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), want.state_dict().values()))
