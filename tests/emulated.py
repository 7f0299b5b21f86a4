"""CUDA graphs emulated on the CPU, so tests can run the GPU path's plumbing (static inputs padded to
batch buckets, graphs replayed on them, steps that feed their own next inputs)."""
from __future__ import annotations

import dataclasses

import torch


class EmulatedGraph:
    """Stands in for a CUDA graph on CPU: a replay recomputes the captured function on the static
    inputs and overwrites the static outputs in place, as a real replay does."""
    def __init__(self, fn, view, out):
        self.fn, self.view, self.out = fn, view, out

    def replay(self):
        copy_into(self.out, self.fn(self.view))


def copy_into(dst, src):
    if dst is None:  # (an output a graphed step does not produce)
        return
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, tuple):
        for a, b in zip(dst, src):
            copy_into(a, b)
    else:
        for f in dataclasses.fields(dst):
            copy_into(getattr(dst, f.name), getattr(src, f.name))


def emulated_pool():
    from ddtree.engine.graphs import GraphPool

    class EmulatedPool(GraphPool):
        def _capture(self, bs):
            view = self._view(bs)
            out = self.fn(view)
            self.graphs[bs] = (EmulatedGraph(self.fn, view, out), out, None)

    return EmulatedPool


def fake_gpu_graphs(monkeypatch) -> None:
    """Engines built after this take the GPU path on the CPU: graphs for AR decode, prefill and
    speculative steps, with every replay emulated."""
    import ddtree.engine.ar as ar_mod
    import ddtree.engine.engine as engine_mod
    import ddtree.speculative.auto as auto
    import ddtree.speculative.decode as decode
    monkeypatch.setattr(ar_mod, "GraphPool", emulated_pool())
    monkeypatch.setattr(decode, "GraphPool", emulated_pool())
    monkeypatch.setattr(auto, "GraphPool", emulated_pool())
    monkeypatch.setattr(engine_mod.LLMEngine, "_graphs_supported", lambda self: True)
