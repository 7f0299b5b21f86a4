"""The AR engine end to end (engine/engine.py, scheduler.py, llm.py) on a tiny random Qwen2 with its tokenizer.

The oracle is the same engine running one request at a time with plenty of pages and no token budget
pressure: batching, preemption, chunked prefill and per-request parameters must not change a request's
tokens.
"""
import json
import os
import shutil

import pytest
import torch

from ddtree.llm import LLM
from ddtree.sampling_params import SamplingParams
from tiny import CORPUS

MAX_TOKENS = 24
LENGTHS = [3, 17, 6, 11, 1, 20, 8, 14, 5, 9, 2, 12]


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(seed: int | None, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def ref_llm(tiny_qwen2):
    # Large pages and a big cache: nothing is ever chunked or preempted.
    return LLM(tiny_qwen2, device="cpu", dtype="float32", page_size=16, num_pages=64)


@pytest.fixture(scope="module")
def alone(ref_llm):
    """`alone(prompt_ids, params)` -> the RequestOutput of that request run by itself (memoized)."""
    cache = {}

    def run(prompt_ids: list[int], params: SamplingParams | None = None):
        params = params or greedy()
        key = (tuple(prompt_ids), repr(params))
        if key not in cache:
            cache[key] = ref_llm.generate([list(prompt_ids)], params)[0]
        return cache[key]

    return run


@pytest.fixture(scope="module")
def corpus_ids(ref_llm) -> list[int]:
    return ref_llm.tokenizer.encode("".join(CORPUS[:6]))


def prompts_of(corpus_ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Distinct prompts of the given lengths, cut from different places in the corpus."""
    return [corpus_ids[7 * i:7 * i + n] for i, n in enumerate(lengths)]


def assert_engine_idle(llm: LLM) -> None:
    sched, alloc = llm.engine.scheduler, llm.engine.allocator
    assert not sched.waiting and not sched.running
    assert alloc.num_free == alloc.num_pages


def check_pages_after_each_step(llm: LLM, monkeypatch) -> None:
    """Asserts after every engine step: no page is held twice or both held and free, none leaks,
    and waiting requests hold none."""
    engine, step = llm.engine, llm.engine.step

    def checked_step():
        out = step()
        held = [p for s in engine.scheduler.running for p in s.block_table]
        assert len(held) == len(set(held)) and not set(held) & set(engine.allocator.free_pages)
        assert len(held) + engine.allocator.num_free == engine.allocator.num_pages
        assert all(not s.block_table for s in engine.scheduler.waiting)
        return out

    monkeypatch.setattr(engine, "step", checked_step)


def test_the_batch_size_headed_for_counts_waiting_prompts_only_while_pages_let_them_in(make_llm, corpus_ids,
                                                                                       monkeypatch):
    # (auto judges the chance for speculation at `Scheduler.headed_for`: in a run bound by the KV cache the waiting
    # prompts are not about to join)
    llm = make_llm(page_size=4, num_pages=24, max_num_batched_tokens=8)  # (prompts also wait for the budget)
    engine, seen = llm.engine, []
    schedule = engine.scheduler.schedule

    def recorded():
        step = schedule()
        sched = engine.scheduler
        seen.append((sched.out_of_pages, engine.scheduler.headed_for(), len(sched.running), len(sched.waiting)))
        return step

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    llm.generate(prompts_of(corpus_ids, LENGTHS), greedy())
    assert any(out for out, *_ in seen) and any(not out and waiting for out, _, _, waiting in seen)
    for out, joined, running, waiting in seen:
        assert joined == (running if out else min(engine.scheduler.max_num_seqs, running + waiting))


@pytest.mark.parametrize("limits", [{}, dict(max_num_batched_tokens=8, max_num_seqs=5)],
                         ids=["preemption", "preemption+chunking"])
def test_more_requests_than_kv_pages_complete_with_their_alone_outputs_and_free_every_page(
        make_llm, alone, corpus_ids, monkeypatch, limits):
    prompts = prompts_of(corpus_ids, LENGTHS)
    seeded_prompt = corpus_ids[:10]
    # 24 pages of 4 = 96 slots for 12 requests that each grow to 25-44 tokens.
    llm = make_llm(page_size=4, num_pages=24, **limits)
    check_pages_after_each_step(llm, monkeypatch)
    outs = llm.generate(prompts + [seeded_prompt], [greedy()] * len(prompts) + [sampled(seed=7)])
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        ref = alone(p)
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
    assert outs[-1].token_ids == alone(seeded_prompt, sampled(seed=7)).token_ids  # recompute keeps its RNG state
    assert_engine_idle(llm)


def test_max_num_seqs_caps_running_requests_without_changing_outputs(make_llm, alone, corpus_ids, monkeypatch):
    llm = make_llm(max_num_seqs=2)
    seen = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        step = schedule()
        seen.append(len(llm.engine.scheduler.running))
        return step

    monkeypatch.setattr(llm.engine.scheduler, "schedule", spy)
    prompts = prompts_of(corpus_ids, [4, 9, 2, 6, 5])
    outs = llm.generate(prompts, greedy(8))
    assert max(seen) == 2
    assert [o.token_ids for o in outs] == [alone(p, greedy(8)).token_ids for p in prompts]
    assert_engine_idle(llm)


def test_prompt_longer_than_token_budget_is_prefilled_in_chunks_with_the_same_output(
        make_llm, alone, corpus_ids, monkeypatch):
    long_prompt, short_prompt = corpus_ids[:45], corpus_ids[50:53]
    llm = make_llm(max_num_batched_tokens=8)
    fed = []
    run = llm.engine.runner.run

    def spy(chunks, *args, **kwargs):
        fed.append({s.seq_id: n for s, n in chunks})
        return run(chunks, *args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "run", spy)
    outs = llm.generate([short_prompt, long_prompt], greedy())
    assert outs[0].token_ids == alone(short_prompt).token_ids
    assert outs[1].token_ids == alone(long_prompt).token_ids
    prefill_steps = [step for step in fed if any(n > 1 for n in step.values())]
    assert len(prefill_steps) >= 45 // 8 and all(sum(n for n in s.values() if n > 1) <= 8 for s in prefill_steps)
    # The short request decoded in the same forwards as the long prompt's chunks.
    assert sum(1 in step.values() and max(step.values()) > 1 for step in fed) >= 3
    assert_engine_idle(llm)


def test_prompt_as_long_as_the_context_raises_and_withdraws_the_whole_call(make_llm, alone, corpus_ids):
    llm = make_llm(max_model_len=32)
    ok, too_long = corpus_ids[:5], corpus_ids[:32]
    with pytest.raises(ValueError, match=r"prompt has 32 tokens; the context limit is 32"):
        llm.generate([ok, too_long, corpus_ids[5:9]], greedy())
    assert_engine_idle(llm)
    # Still usable, and nothing of the failed call runs along.
    out = llm.generate([ok], greedy(8))
    assert len(out) == 1 and out[0].token_ids == alone(ok, greedy(8)).token_ids
    assert llm.last_stats["generated_tokens"] == 8
    # One token shorter fits, and generation stops at the context limit.
    edge = llm.generate([corpus_ids[:31]], greedy())[0]
    assert len(edge.token_ids) == 1 and edge.finish_reason == "length"
    assert_engine_idle(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch build without CUDA")
def test_a_cuda_device_without_cuda_is_a_clear_error(tiny_qwen2):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLM(tiny_qwen2, device="cuda")


def test_empty_prompt_and_out_of_vocab_ids_raise_value_error(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 10_000]])
    assert_engine_idle(llm)


@pytest.mark.parametrize("max_tokens", [1, 5, 17])
def test_max_tokens_gives_exactly_that_many_tokens_and_length_reason(make_llm, alone, corpus_ids, max_tokens):
    out = make_llm().generate([corpus_ids[:6]], greedy(max_tokens))[0]
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert out.token_ids == alone(corpus_ids[:6]).token_ids[:max_tokens]


def first_new_token_index(ids: list[int], start: int = 3) -> int:
    """An index k >= start where ids[k] does not occur before it, so generation would first meet it at k."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k])


def test_eos_from_model_config_stops_generation_and_ignore_eos_continues(make_llm, alone, corpus_ids, tiny_qwen2,
                                                                        tmp_path):
    prompt = corpus_ids[10:16]
    ref = alone(prompt).token_ids
    k = first_new_token_index(ref)
    # The same weights, with the token greedy decoding emits at step k declared as EOS.
    path = shutil.copytree(tiny_qwen2, tmp_path / "eos_model")
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(path / name):
            cfg = json.loads((path / name).read_text())
            cfg["eos_token_id"] = ref[k]
            (path / name).write_text(json.dumps(cfg))
    llm = make_llm(model=str(path))
    stopped = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert stopped.token_ids == ref[:k + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([prompt], greedy())[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_stop_token_ids_end_generation_at_that_token(make_llm, alone, corpus_ids):
    prompt = corpus_ids[10:16]
    ref = alone(prompt).token_ids
    k = first_new_token_index(ref)
    out = make_llm().generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[ref[k]]))[0]
    assert out.token_ids == ref[:k + 1] and out.finish_reason == "stop"


def test_stop_token_ids_still_apply_with_ignore_eos(make_llm, alone, corpus_ids):
    prompt = corpus_ids[10:16]
    ref = alone(prompt).token_ids
    k = first_new_token_index(ref)
    out = make_llm().generate([prompt], greedy(stop_token_ids=[ref[k]]))[0]
    assert out.token_ids == ref[:k + 1] and out.finish_reason == "stop"


def pick_stop_string(tokenizer, text: str, ids: list[int]) -> str:
    """A printable substring of `text` first occurring past its start that no single token's text contains
    (so it is completed only by a later token than the one that starts it), and whose tail first occurs
    inside it (so a stop list with both is satisfied twice by the same token)."""
    pieces = [tokenizer.decode([t]) for t in ids]
    for length in (5, 4, 3):
        for i in range(2, len(text) - length):
            s = text[i:i + length]
            if (s.isprintable() and text.find(s) == i and text.find(s[1:]) == i + 1
                    and not any(s in p for p in pieces)):
                return s
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("start", [10, 30])
def test_stop_string_cuts_text_right_before_its_first_occurrence(make_llm, alone, corpus_ids, start):
    prompt = corpus_ids[start:start + 6]
    ref = alone(prompt)
    llm = make_llm()
    stop = pick_stop_string(llm.tokenizer, ref.text, ref.token_ids)
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, stop=[stop]))[0]
    assert out.text == ref.text[:ref.text.find(stop)] and out.finish_reason == "stop"
    # Generation ends at the token that completes the stop string.
    m = next(j for j in range(1, len(ref.token_ids) + 1) if stop in llm.tokenizer.decode(ref.token_ids[:j]))
    assert out.token_ids == ref.token_ids[:m]
    # Of several stop strings completed by the same token, the one that starts first wins.
    both = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, stop=[stop[1:], "\u2603never", stop]))[0]
    assert both.text == out.text and both.token_ids == out.token_ids
    never = llm.generate([prompt], greedy(stop=["\u2603never"]))[0]
    assert never.text == ref.text and never.finish_reason == "length"


