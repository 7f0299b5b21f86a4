"""Reading sampled tokens back to the host one step late, so the GPU never waits for the host."""
from __future__ import annotations

import torch


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
