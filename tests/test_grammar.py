"""Structured output (engine/grammar.py): the constraint's masks, tree masks against each path's own, and
constrained requests through `LLM` (their texts follow the structure; bad structures are clear errors
that leave nothing behind). The lossless checks against constrained AR are in test_spec.py."""
import json
import random
import re

import pytest
import torch

from ddtree.engine.grammar import WORD, Grammars, new_bitmask
from ddtree.sampling_params import SamplingParams
from tiny import make_tokenizer

VOCAB = 400  # the model's rows: the tokenizer's 384 tokens and unused ones above them
REGEX = r"(yes|no), [a-z]{1,8}\."
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 999}},
          "required": ["ok", "n"], "additionalProperties": False}
OPEN_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items":
               {"type": "string"}}}, "required": ["name"]}  # (other keys allowed, of any value)
LARK = 'start: "x" NUM ";"\nNUM: /[0-9]{1,4}/'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    stops = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    return Grammars(tokenizer, VOCAB, stops)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return {t for t in range(VOCAB) if (int(bitmask[row, t // WORD]) >> (t % WORD)) & 1}


@pytest.mark.parametrize("shape", [dict(regex=REGEX), dict(json_schema=SCHEMA), dict(json_schema=OPEN_SCHEMA),
                                   dict(grammar=LARK)], ids=["regex", "json", "open-json", "lark"])
def test_tree_rows_equal_a_fresh_matcher_fed_each_nodes_path(shape, grammars):
    # A tree grown mostly from allowed tokens (deep paths) with forbidden ones among them: every allowed
    # node's row is the mask of a fresh constraint fed the node's path; a forbidden node's subtree is
    # never accepted, and its rows allow everything.
    params = SamplingParams(**shape)
    rng = random.Random(0)
    for _ in range(3):
        probe = grammars.constraint(params)
        tokens, parents, ok, legal = [7], [-1], [True], [True]
        for n in range(1, 40):
            live = [a for a in range(n) if legal[a]][-3:]  # (near the last allowed node: deep paths, siblings)
            p = rng.choice(live) if rng.random() < 0.9 else rng.randrange(n)
            if legal[p]:
                path = path_of(p, tokens, parents)
                fresh = grammars.constraint(params)
                for t in path:
                    fresh.advance(t)
                row = new_bitmask(1, VOCAB)
                fresh.fill(row, 0)
                choices = sorted(allowed(row, 0) - set(grammars.stop_ids))
                others = sorted(set(range(VOCAB)) - allowed(row, 0))
            else:
                choices, others = [], list(range(VOCAB))
            if choices and rng.random() < 0.85:
                t, is_legal = rng.choice(choices), True
            else:
                t, is_legal = rng.choice(others), False
            tokens.append(t), parents.append(p), ok.append(n % 11 != 10), legal.append(is_legal and ok[-1] and legal[p])
        bitmask = new_bitmask(5 + len(tokens), VOCAB)
        probe.fill_tree(bitmask, 5, tokens, parents, ok)
        assert (bitmask[:5] == -1).all()
        # The walk leaves the constraint as it found it: the deepest allowed path, committed, leaves it where
        # a fresh one fed that path is.
        deepest = max((n for n in range(len(tokens)) if legal[n]), key=lambda n: len(path_of(n, tokens, parents)))
        fresh = grammars.constraint(params)
        for t in path_of(deepest, tokens, parents):
            probe.advance(t), fresh.advance(t)
        mine, theirs = new_bitmask(1, VOCAB), new_bitmask(1, VOCAB)
        probe.fill(mine, 0), fresh.fill(theirs, 0)
        assert torch.equal(mine, theirs)
        for n in range(len(tokens)):
            path = path_of(n, tokens, parents)
            fresh = grammars.constraint(params)
            row = new_bitmask(1, VOCAB)
            if legal[n]:  # (the node and all its ancestors allowed)
                for t in path:
                    fresh.advance(t)
                fresh.fill(row, 0)
            assert allowed(bitmask, 5 + n) == allowed(row, 0), n
        assert max(len(path_of(n, tokens, parents)) for n in range(len(tokens)) if legal[n]) >= 4  # deep paths


def path_of(n: int, tokens: list[int], parents: list[int]) -> list[int]:
    """The tokens from below the root down to node n."""
    return [tokens[a] for a in ancestors(n, parents)][::-1]


def ancestors(n: int, parents: list[int]) -> list[int]:
    """n and its ancestors up to, not including, the root."""
    out = []
    while n > 0:
        out.append(n)
        n = parents[n]
    return out


def test_every_stop_token_is_allowed_exactly_where_the_text_may_end(grammars, tokenizer):
    c = grammars.constraint(SamplingParams(regex="ab|abc"))
    for t in tokenizer.encode("a"):
        assert not c.advance(t)
    row = new_bitmask(1, VOCAB)
    c.fill(row, 0)
    assert not set(grammars.stop_ids) & allowed(row, 0)
    for t in tokenizer.encode("b"):
        assert not c.advance(t)  # (matches, but "c" may follow)
    c.fill(row, 0)
    assert set(grammars.stop_ids) <= allowed(row, 0)
    assert c.advance(tokenizer.encode("c")[0])  # complete: nothing may follow


@pytest.mark.parametrize("params, message", [
    (dict(regex="a", grammar="start: \"a\""), "at most one of json_schema, regex and grammar"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema=3), "json_schema must be a dict or JSON text"),
    (dict(regex=5), "regex must be a string"),
    (dict(regex="a(b"), "regex does not compile"),
    (dict(json_schema={"type": "nonsense"}), "json_schema does not compile"),
    (dict(grammar="start: missing_rule"), "grammar does not compile"),
])
def test_sampling_params_reject_malformed_structures(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def assert_serving_and_idle(llm) -> None:
    assert not llm.engine.has_work()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids  # (the engine still serves)


@pytest.mark.parametrize("model, message", [(dict(with_tokenizer=False), "this model has no tokenizer"),
                                            (dict(vocab_size=300), "llguidance cannot use this model's tokenizer")],
                         ids=["no tokenizer", "tokenizer beyond the model's rows"])
def test_structure_without_a_usable_tokenizer_is_a_clear_error_that_leaks_nothing(model, message, make_llm, tmp_path):
    from tiny import make_tiny_model
    llm = make_llm(model=make_tiny_model(str(tmp_path), **model))
    llm.engine.grammars.prepare()  # (as the server does at start-up: it must not raise)
    with pytest.raises(ValueError, match=f"structured output is not available: {message}"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, regex="ab"))
    assert_serving_and_idle(llm)


def test_a_schema_that_fails_at_its_first_step_is_refused_at_admission(make_llm):
    # (its references never end: it compiles, and fails on its first mask)
    endless = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    llm = make_llm()
    with pytest.raises(ValueError, match="json_schema does not compile"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, json_schema=endless))
    assert_serving_and_idle(llm)


def test_a_grammar_that_names_a_stop_token_ends_there_without_breaking_the_step(make_llm, tmp_path):
    # A model with two stop tokens; the grammar asks for the second first. The request ends at it (a stop
    # token ends a request wherever it comes), and the requests beside it go on.
    from tiny import make_tiny_model
    tok = make_tokenizer()
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    path = make_tiny_model(str(tmp_path))
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**config, "eos_token_id": [end, start]}, f)
    llm = make_llm(model=path)
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=8, grammar='start: <|im_start|> "a"'),
                                             SamplingParams(max_tokens=6, ignore_eos=True)])
    assert outs[0].token_ids == [start] and outs[0].finish_reason == "stop"
    assert len(outs[1].token_ids) == 6
    assert_serving_and_idle(llm)


def test_constrained_texts_follow_their_structure_and_end_with_it(make_llm):
    # A random tiny model has no idea of JSON: every token it writes here is the mask's doing. Each
    # bounded structure completes well within max_tokens and ends the request ("stop").
    llm = make_llm(num_pages=256)
    shapes = [dict(regex=REGEX), dict(json_schema=SCHEMA), dict(grammar=LARK),
              dict(json_schema={"type": "string", "enum": ["alpha", "beta"]})]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i, **s) for i, s in enumerate(shapes)]
        outs = llm.generate(["Hello, world!", "def add(a, b):", "The quick", "import numpy"], params)
        assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
        assert re.fullmatch(REGEX, outs[0].text)
        value = json.loads(outs[1].text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and isinstance(value["n"], int)
        assert re.fullmatch(r"x[0-9]{1,4};", outs[2].text)
        assert json.loads(outs[3].text) in ("alpha", "beta")
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
