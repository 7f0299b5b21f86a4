"""Our DFlash drafter against the z-lab reference package (`dflash==0.1.0`, a test peer)."""
import time

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.config import ModelConfig
from ddtree.models.dflash import random_drafter, save_drafter
from tiny import make_tiny_model

dflash_model = pytest.importorskip("dflash.model")

BLOCK = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_tiny_model(str(tmp_path_factory.mktemp("target")), "qwen3", with_tokenizer=False,
                             num_hidden_layers=4)
    cfg = ModelConfig.from_dir(target)
    draft = str(tmp_path_factory.mktemp("draft"))
    save_drafter(random_drafter(cfg, num_layers=2, block_size=BLOCK, target_layer_ids=[0, 2], std=0.2), draft)
    return target, draft


def reference_models(target, draft):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ref = dflash_model.DFlashDraftModel.from_pretrained(draft, dtype=torch.float32).eval()
    return hf, ref


def reference_draft(hf, ref, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """The target's next token after `prompt` and the reference drafter's logits for the block after it."""
    n, B = len(prompt), ref.block_size
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        feats = dflash_model.extract_context_feature(out.hidden_states, ref.target_layer_ids)
        block = torch.full((1, B), ref.mask_token_id)
        block[0, 0] = first
        hidden = ref(target_hidden=feats, noise_embedding=hf.get_input_embeddings()(block),
                     position_ids=torch.arange(n + B)[None], past_key_values=dflash_model._make_cache(ref.config),
                     use_cache=True)
        return first, ref.compute_logits(hidden[:, 1:], hf.lm_head)[0]


def our_draft(llm, prompt: list[int], first: int) -> torch.Tensor:
    """Our drafter's logits for the block after `prompt` + the target's first token."""
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.step()  # prefill + first token
    assert seq.output_ids == [first]
    llm.engine.allocator.grow(seq, seq.num_cached + llm.engine.speculator.width)  # as the scheduler would
    drafter = llm.engine.speculator.drafter
    with torch.inference_mode():
        return drafter.logits(drafter.prepare([seq]))[0]


def test_drafter_checkpoint_loads_in_reference_with_our_layer_ids(pair):
    _, ref = reference_models(*pair)
    assert ref.target_layer_ids == [0, 2]
    assert ref.block_size == BLOCK


def test_draft_logits_match_reference(pair):
    target, draft = pair
    hf, ref = reference_models(target, draft)
    prompt = [3, 17, 42, 99, 5, 250, 31, 7, 64, 12, 88]
    first, want = reference_draft(hf, ref, prompt)
    llm = LLM(target, draft=draft, spec="dflash", device="cpu", dtype="float32", num_pages=32, page_size=4,
              tokenizer=None)
    got = our_draft(llm, prompt, first)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_output_and_acceptance_match_reference_dflash_generate(pair, monkeypatch):
    target, draft = pair
    hf, ref = reference_models(target, draft)
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # the reference syncs CUDA for stats
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    res = dflash_model.dflash_generate(ref, hf, torch.tensor([prompt]), max_new_tokens=40, stop_token_ids=None,
                                       return_stats=True)
    want = res.output_ids[0, len(prompt):].tolist()
    llm = LLM(target, draft=draft, spec="dflash", device="cpu", dtype="float32", num_pages=64, page_size=4,
              tokenizer=None)
    out = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == want
    assert out.accept_lengths == res.acceptance_lengths


def test_shipped_default_drafter_matches_reference_on_the_default_target():
    """The committed drafter (ddtree/models/default_drafter) loads in the reference package and in
    ddtree, and both give the same draft for the same context on the real default target."""
    from ddtree.models.hub import default_draft
    draft = default_draft()
    assert draft is not None, "the default drafter is missing from the package"
    llm = LLM(device="cpu", dtype="float32", spec="dflash", num_pages=64)  # the default pair, DFlash
    assert llm.drafter is not None and llm.drafter.dcfg.target_layer_ids == [1, 8, 14, 21]
    hf, ref = reference_models(llm.model_path, draft)
    assert ref.target_layer_ids == [1, 8, 14, 21] and ref.block_size == 16
    prompt = llm.encode_chat([{"role": "user", "content": "Write a Python function that reverses a string."}])
    first, want = reference_draft(hf, ref, prompt)
    got = our_draft(llm, prompt, first)
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
