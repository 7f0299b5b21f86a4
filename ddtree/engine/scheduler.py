"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

How prefill and decode share a step: every running request that has finished its prompt decodes
(AR: one token; speculative: a draft block and a verify of `decode_width` tokens), and in the same
step the remaining token budget (`max_num_batched_tokens`) goes to prompt chunks, first to requests
part-way through their prompt, then to newly admitted ones in arrival order. Long prompts are
chunked across steps, so decoding requests never stall behind a long prefill and a new request
starts within one step. AR mode runs both kinds in one forward; speculative mode runs the prompt
chunks first, then the draft and verify.

Pages: a decode that cannot get a page preempts the most recently admitted request (its pages are
released and it goes back to the front of the queue; its prompt and output are recomputed when it
returns), so running out of KV pages slows the engine down but never crashes it or drops work.

Prefix caching (engine/kv_cache.py): admission gives a request the cached pages that begin its tokens,
and its prompt chunks start after them. Each step offers the running requests' full pages whose target
K/V are final (below `num_cached`), marking those whose drafter entries are final too (`drafted_tokens`,
set by a speculative engine), and a released request offers its own, so a preempted request finds its
pages again unless they were taken. A hybrid's prompt chunks stop at each of its `snapshot_at`, where the
prefix cache keeps its recurrent state.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledStep:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (request, tokens in this chunk)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 decode_width: int = 1, decode_tokens: int | None = None):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_width = decode_width  # new K/V slots a decode step writes per request
        # tokens a decode feeds per forward (a verify's tree; 1 for AR, even in a burst of steps)
        self.decode_tokens = decode_width if decode_tokens is None else decode_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, holding pages, in admission order
        self.num_preemptions = 0
        self.out_of_pages = False  # the last schedule left a waiting request out for want of pages
        # tokens of a request whose drafter cache entries are final (a speculative engine's drafter)
        self.drafted_tokens: Callable[[Sequence], int] = lambda seq: 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admitting(self) -> bool:
        """A request waits and a slot is free: decoders keep bursts short, so its prefill is not held back."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def headed_for(self) -> int:
        """The batch size once the prompts waiting for a slot are in (auto judges the chance for
        speculation where the running batch is headed: at the start of a run at C=128 it is let in a few
        prompts at a time); the running one where the KV cache holds no more."""
        if self.out_of_pages:
            return len(self.running)
        return min(self.max_num_seqs, len(self.running) + len(self.waiting))

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        alloc, width = self.allocator, self.decode_width
        preempted = self.num_preemptions
        prefilling = []
        # 1. Decode every request past its prompt; grow its pages, preempting the newest if needed.
        #    (A preempted request is no longer RUNNING: a status check, not a search of the list.)
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue
            if alloc.prefix_caching:
                alloc.offer(seq, seq.num_cached, self.drafted_tokens(seq))
            n = seq.num_uncached
            if n != 1 or not seq.output_ids:  # (a prompt's last token is a chunk: it gives the first output)
                if n >= 1:
                    prefilling.append(seq)
                continue
            need = alloc.pages_needed(seq, seq.num_cached + width)
            while need > alloc.num_free and seq.status is Status.RUNNING:
                self.preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                if need:
                    alloc.grow(seq, seq.num_cached + width)
                step.decode.append(seq)
        # 2. Prompt chunks: requests mid-prompt first, then newly admitted ones. Admission reserves
        #    pages for the whole prompt, so a chunked prefill never stalls.
        # Decode tokens count against the step's token budget too, but prompts always keep a quarter
        # of it so new requests still start while a large batch decodes.
        budget = max(self.max_num_batched_tokens - len(step.decode) * self.decode_tokens,
                     self.max_num_batched_tokens // 4)
        for seq in prefilling:
            if seq.status is Status.RUNNING and budget > 0:
                budget -= self._chunk(seq, budget, step)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.allocator.admit(seq):
                self.out_of_pages = True
                return step
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._chunk(seq, budget, step)
        self.out_of_pages = self.num_preemptions > preempted
        return step

    def _chunk(self, seq: Sequence, budget: int, step: ScheduledStep) -> int:
        n = min(seq.num_uncached, budget)
        if seq.snapshot_at and seq.snapshot_at[0] < seq.num_cached + n:  # (a hybrid's state is kept there)
            n = seq.snapshot_at[0] - seq.num_cached
        step.prefill.append((seq, n))
        return n

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq, seq.num_cached, self.drafted_tokens(seq))
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq, seq.num_cached, self.drafted_tokens(seq))
