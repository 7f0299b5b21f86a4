"""A request's drafter context: which positions' target features the drafter cache holds, which wait
to be stored, and which were never read out (gaps).

The drafter's K/V cover positions [0, stored); the target features of [stored, num_cached) wait in
`pending` until the next draft (or a store) writes them to the drafter cache. An entry is a tensor
[n, K*D], or (buffer, i, n): the first n rows of row i of an AR burst's buffer [R, steps, K*D] (cut out
only when stored: spec/draft.py `pending_rows`), or (None, start, n): a gap, n positions from start
whose features no forward read out (AR steps or a prefill that skipped them; refed before the next
draft). While such steps go on the gap is open, from `gap_from` to num_cached: nothing to do per
step; it is closed into an entry before anything else joins the context.

The speculative side owns this object; a request carries it (`Sequence.draft_context`) and forgets it
with its cache on preemption.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True, eq=False)
class DraftContext:
    stored: int = 0
    pending: list = field(default_factory=list)
    gap_rows: int = 0  # rows in closed gap entries
    gap_from: int | None = None

    def pending_count(self) -> int:
        """Rows of target features pending (gaps included)."""
        return sum(f[2] if isinstance(f, tuple) else f.shape[0] for f in self.pending)

    def add(self, entry: torch.Tensor | tuple) -> None:
        self.pending.append(entry)

    def take(self, num_cached: int) -> list:
        """The pending entries, handed over to be stored: the cache then holds [0, num_cached)."""
        entries, self.pending, self.stored = self.pending, [], num_cached
        return entries

    def replace(self, stored: int, entries: list) -> None:
        """The cache holds [0, stored) and `entries` wait (a burst step's accepted path)."""
        self.stored, self.pending = stored, entries

    @property
    def has_gap(self) -> bool:
        return self.gap_rows > 0 or self.gap_from is not None

    def open_gap(self, num_cached: int) -> None:
        """The forwards from here on do not read out the features: a gap from num_cached on, if none is open."""
        if self.gap_from is None:
            self.gap_from = num_cached

    def close_gap(self, num_cached: int) -> None:
        """Ends an open gap at num_cached: a (None, start, n) entry, merged with one just before it."""
        start, self.gap_from = self.gap_from, None
        if start is None or start == num_cached:
            return
        n = num_cached - start
        last = self.pending[-1] if self.pending else None
        if isinstance(last, tuple) and last[0] is None and last[1] + last[2] == start:
            self.pending[-1] = (None, last[1], last[2] + n)
        else:
            self.pending.append((None, start, n))
        self.gap_rows += n

    def open_gap_rows(self, num_cached: int) -> int:
        """Rows a switch would feed again, an open gap's included."""
        return self.gap_rows + (num_cached - self.gap_from if self.gap_from is not None else 0)

    def gaps(self) -> list[tuple[int, int, int]]:
        """(index in pending, start, n) of every closed gap."""
        return [(j, f[1], f[2]) for j, f in enumerate(self.pending) if isinstance(f, tuple) and f[0] is None]

    def fill_gap(self, j: int, feats: torch.Tensor) -> None:
        """The features of the gap at pending index j (`gaps`), fed through the target again."""
        self.gap_rows -= self.pending[j][2]
        self.pending[j] = feats


def context_of(seq) -> DraftContext:
    """The request's drafter context (made on first use, and again after preemption dropped it)."""
    if seq.draft_context is None:
        seq.draft_context = DraftContext()
    return seq.draft_context
