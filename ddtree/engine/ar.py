"""Plain autoregressive decoding: prompt chunks (prefill) and pipelined bursts of decode steps.

The AR decoder is the engine's decoder without a drafter, and the base the speculative decoders
build on: they prefill through it, and auto's AR steps are its bursts. Where a drafter is attached
(`taps`), a forward can also read out the target features the drafter's context is made of: the
prefill graphs store them in the drafter cache, and tapped decode bursts hand them back to the caller.

On the GPU every forward replays a CUDA graph: decode steps by batch-size bucket, prompt chunks by
width. Greedy and sampled rows share the graphs (engine/sampler.py): a step's tokens are drawn on the
device and feed the next step there, so a burst of steps runs without waiting for the host. Requests
that ask for logprobs or follow a structure take one-token steps beside the burst, through the prefill
graphs: the host reads or masks their logits.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ddtree.config import EngineConfig, ModelConfig
from ddtree.engine.graphs import GraphPool
from ddtree.engine.readback import TokenReadback, pipelined
from ddtree.engine.runner import ModelRunner
from ddtree.engine.grammar import constrained_rows
from ddtree.engine.sampler import COLUMNS, logprob_records, needs_host, sample, sampling_columns
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.sequence import Sequence
from ddtree.ops.attention import pack_rows, page_slots

DECODE_BURST = 16  # graphed AR decode steps per engine step, pipelined (`burst`)
SHORT_BURST = 2  # while a request waits for a free slot (Scheduler.admitting), so its prefill is not held back
# A prompt chunk of at most the last of these tokens is prefilled by replaying the CUDA graph of the
# next width up, with the step's other chunks of that width (an eager prefill is host-bound: about ten
# launches per layer for a few milliseconds of kernels).
PREFILL_WIDTHS = (16, 32, 64, 128, 256, 512)
PREFILL_GRAPH_TOKENS = 4096  # a width's graphs hold up to this many tokens (padding included) per replay


@dataclass(slots=True)
class DecodeInputs:
    ids: torch.Tensor  # [R] last token of each request
    starts: torch.Tensor  # [R] its position
    block_tables: torch.Tensor  # [R, P] page ids
    draw: torch.Tensor  # [R, COLUMNS] sampling settings (engine/sampler.py `sampling_columns`)
    state_slots: torch.Tensor | None = None  # [R] hybrid models: the requests' recurrent-state slots


def decode_inputs(seqs: list[Sequence], tables: list[list[int]], hybrid: bool, scratch_page: int,
                  device: torch.device) -> DecodeInputs:
    """A decode step's per-request inputs in one host->device copy: last tokens, positions, page tables
    (padded with the scratch page), sampling settings and (hybrid models) the state slots."""
    draw = sampling_columns([s.params for s in seqs], [s.seed for s in seqs])
    slots = [[s.state_slot for s in seqs]] if hybrid else []
    rows = pack_rows(tables, [[s.last_token for s in seqs], [s.num_cached for s in seqs]] + draw + slots,
                     scratch_page, device)
    width = 2 + COLUMNS + len(slots)  # (the page tables follow)
    return DecodeInputs(rows[:, 0], rows[:, 1], rows[:, width:], rows[:, 2:2 + COLUMNS],
                        rows[:, 2 + COLUMNS] if slots else None)


@dataclass(slots=True)
class PrefillInputs:
    ids: torch.Tensor  # [R, T] a prompt chunk per request (padded to the graph's width)
    starts: torch.Tensor  # [R] the chunk's first position
    block_tables: torch.Tensor  # [R, P] page ids
    last: torch.Tensor  # [R] the chunk's last real row


@dataclass(slots=True)
class Burst:
    """What a decode burst did: its steps, the tokens each request kept, and (tapped) the target
    features of every step [R, steps, K*D] (rows past a request's kept ones are garbage)."""
    steps: int
    kept: list[int]
    feats: torch.Tensor | None


class ARDecoder:
    def __init__(self, runner: ModelRunner, cfg: ModelConfig, engine_cfg: EngineConfig, scheduler: Scheduler,
                 commit: Callable[[Sequence, list[int]], int], timing: Counter, max_model_len: int,
                 use_graphs: bool, max_pages: int, drafter=None, tap_free_graphs: bool = False):
        """`drafter` (a speculative/draft.py DraftRunner): forwards may read out its target features (`taps`);
        `tap_free_graphs`: also capture graphs that do not (budget auto runs plain AR's steps where
        speculation cannot win). `commit(seq, tokens)` appends tokens to a request (the engine's stop handling)."""
        self.runner, self.cfg, self.device = runner, cfg, runner.device
        self.scheduler, self.commit, self.timing, self.max_model_len = scheduler, commit, timing, max_model_len
        self.drafter, self.max_pages = drafter, max_pages
        self.taps = drafter.layer_ids if drafter is not None else None
        self.readback = TokenReadback(engine_cfg.max_num_seqs, self.device)
        self.burst_steps = DECODE_BURST if use_graphs else 1
        scratch = torch.full((1, 1), runner.scratch_page, dtype=torch.long, device=self.device)
        zeros = lambda bs: torch.zeros(bs, dtype=torch.long, device=self.device)  # noqa: E731
        self.decode_graphs = self.untapped_decode_graphs = None
        if use_graphs and (drafter is None or tap_free_graphs):
            hybrid = cfg.is_hybrid

            def pool(taps):  # (captured now: a bucket first needed mid-run would stall that step)
                graphs = GraphPool(partial(self._graph_decode, taps), engine_cfg.max_num_seqs,
                                   pad={"block_tables": runner.scratch_page, "state_slots": runner.scratch_state_slot},
                                   widths={"block_tables": max_pages}, tp=runner.tp)
                with torch.inference_mode():  # (padding rows: their K/V go to the scratch page, their state to
                    # the scratch slot)
                    graphs.capture_all(lambda bs: DecodeInputs(
                        zeros(bs), zeros(bs), scratch.expand(bs, 1), zeros(bs)[:, None].expand(bs, COLUMNS),
                        zeros(bs) + runner.scratch_state_slot if hybrid else None))
                return graphs
            self.untapped_decode_graphs = self.decode_graphs = pool(None)
            if drafter is not None:
                self.decode_graphs = pool(self.taps)
        # Prefill graphs by width, storing the drafter's context where there is one; with
        # `tap_free_graphs` a second set that does not.
        self.prefill_graphs: dict[int, GraphPool] = {}
        self.untapped_prefill_graphs = self.prefill_graphs
        if use_graphs and not cfg.is_hybrid:  # (a padded chunk would advance a recurrent state)
            mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None  # (CPU: tests)
            self.prefill_graphs, mempool = self._prefill_pools(self.taps, engine_cfg, mempool)
            self.untapped_prefill_graphs = self.prefill_graphs
            if tap_free_graphs and self.taps:
                self.untapped_prefill_graphs, _ = self._prefill_pools(None, engine_cfg, mempool)

    # ------------------------------------------------------------------------- the decoder

    def step(self, prefill: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """One engine step of plain AR: the prompt chunks, then a graphed burst of decode steps; without
        graphs both kinds share one forward, as do the decode requests whose logits the host reads or masks
        (logprobs, structured output).
        Returns the requests that got tokens."""
        decode, hosted = needs_host(decode)
        if not self.can_burst(len(decode)):
            decode += hosted
            hosted = []
            t0 = time.perf_counter()
            touched = self._feed(prefill + [(seq, 1) for seq in decode])
            self.timing["prefill_ms"] += (time.perf_counter() - t0) * 1e3 if prefill else 0.0
            self.timing["ar_tokens"] += len(decode)
            return touched
        touched = self.prefill(prefill + [(seq, 1) for seq in hosted]) if prefill or hosted else []
        if decode:
            t0 = time.perf_counter()
            burst = self.burst(decode)
            self.timing.update({"ar_bursts": 1, "ar_steps": burst.steps, "ar_tokens": sum(burst.kept),
                                "ar_ms": (time.perf_counter() - t0) * 1e3})
        return touched + decode

    def can_burst(self, batch: int) -> bool:
        return self.decode_graphs is not None and 0 < batch <= self.decode_graphs.max_batch

    # ------------------------------------------------------------------------- prefill

    def prefill(self, chunks: list[tuple[Sequence, int]], taps: bool = False) -> list[Sequence]:
        """Feeds each chunk (graphed where it fits) and commits a first token to the requests whose
        prompt it completes; `taps`: the chunks' target features also become their drafter context.
        Returns those requests."""
        t0 = time.perf_counter()
        done = self._feed(chunks, taps)
        self.timing["prefill_ms"] += (time.perf_counter() - t0) * 1e3
        return done

    def _feed(self, chunks: list[tuple[Sequence, int]], taps: bool = False) -> list[Sequence]:
        logits = self._prefill_graphed(chunks, taps)
        if logits is None:
            if self.prefill_graphs:  # (a miss: a chunk too long for the graphs)
                self.timing["eager_prefills"] += 1
            logits, feats = self.runner.run(chunks, self.taps if taps else None)
            if feats is not None:
                self.drafter.store_chunks(chunks, feats)
        done = [i for i, (seq, _) in enumerate(chunks) if seq.num_uncached == 0]  # chunk reached the end
        seqs = [chunks[i][0] for i in done]
        if seqs:
            # each draw at the position its token takes (one host->device copy for settings and positions)
            cols = sampling_columns([s.params for s in seqs], [s.seed for s in seqs]) + [[len(s) for s in seqs]]
            draw = torch.tensor(cols, dtype=torch.long).T.contiguous().to(self.device)
            rows = logits[done]
            allowed = constrained_rows(rows, [s.constraint for s in seqs])
            tokens = sample(allowed, draw[:, :COLUMNS], draw[:, COLUMNS], self.runner.use_triton).tolist()
            for i, (seq, tok) in enumerate(zip(seqs, tokens)):
                scores = None if seq.logprobs is None else logprob_records(rows[i:i + 1], [tok], seq.params.logprobs)
                self.commit(seq, [tok], scores)
        return seqs

    def _prefill_pools(self, taps: list[int] | None, engine_cfg: EngineConfig, mempool):
        """The prefill graphs of each width (with `taps`: storing the drafter's context), captured now (on
        padding: its K/V go to the scratch page), not in the middle of serving; and their memory pool."""
        zeros = lambda bs: torch.zeros(bs, dtype=torch.long, device=self.device)  # noqa: E731
        scratch = torch.full((1, 1), self.runner.scratch_page, dtype=torch.long, device=self.device)
        pools = {}
        for T in PREFILL_WIDTHS:
            if T > min(engine_cfg.max_num_batched_tokens, self.max_pages * engine_cfg.page_size, self.cfg.max_position):
                break
            tokens = min(PREFILL_GRAPH_TOKENS, engine_cfg.max_num_batched_tokens)
            rows = min(engine_cfg.max_num_seqs, max(1, tokens // T))
            graphs = GraphPool(partial(self._graph_prefill, taps), rows, pad={"block_tables": self.runner.scratch_page},
                               widths={"block_tables": self.max_pages, "ids": T}, mempool=mempool,
                               tp=self.runner.tp)
            with torch.inference_mode():
                graphs.capture_all(lambda bs: PrefillInputs(zeros(bs)[:, None].expand(bs, T), zeros(bs),
                                                            scratch.expand(bs, 1), zeros(bs)))
            pools[T], mempool = graphs, graphs.mempool
        return pools, mempool

    def _graph_prefill(self, taps: list[int] | None, inp: PrefillInputs) -> torch.Tensor:
        """A prefill graph: the chunks' logits at their last rows; with taps their target features also go
        into the drafter cache as its context, here (a prompt's store outside a graph costs host time,
        paid by the first speculative step after it)."""
        logits, feats = self.runner.prefill_rows(inp.ids, inp.starts, inp.block_tables, inp.last, taps)
        if taps:  # (padding tokens' rows land past the request's cached tokens, or in the scratch page)
            pos = inp.starts[:, None] + torch.arange(inp.ids.shape[1], device=inp.ids.device)
            slots = page_slots(inp.block_tables, pos, self.runner.page_size)
            self.drafter.store_context(feats.flatten(0, 1), pos.flatten(), slots.flatten())
        return logits

    def _prefill_graphed(self, chunks: list[tuple[Sequence, int]], taps: bool = False):
        """`runner.run` on the prefill graphs: each chunk goes to the graph of the next width up, with
        the step's other chunks of that width (one replay per width and at most `rows` chunks). Returns
        the logits [len(chunks), V] (the drafter's context stored: with taps); None when a chunk fits
        no graph (a long one, or positions past the graphs' page-table width)."""
        if not self.prefill_graphs:
            return None
        assert taps or self.taps is None or self.untapped_prefill_graphs is not self.prefill_graphs, \
            "no prefill graphs without taps were captured: they would store the drafter's context unasked"
        pools = self.prefill_graphs if taps else self.untapped_prefill_graphs
        room = min(self.max_pages * self.runner.page_size, self.cfg.max_position)
        widths = []
        for seq, n in chunks:
            assert len(seq.block_table) * self.runner.page_size >= seq.num_cached + n, "pages must be allocated first"
            T = next((w for w in pools if w >= n), None)
            if T is None or seq.num_cached + T > room:
                return None
            widths.append(T)
        logits = [None] * len(chunks)
        for T in sorted(set(widths)):
            same = [i for i, w in enumerate(widths) if w == T]
            most = pools[T].max_batch
            for k in range(0, len(same), most):
                part = same[k:k + most]
                for i, row in zip(part, self._prefill_replay(T, [chunks[i] for i in part], pools)):
                    logits[i] = row
        if taps:
            self.drafter.mark_stored([seq for seq, _ in chunks])
        return torch.stack(logits)

    def _prefill_replay(self, T: int, chunks: list[tuple[Sequence, int]],
                        pools: dict[int, GraphPool]) -> torch.Tensor:
        """One replay of width T's prefill graph in `pools` for these chunks (each at most T tokens): their
        logits."""
        longest = max(n for _, n in chunks)
        starts = [seq.num_cached for seq, _ in chunks]
        ids = [seq.tokens(s, s + n) + [0] * (longest - n) for (seq, n), s in zip(chunks, starts)]
        columns = [starts, [n - 1 for _, n in chunks]] + [list(col) for col in zip(*ids)]
        rows = pack_rows([seq.block_table for seq, _ in chunks], columns, self.runner.scratch_page,
                         self.device)  # one copy
        logits = pools[T].run(PrefillInputs(rows[:, 2:2 + longest], rows[:, 0], rows[:, 2 + longest:], rows[:, 1]))
        for seq, n in chunks:
            seq.num_cached += n
        return logits[:len(chunks)].clone()  # a static output, overwritten by the next replay

    # ------------------------------------------------------------------------- decode bursts

    def _graph_decode(self, taps: list[int] | None, inp: DecodeInputs):
        """The tokens drawn [R] (greedy and sampled rows alike, keyed by the position they take), and
        with taps also the step's target features [R, K*D]."""
        logits, feats = self.runner.decode_features(inp.ids, inp.block_tables, inp.starts, taps, inp.state_slots)
        tokens = sample(logits, inp.draw, inp.starts + 1, self.runner.use_triton)
        # The next step's inputs, written by this one: its tokens, one position further on.
        inp.ids.copy_(tokens)
        inp.starts.add_(1)
        return tokens if feats is None else (tokens, feats)

    def burst(self, seqs: list[Sequence], most: int | None = None, taps: bool = False) -> Burst:
        """AR decode steps for a fixed batch on the decode graphs (`taps`: the graphs that also read out the
        target features), pipelined: step i+1 is launched (its input tokens are step i's draws, still on
        the device) before step i's tokens are read back and committed, so the GPU never waits for the
        host's graph launch, read-back and bookkeeping. The burst ends after `burst_length` steps (at
        most `most`) or one step after a request finishes (that request's last step is wasted; its K/V
        land in pages it held, which nobody reuses before the next schedule)."""
        R = len(seqs)
        pool = self.decode_graphs if taps else self.untapped_decode_graphs
        steps = min(self.burst_length(seqs), most or self.burst_steps)
        # Only the pages the burst writes and reads go in (speculative requests hold a speculative
        # step's worth more); the graph's table pads the rest with the scratch page.
        ps = self.runner.page_size
        tables = [s.block_table[:(s.num_cached + steps - 1) // ps + 1] for s in seqs]
        first = decode_inputs(seqs, tables, self.cfg.is_hybrid, self.runner.scratch_page, self.device)
        kept, feats_buf = [0] * R, None

        def launch(i: int) -> int:
            nonlocal feats_buf
            if i == 0:
                out = pool.run(first)
            else:  # the graph already wrote this step's inputs
                out = pool.replay(R)
            tokens, feats = out if isinstance(out, tuple) else (out, None)
            if feats is not None:  # a static output: kept before the next replay overwrites it
                if feats_buf is None:
                    feats_buf = feats.new_empty(R, steps, feats.shape[-1])
                feats_buf[:, i].copy_(feats[:R])
            return self.readback.start(tokens[:R])

        ran = pipelined(steps, launch, lambda handle: self._commit_step(seqs, handle, kept))
        return Burst(ran, kept, feats_buf)

    def burst_length(self, seqs: list[Sequence]) -> int:
        n = min(self.burst_steps, SHORT_BURST) if self.scheduler.admitting() else self.burst_steps
        left = max(min(s.params.max_tokens, self.max_model_len - len(s.prompt_ids)) - len(s.output_ids) for s in seqs)
        return max(1, min(n, left))

    def _commit_step(self, seqs: list[Sequence], handle, kept: list[int]) -> bool:
        """Commits one decode step's tokens to the requests still running, counting them in `kept`;
        True if one finished."""
        ended = False
        for i, (seq, tok) in enumerate(zip(seqs, self.readback.result(handle, len(seqs)))):
            if seq.is_finished:  # finished in an earlier step of the burst: this token is discarded
                continue
            seq.num_cached += 1
            kept[i] += 1
            self.commit(seq, [tok])
            ended = ended or seq.is_finished
        return ended
