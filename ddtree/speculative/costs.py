"""The cost side of `budget="auto"` (speculative/policy.py): step times in milliseconds by batch size, measured
at start-up on the device (`measure_costs`: one AR step, one draft step and one verify step of each
candidate width, and the context store a switch from AR pays first, at a few batch sizes), linear in
between (`CostTable`); and those times as the engine pays them, corrected by what real steps took
(`CostModel`)."""
from __future__ import annotations

import json
import os
import statistics
import time
from bisect import bisect_left
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

AR_TIMING_BURST = 8  # AR steps timed back to back, as the engine's pipelined bursts run them
STORE_ROWS = 64  # pending context rows per request in the timed store (speculative/auto.py PENDING_ROWS caps a stretch's)
STORE_ENTRY_ROWS = 8  # ... in entries of this many (AR bursts run 16 steps, 2 while requests wait for a slot)


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear in x; below the first point its value, past the last the last slope (>= 0)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect_left(xs, x), len(xs) - 1)
    slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    if x > xs[i]:
        return ys[i] + max(slope, 0.0) * (x - xs[i])
    return ys[i - 1] + slope * (x - xs[i - 1])


@dataclass(slots=True)
class CostTable:
    """Step times in milliseconds by batch size (`batch`, ascending)."""
    batch: list[int]
    ar: list[float]  # one AR decode step
    draft: list[float]  # one drafter block
    verify: dict[int, list[float]]  # budget -> verifying budget + 1 nodes per request
    store: list[float] | None = None  # an AR stretch's drafter context (STORE_ROWS a request) stored at a switch

    def __post_init__(self) -> None:
        n = len(self.batch)
        assert n and self.batch == sorted(self.batch) and len(self.ar) == len(self.draft) == n
        assert all(len(v) == n for v in self.verify.values()) and (self.store is None or len(self.store) == n)

    def ar_ms(self, batch: int) -> float:
        return interpolate(self.batch, self.ar, batch)

    def draft_ms(self, batch: int) -> float:
        return interpolate(self.batch, self.draft, batch)

    def verify_ms(self, budget: int, batch: int) -> float:
        return interpolate(self.batch, self.verify[budget], batch)

    def store_ms(self, batch: int) -> float | None:
        """A switch's context store (None: not measured)."""
        return None if self.store is None else interpolate(self.batch, self.store, batch)

    def as_dict(self) -> dict:
        return {"batch": self.batch, "ar": self.ar, "draft": self.draft,
                "verify": {str(b): v for b, v in self.verify.items()}, "store": self.store}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        return cls(d["batch"], d["ar"], d["draft"], {int(b): v for b, v in d["verify"].items()}, d.get("store"))


