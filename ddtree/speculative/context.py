"""A request's drafter context: which positions' target features the drafter cache holds, which wait
to be stored, and which were never read out (gaps).

The drafter's K/V cover positions [0, stored); entries for [stored, covered) wait in `pending` until
the next draft (or a store) writes them to the drafter cache. An entry is a tensor [n, K*D], or
(buffer, i, n): the first n rows of row i of an AR burst's buffer [R, steps, K*D] (cut out only when
stored: speculative/draft.py `pending_rows`), or (None, start, n): a gap, n positions from start whose
features no forward read out, to be fed through the target again before the next draft.

Positions from `covered` to the request's num_cached are an open gap: steps that do not read out the
features (plain AR's, under budget auto) leave one without touching this object. `close_gap` turns it
into a gap entry before anything else joins the context.

The speculative side owns this object; a request carries it (`Sequence.draft_context`) and forgets it
with its cache on preemption.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def rows_of(entry: torch.Tensor | tuple) -> int:
    return entry[2] if isinstance(entry, tuple) else entry.shape[0]


@dataclass(slots=True, eq=False)
class DraftContext:
    stored: int = 0
    pending: list = field(default_factory=list)
    covered: int = 0  # stored + the rows of the pending entries
    gap_rows: int = 0  # rows in gap entries

    def pending_count(self) -> int:
        """Rows of target features pending (gap entries included)."""
        return self.covered - self.stored

    def add(self, entry: torch.Tensor | tuple) -> None:
        self.pending.append(entry)
        self.covered += rows_of(entry)

    def take(self, num_cached: int) -> list:
        """The pending entries, handed over to be stored: the cache then holds [0, num_cached)."""
        entries, self.pending, self.stored = self.pending, [], num_cached
        self.covered = num_cached
        return entries

    def replace(self, stored: int, entries: list) -> None:
        """The cache holds [0, stored) and `entries` wait (a burst step's accepted path)."""
        self.stored, self.pending = stored, entries
        self.covered = stored + sum(map(rows_of, entries))

    def has_gap(self, num_cached: int) -> bool:
        return self.gap_rows > 0 or self.covered < num_cached

    def gap_rows_at(self, num_cached: int) -> int:
        """Rows a switch would feed again, the open gap's included."""
        return self.gap_rows + num_cached - self.covered

    def close_gap(self, num_cached: int) -> None:
        """Ends the open gap at num_cached: a (None, start, n) entry, merged with one just before it."""
        n, start = num_cached - self.covered, self.covered
        if n <= 0:
            return
        last = self.pending[-1] if self.pending else None
        if isinstance(last, tuple) and last[0] is None and last[1] + last[2] == start:
            self.pending[-1] = (None, last[1], last[2] + n)
        else:
            self.pending.append((None, start, n))
        self.gap_rows += n
        self.covered = num_cached

    def gaps(self) -> list[tuple[int, int, int]]:
        """(index in pending, start, n) of every gap entry."""
        return [(j, f[1], f[2]) for j, f in enumerate(self.pending) if isinstance(f, tuple) and f[0] is None]

    def fill_gap(self, j: int, feats: torch.Tensor) -> None:
        """The features of the gap at pending index j (`gaps`), fed through the target again."""
        self.gap_rows -= self.pending[j][2]
        self.pending[j] = feats


def context_of(seq) -> DraftContext:
    """The request's drafter context (made on first use, and again after preemption dropped it). The
    drafted pages the prefix cache gave the request hold the drafter's entries: the cache holds those
    positions (the rest of its cached tokens are an open gap)."""
    if seq.draft_context is None:
        seq.draft_context = DraftContext(stored=seq.num_prefix_drafted, covered=seq.num_prefix_drafted)
    return seq.draft_context


def drafted_tokens(seq) -> int:
    """The request's tokens whose drafter cache entries are final (its pages up to there may be marked
    drafted in the prefix cache): those the drafter cache holds."""
    stored = seq.num_prefix_drafted if seq.draft_context is None else seq.draft_context.stored
    return min(seq.num_cached, stored)
