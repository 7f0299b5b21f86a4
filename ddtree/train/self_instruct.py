"""Self-instruct prompts: the target writes the user requests itself.

A fixed grid of task kinds x topics, shuffled by the seed, gives each request a plan (kind, topic,
and a persona, length, programming language and example messages drawn from the same seeded
generator). The plan becomes a few-shot document of example user messages (`EXAMPLES`, of other
kinds than the plan's) that ends where the plan's message is to be written; the target continues it
as plain text, sampled, and the cleaned continuation (`clean_request`) is the prompt. A share of the
plans are follow-ups: the target answers its first request greedily in chat, then continues a
document of that exchange with the user's next message, and the prompt is the three-message
conversation. Request k is sampled with the seed `seed` * 2^32 + 2k (its follow-up message with
2k + 1), so the same seed, target and engine give the same prompts.
"""
from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ddtree.train.dedup import ngram_hashes

# What a message of each kind asks for (as the meta-prompt names it), with the kind's share of the plans.
TASK_KINDS: dict[str, str] = {
    "code_write": "{language} code that does something concrete",
    "code_fix": "help with a bug or an error message in {language} code it pastes",
    "code_howto": "how to do something in {language}",
    "json": "an answer in JSON, with the fields named",
    "structured": "a markdown table, YAML, CSV or a numbered list",
    "math": "a worked solution to a math problem",
    "short_answer": "a one-line answer: a fact, a number, a date or yes or no",
    "explain": "an explanation of a concept or of a difference",
    "writing": "a piece of writing: an email, a story, a description or a summary",
    "advice": "practical advice or step-by-step instructions",
}
KIND_WEIGHTS = {"code_write": 3, "code_fix": 2, "code_howto": 2, "json": 2, "structured": 1, "math": 2,
                "short_answer": 2, "explain": 2, "writing": 2, "advice": 1}
TOPICS = [
    "personal finance", "cooking", "travel", "astronomy", "biology", "world history", "web development",
    "databases", "machine learning", "computer networking", "operating systems", "game development", "music",
    "fitness", "contract law", "marketing", "chemistry", "physics", "statistics", "linguistics", "geography",
    "climate", "gardening", "cars", "photography", "teaching", "hospital administration", "online shopping",
    "logistics", "football", "literature", "philosophy", "psychology", "real estate", "computer security",
    "cloud infrastructure", "mobile apps", "spreadsheets", "embedded systems", "retail", "pets", "parenting",
    "job hunting", "event planning", "architecture", "agriculture", "electronics", "board games",
]
PERSONAS = ["a student", "a software engineer", "a teacher", "a small business owner", "a data analyst",
            "a researcher", "a hobbyist", "a product manager", "a retiree", "a nurse", "a journalist",
            "a system administrator", "a freelancer", "a beginner programmer"]
LANGUAGES = ["Python", "JavaScript", "TypeScript", "Java", "C++", "C", "C#", "Go", "Rust", "SQL", "Bash", "PHP",
             "Ruby", "Kotlin", "Swift", "HTML and CSS", "R"]