def test_seeded_sampling_reproduces_and_depends_on_the_seed(make_llm, corpus_ids):
    llm = make_llm()
    prompt = corpus_ids[:8]
    a, b, c = (llm.generate([prompt], sampled(seed=s))[0].token_ids for s in (1, 1, 2))
    assert a == b and a != c
    assert a != llm.generate([prompt], greedy(16))[0].token_ids  # really sampled


def test_seeded_request_output_does_not_depend_on_the_rest_of_the_batch(make_llm, alone, corpus_ids):
    llm = make_llm()
    prompt = corpus_ids[:8]
    solo = alone(prompt, sampled(seed=3)).token_ids
    others = prompts_of(corpus_ids, [5, 12, 3])
    outs = llm.generate([others[0], prompt, others[1], others[2], prompt],
                        [sampled(seed=None), sampled(seed=3), greedy(16), sampled(seed=None), sampled(seed=4)])
    assert outs[1].token_ids == solo
    assert outs[4].token_ids != solo  # same prompt, other seed
    assert outs[2].token_ids == alone(others[1], greedy(16)).token_ids


def test_greedy_request_batched_with_sampled_ones_gives_exactly_the_greedy_output(make_llm, alone, corpus_ids):
    prompts = prompts_of(corpus_ids, [6, 6, 9, 4])
    params = [sampled(seed=None, max_tokens=MAX_TOKENS), greedy(), sampled(seed=5, max_tokens=MAX_TOKENS),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=3, ignore_eos=True)]
    outs = make_llm().generate(prompts, params)
    assert outs[1].token_ids == alone(prompts[1]).token_ids
    # Temperature with top_k=1 is greedy too.
    tk1 = make_llm().generate([prompts[0], prompts[2]],
                              [SamplingParams(max_tokens=MAX_TOKENS, temperature=2.0, top_k=1, ignore_eos=True),
                               sampled(seed=None, max_tokens=MAX_TOKENS)])
    assert tk1[0].token_ids == alone(prompts[0]).token_ids


