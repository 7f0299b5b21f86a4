"""Incremental detokenization (engine/detokenizer.py) with the tiny byte-level BPE tokenizer of tests/tiny.py
and a tiny Llama-style one (Metaspace + byte fallback, which drops the leading space of a decode)."""
import json

import pytest

from ddtree.engine.detokenizer import IncrementalDetokenizer
from tiny import CORPUS, make_tokenizer

# Characters of 2, 3 and 4 UTF-8 bytes; the ones outside the tokenizers' corpus fall apart into byte tokens.
TEXT = "naïve café 日本語 🙂 — Ω€ 👍🏽 ok"


def make_metaspace_tokenizer():
    """SentencePiece-like BPE: '▁' marks spaces, unknown characters fall back to <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"],
                                                         show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}  # byte tokens are ordinary tokens
    for t in trained["vocab"]:
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                 prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>")


TOKENIZERS = {"byte_level": make_tokenizer, "metaspace": make_metaspace_tokenizer}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


@pytest.fixture(scope="module")
def ids(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # The test only means something if some characters really are split across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    return ids


def feed(detok: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    return [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]


def test_one_token_at_a_time_never_emits_half_a_character(tok, ids):
    pieces = feed(IncrementalDetokenizer(tok, []), ids, 1)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens had to wait for the rest of their character


@pytest.mark.parametrize("step", [2, 3, 7])
def test_several_tokens_at_a_time_give_the_same_text(tok, ids, step):
    pieces = feed(IncrementalDetokenizer(tok, []), ids, step)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_prompt_context_does_not_leak_into_output(tok, ids):
    prompt = tok.encode("Hello, world! How are you today?")
    pieces = feed(IncrementalDetokenizer(tok, prompt), ids, 1)
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(pieces).strip() == TEXT  # (a Metaspace tokenizer spaces the first word after a prompt)


def test_leading_space_of_first_generated_word_is_kept_by_prompt_context():
    tok = make_metaspace_tokenizer()
    ids = tok.encode("The quick brown fox")
    prompt, out = ids[:2], ids[2:]
    assert tok.decode(out) == "brown fox"  # decoded alone, the leading space is lost
    assert "".join(feed(IncrementalDetokenizer(tok, prompt), out, 1)) == " brown fox"


def test_special_tokens_produce_no_text(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert detok.add([tok.eos_token_id]) == ""
    assert detok.add(tok.encode(" ok")) == " ok"


def test_without_tokenizer_text_is_empty():
    assert IncrementalDetokenizer(None, [1, 2]).add([3, 4]) == ""