LENGTHS = ["one sentence", "two or three sentences", "a short paragraph"]
FOLLOW_UPS = [
    "asks to change or extend the answer in a specific way",
    "asks a question about one detail of the answer",
    "points out a problem with the answer and asks for a fix",
    "asks for the same content in another form: shorter, as a table, as code, or for another audience",
]
# Example messages for the few-shot meta-prompt, written for it: (kind, language, persona, topic, message). A plan
# is shown examples of other kinds than its own, so that it is not led to copy one.
EXAMPLES = [
    ("code_write", "Python", "a teacher", "statistics",
     "Can you write a Python function that takes a list of exam scores and returns the mean, the median and the "
     "standard deviation? I can't use numpy on the school computers."),
    ("code_fix", "JavaScript", "a beginner programmer", "web development",
     "My fetch call returns \"Unexpected token < in JSON at position 0\". Here is the code:\n\n"
     "fetch('/api/items').then(r => r.json()).then(console.log)\n\nWhat am I doing wrong?"),
    ("code_howto", "Python", "a data analyst", "spreadsheets",
     "How do I read only the columns 'date' and 'amount' from a big CSV file with pandas, and parse the dates "
     "while reading?"),
    ("json", "", "a product manager", "mobile apps",
     "Turn these notes into a JSON array of objects with the fields title, owner and due_date: login screen "
     "redesign - Maria - May 3; push notifications - Tom - May 10."),
    ("structured", "", "a student", "chemistry",
     "Make a markdown table of the first ten elements with their symbol, atomic number and whether each is a metal."),
    ("math", "", "a small business owner", "retail",
     "I buy mugs at $4.20 each and sell them for $9. If card fees take 3% of each sale, how many mugs do I need to "
     "sell to make $1,000 profit?"),
    ("short_answer", "", "a hobbyist", "astronomy", "Which planet has the shortest day?"),
    ("explain", "", "a nurse", "biology",
     "What is the difference between type 1 and type 2 diabetes, in simple terms?"),
    ("writing", "", "a freelancer", "job hunting",
     "Write a short, friendly email to a former client asking if they would be willing to give me a testimonial "
     "for my website."),
    ("advice", "", "a retiree", "gardening",
     "My tomato leaves are turning yellow from the bottom up. What should I check first, and what can I do about "
     "it this week?"),
    ("short_answer", "", "a journalist", "world history", "In what year did the Berlin Wall fall?"),
    ("code_write", "Bash", "a system administrator", "computer security",
     "Write a Bash script that lists every user account on a Linux machine that has not logged in for 90 days."),
]
_HEADER = "Messages that people sent to an AI assistant, with who wrote each and what it asks for.\n"
_STOPS = ["\n###", "\nMessage:", "\nFrom:"]  # (where the next example entry would start)


@dataclass
class SelfInstructConfig:
    count: int = 1000  # prompts wanted (after cleaning, the evaluation check and dedup)
    seed: int = 0
    temperature: float = 0.9
    top_p: float = 0.95
    max_tokens: int = 256  # a request's length limit (an unfinished one is dropped, see drop_unfinished)
    answer_max_tokens: int = 256  # the first answer of a follow-up (the conversation stays within ~512 tokens)
    follow_up_share: float = 0.15
    min_chars: int = 12
    max_chars: int = 2000
    drop_unfinished: bool = True  # drop requests and answers cut off at their token limit
    batch_size: int = 256
    max_requests: int | None = None  # requests to try at most (default: 4 x count)
    examples: int = 3  # example messages in each meta-prompt


@dataclass(frozen=True)
class Plan:
    index: int
    kind: str
    topic: str
    persona: str
    language: str
    length: str
    follow_up: str | None  # the follow-up's kind, or None for a single request
    examples: tuple[int, ...]  # indices into EXAMPLES


def request_plans(seed: int, follow_up_share: float = 0.15, examples: int = 3) -> Iterator[Plan]:
    """The plans in order, without end: the grid's cells (each kind as many times as its weight, with
    every topic) shuffled by the seed, then again in a new order."""
    rng = random.Random(seed)
    cells = [(k, t) for k, w in KIND_WEIGHTS.items() for _ in range(w) for t in TOPICS]
    for index in itertools.count():
        if index % len(cells) == 0:
            rng.shuffle(cells)
        kind, topic = cells[index % len(cells)]
        follow_up = rng.choice(FOLLOW_UPS) if rng.random() < follow_up_share else None
        shown = rng.sample([i for i, e in enumerate(EXAMPLES) if e[0] != kind], examples)
        yield Plan(index, kind, topic, rng.choice(PERSONAS), rng.choice(LANGUAGES), rng.choice(LENGTHS), follow_up,
                   tuple(shown))


def _entry(number: int, persona: str, asks_for: str, topic: str, length: str | None = None) -> str:
    about = f"From: {persona}. Asks for: {asks_for}. Topic: {topic}." + (f" Length: {length}." if length else "")
    return f"\n### Message {number}\n{about}\nMessage:"


