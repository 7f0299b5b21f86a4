"""Hybrid targets (models/hybrid.py): a tiny random Qwen3.5 text model (Gated DeltaNet layers and gated
full attention) against transformers' own implementation, through `LLM`."""
import pytest
import torch

from ddtree import LLM, SamplingParams
from tiny import make_tiny_model

ENGINE = dict(device="cpu", dtype="float32", page_size=4)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3_5")), "qwen3_5")


@pytest.fixture(scope="module")
def hf(hybrid):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [list(range(3, 40)), list(range(100, 107)), [5], list(range(200, 290, 3))]


def reference(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and the log-softmax of its logits at each generated position
    (its prefill runs the chunked form of the delta rule, its decode steps the recurrent form)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    logp = torch.log_softmax(torch.cat(out.logits).float(), -1)
    return out.sequences[0, len(prompt):].tolist(), logp


def assert_idle(llm: LLM) -> None:
    alloc = llm.engine.allocator
    assert alloc.num_free == alloc.num_pages and len(alloc.free_slots) == alloc.num_state_slots > 0


def test_the_hybrid_config_is_read_with_its_layer_kinds(hybrid):
    from ddtree.config import ModelConfig
    cfg = ModelConfig.from_dir(hybrid)
    assert cfg.is_hybrid and cfg.attention_layers == [3] and cfg.linear_layers == [0, 1, 2]
    assert cfg.rotary_dim == 8 and cfg.attn_output_gate and cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 8


@pytest.mark.parametrize("limits", [dict(num_pages=128, max_num_batched_tokens=2048),
                                    dict(num_pages=128, max_num_batched_tokens=16),
                                    dict(num_pages=16, max_num_batched_tokens=16, max_num_seqs=3)],
                         ids=["whole-prompts", "chunked-prefill", "preempted"])
def test_greedy_output_and_logprobs_equal_transformers_alone_and_batched(limits, hybrid, hf, prompts):
    # Chunked prefill carries the convolution window and the recurrent state from chunk to chunk; with
    # few pages requests are preempted and recomputed from zero state. The log-probabilities are the
    # logits at every generated position, against transformers' full forward over prompt + output.
    n = 14
    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)
    llm = LLM(hybrid, **ENGINE, **limits)
    batched = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts[:2]]
    for prompt, got, one in zip(prompts, batched, alone + [None] * len(prompts)):
        want, logp = reference(hf, prompt, n)
        assert got.token_ids == want and (one is None or one.token_ids == want)
        torch.testing.assert_close(torch.tensor([lp for lp, _ in got.logprobs]),
                                   logp.gather(1, torch.tensor(want)[:, None])[:, 0], atol=1e-4, rtol=0)
    if "max_num_seqs" in limits:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_and_aborts_free_the_state_slots(hybrid, prompts):
    llm = LLM(hybrid, **ENGINE, num_pages=128, max_num_seqs=4)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    batched = llm.generate(prompts, params)
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    stream = llm.stream(prompts[0], params[0])
    next(stream)
    stream.close()  # aborted mid-request: its pages and state slot come back
    assert_idle(llm)


def test_speculative_modes_refuse_hybrid_targets_clearly(hybrid, tmp_path):
    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter
    save_drafter(random_drafter(ModelConfig.from_dir(hybrid), num_layers=1, block_size=4, target_layer_ids=[0, 3]),
                 str(tmp_path))
    with pytest.raises(ValueError, match="hybrid models .* not supported yet"):
        LLM(hybrid, draft=str(tmp_path), spec="ddtree", budget=4, topk=2, **ENGINE, num_pages=64)