def assert_output_shape(out, max_tokens: int) -> None:
    assert isinstance(out.text, str) and out.token_ids and len(out.token_ids) <= max_tokens
    assert out.finish_reason in ("stop", "length") and out.accept_lengths == []


def test_generate_accepts_a_string_token_ids_and_lists_of_either(make_llm, alone):
    llm = make_llm()
    text, other = "Hello, world!", "def add(a, b):"
    ids = llm.tokenizer.encode(text)
    params = greedy(8)
    from_str = llm.generate(text, params)
    from_ids = llm.generate(ids, params)
    from_strs = llm.generate([text, other], params)
    from_id_lists = llm.generate([ids, llm.tokenizer.encode(other)], params)
    assert len(from_str) == len(from_ids) == 1 and len(from_strs) == len(from_id_lists) == 2
    expected = alone(ids, params)
    for out in (from_str[0], from_ids[0], from_strs[0], from_id_lists[0]):
        assert_output_shape(out, 8)
        assert out.prompt_token_ids == ids  # token_ids hold only the generated tokens
        assert out.token_ids == expected.token_ids and out.text == expected.text
    assert from_strs[1].token_ids == from_id_lists[1].token_ids == alone(llm.tokenizer.encode(other), params).token_ids


def test_stream_yields_the_generated_text_in_pieces_never_a_stop_strings_start(make_llm, alone, corpus_ids):
    prompt = corpus_ids[3:9]
    ref = alone(prompt)
    llm = make_llm()
    pieces = list(llm.stream(prompt, greedy()))
    assert "".join(pieces) == ref.text and len(pieces) > 1
    assert llm.last_stats["generated_tokens"] == len(ref.token_ids)
    assert llm.last_stats["finish_reasons"] == [ref.finish_reason]
    stop = pick_stop_string(llm.tokenizer, ref.text, ref.token_ids)
    pieces = list(llm.stream(prompt, greedy(stop=[stop])))
    assert "".join(pieces) == ref.text[:ref.text.find(stop)]  # (nothing past it was streamed, then taken back)
    conv = [{"role": "user", "content": "Hi"}]
    assert "".join(llm.stream(conv, greedy())) == llm.chat(conv, greedy())[0].text
    stream = llm.stream(prompt, greedy())
    next(stream)
    stream.close()  # the consumer leaves: the request is aborted and its pages freed
    assert_engine_idle(llm)