def meta_prompt(plan: Plan) -> str:
    """A few-shot document of example messages ending where the plan's message is to be written (the
    target continues it as plain text, up to the next '###')."""
    parts = [_HEADER]
    for n, i in enumerate(plan.examples, 1):
        kind, language, persona, topic, message = EXAMPLES[i]
        parts.append(_entry(n, persona, TASK_KINDS[kind].format(language=language), topic) + f" {message}\n")
    parts.append(_entry(len(plan.examples) + 1, plan.persona, TASK_KINDS[plan.kind].format(language=plan.language),
                        plan.topic, plan.length))
    return "".join(parts)


def follow_up_prompt(request: str, answer: str, follow_up: str) -> str:
    """A document that shows the first exchange and ends where the user's next message is to be written."""
    return (f"A conversation between a user and an AI assistant.\n\n### User\n{request}\n\n### Assistant\n"
            f"{answer}\n\n### User (a follow-up that {follow_up})\n")


_PREAMBLE = re.compile(r"^(sure|certainly|of course|okay|ok|absolutely|here(?:'s| is| are| it is)|below is|"
                       r"this is)\b[^\n]*$", re.I)
_LABEL = re.compile(r"^(?:\*\*|__)?(?:user(?:'s)?(?: next)?(?: message| request)?|message|request|prompt|query|"
                    r"question|<user>)(?:\*\*|__)?\s*:?\s*(?:\*\*|__)?\s*", re.I)
_QUOTES = {'"': '"', "'": "'", "\u201c": "\u201d", "\u2018": "\u2019", "\u00ab": "\u00bb"}
_META_TAIL = re.compile(r"^(\(|note:|this message|---|\*\*note)", re.I)
_ACKNOWLEDGEMENT = re.compile(r"^(sure|certainly|of course|okay|absolutely|great)[!,.]\s+", re.I)
# Replies that answer as the assistant or refuse instead of writing a request.
_NOT_A_REQUEST = re.compile(r"^(i'm sorry|i am sorry|sorry|i cannot|i can't|as an ai)\b|how (can|may) i (help|assist)|"
                            r"i'?d be (happy|glad) to|i'm here to help|i can help you|what would you like", re.I)
# The meta-prompt's own fields and wording showing through (its template copied rather than followed).
_TEMPLATE = re.compile(r"\b(from|asks for|topic|length|message)\s*:|you might say|next message|a follow-up that",
                       re.I)
ECHO_WORDS = 8  # a request sharing this many consecutive words with its meta-prompt copies it


def echoes(text: str, prompt: str, n: int = ECHO_WORDS) -> bool:
    """Whether `text` shares a run of n normalised words with `prompt` (an example or the instructions
    copied instead of a new message written)."""
    import numpy as np
    return bool(np.isin(ngram_hashes(text, n), ngram_hashes(prompt, n)).any())


def clean_request(text: str, min_chars: int = 12, max_chars: int = 2000) -> str | None:
    """The user message in a reply to a meta-prompt: preambles ("Sure, here is a message:"), labels
    ("User:", "**Request:**"), wrapping quotes or tags and trailing notes removed. None for a refusal,
    a reply in the assistant's voice, the meta-prompt's fields showing through ("Topic:"), or a message
    outside [min_chars, max_chars]."""
    text = text.strip()
    for _ in range(2):  # a preamble line ending in ':' or standing alone ("Sure!")
        first, _, rest = text.partition("\n")
        if rest.strip() and _PREAMBLE.match(first.strip()) and (first.rstrip().endswith((":", "!", "."))):
            text = rest.strip()
    text = _LABEL.sub("", text, count=1).strip()
    text = _ACKNOWLEDGEMENT.sub("", text, count=1)
    text = text.removesuffix("</user>").strip()
    if text.startswith("```") and text.endswith("```") and text.count("```") == 2:
        first, _, rest = text[3:-3].partition("\n")
        if first.strip().lower() in ("", "text", "markdown", "plaintext"):
            text = rest.strip()
    for _ in range(2):
        if len(text) >= 2 and _QUOTES.get(text[0]) == text[-1] and text.count(text[0]) <= 2:
            text = text[1:-1].strip()
    paragraphs = text.split("\n\n")
    while len(paragraphs) > 1 and _META_TAIL.match(paragraphs[-1].strip()):
        paragraphs.pop()
    text = "\n\n".join(paragraphs).strip()
    if not min_chars <= len(text) <= max_chars or _NOT_A_REQUEST.search(text) or _TEMPLATE.search(text):
        return None
    return text


