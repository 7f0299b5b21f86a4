"""The offline Python API: `LLM(...).generate(prompts, params)` and `LLM(...).chat(conversations, params)`."""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ddtree.config import EngineConfig, ParallelConfig, PolicyConfig, default_device, parse_dtype
from ddtree.engine.engine import LLMEngine
from ddtree.engine.sequence import Sequence
from ddtree.sampling_params import SamplingParams

SPEC_MODES = ("none", "dflash", "ddtree")
DEFAULT_BUDGET, DEFAULT_TOPK = "auto", 4  # auto: the budget (AR included) is chosen per step


@dataclass(slots=True)
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str | None
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step; [] for AR
    # With SamplingParams.logprobs: per generated token, (its log-probability under the model,
    # [(token id, log-probability)] of the most likely tokens at that position)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache held (not computed again)


def cost_cache_path(setup: dict) -> str:
    """Where budget auto's table for `setup` (`LLM._cost_setup`) is kept: $DDTREE_COST_CACHE, else the
    ddtree cache's costs/, by a hash of the setup."""
    import hashlib
    import json

    from ddtree.models.hub import cache_dir
    digest = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(os.environ.get("DDTREE_COST_CACHE") or os.path.join(cache_dir(), "costs"), f"{digest}.json")


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None for a checkpoint without one (token-id prompts only)."""
    import os

    from transformers import AutoTokenizer
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path)


class LLM:
    def __init__(self, model: str | None = None, *, draft: str | None = None, spec: str | None = None,
                 budget: int | None = None, topk: int | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, page_size: int = 16, num_pages: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 kv_cache_gb: float = 1.0, cuda_graphs: bool = True, kernels: str = "auto", tokenizer=None,
                 cost_table=None, tensor_parallel_size: int = 1, parallel: ParallelConfig | None = None,
                 policy: PolicyConfig | None = None, load_format: str = "auto", enable_prefix_caching: bool = True,
                 prefix_state_snapshots: int | None = None):
        """`tensor_parallel_size` > 1 splits the target over that many ranks (processes) on this host;
        `parallel` sets more (several hosts: parallel/workers.py). `close()` stops them. `kernels`:
        EngineConfig's (the reference torch ops with "torch"); `policy`: budget "auto"'s tunables.
        `load_format="dummy"`: the checkpoint's config with random weights, nothing else read (to
        measure speed without the weights). `enable_prefix_caching`: a prompt that begins with an earlier
        request's tokens reuses their K/V by full pages (hybrid targets: and a recurrent state kept at an
        earlier prompt's last full page; `prefix_state_snapshots` of them, default `max_num_seqs`)."""
        from ddtree.models.hub import default_draft, is_default_model, resolve_model
        from ddtree.models.loader import load_model

        self.device = torch.device(device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch build sees no CUDA GPU (torch {torch.__version__}); "
                             "use device='cpu'")
        self.dtype = parse_dtype(dtype, self.device.type)
        self.model_path = resolve_model(model)
        self.parallel = parallel or ParallelConfig(tensor_parallel_size=tensor_parallel_size)
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        if load_format == "dummy" and self.parallel.distributed:
            raise ValueError("load_format='dummy' runs in one process, without tensor parallelism")
        self.tp = None
        if self.parallel.distributed:
            self._start_ranks()
        else:
            self.net, self.config = load_model(self.model_path, self.device, self.dtype,
                                               random_weights=load_format == "dummy")
            self.shard_config = self.config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path)
        self.engine_cfg = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                       kv_cache_gb=kv_cache_gb, cuda_graphs=cuda_graphs, kernels=kernels,
                                       policy=policy or PolicyConfig(), enable_prefix_caching=enable_prefix_caching,
                                       prefix_state_snapshots=prefix_state_snapshots)
        self.drafter = None
        default_pair = draft is None and spec is None and is_default_model(model)
        if draft is None and spec != "none" and is_default_model(model):
            draft = default_draft()  # the default pair: our drafter for the default model (DDTree)
        self.draft_path = str(draft) if isinstance(draft, (str, os.PathLike)) else None
        if draft is not None:
            from ddtree.models.dflash import load_drafter
            self.drafter = load_drafter(str(draft), self.config, self.device, self.dtype) \
                if isinstance(draft, (str, os.PathLike)) else draft
        self.engine = None
        self.kept: dict[tuple, LLMEngine] = {}  # engines of other modes (`switch_mode`)
        if default_pair and self.device.type == "cpu":
            # On the CPU the default pair's speculation is slower than AR (every speculative mode in the
            # CPU rows of docs/performance-history.md): AR from the start, without measuring a cost table
            # first. The drafter stays loaded for set_mode; an explicit spec is honoured.
            spec = "none"
        self.set_mode(spec or ("ddtree" if draft is not None else "none"), budget, topk, cost_table)
        self.last_stats: dict = {}

    def _start_ranks(self) -> None:
        """Tensor parallelism: this process is rank 0 and holds its shard of the target (`net`,
        `shard_config`); workers hold the others. `config` stays the whole model's."""
        from ddtree.config import ModelConfig
        from ddtree.models.loader import load_model
        from ddtree.parallel.shard import Shard, shard_config
        from ddtree.parallel.workers import TensorParallel, bind_group
        self.config = ModelConfig.from_dir(self.model_path)
        shard = Shard(0, self.parallel.tensor_parallel_size)
        shard_config(self.config, shard)  # (a size that does not divide the model fails here, before any start)
        self.tp = TensorParallel(self.parallel, self.model_path, self.device, self.dtype)
        try:
            self.net, self.shard_config = load_model(self.model_path, self.device, self.dtype, shard)
            bind_group(self.net, self.tp.channel.step)
            self.tp.loaded()
        except BaseException:
            self.tp.close()
            raise

    def close(self) -> None:
        """Stops the tensor-parallel workers (nothing to do on one rank); the LLM is unusable after."""
        if self.tp is not None:
            self.engine, self.kept = None, {}
            self.tp.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_mode(self, spec: str, budget: int | str | None = None, topk: int | None = None,
                 cost_table=None) -> None:
        """(Re)builds the engine for a decoding mode, keeping the loaded weights and drafter. `budget`
        "auto" chooses it per step (0 = AR included) from a table of step costs (`cost_table`, a
        `ddtree.speculative.costs.CostTable`; measured on the device when not given)."""
        self.spec, self.budget, self.topk = self._mode(spec, budget, topk)
        if self.engine is not None or self.kept:  # free the old KV caches and graphs before sizing a new one
            self.engine = None
            self.kept.clear()
            layers = [layer.self_attn for layer in self.net.model.layers if hasattr(layer, "self_attn")]
            layers += [layer.self_attn for layer in self.drafter.layers] if self.drafter is not None else []
            for attn in layers:  # the layers hold views of the old cache
                attn.k_cache = attn.v_cache = torch.empty(0)
            for layer in self.net.model.layers:  # (hybrid models: and of the old recurrent states)
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.conv_state = layer.linear_attn.recurrent_state = torch.empty(0)
            gc.collect()  # graph pools hold bound methods of the engine: a reference cycle
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.engine = self._build(cost_table)

    def switch_mode(self, spec: str, budget: int | str | None = None, topk: int | None = None) -> None:
        """`set_mode`, but every engine built so far is kept (its KV cache, CUDA graphs and, under auto,
        what its policy learned) and switched back to: benchmarks interleave the modes they compare run
        by run, so that a drift of the machine's speed over minutes does not fall on one mode's rows.
        Each kept mode holds its own KV cache (size it with `num_pages`)."""
        key = self._mode(spec, budget, topk)
        if self.engine is not None and key == (self.spec, self.budget, self.topk):
            return
        if self.engine is not None:
            self.kept[(self.spec, self.budget, self.topk)] = self.engine
        self.spec, self.budget, self.topk = key
        self.engine = self.kept.pop(key, None)
        if self.engine is None:
            self.engine = self._build(None)
        else:
            self.engine.runner.bind_cache()
            if self.engine.speculator is not None:
                self.engine.speculator.drafter.bind_cache()

    def _build(self, cost_table) -> LLMEngine:
        """The engine of the current mode. Budget auto's cost table is measured once per setup (device,
        model, drafter, dtype, engine sizes) and kept in the ddtree cache; a later start reuses it."""
        from ddtree.speculative.costs import cached_costs, store_costs
        setup = self._cost_setup() if self.budget == "auto" and cost_table is None else None
        path = cost_cache_path(setup) if setup is not None else None
        cached = cached_costs(path) if path is not None else None
        if cached is not None and not set(setup["budgets"][1:]) <= set(cached.verify):
            cached = None  # (kept by code with other budgets: measured again)
        engine = LLMEngine(self.net, self.shard_config, self.tokenizer, self.engine_cfg, self.device, self.dtype,
                           self.drafter if self.spec != "none" else None, self.budget, self.topk, cost_table or cached,
                           self.tp)
        if path is not None and cached is None and engine.speculator is not None:
            store_costs(path, engine.speculator.policy.table, setup)
        return engine

    def _cost_setup(self) -> dict | None:
        """What budget auto's measured costs depend on; None when the drafter has no files to name it by."""
        if self.draft_path is None:
            return None
        from dataclasses import asdict

        def files(path: str) -> list:
            path = os.path.realpath(path)
            names = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
            found = [path]
            for n in names:
                if n.endswith((".json", ".safetensors", ".gguf")) and os.path.exists(os.path.join(path, n)):
                    st = os.stat(os.path.join(path, n))
                    found.append((n, st.st_size, int(st.st_mtime)))
            return found

        from ddtree.speculative.policy import candidate_budgets

        engine = asdict(self.engine_cfg)
        engine.pop("policy")  # (the plan's settings, not the costs')
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"format": 1, "device": device, "torch": torch.__version__, "dtype": str(self.dtype),
                "model": files(self.model_path), "drafter": files(self.draft_path), "topk": self.topk,
                "budgets": candidate_budgets(self.drafter.dcfg.block_size - 1, self.topk,
                                             self.engine_cfg.policy.budgets),
                "engine": engine, "tensor_parallel_size": self.parallel.tensor_parallel_size}


    def _mode(self, spec: str, budget: int | str | None, topk: int | None) -> tuple[str, int | str, int]:
        """(spec, budget, topk) checked and with their defaults."""
        if spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {SPEC_MODES}, got {spec!r}")
        if spec != "none" and self.drafter is None:
            raise ValueError(f"spec={spec!r} needs a drafter: pass draft=PATH (a DFlash checkpoint dir)")
        if isinstance(budget, str):  # also from the command line: "8", "auto"
            budget = int(budget.strip()) if budget.strip().isdigit() else budget.strip().lower()
        if budget is not None and budget != "auto" and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"budget must be a non-negative integer or 'auto', got {budget!r}")
        if topk is not None and (not isinstance(topk, int) or topk < 1):
            raise ValueError(f"topk must be a positive integer, got {topk!r}")
        if spec != "none":
            block = self.drafter.dcfg.block_size
            if spec == "dflash":  # a chain of the drafter's argmax tokens: the tree with topk 1
                budget = budget if budget == "auto" else min(budget if budget is not None else block - 1, block - 1)
                topk = 1
            else:
                budget = DEFAULT_BUDGET if budget is None else budget
                topk = DEFAULT_TOPK if topk is None else topk
        if spec == "none" and budget == "auto":
            budget = 0
        return spec, budget or 0, topk or 1

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """`prompts`: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError(f"{self.model_path} has no tokenizer: pass prompts as lists of token ids")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, params, use_tqdm)

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """`conversations`: one conversation (a list of {"role", "content"} messages) or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.encode_chat(c) for c in conversations]
        return self._run(ids, params, use_tqdm)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer (and so no chat template)")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None) -> Iterator[str]:
        """One request's text as the engine commits it, in pieces: `prompt` is a string, token ids, or a
        conversation (chat messages). Text that could still turn out to be the start of a stop string is
        held back until it cannot. `last_stats` describes the request once the iterator is exhausted;
        closing it early aborts the request."""
        params = SamplingParams() if params is None else params
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = self.encode_chat(prompt)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        seq = self.engine.add_request(ids, params, stream=True)
        hold = max(map(len, params.stop), default=1) - 1
        sent, before = 0, self._counters()
        t0, steps = time.perf_counter(), 0
        try:
            while not seq.is_finished:
                self.engine.step()
                steps += 1
                end = len(seq.text) if seq.is_finished else len(seq.text) - hold
                if end > sent:
                    yield seq.text[sent:end]
                    sent = end
        finally:
            self.engine.abort(seq)  # (a no-op once finished)
        self._record_stats([seq], before, time.perf_counter() - t0, steps)

    def _counters(self) -> tuple[dict, dict]:
        spec = self.engine.speculator
        return (dict(spec.stats.budget_hist) if spec is not None else {}), dict(self.engine.timing)

    def _run(self, prompt_ids: list[list[int]], params, use_tqdm: bool) -> list[RequestOutput]:
        params = SamplingParams() if params is None else params
        plist = params if isinstance(params, list) else [params] * len(prompt_ids)
        if len(plist) != len(prompt_ids):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompt_ids)} prompts")
        seqs: list[Sequence] = []
        try:
            for ids, p in zip(prompt_ids, plist):
                seqs.append(self.engine.add_request(ids, p, stream=False))
        except Exception:
            for s in seqs:  # a bad prompt loses nothing: the ones already queued are withdrawn
                self.engine.abort(s)
            raise
        before = self._counters()
        t0, steps = time.perf_counter(), 0
        bar = tqdm(total=len(seqs), disable=not use_tqdm, desc="generate")
        unfinished = seqs
        # No cyclic garbage collection inside the loop: a full one walks every object of the process
        # (hundreds of thousands with the default pair loaded), a stall in the middle of the steps that
        # can take a large share of a short run; it runs after instead.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while unfinished:
                touched = self.engine.step()
                steps += 1
                # A request finishes in the step that touches it (or, rarely, in a step that touches none:
                # one given up on for lack of pages), so the others need not be scanned every step.
                if not touched or any(s.is_finished for s in touched):
                    left = [s for s in unfinished if not s.is_finished]
                    bar.update(len(unfinished) - len(left))
                    unfinished = left
        finally:
            if collecting:
                gc.enable()
        bar.close()
        self._record_stats(seqs, before, time.perf_counter() - t0, steps)
        return [RequestOutput(s.prompt_ids, s.text, list(s.output_ids), s.finish_reason, list(s.accept_lengths),
                              None if s.logprobs is None else list(s.logprobs),
                              s.num_cached_prompt or 0) for s in seqs]

    def _record_stats(self, seqs: list[Sequence], before: tuple[dict, dict], elapsed: float, steps: int) -> None:
        """`last_stats`: the requests' tokens, time and acceptance, and the engine counters' growth since
        `before` (`_counters`)."""
        hist_before, timing_before = before
        spec = self.engine.speculator
        generated = sum(len(s.output_ids) for s in seqs)
        accepts = [a for s in seqs for a in s.accept_lengths]
        self.last_stats = {"elapsed_s": elapsed, "generated_tokens": generated, "steps": steps,
                           "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
                           "mean_accept_length": sum(accepts) / len(accepts) if accepts else None,
                           "finish_reasons": [s.finish_reason for s in seqs]}
        bursts = {k: n - timing_before.get(k, 0) for k, n in sorted(self.engine.timing.items())}
        if spec is not None:  # request-steps per budget (0: AR steps of budget "auto", wherever they ran)
            hist = {b: n - hist_before.get(b, 0) for b, n in spec.stats.budget_hist.items()}
            hist[0] = bursts.get("ar_tokens", 0)
            self.last_stats["budget_hist"] = {b: n for b, n in sorted(hist.items()) if n}
        if any(bursts.values()):  # where the wall time went, and how steps were grouped into bursts
            self.last_stats["bursts"] = bursts