def test_generate_command_streams_one_prompt_and_refuses_budget_zero_with_a_speculative_mode(tiny_qwen2, capsys):
    from ddtree.cli import main
    rc = main(["generate", "--model", tiny_qwen2, "--device", "cpu", "--max-tokens", "5", "--ignore-eos", "--raw",
               "def f(x):"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() and "[loaded in" in err and "5 tokens in" in err and "finish: length" in err
    rc = main(["generate", "--model", tiny_qwen2, "--device", "cpu", "--spec", "ddtree", "--budget", "0", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--budget 0 with --spec ddtree is plain AR" in err


def test_generate_with_one_params_per_prompt_checks_the_count(make_llm):
    llm = make_llm()
    outs = llm.generate(["a", "b"], [greedy(2), greedy(5)])
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(2), greedy(5)])
    assert_engine_idle(llm)


def test_generate_collects_no_garbage_mid_loop_and_restores_collection_even_on_error(make_llm, monkeypatch):
    import gc

    llm = make_llm()
    step, seen = llm.engine.step, []
    monkeypatch.setattr(llm.engine, "step", lambda: seen.append(gc.isenabled()) or step())
    llm.generate("a", greedy(4))
    assert seen and not any(seen) and gc.isenabled()

    def broken():
        raise RuntimeError("device lost")
    monkeypatch.setattr(llm.engine, "step", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate("a", greedy(4))
    assert gc.isenabled()


def test_generate_rejects_an_empty_params_list(make_llm):
    with pytest.raises(ValueError, match="0 SamplingParams for 1 prompts"):
        make_llm(max_model_len=8).generate(["a"], [])  # (short context: the defaults would run 256 tokens)


def test_chat_accepts_one_conversation_or_a_list(make_llm, alone):
    llm = make_llm()
    tok = llm.tokenizer
    first = [{"role": "user", "content": "Hello, world!"}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "for i in range(10):"}]
    params = greedy(8)
    one = llm.chat(first, params)
    both = llm.chat([first, second], params)
    assert len(one) == 1 and len(both) == 2
    template_ids = tok.encode(tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    assert one[0].prompt_token_ids == both[0].prompt_token_ids == template_ids
    assert tok.decode(template_ids).endswith("<|im_start|>assistant\n")
    assert one[0].token_ids == both[0].token_ids == alone(template_ids, params).token_ids
    assert "Be brief." in tok.decode(both[1].prompt_token_ids)
    for out in one + both:
        assert_output_shape(out, 8)
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([[]])


# ----------------------------------------------------------------------------- graphed AR bursts, emulated

@pytest.mark.parametrize("limits", [dict(num_pages=64, max_num_seqs=16), dict(num_pages=20, max_num_seqs=3)],
                         ids=["roomy", "few-pages-and-seqs"])
def test_graphed_ar_decode_bursts_emulated_on_cpu_give_the_alone_outputs(tiny_qwen2, alone, corpus_ids,
                                                                         monkeypatch, limits):
    # The GPU AR path (static inputs, bursts of pipelined steps whose inputs are the previous step's
    # samples, tokens read back one step late, requests finishing mid-burst, preemption) with the CUDA
    # graph replays emulated: every request gets exactly what it gets alone, and no page leaks.
    import ddtree.engine.engine as engine_mod
    from emulated import fake_gpu_graphs
    fake_gpu_graphs(monkeypatch)
    llm = LLM(tiny_qwen2, device="cpu", dtype="float32", page_size=4, spec="none", **limits)
    eng = llm.engine
    assert eng.ar.decode_graphs is not None and eng.ar.burst_steps == engine_mod.DECODE_BURST > 1
    assert set(eng.ar.decode_graphs.graphs) == set(eng.ar.decode_graphs.buckets)  # all captured at start-up
    prompts = prompts_of(corpus_ids, LENGTHS[:8])
    params = [greedy(n) for n in (1, 2, 9, 24, 7, 16)] + [sampled(5, 13), sampled(6, 20)]
    params[3] = greedy(24, stop=["e"])  # a stop string ends it mid-burst
    bursts = []
    run = eng.ar.burst
    monkeypatch.setattr(eng.ar, "burst", lambda seqs: bursts.append(eng.ar.burst_length(seqs)) or run(seqs))
    check_pages_after_each_step(llm, monkeypatch)
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        want = alone(prompt, p)
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert max(bursts) == engine_mod.DECODE_BURST
    assert eng.scheduler.num_preemptions > 0 or limits["num_pages"] == 64
    assert_engine_idle(llm)


def test_single_prompt_prefills_replay_graphs_and_give_the_eager_outputs(tiny_qwen2, alone, corpus_ids,
                                                                        monkeypatch):
    # A step that prefills one prompt chunk replays the graph of the next width up (padding tokens
    # after the real ones); chunked prompts continue at an offset. Graphs emulated on the CPU.
    from emulated import fake_gpu_graphs
    fake_gpu_graphs(monkeypatch)
    llm = LLM(tiny_qwen2, device="cpu", dtype="float32", page_size=4, spec="none", num_pages=96, max_num_seqs=1,
              max_num_batched_tokens=32)
    eng = llm.engine
    assert list(eng.ar.prefill_graphs) == [16, 32]  # up to the step's token limit
    widths = []
    real = eng.ar._prefill_graphed
    monkeypatch.setattr(eng.ar, "_prefill_graphed", lambda chunks, taps=False: (widths.append(chunks[0][1]),
                                                                             real(chunks, taps))[1])
    prompts = prompts_of(corpus_ids, [3, 16, 17, 45])  # 45 tokens: chunks of 32 and 13
    params = [greedy(6), greedy(5), sampled(7, 4), greedy(3)]
    for prompt, p in zip(prompts, params):
        (out,) = llm.generate([prompt], p)
        want = alone(prompt, p)
        assert (out.token_ids, out.text) == (want.token_ids, want.text)
    assert widths == [3, 16, 17, 32, 13]
    assert_engine_idle(llm)


def test_multi_prompt_prefills_replay_graphs_by_width_and_give_the_eager_outputs(tiny_qwen2, alone, corpus_ids,
                                                                                  monkeypatch):
    # A step's prompt chunks are grouped by graph width, at most a graph's rows per replay (here 2 of
    # width 16, 1 of width 32: 32 graph tokens), padding rows and padding tokens included. Every
    # output is the request's alone.
    import ddtree.engine.ar as ar_mod
    from emulated import fake_gpu_graphs
    fake_gpu_graphs(monkeypatch)
    monkeypatch.setattr(ar_mod, "PREFILL_GRAPH_TOKENS", 32)
    llm = LLM(tiny_qwen2, device="cpu", dtype="float32", page_size=4, spec="none", num_pages=256, max_num_seqs=4,
              max_num_batched_tokens=64)
    eng = llm.engine
    assert {T: g.max_batch for T, g in eng.ar.prefill_graphs.items()} == {16: 2, 32: 1, 64: 1}
    replays, steps = [], []
    real_replay, real = eng.ar._prefill_replay, eng.ar._prefill_graphed
    monkeypatch.setattr(eng.ar, "_prefill_replay", lambda T, chunks, pools: replays.append((T, [n for _, n in chunks]))
                        or real_replay(T, chunks, pools))
    monkeypatch.setattr(eng.ar, "_prefill_graphed", lambda chunks, taps=False: (lambda r: steps.append(
        (len(chunks), r is not None)) or r)(real(chunks, taps)))
    prompts = prompts_of(corpus_ids, [3, 20, 9, 14])  # one step: widths 16, 32, 16, 16
    params = [greedy(5), greedy(4), sampled(3, 4), greedy(6)]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        want = alone(prompt, p)
        assert (out.token_ids, out.text) == (want.token_ids, want.text)
    assert steps[0] == (4, True), steps
    assert sorted(replays[:3]) == [(16, [3, 9]), (16, [14]), (32, [20])], replays
    steps.clear(), replays.clear()
    # The 50-token prompt begins with the 20-token one: the prefix cache holds its first 5 pages, so
    # its chunk is the other 30 tokens (width 32); the 5-token prompt's one full page is its last.
    long_prompts = prompts_of(corpus_ids, [5, 50])
    outs = llm.generate(long_prompts, greedy(3))
    for prompt, out in zip(long_prompts, outs):
        assert out.token_ids == alone(prompt, greedy(3)).token_ids
    assert [o.num_cached_tokens for o in outs] == [0, 20]
    assert steps[0] == (2, True) and sorted(replays) == [(16, [5]), (32, [30])], (steps, replays)
    assert_engine_idle(llm)


def test_a_kv_cache_too_small_for_one_decode_step_is_a_clear_error(tiny_qwen2):
    with pytest.raises(ValueError, match="KV cache holds 1 tokens"):
        LLM(tiny_qwen2, device="cpu", dtype="float32", page_size=1, num_pages=1, spec="none")