def self_instruct_records(llm, cfg: SelfInstructConfig, admit: Callable[[dict], bool] = lambda r: True,
                          stats: dict | None = None) -> list[dict]:
    """Prompt records {"prompt" or "messages", "source": "self_instruct", "kind", "topic"} written by the
    target (`llm`, an `ddtree.LLM` with a tokenizer and a chat template) until `cfg.count` pass `admit`
    (the evaluation check and dedup) or `cfg.max_requests` plans are spent. Requests that copy a run of
    `ECHO_WORDS` words from their meta-prompt are dropped. `stats`, if given, receives the plans tried
    ("requests") and how many gave no usable prompt ("unusable": dropped by cleaning, cut off, or a
    follow-up that failed) before the evaluation check and dedup."""
    from ddtree import SamplingParams

    def sampled(k: int, max_tokens: int) -> SamplingParams:  # (a message ends where the next '###' would start)
        return SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              seed=(cfg.seed * 2**32 + k) % 2**64, stop=_STOPS)

    def text_of(out, prompt: str) -> str | None:
        if cfg.drop_unfinished and out.finish_reason == "length":
            return None
        text = clean_request(out.text, cfg.min_chars, cfg.max_chars)
        return None if text is None or echoes(text, prompt) else text

    plans = request_plans(cfg.seed, cfg.follow_up_share, cfg.examples)
    limit = cfg.max_requests if cfg.max_requests is not None else 4 * cfg.count
    kept: list[dict] = []
    tried = unusable = 0
    while len(kept) < cfg.count and tried < limit:
        batch = list(itertools.islice(plans, min(cfg.batch_size, limit - tried)))
        tried += len(batch)
        metas = [meta_prompt(p) for p in batch]
        outs = llm.generate(metas, [sampled(2 * p.index, cfg.max_tokens) for p in batch])
        requests = [text_of(o, m) for o, m in zip(outs, metas)]
        follow = [(p, r) for p, r in zip(batch, requests) if p.follow_up and r is not None]
        conversations: dict[int, list[dict]] = {}
        if follow:
            answers = llm.chat([[{"role": "user", "content": r}] for _, r in follow],
                               SamplingParams(max_tokens=cfg.answer_max_tokens))
            follow = [(p, r, a.text.strip()) for (p, r), a in zip(follow, answers)
                      if a.text.strip() and not (cfg.drop_unfinished and a.finish_reason == "length")]
            docs = [follow_up_prompt(r, a, p.follow_up) for p, r, a in follow]
            nexts = llm.generate(docs, [sampled(2 * p.index + 1, cfg.max_tokens) for p, _, _ in follow])
            for (p, r, a), o, doc in zip(follow, nexts, docs):
                nxt = text_of(o, doc)
                if nxt is not None:
                    conversations[p.index] = [{"role": "user", "content": r}, {"role": "assistant", "content": a},
                                              {"role": "user", "content": nxt}]
        for p, r in zip(batch, requests):
            if len(kept) >= cfg.count:
                break
            if r is None or (p.follow_up and p.index not in conversations):
                unusable += 1
                continue
            if p.follow_up:
                record = {"messages": conversations[p.index], "source": "self_instruct", "kind": "follow_up",
                          "first_kind": p.kind, "topic": p.topic}
            else:
                record = {"prompt": r, "source": "self_instruct", "kind": p.kind, "topic": p.topic}
            if p.kind.startswith("code"):
                record["language"] = p.language
            if admit(record):
                kept.append(record)
    if stats is not None:
        stats.update(requests=tried, unusable=unusable)
    return kept
