"""Evaluation prompt sets shipped with the package (see data/README.md for sources and licences)."""
from __future__ import annotations

import json
import os

DATA = os.path.join(os.path.dirname(__file__), "data")
DATASETS = ("humaneval", "mtbench")


def load_prompts(name: str, limit: int | None = None) -> list[dict]:
    """Rows {"id", "category", "messages"}: a one-turn chat conversation per prompt (MT-Bench: first turn)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASETS}")
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
