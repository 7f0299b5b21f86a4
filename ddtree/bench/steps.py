"""Device time of single engine steps: each step's CUDA graph (an AR decode step, a draft, a whole
speculative step, a verify of a width) captured on fake requests and replayed (`step_times`), and the
kernels each step is made of (`step_profiles`). `ddtree bench latency --step-times` and the GPU tools in
benchmarks/ report them.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ddtree import LLM, SamplingParams


def time_graph(fn, inputs, reps: int = 30, tp=None) -> float:
    """Median milliseconds of one replay of fn's CUDA graph (eager wall time on CPU); `tp`: the
    tensor-parallel ranks that replay their side of it."""
    from ddtree.engine.graphs import GraphPool
    if not torch.cuda.is_available():
        times = []
        for _ in range(max(3, reps // 10)):
            t0 = time.perf_counter()
            fn(inputs)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    rows = inputs_rows(inputs)
    pool = GraphPool(fn, rows, tp=tp)
    pool.run(inputs)
    return median_replay_ms(pool if tp is not None else pool.graphs[pool.buckets[-1]][0], reps, rows)


def median_replay_ms(graph, reps: int, rows: int = 0) -> float:
    """Median milliseconds of one replay of a captured CUDA graph, or of a GraphPool's graph for `rows`,
    over `reps` replays (CUDA events)."""
    replay = graph.replay if isinstance(graph, torch.cuda.CUDAGraph) else lambda: graph.replay(rows)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(fn, calls: int = 1, reps: int = 200) -> float:
    """Median microseconds of one call of fn (no arguments), `calls` calls captured in one CUDA graph after
    two warm calls on a side stream (where Triton compiles and autotunes), over `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    return median_replay_ms(g, reps) * 1e3 / calls


def inputs_rows(inp) -> int:
    return getattr(inp, dataclasses.fields(inp)[0].name).shape[0]


@torch.inference_mode()
def step_times(llm: LLM, batch_sizes: list[int], widths: list[int], context: int = 512,
               timer=None) -> list[dict]:
    """Device time of one AR decode step, one draft step and one verify step of each width, for
    requests with `context` cached tokens (fake requests; their pages are returned afterwards).
    `timer(fn, inputs, tp)` times each step (`time_graph` unless given)."""
    timer = timer or time_graph
    from ddtree.engine.ar import DecodeInputs
    from ddtree.engine.sampler import COLUMNS
    from ddtree.engine.sequence import Sequence
    from ddtree.speculative.auto import AdaptiveSpeculator
    from ddtree.speculative.draft import StepInputs

    eng = llm.engine
    runner, rows = eng.runner, []
    tp = runner.tp
    dev = llm.device
    for bs in batch_sizes:
        seqs = [Sequence(list(range(100, 100 + context)), SamplingParams(), None) for _ in range(bs)]
        width = max(widths + [eng.speculator.drafter.block_size if eng.speculator else 1]) + 1
        pages = sum(eng.allocator.pages_needed(s, context + width) for s in seqs)
        if pages > eng.allocator.num_free:
            raise ValueError(f"{bs} requests of {context + width} tokens need {pages} KV pages; the cache has "
                             f"{eng.allocator.num_free} free (fewer requests, a shorter context, or more memory)")
        if eng.allocator.num_state_slots and bs > len(eng.allocator.free_slots):
            raise ValueError(f"{bs} requests need {bs} recurrent-state slots; {len(eng.allocator.free_slots)} "
                             f"are free (max_num_seqs sets them)")
        for s in seqs:
            eng.allocator.grow(s, context + width)
            s.num_cached = context  # K/V content is irrelevant for timing
        try:  # (the fake requests' pages and slots go back whatever happens)
            tables = runner.tables(seqs)
            starts = torch.full((bs,), context, device=dev)
            # (distinct tokens: a routed-experts layer sends them to different experts, as real text does)
            vocab = llm.config.vocab_size
            ids = (torch.arange(bs, device=dev) * 7919 + 11) % vocab
            # (hybrid targets: the fake requests' recurrent-state slots, handed out with their pages)
            slots = torch.tensor([s.state_slot for s in seqs], device=dev) if llm.config.is_hybrid else None
            row = {"concurrency": bs, "context": context}
            row["ar_step_ms"] = timer(
                lambda i: runner.decode_features(i.ids, i.block_tables, i.starts, None, i.state_slots)[0],
                DecodeInputs(ids, starts, tables, torch.zeros(bs, COLUMNS, dtype=torch.long, device=dev), slots), tp=tp)
            if eng.speculator is not None:
                dr = eng.speculator.drafter
                C = dr.block_size
                inp = StepInputs(ids, starts, tables, torch.zeros(bs, C, dr.feat_dim, dtype=llm.dtype, device=dev),
                                 (starts[:, None] - C + torch.arange(C, device=dev)),
                                 torch.full((bs, C), dr.scratch_slot, device=dev),
                                 torch.zeros(bs, COLUMNS, dtype=torch.long, device=dev), slots)
                row["draft_step_ms"] = timer(dr.logits, inp, tp=tp)
                if not isinstance(eng.speculator, AdaptiveSpeculator):  # a fixed budget: the whole step (draft, tree, verify,
                    # accept, K/V compaction), as the engine replays it
                    row["spec_step_ms"] = timer(eng.speculator._graph_step, inp, tp=tp)
                taps = dr.layer_ids
                for n in widths:
                    depth = torch.arange(n, device=dev).expand(bs, n).contiguous()
                    mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev)).expand(bs, n, n).contiguous()
                    toks = (torch.arange(bs * n, device=dev).view(bs, n) * 7919 + 13) % vocab
                    vin = DecodeInputs(toks, starts, tables, torch.zeros(bs, COLUMNS, dtype=torch.long, device=dev), slots)
                    row[f"verify_{n}_ms"] = timer(
                        lambda i, d=depth, m=mask: runner.verify(i.block_tables, i.starts, i.ids, d, m, taps,
                                                                 i.state_slots)[0], vin, tp=tp)
            if tp is not None:  # the row-parallel layers' all-reduces of one AR step (two a layer), alone
                hidden = AllReduceInputs(torch.zeros(bs, llm.config.hidden_size, dtype=llm.dtype, device=dev))
                row["all_reduce_ms"] = timer(lambda i: runner.all_reduce(i.x, 2 * llm.config.num_layers), hidden, tp=tp)
                row["all_reduce_share"] = row["all_reduce_ms"] / row["ar_step_ms"]
        finally:
            for s in seqs:
                eng.allocator.release(s)
        rows.append(row)
    return rows


def kernel_table(fn, rows: int = 30) -> str:
    """GPU kernel time by name over one call of `fn` (torch's profiler), the largest first (op time on
    the CPU where there is no GPU)."""
    from torch.profiler import ProfilerActivity, profile
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=rows)


def step_profiles(llm: LLM, batch_size: int, widths: list[int], context: int = 512) -> dict[str, str]:
    """`kernel_table` of each step `step_times` measures (ar_step, draft_step, spec_step, verify_N), each
    kind of step alone: its graph's warm-up runs, capture and replays (`time_graph`), nearly all replays.
    Where each kind of step spends its time."""
    tables = []

    def profiled(fn, inputs, tp=None):
        ms = time_graph(fn, inputs, tp=tp)  # (compiles and autotunes outside the profile)
        tables.append(kernel_table(lambda: time_graph(fn, inputs, tp=tp)))
        return ms

    row = step_times(llm, [batch_size], widths, context, timer=profiled)[0]
    return dict(zip([k[:-len("_ms")] for k in row if k.endswith("_ms")], tables))


@dataclasses.dataclass
class AllReduceInputs:
    x: torch.Tensor
