"""Our decoder against transformers on tiny random Qwen2, Qwen3 and Llama checkpoints."""
import os

import pytest
import torch

from ddtree.config import EngineConfig
from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sequence import Sequence
from ddtree.models.loader import load_model
from ddtree.sampling_params import SamplingParams
from tiny import make_tiny_model

FAMILIES = ["qwen2", "qwen3", "llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, cfg = load_model(path, "cpu", torch.float32)
    return hf, ours, cfg


def all_logits(runner: ModelRunner, seq: Sequence, n: int) -> torch.Tensor:
    """Feeds n tokens of seq through the runner and returns logits at every one of them."""
    input_ids, positions, batch = runner.prepare([(seq, n)])
    hidden, _ = runner.model(input_ids, positions, batch)
    seq.num_cached += n
    return runner.model.compute_logits(hidden)


def test_logits_match_transformers_prefill_and_stepwise_decode(pair):
    hf, ours, cfg = pair
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (21,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(ours, cfg, EngineConfig(page_size=4, num_pages=16), torch.device("cpu"), torch.float32)
    alloc = PageAllocator(16, 4)
    seq = Sequence(ids, SamplingParams(), None)
    alloc.grow(seq, len(ids))
    with torch.no_grad():
        got = [all_logits(runner, seq, 13)]  # prefill a prefix (crosses pages), then one token at a time
        got += [all_logits(runner, seq, 1) for _ in range(len(ids) - 13)]
    got = torch.cat(got)
    err = (got - ref).abs().max().item()
    assert err < 1e-4, err
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_hidden_state_taps_match_transformers_hidden_states(pair):
    hf, ours, cfg = pair
    ids = list(range(3, 12))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    runner = ModelRunner(ours, cfg, EngineConfig(page_size=4, num_pages=8), torch.device("cpu"), torch.float32)
    seq = Sequence(ids, SamplingParams(), None)
    PageAllocator(8, 4).grow(seq, len(ids))
    input_ids, positions, batch = runner.prepare([(seq, len(ids))])
    with torch.no_grad():
        _, taps = ours(input_ids, positions, batch, taps=[1, 0])
    # Layer id l is the output of decoder layer l: transformers' hidden_states[l + 1], except that
    # transformers applies the final norm to the last entry.
    assert torch.allclose(ours.model.norm(taps[0]), ref[2][0], atol=1e-5)
    assert torch.allclose(taps[1], ref[1][0], atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers_single_and_batched(family, tmp_path):
    from transformers import AutoModelForCausalLM
    from ddtree import LLM

    path = make_tiny_model(str(tmp_path), family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", page_size=4, num_pages=96)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (1, 5, 11, 23)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    single = [llm.generate(p, params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert single == refs
    assert batched == refs
    assert llm.engine.allocator.num_free == 96


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    from transformers import AutoModelForCausalLM
    single = make_tiny_model(str(tmp_path / "single"), "qwen3", with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")  # many files + an index
    import os
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    a, _ = load_model(single, "cpu", torch.float32)
    b, _ = load_model(str(tmp_path / "sharded"), "cpu", torch.float32)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_load_format_dummy_runs_a_config_without_weights(tmp_path):
    # A directory with config.json only: load_format="dummy" builds the model with random weights (and
    # nothing else read), so speed can be measured for models whose weights are not at hand.
    import shutil

    from ddtree import LLM
    full = make_tiny_model(str(tmp_path / "full"), "qwen3_moe", with_tokenizer=False)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(full, "config.json"), bare / "config.json")
    with pytest.raises(FileNotFoundError):
        LLM(str(bare), device="cpu", dtype="float32", num_pages=32)
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(bare), device="cpu", dtype="float32", num_pages=32, load_format="random")
    llm = LLM(str(bare), device="cpu", dtype="float32", num_pages=32, load_format="dummy")
    assert llm.net.model.layers[0].self_attn.qkv_proj.weight.std() > 0.01
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5
