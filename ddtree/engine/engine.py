"""The engine loop: schedule -> run -> sample -> commit tokens (stops, detokenization) -> finished."""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch

from ddtree.config import EngineConfig, ModelConfig
from ddtree.engine.detokenizer import IncrementalDetokenizer
from ddtree.engine.graphs import GraphPool
from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.readback import TokenReadback
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import COLUMNS, request_seed, sample, sampling_columns
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.sequence import Sequence
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.transformer import CausalLM
from ddtree.ops.attention import pack_rows, page_slots
from ddtree.sampling_params import SamplingParams
from ddtree.spec.adaptive import AR_BURST_STEPS, candidate_budgets
from ddtree.spec.auto import AdaptiveSpeculator
from ddtree.spec.costs import CostTable
from ddtree.spec.decode import SHORT_BURST, SPEC_BURST, Speculator
from ddtree.spec.draft import DraftRunner, close_gap, has_gap, open_gaps


DECODE_BURST = AR_BURST_STEPS  # graphed AR decode steps per engine step, pipelined (see LLMEngine._decode_graphed)
PENDING_ROWS = 128  # auto: drafter context rows a request may hold pending (7 KB each) before a store
# A prompt chunk of at most the last of these tokens is prefilled by replaying the CUDA graph of the
# next width up, with the step's other chunks of that width (an eager prefill is host-bound: ~24
# layers x ~10 launches; on the H200 a 2-prompt one took 14 ms of host time for 1.8 ms of kernels).
PREFILL_WIDTHS = (16, 32, 64, 128, 256, 512)
PREFILL_GRAPH_TOKENS = 4096  # a width's graphs hold up to this many tokens (padding included) per replay
PREFILL_GRAPHS = os.environ.get("DDTREE_PREFILL_GRAPHS", "1") != "0"  # =0: eager prefill (to compare)


@dataclass(slots=True)
class DecodeInputs:
    ids: torch.Tensor  # [R] last token of each request
    starts: torch.Tensor  # [R] its position
    block_tables: torch.Tensor  # [R, P] page ids
    draw: torch.Tensor  # [R, COLUMNS] sampling settings (engine/sampler.py `sampling_columns`)


@dataclass(slots=True)
class PrefillInputs:
    ids: torch.Tensor  # [R, T] a prompt chunk per request (padded to the graph's width)
    starts: torch.Tensor  # [R] the chunk's first position
    block_tables: torch.Tensor  # [R, P] page ids
    last: torch.Tensor  # [R] the chunk's last real row


