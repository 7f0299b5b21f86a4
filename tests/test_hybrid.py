"""Hybrid targets (models/hybrid.py): a tiny random Qwen3.5 text model (Gated DeltaNet layers and gated
full attention) against transformers' own implementation, through `LLM`."""
import os

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
    import json
    import os

    from ddtree.config import ModelConfig
    cfg = ModelConfig.from_dir(hybrid)
    assert cfg.is_hybrid and cfg.attention_layers == [3] and cfg.linear_layers == [0, 1, 2]
    assert cfg.rotary_dim == 8 and cfg.attn_output_gate and cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 8
    with open(os.path.join(hybrid, "config.json")) as f:
        text = json.load(f)
    del text["rope_parameters"]["partial_rotary_factor"]  # (transformers' default: a quarter of the head)
    assert ModelConfig.from_dict(text).rotary_dim == 4
    # a multimodal checkpoint's config: the text model's, tied as the top-level flag says (as transformers ties)
    outer = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": {**text, "tie_word_embeddings": True}}
    assert ModelConfig.from_dict(outer).tie_word_embeddings is False


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
    # (repeated prompts start from the prefix cache: the K/V of their pages before the last one, and the
    # recurrent state kept where the batched run's prompt chunks stopped, at the last full page; with 16
    # pages the batched run's preemptions leave none of them cached)
    if "max_num_seqs" not in limits:
        assert [o.num_cached_tokens for o in alone] == [36, 4]
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


@pytest.fixture(scope="module")
def drafter(hybrid, tmp_path_factory) -> str:
    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter
    d = str(tmp_path_factory.mktemp("hybrid_drafter"))
    save_drafter(random_drafter(ModelConfig.from_dir(hybrid), num_layers=1, block_size=8, target_layer_ids=[0, 3]), d)
    return d


@pytest.mark.parametrize("spec, budget, topk", [("dflash", None, None), ("ddtree", 8, 2)])
def test_prefix_cache_hits_restore_the_recurrent_state_and_stay_lossless(spec, budget, topk, hybrid, drafter, prompts):
    # A prompt's chunks stop at its last full page, where the prefix cache keeps the recurrent state; a later
    # request that begins alike starts from that state (copied into its slot) and the pages' K/V, and a
    # longer prompt past the kept state computes the rest. Outputs equal AR's without the cache.
    from test_spec import continuation, noisy_oracle, plant
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    turns = prompts + [prompts[0] + [41, 42, 43, 44, 45, 46]]
    ar = LLM(hybrid, **ENGINE, num_pages=256, enable_prefix_caching=False).generate(turns, params)
    llm = LLM(hybrid, draft=drafter, spec=spec, budget=budget, topk=topk, **ENGINE, num_pages=256)
    plant(llm, noisy_oracle(continuation(turns, ar), vocab=llm.config.vocab_size))
    first = llm.generate(turns[:4], params)
    again = [llm.generate([t], params)[0] for t in turns]
    assert [o.token_ids for o in first + again] == [o.token_ids for o in ar[:4] + ar]
    assert [o.num_cached_tokens for o in first] == [0] * 4
    assert [o.num_cached_tokens for o in again] == [36, 4, 0, 28, 36]
    alloc = llm.engine.allocator
    assert len(alloc.snapshot_of) == 4  # (at 36, 4, 28 and the longer prompt's 40; a 1-token prompt keeps none)
    assert_idle(llm)


@pytest.mark.parametrize("drafter_kind", ["oracle", "noisy"])
@pytest.mark.parametrize("spec, budget, topk", [("dflash", None, None), ("ddtree", 8, 2), ("ddtree", 16, 4)])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
def test_speculative_output_equals_ar(sampled, spec, budget, topk, drafter_kind, hybrid, drafter, prompts):
    # Every tree node sees its own ancestors' recurrent state and convolution window only, and the
    # request's state becomes the accepted path's: DFlash (a chain) and DDTree commit AR's tokens, greedy
    # and seeded sampled. The planted drafter proposes AR's continuation: always (oracle, whole blocks
    # accepted) or at ranks 0-2 or not at all (noisy: accepts along side branches among siblings).
    from test_spec import continuation, noisy_oracle, oracle, plant
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **(dict(temperature=0.8, seed=i) if sampled else {}))
              for i in range(len(prompts))]
    ar = LLM(hybrid, **ENGINE, num_pages=256).generate(prompts, params)
    llm = LLM(hybrid, draft=drafter, spec=spec, budget=budget, topk=topk, **ENGINE, num_pages=256)
    full = continuation(prompts, ar)
    plant(llm, (oracle if drafter_kind == "oracle" else noisy_oracle)(full, vocab=llm.config.vocab_size))
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ar]
    accepts = [n for o in got for n in o.accept_lengths]
    assert sum(accepts) / len(accepts) >= (4.0 if drafter_kind == "oracle" else 1.5), accepts
    assert_idle(llm)


