"""The real default model (Qwen2.5-Coder-0.5B-Instruct from PyPI) on CPU against transformers."""
import pytest
import torch

from ddtree import LLM, SamplingParams

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What is a hash map? Answer in two sentences.",
           "Translate to French: the cat sleeps on the warm windowsill."]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", spec="ddtree")


def test_default_model_greedy_chat_matches_transformers(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32).eval()
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(convs, SamplingParams(max_tokens=32))
    eos = llm.config.eos_token_ids
    for conv, out in zip(convs, outs):
        ids = llm.encode_chat(conv)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos,
                              pad_token_id=llm.tokenizer.pad_token_id)[0, len(ids):].tolist()
        if any(t in eos for t in ref):  # transformers stops after the end-of-turn token, as we do
            ref = ref[:next(i for i, t in enumerate(ref) if t in eos) + 1]
        assert out.token_ids == ref
        assert out.text == llm.tokenizer.decode(ref, skip_special_tokens=True)
    assert "def" in outs[0].text  # a sensible answer, not just matching noise


def test_default_model_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "Reply with the single word: yes"}],
                   SamplingParams(max_tokens=16))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.config.eos_token_ids
    assert "yes" in out.text.lower()


def test_default_pair_is_ddtree_with_the_shipped_drafter(llm):
    from ddtree.models.hub import default_draft
    assert default_draft() is not None
    assert llm.spec == "ddtree" and llm.budget == "auto" and llm.drafter is not None
    table = llm.engine.speculator.policy.table
    llm.set_mode("ddtree", 16, 4)
    try:
        out = llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(max_tokens=48))[0]
        assert max(out.accept_lengths) >= 2  # the trained drafter gets whole tokens accepted, not just the bonus
    finally:  # (the start-up table: measuring one takes ~50 s here)
        llm.set_mode("ddtree", "auto", cost_table=table)


def test_default_pair_dflash_and_ar_equal_ddtree(llm):
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=24)
    table = llm.engine.speculator.policy.table
    llm.set_mode("ddtree", 16, 4)
    want = [o.token_ids for o in llm.chat(convs, params)]
    for spec, budget in (("dflash", None), ("none", None), ("ddtree", "auto")):
        llm.set_mode(spec, budget, cost_table=table if budget == "auto" else None)
        assert [o.token_ids for o in llm.chat(convs, params)] == want, spec


def test_default_pair_structured_output_equals_constrained_ar(llm):
    # A JSON schema with other keys allowed, on the real tokenizer (tokens such as `",` and ` ["` cross the
    # structure's boundaries): DDTree's tree masks, each node's from the structure after its own path,
    # give constrained AR's tokens, greedy and seeded.
    import json
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 150},
                                               "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "age", "languages"],
              # (one line: this layout led a matcher rolled back after each branch off constrained AR's tokens)
              "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}
    conv = [{"role": "user", "content": "Give me a JSON record of a fictional programmer."}]
    params = [SamplingParams(max_tokens=48, json_schema=schema),
              SamplingParams(max_tokens=48, temperature=0.7, seed=1, json_schema=schema)]
    table = llm.engine.speculator.policy.table
    try:
        llm.set_mode("none", None)
        want = llm.chat([conv, conv], params)
        llm.set_mode("ddtree", 16, 4)
        got = llm.chat([conv, conv], params)
    finally:
        llm.set_mode("ddtree", "auto", cost_table=table)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(n for o in got for n in o.accept_lengths) >= 3
    assert want[0].text.startswith("{") and '"name": "' in want[0].text
    if want[0].finish_reason == "stop":  # (other keys may follow: it may not end within 48 tokens)
        value = json.loads(want[0].text)
        assert isinstance(value["name"], str) and 0 <= value["age"] <= 150