class LLMEngine:
    def __init__(self, model: CausalLM, cfg: ModelConfig, tokenizer, engine_cfg: EngineConfig,
                 device: torch.device, dtype: torch.dtype, drafter: DFlashDrafter | None = None,
                 budget: int | str = 0, topk: int = 1, cost_table: CostTable | None = None):
        """`budget`: DDTree nodes per step, 0 for AR, or "auto" (chosen per step from `cost_table`,
        measured here on the device when not given)."""
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        auto = budget == "auto"
        speculative = drafter is not None and (auto or budget > 0)
        if auto and speculative:
            budget = candidate_budgets(drafter.dcfg.block_size - 1, topk)[-1]
        # rows of logits one forward can produce: every request's tree (or its one token)
        logit_rows = engine_cfg.max_num_seqs * (budget + 1 if speculative else 1)
        self.runner = ModelRunner(model, cfg, engine_cfg, device, dtype, logit_rows)
        self.allocator = PageAllocator(self.runner.num_pages, engine_cfg.page_size)
        capacity = self.runner.num_pages * engine_cfg.page_size
        self.use_graphs = engine_cfg.cuda_graphs and self._graphs_supported()
        self.speculator = None
        # Host ms of prefills and whole steps in every mode, and how graphed AR steps were grouped into
        # bursts (auto adds its speculative bursts and context stores: spec/decode.py `SpecStats`):
        # benchmark rows split the wall time with it.
        self.timing: Counter = Counter()
        # Graphed AR decodes (also auto's AR steps) run in bursts of up to `burst` steps (_decode_graphed).
        self.burst = DECODE_BURST if self.use_graphs and (auto or not speculative) else 1
        # K/V slots a decode step writes past a request's cached tokens: the tree or the draft block,
        # or one per step of an AR burst; a burst of speculative steps advances up to a block per
        # step before its last tree.
        width = self.burst
        if speculative:
            block = drafter.dcfg.block_size
            width = max(budget + 1, block)
            if self.use_graphs:  # graphed bursts of speculative steps, and (auto) of AR steps
                width = max(width + (SPEC_BURST - 1) * block, self.burst)
        max_pages = -(-(min(engine_cfg.max_model_len or cfg.max_position, cfg.max_position) + width)
                      // engine_cfg.page_size)
        if speculative:
            draft_runner = DraftRunner(drafter, model, self.runner.num_slots, engine_cfg.page_size, device, dtype,
                                       self.runner.scratch_page * engine_cfg.page_size, self.runner.use_triton)
            if auto:
                self.speculator = AdaptiveSpeculator(self.runner, draft_runner, topk, self.use_graphs,
                                                     engine_cfg.max_num_seqs, max_pages, cost_table,
                                                     engine_cfg.coupled_drafts)
            else:
                self.speculator = Speculator(self.runner, draft_runner, budget, topk, self.use_graphs,
                                             engine_cfg.max_num_seqs, max_pages, engine_cfg.coupled_drafts)
                if self.use_graphs:
                    with torch.inference_mode():
                        self.speculator.graphs.capture_all(self.speculator.padding_inputs)
            self.speculator.stats.bursts = self.timing
        # Padding inputs for capturing graphs ahead of serving: zeros, and page tables of the scratch page.
        scratch = torch.full((1, 1), self.runner.scratch_page, dtype=torch.long, device=device)
        zeros = lambda bs: torch.zeros(bs, dtype=torch.long, device=device)  # noqa: E731
        self.decode_graphs = self.untapped_decode_graphs = None
        if self.use_graphs and (self.speculator is None or auto):
            # auto's AR steps are the engine's, and each also reads out its target features (the
            # drafter's context, kept pending): choosing AR costs about what plain AR does. Where the
            # policy sees no chance for speculation at all, its AR bursts run plain AR's graphs, with no
            # read-out (the requests' context then has a gap, refed at a switch: spec/auto.py).
            def pool(taps):  # (under auto a bucket could first come up after the warm-up, mid-run: captured now)
                graphs = GraphPool(partial(self._graph_decode, taps), engine_cfg.max_num_seqs,
                                   pad={"block_tables": self.runner.scratch_page}, widths={"block_tables": max_pages})
                with torch.inference_mode():  # (padding rows: their K/V go to the scratch page)
                    graphs.capture_all(lambda bs: DecodeInputs(zeros(bs), zeros(bs), scratch.expand(bs, 1),
                                                               zeros(bs)[:, None].expand(bs, COLUMNS)))
                return graphs
            self.untapped_decode_graphs = self.decode_graphs = pool(None)
            if self.speculator is not None:
                self.decode_graphs = pool(self.speculator.drafter.layer_ids)
        # Prefill graphs by width; with a speculator they also store the drafter's context, and under
        # auto a second set does not: prompts joining a batch size where speculation is hopeless.
        self.prefill_graphs: dict[int, GraphPool] = {}
        self.untapped_prefill_graphs = self.prefill_graphs
        if self.use_graphs and PREFILL_GRAPHS:
            taps = self.speculator.drafter.layer_ids if self.speculator is not None else None
            self.max_pages = max_pages
            pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None  # (CPU: tests)
            self.prefill_taps = taps
            self.prefill_graphs, pool = self._prefill_pools(taps, engine_cfg, max_pages, pool)
            self.untapped_prefill_graphs = self.prefill_graphs
            if auto and taps:
                self.untapped_prefill_graphs, _ = self._prefill_pools(None, engine_cfg, max_pages, pool)
        # Tokens a decode feeds per step, counted against prompt chunks: auto counts one (its AR steps;
        # where it speculates the batch is small), or a large batch would leave prompts a quarter of
        # the step's budget and admit them slowly.
        self.scheduler = Scheduler(self.allocator, engine_cfg.max_num_seqs, engine_cfg.max_num_batched_tokens,
                                   decode_width=width, decode_tokens=budget + 1 if speculative and not auto else 1)
        self.readback = TokenReadback(engine_cfg.max_num_seqs, device)
        # A request at the limit must still find room for one step's width of speculative K/V.
        self.max_model_len = min(engine_cfg.max_model_len or cfg.max_position, cfg.max_position,
                                 capacity - width + 1)
        if self.max_model_len < 2:
            raise ValueError(f"the KV cache holds {capacity} tokens ({self.runner.num_pages} pages), too few for a "
                             f"decode step of width {width}: give it more memory (kv_cache_gb on CPU, "
                             "gpu_memory_utilization on GPU) or more pages")
        self.eos_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)

    def _prefill_pools(self, taps: list[int] | None, engine_cfg: EngineConfig, max_pages: int, pool):
        """The prefill graphs of each width (with `taps`: storing the drafter's context), captured now (on
        padding: its K/V go to the scratch page), not in the middle of serving; and their memory pool."""
        zeros = lambda bs: torch.zeros(bs, dtype=torch.long, device=self.device)  # noqa: E731
        scratch = torch.full((1, 1), self.runner.scratch_page, dtype=torch.long, device=self.device)
        pools = {}
        for T in PREFILL_WIDTHS:
            if T > min(engine_cfg.max_num_batched_tokens, max_pages * engine_cfg.page_size, self.cfg.max_position):
                break
            tokens = min(PREFILL_GRAPH_TOKENS, engine_cfg.max_num_batched_tokens)
            rows = min(engine_cfg.max_num_seqs, max(1, tokens // T))
            graphs = GraphPool(partial(self._graph_prefill, taps), rows, pad={"block_tables": self.runner.scratch_page},
                               widths={"block_tables": max_pages, "ids": T}, mempool=pool)
            with torch.inference_mode():
                graphs.capture_all(lambda bs: PrefillInputs(zeros(bs)[:, None].expand(bs, T), zeros(bs),
                                                            scratch.expand(bs, 1), zeros(bs)))
            pools[T], pool = graphs, graphs.mempool
        return pools, pool

    def _graphs_supported(self) -> bool:
        # Graphs need the Triton kernels: the torch reference attention reads host values.
        return self.device.type == "cuda" and self.runner.use_triton

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True) -> Sequence:
        """Queues a request. `stream=False` (offline use) detokenizes once at the end instead of per
        token, unless stop strings need the text as it grows."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len} "
                             "(including at least one generated token)")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        incremental = stream or bool(params.stop)
        seq = Sequence(list(prompt_ids), params,
                       IncrementalDetokenizer(self.tokenizer, prompt_ids) if incremental else None)
        seq.seed = request_seed(params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Runs one step; returns the requests that received tokens or finished in it."""
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        if step.empty:
            self._unblock()
            return []
        timing = self.timing
        if self.speculator is None:
            if self.decode_graphs is not None and step.decode and len(step.decode) <= self.decode_graphs.max_batch:
                touched = self._forward_and_sample(step.prefill) if step.prefill else []
                t1 = time.perf_counter()
                steps, _ = self._decode_graphed(step.decode)
                t2 = time.perf_counter()
                timing.update({"prefill_ms": (t1 - t0) * 1e3 if step.prefill else 0.0, "ar_bursts": 1,
                               "ar_steps": steps, "ar_ms": (t2 - t1) * 1e3, "engine_ms": (t2 - t0) * 1e3})
                return touched + step.decode
            # AR: prompt chunks and single-token decodes share one forward
            touched = self._forward_and_sample(step.prefill + [(seq, 1) for seq in step.decode])
            ms = (time.perf_counter() - t0) * 1e3
            timing.update({"prefill_ms": ms if step.prefill else 0.0, "engine_ms": ms})
            return touched
        spec = self.speculator
        touched = self._spec_prefill(step.prefill) if step.prefill else []
        if step.prefill:
            timing["prefill_ms"] += (time.perf_counter() - t0) * 1e3
        if step.decode:
            # a prefill chunk still running on the device would count in the step times auto measures
            spec.timed = not step.prefill
            spec.short_bursts = self._admitting()
            ar = spec.ar_steps(step.decode, self._joined()) if isinstance(spec, AdaptiveSpeculator) else 0
            if ar and self.decode_graphs is not None and len(step.decode) <= self.decode_graphs.max_batch:
                self._auto_ar_burst(step.decode, ar)
            elif ar:
                spec.ar_step(step.decode, self.commit)
            else:
                spec.step(step.decode, self.commit)
        timing["engine_ms"] += (time.perf_counter() - t0) * 1e3
        return touched + step.decode

    def _spec_prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prompt chunks that also store the drafter's context; under auto with graphed AR bursts, not
        where the policy sees no chance for speculation at the batch they join, or a chunk's request
        already has a gap (a switch refeeds first anyway): their context is left with one, as tap-free
        AR bursts leave it (fed again at a switch, should one come). All the step's chunks go one way,
        in one forward: split in two, at C=64 on the H200 (bfc8621) a run's prefills took 19 forwards
        to plain AR's 15."""
        spec = self.speculator
        taps = spec.drafter.layer_ids
        if not (isinstance(spec, AdaptiveSpeculator) and self.decode_graphs is not None):
            return self._forward_and_sample(chunks, taps)
        if not (any(has_gap(seq) for seq, _ in chunks) or spec.tap_free_prefill(self._joined())):
            return self._forward_and_sample(chunks, taps)
        open_gaps([seq for seq, _ in chunks])
        self.timing["tap_free_prefills"] += 1
        return self._forward_and_sample(chunks)

    def _forward_and_sample(self, chunks: list[tuple[Sequence, int]], taps: list[int] | None = None):
        logits = self._prefill_graphed(chunks, taps)  # (with taps, the graph also stores the context)
        if logits is None:
            if self.prefill_graphs:  # (a miss: a chunk too long for the graphs)
                self.timing["eager_prefills"] += 1
            logits, feats = self.runner.run(chunks, taps)
            if feats is not None:
                for (seq, _), f in zip(chunks, feats.split([n for _, n in chunks])):
                    seq.pending_features.append(f)
                self.speculator.drafter.store_pending([seq for seq, _ in chunks])
        done = [i for i, (seq, _) in enumerate(chunks) if seq.num_uncached == 0]  # chunk reached the end
        if not done:
            return []
        seqs = [chunks[i][0] for i in done]
        # each draw at the position its token takes (one host->device copy for settings and positions)
        cols = sampling_columns([s.params for s in seqs], [s.seed for s in seqs]) + [[len(s) for s in seqs]]
        draw = torch.tensor(cols, dtype=torch.long).T.contiguous().to(self.device)
        tokens = sample(logits[done], draw[:, :COLUMNS], draw[:, COLUMNS],
                        self.runner.use_triton).tolist()
        for seq, tok in zip(seqs, tokens):
            self.commit(seq, [tok])
        return seqs

    def _graph_prefill(self, taps: list[int] | None, inp: PrefillInputs) -> torch.Tensor:
        """A prefill graph: the chunks' logits at their last rows; with taps their target features also go
        into the drafter cache as its context, here (a prompt's store outside a graph cost a few ms of
        host time, paid by the first speculative step after it)."""
        logits, feats = self.runner.prefill_rows(inp.ids, inp.starts, inp.block_tables, inp.last, taps)
        if taps:  # (padding tokens' rows land past the request's cached tokens, or in the scratch page)
            pos = inp.starts[:, None] + torch.arange(inp.ids.shape[1], device=inp.ids.device)
            slots = page_slots(inp.block_tables, pos, self.runner.page_size)
            self.speculator.drafter.store_context(feats.flatten(0, 1), pos.flatten(), slots.flatten())
        return logits

    def _prefill_graphed(self, chunks: list[tuple[Sequence, int]], taps: list[int] | None = None):
        """`runner.run` on the prefill graphs: each chunk goes to the graph of the next width up, with
        the step's other chunks of that width (one replay per width and at most `rows` chunks). Returns
        the logits [len(chunks), V] (the drafter's context stored: with taps); None when a chunk fits
        no graph (a long one, or positions past the graphs' page-table width)."""
        if not self.prefill_graphs:
            return None
        assert taps in (None, self.prefill_taps), "the prefill graphs were captured with other taps"
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
            for seq, _ in chunks:
                seq.draft_len = seq.num_cached
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

    def _graph_decode(self, taps: list[int] | None, inp: "DecodeInputs"):
        """The tokens drawn [R] (greedy and sampled rows alike, keyed by the position they take), and
        with taps (auto) also the step's target features [R, K*D]."""
        logits, feats = self.runner.decode_features(inp.ids, inp.block_tables, inp.starts, taps)
        tokens = sample(logits, inp.draw, inp.starts + 1, self.runner.use_triton)
        # The next step's inputs, written by this one: its tokens, one position further on.
        inp.ids.copy_(tokens)
        inp.starts.add_(1)
        return tokens if feats is None else (tokens, feats)

    def _auto_ar_burst(self, seqs: list[Sequence], most: int) -> None:
        """AR steps chosen by auto (at most `most`): a graphed AR burst whose steps also read out their
        target features, kept as each request's pending drafter context; or, where the policy sees no
        chance for speculation at this batch size or the one it is headed for, or a switch would refeed
        gaps first anyway (`tap_free`), plain AR's burst, the requests' context left with a gap."""
        spec = self.speculator
        tap_free = spec.tap_free
        # The context rows wait (a verified path's, earlier AR steps'), to be stored in one go before
        # the next draft: an AR step that stored its own row spent ~7 small kernels, 4-5% of
        # an AR step on the H200. Only rows piling up are stored now (not a time to learn from: device
        # work not waited for), and not a request's with a gap (refed only at a switch).
        full = [] if tap_free else [s for s in seqs if s.num_cached - s.draft_len > PENDING_ROWS and not has_gap(s)]
        if full:
            t0 = time.perf_counter()
            spec.drafter.store_pending(full)
            spec.timed = False
            spec.stats.bursts["store_ms"] += (time.perf_counter() - t0) * 1e3
        if tap_free:  # the gap opens, or goes on
            open_gaps(seqs)
        else:  # rows join the context after it
            for seq in seqs:
                if seq.gap_from is not None:
                    close_gap(seq)
        t0 = time.perf_counter()
        steps, committed = self._decode_graphed(seqs, most, self.untapped_decode_graphs if tap_free else
                                                self.decode_graphs)
        spec.after_ar_burst(len(seqs), steps, committed, (time.perf_counter() - t0) * 1e3)

    def _decode_graphed(self, seqs: list[Sequence], most: int | None = None,
                        pool: GraphPool | None = None) -> tuple[int, int]:
        """AR decode steps for a fixed batch, pipelined: step i+1 is launched (its input tokens are step
        i's samples, still on the device) before step i's tokens are read back and committed, so the
        GPU never waits for the host's graph launch, read-back and bookkeeping. The burst ends after
        `_burst_length` steps or one step after a request finishes (that request's last step is wasted;
        its K/V land in pages it held, which nobody reuses before the next schedule). Returns the number
        of steps run and of tokens committed."""
        R, pool = len(seqs), pool or self.decode_graphs
        steps = min(self._burst_length(seqs), most or self.burst)
        # Only the pages the burst writes and reads go in (auto's requests hold a speculative step's worth
        # more); the graph's table pads the rest with the scratch page.
        ps = self.runner.page_size
        tables = [s.block_table[:(s.num_cached + steps - 1) // ps + 1] for s in seqs]
        draw = sampling_columns([s.params for s in seqs], [s.seed for s in seqs])
        rows = pack_rows(tables, [[s.last_token for s in seqs], [s.num_cached for s in seqs]] + draw,
                         self.runner.scratch_page, self.device)
        pending = None
        kept, feats_buf = [0] * R, None  # (auto) rows committed per request, and the burst's feature rows
        for i in range(steps):
            if i == 0:
                out = pool.run(DecodeInputs(rows[:, 0], rows[:, 1], rows[:, 2 + COLUMNS:], rows[:, 2:2 + COLUMNS]))
            else:  # the graph already wrote this step's inputs
                out = pool.replay(R)
            tokens, feats = out if isinstance(out, tuple) else (out, None)
            tokens = tokens[:R]
            if feats is not None:  # a static output: kept before the next replay overwrites it
                if feats_buf is None:
                    feats_buf = feats.new_empty(R, steps, feats.shape[-1])
                feats_buf[:, i].copy_(feats[:R])
            launched = self.readback.start(tokens)
            ended = pending is not None and self._commit_decoded(seqs, pending, kept)
            pending = launched
            if ended:
                steps = i + 1
                break
        self._commit_decoded(seqs, pending, kept)
        if feats_buf is not None:
            # One pending block per request and burst (not a row per step: a store then concatenates
            # thousands of tiny tensors at a large batch, ~10 ms of host time at 128 requests), and not
            # cut out as a view here (spec/draft.py `pending_rows`). (Not to a request that finished
            # in the burst: its cache is dropped, and the entry would keep the whole buffer alive as
            # long as the request object.)
            for i, (seq, n) in enumerate(zip(seqs, kept)):
                if n and not seq.is_finished:
                    seq.pending_features.append((feats_buf, i, n))
        return steps, sum(kept)

    def _burst_length(self, seqs: list[Sequence]) -> int:
        # Short bursts while a request waits for a free slot, so its prefill is not held back.
        n = min(self.burst, SHORT_BURST) if self._admitting() else self.burst
        left = max(min(s.params.max_tokens, self.max_model_len - len(s.prompt_ids)) - len(s.output_ids) for s in seqs)
        return max(1, min(n, left))

    def _joined(self) -> int:
        """The batch size once the prompts waiting for a slot are in (auto judges the chance for speculation
        where the running batch is headed: at the start of a run at C=128 it is let in a few prompts at a
        time, 2,048 prompt tokens a step); the running one where the KV cache holds no more."""
        sched = self.scheduler
        if sched.out_of_pages:
            return len(sched.running)
        return min(sched.max_num_seqs, len(sched.running) + len(sched.waiting))

    def _admitting(self) -> bool:
        """A request waits and a slot is free: short bursts, so its prefill is not held back."""
        sched = self.scheduler
        return bool(sched.waiting) and len(sched.running) < sched.max_num_seqs

    def _commit_decoded(self, seqs: list[Sequence], handle, kept: list[int]) -> bool:
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

    def _unblock(self) -> None:
        # Nothing could be scheduled: the queue head needs more pages than the whole cache has
        # (a preempted request that grew too long). Finish it rather than wait forever.
        if self.scheduler.waiting and not self.scheduler.running:
            seq = self.scheduler.waiting[0]
            if seq.detok is None:
                seq.text = self._decode(seq.output_ids)
            self.scheduler.finish(seq, "length")

    def commit(self, seq: Sequence, tokens: list[int]) -> int:
        """Appends tokens one at a time until a stop condition; returns how many were kept."""
        p, out, detok = seq.params, seq.output_ids, seq.detok
        eos = () if p.ignore_eos else self.eos_ids
        max_out = min(p.max_tokens, self.max_model_len - len(seq.prompt_ids))  # output length that ends it
        for n, tok in enumerate(tokens, 1):
            out.append(tok)
            before = len(seq.text)
            if detok is not None:
                seq.text += detok.add([tok])
            reason, cut = None, False
            if tok in eos or tok in p.stop_token_ids:
                reason = "stop"
            elif p.stop and self._cut_at_stop(seq, before):
                reason, cut = "stop", True
            elif len(out) >= max_out:
                reason = "length"
            if reason:
                if detok is None:
                    seq.text = self._decode(out)
                elif not cut:  # text held back for an incomplete character is emitted at the end
                    seq.text += detok.flush()
                self.scheduler.finish(seq, reason)
                return n
        return len(tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    @staticmethod
    def _cut_at_stop(seq: Sequence, before: int) -> bool:
        # A new match must end in the newly added text, so search only from just before it.
        start = max(0, before - max(map(len, seq.params.stop)) + 1)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return False
        seq.text = seq.text[:min(hits)]
        return True
