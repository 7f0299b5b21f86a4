"""Code-context prompts: functions from the Python sources installed on this machine (the standard
library and site-packages), quoted in requests to complete, explain, refactor, review or test them.

Files are listed in sorted order under each root, shuffled by the seed and read one by one until
enough functions are found, at most `per_file` from a file, so the same seed on the same installation
gives the same prompts. Excerpts stay short (a function of `min_lines` to `max_lines` lines, at most
`max_chars` characters), never a whole file. A record keeps the function's whole source under "code"
for the evaluation check (`dedup.EvaluationIndex.contamination`); prompt files leave it out.
"""
from __future__ import annotations

import ast
import os
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field

# Requests by kind, with the kind's share of the prompts. "{module}" is the dotted module the code
# comes from.
REQUESTS: dict[str, list[str]] = {
    "complete": [
        "Complete this Python function:",
        "Finish the implementation of this function from {module}. Reply with code only.",
        "Here is the start of a Python function. Write the rest of it.",
        "Fill in the body of this function so that it does what its name and docstring say:",
    ],
    "explain": [
        "Explain what this Python function does:",
        "Walk me through this code from {module} step by step.",
        "What does this function do, and when would I use it?",
        "I found this in {module}. Can you explain it in plain words?",
    ],
    "refactor": [
        "Refactor this function to make it easier to read, keeping its behaviour the same:",
        "How could this code be simplified? Show the improved version.",
        "Rewrite this function with type hints and a clear docstring.",
    ],
    "review": [
        "Review this code. Are there bugs or edge cases it misses?",
        "Is there anything wrong with this function? Suggest fixes if so.",
    ],
    "test": [
        "Write pytest unit tests for this function:",
        "What test cases would you write for this code? Write them with unittest.",
    ],
}
KIND_WEIGHTS = {"complete": 0.35, "explain": 0.25, "refactor": 0.15, "review": 0.1, "test": 0.15}
_SKIPPED_DIRS = {"test", "tests", "testing", "__pycache__", "site-packages", "dist-packages", "idle_test"}
_EVALUATION_PATHS = re.compile(r"human_?eval|evalplus|mbpp", re.I)  # packages of code benchmarks


@dataclass
class CodeContextConfig:
    count: int = 1000  # prompts wanted (after the evaluation check and dedup)
    seed: int = 0
    roots: list[str] = field(default_factory=list)  # default: the standard library and site-packages
    per_file: int = 2
    min_lines: int = 5
    max_lines: int = 60
    max_chars: int = 2500
    max_file_bytes: int = 400_000


def default_roots() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths["stdlib"], paths["purelib"], paths["platlib"]) if os.path.isdir(p)))


def python_files(roots: list[str]) -> list[tuple[str, str]]:
    """(root, path relative to it) of each .py file, sorted; test directories, nested site-packages
    and code-benchmark packages left out."""
    out = []
    for root in roots:
        for d, dirs, files in os.walk(root):
            rel_dir = os.path.relpath(d, root)
            dirs[:] = sorted(x for x in dirs if x not in _SKIPPED_DIRS and not _EVALUATION_PATHS.search(x))
            if rel_dir != "." and _EVALUATION_PATHS.search(rel_dir):
                continue
            out += [(root, os.path.normpath(os.path.join(rel_dir, f))) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def module_name(rel_path: str) -> str:
    parts = rel_path[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__main__"


def _module_functions(body: list[ast.stmt]) -> Iterator[ast.FunctionDef]:
    """Module-level functions and methods of (nested) classes; not functions inside functions."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _module_functions(node.body)


def _functions(source: str, cfg: CodeContextConfig) -> list[tuple[ast.FunctionDef, str]]:
    """(node, dedented source) of each function in a file within the size bounds, with a real body."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for node in _module_functions(tree.body):
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n_lines = node.end_lineno - start + 1
        if not cfg.min_lines <= n_lines <= cfg.max_lines:
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if not body or all(isinstance(s, (ast.Pass, ast.Raise)) or
                           (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body):
            continue  # (a stub: nothing to complete or explain)
        text = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
        if len(text) <= cfg.max_chars and "\t" not in text:
            found.append((node, text))
    return found


def _head(node: ast.FunctionDef, text: str, extra_lines: int) -> str | None:
    """The function's signature and docstring, plus `extra_lines` lines of its body: the part a
    "complete" request shows. None if that would show the whole function or nothing past the signature."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    has_doc = ast.get_docstring(node) is not None
    body = node.body[1:] if has_doc else node.body
    shown_to = (node.body[0].end_lineno if has_doc else body[0].lineno - 1) + extra_lines  # (file line numbers)
    if shown_to >= node.end_lineno or (not has_doc and extra_lines == 0):
        return None
    return "\n".join(text.splitlines()[:shown_to - first + 1])


def code_context_records(cfg: CodeContextConfig) -> Iterator[dict]:
    """Prompt records {"prompt", "source": "code_contexts", "kind", "origin", "code"} (see the module
    docstring), as many as the files give: the caller takes what it needs (`cfg.count` is its target)
    after the evaluation check and dedup (which takes a function quoted twice, e.g. a vendored copy, once)."""
    rng = random.Random(cfg.seed)
    files = python_files(cfg.roots or default_roots())
    rng.shuffle(files)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    for root, rel in files:
        path = os.path.join(root, rel)
        try:
            if os.path.getsize(path) > cfg.max_file_bytes:
                continue
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        candidates = _functions(source, cfg)
        rng.shuffle(candidates)
        taken = 0
        for node, text in candidates:
            if taken >= cfg.per_file:
                break
            kind = rng.choices(kinds, weights)[0]
            shown = text
            if kind == "complete":
                shown = _head(node, text, rng.randint(0, 3))
                if shown is None:
                    kind, shown = "explain", text
            request = rng.choice(REQUESTS[kind]).format(module=module_name(rel))
            taken += 1
            yield {"prompt": f"{request}\n\n```python\n{shown}\n```", "source": "code_contexts", "kind": kind,
                   "origin": f"{module_name(rel)}:{node.name}", "code": text}
