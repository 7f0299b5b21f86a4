"""Reading sampled tokens back to the host one step late, so the GPU never waits for the host."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Launched = TypeVar("Launched")


def pipelined(steps: int, launch: Callable[[int], Launched], commit: Callable[[Launched], bool]) -> int:
    """The loop of a decode burst: step i + 1 is launched (its inputs computed on the device from step
    i's outputs) before step i is read back and committed, so the device never waits for the host's
    launch, read-back and bookkeeping. `launch(i)` starts step i and its read-back; `commit(launched)`
    commits a step, True when a request finished: the burst then ends after the step already launched
    (wasted for that request). Returns the number of steps run."""
    pending = None
    for i in range(steps):
        launched = launch(i)
        ended = pending is not None and commit(pending)
        pending = launched
        if ended:
            steps = i + 1
            break
    commit(pending)
    return steps


class TokenReadback:
    """Copies sampled tokens to the host without waiting for them (pinned buffers, an event per copy),
    so the host can launch the next step before reading this one. Two buffers, used in turn: a
    buffer is read before the copy after next overwrites it."""

    def __init__(self, max_rows: int, device: torch.device):
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(max_rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> int:
        i, self.turn = self.turn, 1 - self.turn
        self.buffers[i][:tokens.shape[0]].copy_(tokens, non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        return i

    def result(self, i: int, n: int) -> list[int]:
        if self.events[i] is not None:
            self.events[i].synchronize()
        return self.buffers[i][:n].tolist()
