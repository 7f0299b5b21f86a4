"""The engine loop: schedule -> decoder step (prefill, decode) -> commit tokens (stops, detokenization).

The decoder is plain AR (engine/ar.py) or a speculative one built on it (speculative/decode.py: DFlash and
DDTree at a fixed budget; speculative/auto.py: the budget chosen per burst). The loop knows only its
interface: `step(prefill chunks, decode requests)`, and the K/V width a decode step writes.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from ddtree.config import EngineConfig, ModelConfig
from ddtree.engine.ar import DECODE_BURST, ARDecoder
from ddtree.engine.detokenizer import IncrementalDetokenizer
from ddtree.engine.grammar import Grammars
from ddtree.engine.kv_cache import PageAllocator
from ddtree.engine.runner import ModelRunner
from ddtree.engine.sampler import request_seed
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.sequence import Sequence
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.transformer import CausalLM
from ddtree.sampling_params import SamplingParams
from ddtree.speculative.auto import AdaptiveSpeculator
from ddtree.speculative.context import drafted_tokens
from ddtree.speculative.costs import CostTable
from ddtree.speculative.decode import SPEC_BURST, Speculator
from ddtree.speculative.draft import DraftRunner
from ddtree.speculative.policy import candidate_budgets


class LLMEngine:
    def __init__(self, model: CausalLM, cfg: ModelConfig, tokenizer, engine_cfg: EngineConfig,
                 device: torch.device, dtype: torch.dtype, drafter: DFlashDrafter | None = None,
                 budget: int | str = 0, topk: int = 1, cost_table: CostTable | None = None, tp=None):
        """`budget`: DDTree nodes per step, 0 for AR, or "auto" (chosen per step from `cost_table`,
        measured here on the device when not given). `tp`: tensor parallelism (parallel/workers.py),
        `model` and `cfg` being rank 0's shard."""
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        auto = budget == "auto"
        speculative = drafter is not None and (auto or budget > 0)
        if auto and speculative:
            budget = candidate_budgets(drafter.dcfg.block_size - 1, topk, engine_cfg.policy.budgets)[-1]
        # rows of logits one forward can produce: every request's tree (or its one token)
        logit_rows = engine_cfg.max_num_seqs * (budget + 1 if speculative else 1)
        self.runner = ModelRunner(model, cfg, engine_cfg, device, dtype, logit_rows, tp)
        snapshots = self.runner.snapshot_slots
        self.allocator = PageAllocator(self.runner.num_pages, engine_cfg.page_size,
                                       engine_cfg.max_num_seqs if cfg.is_hybrid else 0,
                                       prefix_caching=engine_cfg.enable_prefix_caching and
                                       (not cfg.is_hybrid or bool(snapshots)),
                                       # (a fixed budget has no way to feed a drafter context's gap: budget
                                       # auto refeeds it, or runs plain AR while it is open; never over a
                                       # hybrid's states, which a refeed would advance twice)
                                       require_drafted=speculative and (not auto or cfg.is_hybrid),
                                       snapshot_slots=snapshots)
        capacity = self.runner.num_pages * engine_cfg.page_size
        use_graphs = engine_cfg.cuda_graphs and self._graphs_supported()
        # Host ms of prefills and whole steps in every mode, and how graphed AR steps were grouped into
        # bursts (auto adds its speculative bursts and context stores: speculative/decode.py `SpecStats`):
        # benchmark rows split the wall time with it.
        self.timing: Counter = Counter()
        # K/V slots a decode step writes past a request's cached tokens: the tree or the draft block,
        # or one per step of an AR burst; a burst of speculative steps advances up to a block per
        # step before its last tree.
        ar_burst = DECODE_BURST if use_graphs and (auto or not speculative) else 1
        width = ar_burst
        if speculative:
            block = drafter.dcfg.block_size
            width = max(budget + 1, block)
            if use_graphs:  # graphed bursts of speculative steps, and (auto) of AR steps
                width = max(width + (SPEC_BURST - 1) * block, ar_burst)
        max_pages = -(-(min(engine_cfg.max_model_len or cfg.max_position, cfg.max_position) + width)
                      // engine_cfg.page_size)
        # Tokens a decode feeds per step, counted against prompt chunks: auto counts one (its AR steps;
        # where it speculates the batch is small), or a large batch would leave prompts a quarter of
        # the step's budget and admit them slowly.
        self.scheduler = Scheduler(self.allocator, engine_cfg.max_num_seqs, engine_cfg.max_num_batched_tokens,
                                   decode_width=width, decode_tokens=budget + 1 if speculative and not auto else 1)
        if speculative:  # (the prefix cache marks the pages whose drafter entries are final)
            self.scheduler.drafted_tokens = drafted_tokens
        # A request at the limit must still find room for one step's width of speculative K/V.
        self.max_model_len = min(engine_cfg.max_model_len or cfg.max_position, cfg.max_position,
                                 capacity - width + 1)
        if self.max_model_len < 2:
            raise ValueError(f"the KV cache holds {capacity} tokens ({self.runner.num_pages} pages), too few for a "
                             f"decode step of width {width}: give it more memory (kv_cache_gb on CPU, "
                             "gpu_memory_utilization on GPU) or more pages")
        draft_runner = None
        if speculative:
            draft_runner = DraftRunner(drafter, self.runner, self.runner.num_slots, engine_cfg.page_size, device, dtype,
                                       self.runner.scratch_page * engine_cfg.page_size, self.runner.use_triton)
        self.ar = ARDecoder(self.runner, cfg, engine_cfg, self.scheduler, self.commit, self.timing, self.max_model_len,
                            use_graphs, max_pages, draft_runner, tap_free_graphs=auto)
        self.ar.burst_steps = ar_burst
        self.speculator = None
        if speculative:
            if auto:
                self.speculator = AdaptiveSpeculator(self.runner, draft_runner, self.ar, topk, use_graphs,
                                                     engine_cfg.max_num_seqs, max_pages, cost_table, engine_cfg.policy)
            else:
                self.speculator = Speculator(self.runner, draft_runner, self.ar, budget, topk, use_graphs,
                                             engine_cfg.max_num_seqs, max_pages)
                if use_graphs:
                    with torch.inference_mode():
                        self.speculator.graphs.capture_all(self.speculator.padding_inputs)
            self.speculator.stats.bursts = self.timing
        self.eos_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.grammars = Grammars(tokenizer, cfg.vocab_size, self.eos_ids)

    @property
    def decoder(self):
        """What runs a step: the speculative decoder, or plain AR."""
        return self.speculator or self.ar

    def _graphs_supported(self) -> bool:
        # Graphs need the Triton kernels: the torch reference attention reads host values. Routed experts
        # need grouped products (models/moe.py) for their device-only path; without, they group on the host.
        from ddtree.models.moe import grouped_mm_runs
        moe_ok = self.cfg.moe is None or grouped_mm_runs(torch.empty(0, dtype=self.runner.dtype, device=self.device))
        return self.device.type == "cuda" and self.runner.use_triton and moe_ok

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
        constraint = self.grammars.constraint(params)  # (ValueError where it does not compile)
        incremental = stream or bool(params.stop)
        seq = Sequence(list(prompt_ids), params,
                       IncrementalDetokenizer(self.tokenizer, prompt_ids) if incremental else None)
        seq.seed = request_seed(params)
        seq.constraint = constraint
        if params.logprobs is not None:
            seq.logprobs = []
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
        self._copy_states(self.allocator.take_state_copies())  # (hybrids: prefix hits' states, before the step)
        touched = self.decoder.step(step.prefill, step.decode)
        self._copy_states([c for seq, _ in step.prefill if seq.snapshot_at and seq.num_cached == seq.snapshot_at[0]
                           and (c := self.allocator.snapshot(seq))])
        self.timing["engine_ms"] += (time.perf_counter() - t0) * 1e3
        return touched

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Hybrid models: (source, destination) recurrent-state slot copies for the prefix cache, in order:
        of copies to one slot (a step's snapshot that took the slot of one taken before it) the last."""
        last = {dst: src for src, dst in copies}  # (an indexed copy with a repeated destination is undefined)
        if last:
            dst, src = zip(*last.items())
            self.runner.copy_states(list(src), list(dst))

    def _unblock(self) -> None:
        # Nothing could be scheduled: the queue head needs more pages than the whole cache has
        # (a preempted request that grew too long). Finish it rather than wait forever.
        if self.scheduler.waiting and not self.scheduler.running:
            seq = self.scheduler.waiting[0]
            if seq.detok is None:
                seq.text = self._decode(seq.output_ids)
            self.scheduler.finish(seq, "length")

    def commit(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> int:
        """Appends tokens one at a time until a stop condition; returns how many were kept. `logprobs`:
        the tokens' records (engine/sampler.py `logprob_records`), for a request that asked for them."""
        kept = self._append(seq, tokens)
        if seq.logprobs is not None:
            assert logprobs is not None, "a request that asked for logprobs got tokens without them"
            seq.logprobs.extend(logprobs[:kept])
        return kept

    def _append(self, seq: Sequence, tokens: list[int]) -> int:
        p, out, detok = seq.params, seq.output_ids, seq.detok
        eos = () if p.ignore_eos else self.eos_ids
        max_out = min(p.max_tokens, self.max_model_len - len(seq.prompt_ids))  # output length that ends it
        for n, tok in enumerate(tokens, 1):
            out.append(tok)
            before = len(seq.text)
            if detok is not None:
                seq.text += detok.add([tok])
            reason, cut = None, False
            complete = seq.constraint is not None and seq.constraint.advance(tok)
            if tok in eos or tok in p.stop_token_ids or complete:
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
