"""A request's state as it moves through the engine: tokens, KV pages, progress and output."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


from ddtree.engine.detokenizer import IncrementalDetokenizer
from ddtree.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None  # None: the text is decoded once, when the request finishes
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    # The prefix cache (engine/kv_cache.py): of the tokens it gave the request at its (last) admission, those
    # whose pages hold the drafter's entries too; its first pages offered, and marked drafted.
    num_prefix_drafted: int = 0
    num_offered_pages: int = 0
    num_drafted_pages: int = 0
    num_cached_prompt: int | None = None  # prompt tokens found cached at its first admission
    # hybrid models: where its prompt chunks stop for the prefix cache's state snapshots (ascending)
    snapshot_at: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)  # the prefix cache's keys of its first full pages
    finish_reason: str | None = None
    accept_lengths: list[int] = field(default_factory=list)
    seed: int = 0  # keys every draw with the token's position (engine/sampler.py)
    state_slot: int = -1  # hybrid models: the recurrent-state slot held with the pages (engine/kv_cache.py)
    # With params.logprobs: per output token (its log-probability, [(token, log-probability)] of the
    # params.logprobs most likely), engine/sampler.py `logprob_records`.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # Structured output: the matcher of the request's json_schema, regex or grammar (engine/grammar.py
    # `Constraint`), advanced by each committed token.
    constraint: object | None = None
    text: str = ""  # detokenized output, cut at a stop string
    # Speculative decoding: the drafter's context for this request (speculative/context.py `DraftContext`,
    # owned by the speculative side; dropped with the cache).
    draft_context: object | None = None

    def drop_cache(self) -> None:
        """Forget all cached state (pages were released): everything is recomputed on readmission."""
        self.block_table = []
        self.state_slot = -1
        self.num_cached = self.num_prefix_drafted = self.num_offered_pages = self.num_drafted_pages = 0
        self.snapshot_at = []
        self.draft_context = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step reads one token)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P:end - P]
        if end <= P:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - P]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens still to be fed to the model (a prompt, a prompt's tail after a chunk, or a
        preempted request's prompt plus output)."""
        return len(self) - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
