"""CUDA graphs for the decode-time steps (AR decode, and the whole speculative step).

A step function reads a dataclass of device tensors with one row per request and returns a
dataclass of device tensors. `GraphPool` keeps static copies of the inputs sized for the largest
batch, captures the function once per batch-size bucket (1, 2, 4, 8, ...), and on each call copies
the real rows in, fills padding rows with harmless values (their K/V land in the scratch page),
replays the graph and returns the outputs. A bucket is captured on padding values only (its warm-up
runs execute for real), so a step function may also update its own inputs. Every per-step value,
positions and masks included, is derived inside the graph from these static buffers, so a replay
can never read a stale tensor.

Under tensor parallelism (`tp`, parallel/workers.py) the other ranks capture their side of each graph
at the same time: the broadcasts of the target's inputs and the layers' all-reduces are captured on
every rank, and each replay here is announced so that the workers replay theirs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ddtree.ops.fused import graphing


def buckets_up_to(n: int) -> list[int]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


class GraphPool:
    def __init__(self, fn: Callable, max_batch: int, pad: dict[str, float] | None = None,
                 widths: dict[str, int] | None = None, mempool=None, tp=None):
        """`pad`: value for padding rows per input field (default 0); `widths`: fixed size of dim 1 for
        inputs whose width varies between calls (page tables); `mempool`: a `torch.cuda.graph_pool_handle()`
        shared with other pools whose graphs never run concurrently and whose outputs are consumed
        before another graph replays (their intermediates then share memory); `tp`: the tensor-parallel ranks
        that mirror the target's calls in `fn`."""
        self.fn, self.max_batch, self.tp = fn, max_batch, tp
        self.pad, self.widths = pad or {}, widths or {}
        self.buckets = buckets_up_to(max_batch)
        self.static: dict[str, torch.Tensor] | None = None
        # bucket -> (graph, its outputs, the workers' key for their side of it, or None: nothing mirrored)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, int | None]] = {}
        self.mempool = mempool
        self.input_type = None

    def _allocate(self, inp) -> None:
        self.input_type = type(inp)
        self.static = {}
        for f in dataclasses.fields(inp):
            t = getattr(inp, f.name)
            if t is None:  # (an input this kind of step does without)
                continue
            shape = list(t.shape)
            shape[0] = self.max_batch
            if f.name in self.widths:
                shape[1] = self.widths[f.name]
            self.static[f.name] = torch.full(shape, self.pad.get(f.name, 0), dtype=t.dtype, device=t.device)

    def _view(self, bs: int):
        return self.input_type(**{k: v[:bs] for k, v in self.static.items()})

    def run(self, inp):
        if self.static is None:
            self._allocate(inp)
        R = getattr(inp, next(iter(self.static))).shape[0]
        bs = next(b for b in self.buckets if b >= R)
        if bs not in self.graphs:
            # Captured on padding, before the inputs go in: the warm-up runs really execute, and on
            # stale rows of an earlier step they would write K/V over live cache positions.
            for name, buf in self.static.items():
                buf.fill_(self.pad.get(name, 0))
            self._capture(bs)
        for name, buf in self.static.items():
            t, pad = getattr(inp, name), self.pad.get(name, 0)
            if buf.dim() > 1 and t.shape[1] != buf.shape[1]:
                buf[:R, :t.shape[1]].copy_(t)
                buf[:R, t.shape[1]:].fill_(pad)
            else:
                buf[:R].copy_(t)
            if R < bs:
                buf[R:bs].fill_(pad)
        return self.replay(R)

    def capture_all(self, padding_inputs) -> None:
        """Every bucket's graph now, ahead of serving, on `padding_inputs(bs)` (fake rows whose writes go
        where nobody reads): a capture in the middle of serving stalls that step far longer than a replay."""
        for bs in self.buckets:
            self.run(padding_inputs(bs))

    def replay(self, rows: int):
        """Replays the graph for `rows` on the static inputs as they are: for a step function that
        writes the next step's inputs itself (AR decode feeding its tokens forward)."""
        graph, out, key = self.graphs[next(b for b in self.buckets if b >= rows)]
        if key is not None:
            self.tp.call("replay", key)
        graph.replay()
        return out

    def _capture(self, bs: int) -> None:
        view = self._view(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if self.tp is not None:  # (the workers warm up as this rank does: what compiles, compiles now)
            self.tp.call("warm_up", True)
        try:
            with graphing(), torch.cuda.stream(stream):  # warm up: compile kernels, settle allocator state
                for _ in range(2):
                    self.fn(view)
        finally:
            if self.tp is not None:
                self.tp.call("warm_up", False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        key = self.tp.begin_capture() if self.tp is not None else None
        try:
            with graphing(), torch.cuda.graph(graph, pool=self.mempool):
                out = self.fn(view)
        finally:
            if key is not None and not self.tp.end_capture():
                key = None  # (no target call in `fn`: the workers have nothing to replay)
        self.mempool = graph.pool()
        self.graphs[bs] = (graph, out, key)