def test_tree_verify_logits_equal_separate_forwards_of_each_root_to_node_path(hybrid, hf):
    # A tree with siblings at every depth, verified in one forward over the cached prompt: each node's
    # logits equal transformers' forward over the prompt and that node's root-to-node path alone.
    llm = LLM(hybrid, **ENGINE, num_pages=64)
    eng = llm.engine
    prompt = list(range(40, 71))
    seq = eng.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    while not seq.output_ids:  # the prompt is cached (in two chunks: the prefix cache keeps the state at
        eng.step()              # its last full page); its first token is drawn (the tree's root)
    parents = [-1, 0, 0, 0, 1, 1, 4, 2]
    tokens = [seq.output_ids[0], 11, 12, 13, 21, 22, 31, 23]
    depth = [0] + [0] * 7
    for i, p in enumerate(parents[1:], 1):
        depth[i] = depth[p] + 1
    N = len(tokens)
    mask = torch.zeros(1, N, N, dtype=torch.bool)
    for i in range(N):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    start = seq.num_cached
    eng.allocator.grow(seq, start + N)
    logits, _ = eng.runner.verify(eng.runner.tables([seq]), torch.tensor([start]), torch.tensor([tokens]),
                                  torch.tensor([depth]), mask, None, torch.tensor([seq.state_slot]))
    for i in range(N):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        with torch.no_grad():
            want = hf(torch.tensor([prompt + path])).logits[0, -1]
        torch.testing.assert_close(logits[0, i], want, atol=2e-4, rtol=0)
    eng.abort(seq)
    assert_idle(llm)


def test_a_drafter_trained_on_a_hybrid_target_is_accepted_and_lossless(hybrid, tmp_path):
    # train-drafter works against a hybrid target unchanged (its features are the tapped layers'
    # outputs, whatever the layer kind): a few hundred CPU steps on the target's own answers, then
    # DFlash and DDTree with that drafter accept real drafts and still commit AR's tokens.
    from ddtree.models.loader import load_model
    from ddtree.train.data import generate_dataset, load_dataset
    from ddtree.train.drafter import TrainConfig, train
    prompts = ["Write a function that adds two numbers.", "Hello, how are you today?", "Explain the quick brown fox.",
               "Print the squares of 0 to 9.", "What is numpy used for?", "Say something in French."]
    data = str(tmp_path / "data.pt")
    ar = LLM(hybrid, **ENGINE, num_pages=256)
    generate_dataset(hybrid, prompts, data, max_new_tokens=40, ignore_eos=True, llm=ar)
    net, _ = load_model(hybrid, "cpu", torch.float32)
    out = str(tmp_path / "drafter")
    cfg = TrainConfig(steps=300, batch_size=4, blocks_per_seq=8, lr=3e-3, warmup=20, save_every=10**9, log_every=50,
                      save_dtype="float32")
    train(net, load_dataset(data), out, cfg, num_layers=1, block_size=8, progress=False)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in ar.chat(convs, params)]
    for spec, budget, topk in [("dflash", None, None), ("ddtree", 12, 3)]:
        llm = LLM(hybrid, draft=out, spec=spec, budget=budget, topk=topk, **ENGINE, num_pages=256)
        got = llm.chat(convs, params)
        assert [o.token_ids for o in got] == want, spec
        accepts = [n for o in got for n in o.accept_lengths]
        assert sum(accepts) / len(accepts) > 2.0, (spec, accepts)


def test_graphed_ar_decode_bursts_emulated_on_cpu_equal_eager_decoding(hybrid, prompts, monkeypatch):
    # The GPU's AR path for hybrids (CUDA graphs emulated on the CPU): every request's window and state
    # gathered from its slot, advanced and written back by device ops inside pipelined bursts, padding
    # rows on the scratch slot; with few pages requests are preempted and start again from zero state.
    from emulated import fake_gpu_graphs
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n, kw in
              [(20, {}), (33, dict(temperature=0.8, seed=1)), (9, {}), (26, dict(temperature=1.0, seed=2))]]
    want = LLM(hybrid, **ENGINE, num_pages=256).generate(prompts, params)
    fake_gpu_graphs(monkeypatch)
    for pages in (256, 18):
        llm = LLM(hybrid, **ENGINE, num_pages=pages, max_num_seqs=3)
        assert llm.engine.ar.decode_graphs is not None and llm.engine.ar.burst_steps > 1
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], pages
        assert pages == 256 or llm.engine.scheduler.num_preemptions > 0
        assert_idle(llm)