def cached_costs(path: str) -> CostTable | None:
    """A table measured by an earlier start with the same setup (`store_costs`), or None."""
    try:
        with open(path) as f:
            return CostTable.from_dict(json.load(f)["table"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None


def store_costs(path: str, table: CostTable, setup: dict) -> None:
    """Keeps a measured table for later starts with the same `setup` (what the file name hashes)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"setup": setup, "table": table.as_dict()}, f)
        os.replace(path + ".tmp", path)
    except OSError:  # (a read-only cache: measured again next time)
        pass


def wall_ms(fn, device: torch.device, reps: int, repeat: int = 1) -> list[float]:
    """`reps` timings of `repeat` back-to-back calls of `fn`, each from and to a device synchronize (host
    launch included), in milliseconds per call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / repeat)
    return times


def measure_costs(spec, batch_sizes: list[int], context: int, reps: int) -> CostTable:
    """Times the speculator's own steps on fake requests (`spec.fake_steps`): on GPU replays of its
    CUDA graphs (captured here, ahead of serving), on CPU eager calls. Wall-clock milliseconds as the
    engine pays them, host launch included: a draft, or a whole speculative step of budget b (draft,
    tree, verify), is timed to a synchronize, and verify(b) is the whole step less the draft; AR steps
    run in pipelined bursts, so one is timed as a share of a burst of `AR_TIMING_BURST` back-to-back
    steps (the host launches overlap the device work); a store of `STORE_ROWS` pending rows a request
    (host work included), to a synchronize. Median of `reps` after a warm-up (which also compiles what
    the first store of a shape would have compiled mid-run)."""
    def timed(fn, repeat: int = 1) -> float:
        fn()
        return statistics.median(wall_ms(fn, spec.runner.device, reps, repeat))

    ar, draft, verify, store = [], [], {b: [] for b in spec.budgets if b > 0}, []
    # (progress on a terminal: on the CPU this takes about a minute)
    for bs in tqdm(batch_sizes, desc="budget auto: measuring step costs", unit="batch size", disable=None):
        steps = spec.fake_steps(bs, context)
        ar.append(timed(steps[0], AR_TIMING_BURST))
        draft.append(timed(steps["draft"]))
        for b in verify:  # (a floor: the two timings are separate medians)
            verify[b].append(max(timed(steps[b]) - draft[-1], 0.1 * draft[-1]))
        store.append(timed(steps["store"]))
    return CostTable(list(batch_sizes), ar, draft, verify, store)


def bucket(batch: int) -> int:
    """The power of two at or above `batch` (the CUDA graphs' batch buckets)."""
    return 1 << (batch - 1).bit_length()


class CostModel:
    """Step times in ms as the engine pays them: the table's, times a correction per kind of step ("ar": an
    AR step that reads out the drafter's context, "spec": a whole speculative step, "store": a switch's
    context store, "refeed": feeding skipped rows again) and batch bucket, learnt from timed steps. The
    table counts as a first sample (ratio 1), then a plain mean, then a running one at `decay`; a sample
    counts between half and four times the model. A bucket not timed yet takes the nearest smaller one's
    (host work grows with the batch)."""

    def __init__(self, table: CostTable, decay: float = 0.1):
        self.table, self.decay = table, decay
        self.ratio: dict[str, dict[int, tuple[float, int]]] = {}  # kind -> bucket -> (ratio, samples)
        # A refeed: `refeed_fixed` ms per eager forward of at most `refeed_rows` rows (None: any number), plus
        # `refeed_row` ms a row; until timed (`set_refeed`), a row costs what a verified node does at the
        # table's widest step.
        widest = max(table.verify, default=0)
        self.refeed_fixed, self.refeed_rows = 0.0, None
        self.refeed_row = table.verify[widest][-1] / ((widest + 1) * table.batch[-1]) if widest else 0.0

    def set_refeed(self, fixed_ms: float, row_ms: float, forward_rows: int | None = None) -> None:
        self.refeed_fixed, self.refeed_row, self.refeed_rows = fixed_ms, row_ms, forward_rows

    def scale(self, kind: str, batch: int) -> float:
        seen, key = self.ratio.get(kind), bucket(batch)
        below = [k for k in seen if k <= key] if seen else None
        return seen[max(below)][0] if below else 1.0

    def ar_ms(self, batch: int) -> float:
        return self.table.ar_ms(batch) * self.scale("ar", batch)

    def spec_ms(self, budget: int, batch: int) -> float:
        return (self.table.draft_ms(batch) + self.table.verify_ms(budget, batch)) * self.scale("spec", batch)

    def store_ms(self, batch: int) -> float:
        return (self.table.store_ms(batch) or 0.0) * self.scale("store", batch)

    def refeed_model(self, rows: int) -> float:
        """A refeed of `rows` rows as timed at start-up: a fixed cost per forward it takes, plus its rows."""
        forwards = -(-rows // self.refeed_rows) if self.refeed_rows else 1
        return forwards * self.refeed_fixed + rows * self.refeed_row if rows > 0 else 0.0

    def refeed_ms(self, rows: int) -> float:
        return self.refeed_model(rows) * self.scale("refeed", 1)

    def observe(self, kind: str, batch: int, ms: float, model_ms: float) -> None:
        """A step of `kind` at `batch` took `ms` where the table (uncorrected) says `model_ms`."""
        if model_ms <= 0:
            return
        per, key = self.ratio.setdefault(kind, {}), bucket(batch)
        old, n = per.get(key, (1.0, 1))
        a = max(self.decay, 1 / (n + 1))
        per[key] = ((1 - a) * old + a * min(max(ms / model_ms, 0.5), 4.0), n + 1)

    def state(self) -> dict:
        return {"ratio": {f"{kind}@{k}": round(r, 4) for kind, per in sorted(self.ratio.items())
                          for k, (r, _) in sorted(per.items())},
                "refeed": {"fixed_ms": self.refeed_fixed, "row_ms": self.refeed_row, "forward_rows": self.refeed_rows}}