def test_a_multimodal_qwen3_5_checkpoint_loads_its_text_model(tmp_path, prompts):
    # Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration (a vision tower besides the text
    # model, its weights under model.language_model.*): ddtree serves the text model and equals
    # transformers' own generation from text.
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from tiny import make_config
    text = make_config("qwen3_5", 384).to_dict()
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                             num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    hf.save_pretrained(str(tmp_path))
    out = LLM(str(tmp_path), **ENGINE, num_pages=64).generate(prompts[:2], SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, o in zip(prompts, out):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert o.token_ids == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("n", [1, 5, 64, 65, 150])
def test_the_chunked_delta_rule_equals_the_token_by_token_recurrence(n):
    from ddtree.models.delta_rule import chunked_delta_rule, gated_delta_rule
    g = torch.Generator().manual_seed(n)
    H, K, V = 4, 16, 8
    q, k, v = torch.randn(n, H, K, generator=g), torch.randn(n, H, K, generator=g), torch.randn(n, H, V, generator=g)
    decay, beta, state = -2 * torch.rand(n, H, generator=g), torch.rand(n, H, generator=g), torch.randn(H, K, V, generator=g)
    want, want_state = gated_delta_rule(q, k, v, decay, beta, state)
    got, got_state = chunked_delta_rule(q, k, v, decay, beta, state, chunk=32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec, budget, topk", [("dflash", None, None), ("ddtree", 16, 4)])
def test_graphed_speculative_bursts_emulated_on_cpu_equal_ar(spec, budget, topk, hybrid, drafter, prompts, monkeypatch):
    # The GPU's speculative path for hybrids (CUDA graphs emulated): pipelined bursts whose trees are
    # verified and committed with device ops only, padding rows on the scratch state slot.
    from emulated import fake_gpu_graphs
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n, kw in
              [(20, {}), (33, dict(temperature=0.8, seed=1)), (9, {}), (26, dict(temperature=1.0, seed=2))]]
    want = LLM(hybrid, **ENGINE, num_pages=256).generate(prompts, params)
    fake_gpu_graphs(monkeypatch)
    llm = LLM(hybrid, draft=drafter, spec=spec, budget=budget, topk=topk, **ENGINE, num_pages=256, max_num_seqs=3)
    assert llm.engine.speculator.graphs is not None
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_idle(llm)


def test_preempted_speculative_requests_recompute_their_state_and_stay_lossless(hybrid, drafter, prompts):
    from test_spec import continuation, noisy_oracle, plant
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **(dict(temperature=0.8, seed=i) if i % 2 else {}))
              for i in range(len(prompts))]
    ar = LLM(hybrid, **ENGINE, num_pages=256).generate(prompts, params)
    llm = LLM(hybrid, draft=drafter, spec="ddtree", budget=8, topk=2, **ENGINE, num_pages=22, max_num_seqs=3)
    plant(llm, noisy_oracle(continuation(prompts, ar), vocab=llm.config.vocab_size))
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ar]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm)


def test_step_times_run_on_a_hybrid_target(hybrid, drafter):
    # `bench latency --step-times` (an AR step, a draft, a whole speculative step, verify of a width) on
    # fake requests that hold state slots; afterwards every page and slot is back.
    from ddtree.bench.steps import step_profiles, step_times
    llm = LLM(hybrid, draft=drafter, spec="ddtree", budget=8, topk=2, **ENGINE, num_pages=64)
    rows = step_times(llm, [1, 2], [9], context=20)
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r[k] > 0 for r in rows for k in ("ar_step_ms", "draft_step_ms", "spec_step_ms", "verify_9_ms"))
    assert_idle(llm)
    # each step's kernels, profiled alone
    assert list(step_profiles(llm, 1, [9], context=20)) == ["ar_step", "draft_step", "spec_step", "verify_9"]
    assert_idle(llm)
    # more requests than the cache holds, or than there are state slots: a clear error, and nothing taken
    with pytest.raises(ValueError, match="KV pages"):
        step_times(llm, [40], [9], context=20)
    assert_idle(llm)
    few_slots = LLM(hybrid, **ENGINE, num_pages=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="state slots"):
        step_times(few_slots, [8], [9], context=20)
    assert_idle(few_slots)


def random_tree(n: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """Parents (-1: the root, node 0) and depths of n nodes, ancestors first, many siblings at a depth."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        parents.append(int(torch.randint(0, i, (1,), generator=g)) if i > 2 else 0)
        depth.append(depth[parents[-1]] + 1)
    return parents, depth


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
def test_the_triton_kernels_equal_the_torch_path_for_decode_steps_trees_and_commits(hybrid):
    # One Gated DeltaNet layer of the tiny model, its slots filled with random windows and states: a
    # decode step (one request fresh), then a tree per request (a chain, and random trees with siblings)
    # whose accepted path ends at a random node. The kernels (ops/triton_gdn.py) and the torch path give
    # the same outputs, the same slot windows and states after each, and leave the other slots alone.
    import copy

    from ddtree.models.loader import load_model
    from ddtree.ops.attention import uniform_batch
    model, cfg = load_model(hybrid, "cpu", torch.float32)
    layer = model.model.layers[cfg.linear_layers[1]].linear_attn
    g = torch.Generator().manual_seed(5)
    lin, R, slots_n = cfg.linear, 3, 6
    layer.conv_state = torch.randn(slots_n, lin.conv_dim, lin.conv_kernel - 1, generator=g)
    layer.recurrent_state = torch.randn(slots_n, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, generator=g) * 0.3
    ours = copy.deepcopy(layer)
    slots = torch.tensor([[4, 9], [0, 9], [2, 9]])[:, 0]  # (strided, as the engine's columns are)
    tables = torch.zeros(R, 32, dtype=torch.int32)

    def run(mod, x, positions, batch, triton):
        batch = copy.copy(batch)
        batch.use_triton = triton
        return mod(x, positions, batch)

    starts = torch.tensor([9, 0, 30])  # the second request's first token: a fresh slot
    x = torch.randn(R, cfg.hidden_size, generator=g)
    batch = uniform_batch(tables, starts, 1, None, 4)
    batch.state_slots = slots
    torch.testing.assert_close(run(ours, x, starts, batch, True), run(layer, x, starts, batch, False),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.conv_state, layer.conv_state, atol=0, rtol=0)
    torch.testing.assert_close(ours.recurrent_state, layer.recurrent_state, atol=1e-5, rtol=1e-4)
    for N, chain in ((5, True), (11, False), (20, False), (33, True), (65, False)):
        mask = torch.zeros(R, N, N, dtype=torch.bool)
        depths = torch.zeros(R, N, dtype=torch.long)
        parents = []
        for r in range(R):
            par, dep = (list(range(-1, N - 1)), list(range(N))) if chain else random_tree(N, g)
            parents.append(par)
            depths[r] = torch.tensor(dep)
            for i in range(N):
                j = i
                while j >= 0:
                    mask[r, i, j] = True
                    j = par[j]
        starts = torch.tensor([12, 3, 40])
        positions = (starts[:, None] + depths).flatten()
        x = torch.randn(R * N, cfg.hidden_size, generator=g)
        batch = uniform_batch(tables, starts, N, mask, 4)
        batch.state_slots, batch.commit_states = slots, False
        torch.testing.assert_close(run(ours, x, positions, batch, True), run(layer, x, positions, batch, False),
                                   atol=1e-5, rtol=1e-4)
        ends = torch.randint(0, N, (R,), generator=g)
        ours.commit(slots, ends)
        layer.commit(slots, ends)
        torch.testing.assert_close(ours.conv_state, layer.conv_state, atol=0, rtol=0)
        torch.testing.assert_close(ours.recurrent_state, layer.recurrent_state, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("N, chain, DK, Hk", [(40, True, 64, 2), (65, True, 64, 2), (65, False, 64, 2), (17, False, 48, 1)])
def test_the_tree_solve_holds_every_ancestor_when_keys_align(N, chain, DK, Hk):
    # Nearly parallel keys, beta near 1 and no decay make every ancestor's update count in a node's
    # (the solve's deep terms are of order one), as in trained models where neighbouring keys align. The
    # kernel's updates and outputs equal the torch solve's over a deep chain and a wide tree: 64 key
    # channels are two of the kernel's 32-channel chunks, 48 three 16-channel ones, and one key head may
    # serve both value heads.
    from ddtree.models.delta_rule import delta_rule_over, l2_normalize
    from ddtree.ops.triton_gdn import key_chunk, tree_delta
    g = torch.Generator().manual_seed(N)
    H, DV, R = 2, 16, 2  # (value heads)
    parents = [list(range(-1, N - 1)) if chain else random_tree(N, g)[0] for _ in range(R)]
    above = torch.zeros(R, N, N, dtype=torch.bool)
    for r in range(R):
        for i in range(N):
            j = i
            while j >= 0:
                above[r, i, j], j = True, parents[r][j]
    depth = above.sum(-1) - 1
    q = torch.randn(R * N, Hk, DK, generator=g)
    k = torch.randn(Hk, DK, generator=g) + 0.05 * torch.randn(R * N, Hk, DK, generator=g)
    v = torch.randn(R * N, H, DV, generator=g)
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    b = torch.full((R * N, H), 4.0) + torch.rand(R * N, H, generator=g)  # beta = sigmoid(b) near 1
    a = torch.full((R * N, H), -30.0)  # softplus(a) near 0: no decay
    A_log, dt_bias = torch.zeros(H), torch.zeros(H)
    state = torch.randn(3, H, DK, DV, generator=g) * 0.3
    slots, prefix = torch.tensor([2, 0]), torch.tensor([5, 7])
    z = torch.randn(R * N, H * DV, generator=g)
    solve = lambda split=None: tree_delta(state, slots, prefix, mixed, b, a, A_log, dt_bias, z,  # noqa: E731
                                          torch.ones(DV), 1e-6, Hk, above, depth, split=split)
    q, k = (x.repeat_interleave(H // Hk, dim=1) for x in (q, k))  # (each value head's key head)
    qn = (l2_normalize(q) / DK ** 0.5).view(R, N, H, DK).transpose(1, 2)
    kn = l2_normalize(k).view(R, N, H, DK).transpose(1, 2)
    gate = (-torch.nn.functional.softplus(a)).view(R, N, H).transpose(1, 2)
    beta = torch.sigmoid(b).view(R, N, H).transpose(1, 2)
    o_ref, d_ref, G_ref = delta_rule_over(qn, kn, v.view(R, N, H, DV).transpose(1, 2), gate, beta, state[slots], above)
    assert d_ref.abs().max() > 1.0  # (the deep terms are not negligible)
    o_ref = o_ref.transpose(1, 2).reshape(R * N, H, DV)  # (the outputs, normed and gated as the kernel's are)
    want = o_ref * torch.rsqrt(o_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.nn.functional.silu(z.view(R * N, H, DV))
    # the engine's launch, and a fixed split of the whole head's value columns
    for split in (None, dict(BLOCK_V=DV, BLOCK_K=key_chunk(DK), num_warps=4)):
        out, d, G = solve(split)
        torch.testing.assert_close(G, G_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d, d_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, want.flatten(1), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton needs a GPU or its interpreter")
def test_the_triton_path_generates_like_the_torch_path(hybrid, drafter, prompts):
    # The GPU's kernels (paged attention and K/V stores at partial rotary, the Gated DeltaNet decode step,
    # tree solve and commit), run by the interpreter: AR and DDTree under a noisy oracle (side branches
    # accepted) give the torch path's greedy tokens.
    from test_spec import continuation, noisy_oracle, plant
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ar = LLM(hybrid, **ENGINE, num_pages=64).generate(prompts[:3], params)
    for spec in (None, "ddtree"):
        llm = LLM(hybrid, draft=drafter if spec else None, spec=spec, budget=8, topk=2, **ENGINE, num_pages=64,
                  kernels="triton")
        if spec:
            plant(llm, noisy_oracle(continuation(prompts[:3], ar), vocab=llm.config.vocab_size))
        got = llm.generate(prompts[:3], params)
        assert [o.token_ids for o in got] == [o.token_ids for o in ar], spec
        if spec is None:  # one request: its decode steps take the fused few-rows products
            assert llm.generate(prompts[:1], params)[0].token_ids == ar[0].token_ids
        assert_idle(llm)


def test_the_tree_kernel_is_offered_only_splits_within_a_head():
    # The autotuner's splits of a head's value columns: a whole 128-column head a program is among them,
    # and none wider than the head it splits (a 64-column head never gets 128).
    from ddtree.ops.triton_gdn import TREE_SPLITS, splits_within_head
    widths = lambda dv: sorted({c.kwargs["BLOCK_V"] for c in splits_within_head(TREE_SPLITS, {}, DV=dv)})  # noqa: E731
    assert widths(128) == [16, 32, 64, 128]
    assert widths(64) == [16, 32, 64]
