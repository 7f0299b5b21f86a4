"""`ddtree bench serve`: a load generator for a running `ddtree serve`, a concurrency sweep over HTTP.

At each concurrency C, C closed-loop clients send streaming chat requests (each sends its next request
when its last one ends) until max(--num-prompts, C) requests are done; a warm-up round at that C runs
first and is not counted. Client side: output tok/s (all generated tokens over the level's wall time),
TTFT (to the first non-empty text chunk), TPOT ((latency - TTFT) / (tokens - 1)), ITL (gaps between
text chunks: a speculative step's tokens arrive in one chunk) and end-to-end latency, as mean, p50, p90
and p99 in ms, and the prompt tokens the server's prefix cache held (its usage's `cached_tokens`).
`--multi-turn` (MT-Bench) sends each conversation's turns in order, the second with the first and the
model's answer before it, as a chat client does; rows then add `per_turn` statistics. Server side: the
mean acceptance length from the deltas of the server's `/metrics` (speculation counters and the
acceptance-length histogram) around the measured requests, and its distribution from the requests' own
`ddtree.accept_lengths`. The server's mode, budget, topk and device
come from the `ddtree` field of `/v1/models`. Rows are JSON lines with the fields of `bench latency`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from ddtree.bench.datasets import load_conversations, sample_prompts
from ddtree.bench.latency import accept_hist, environment

SPEC_COUNTERS = ("ddtree_spec_verify_steps_total", "ddtree_spec_drafted_tokens_total",
                 "ddtree_spec_accepted_tokens_total", "ddtree_spec_acceptance_length_sum",
                 "ddtree_spec_acceptance_length_count", "ddtree_generation_tokens_total")


@dataclass(slots=True)
class Result:
    category: str
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    error: str | None = None
    turn: int = 1
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, those the server's prefix cache held

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.ttft is not None and self.tokens > 1 else None


async def one_request(client: httpx.AsyncClient, url: str, body: dict, category: str) -> Result:
    """Sends one streaming chat request and times its chunks."""
    res, chunks, last = Result(category), 0, 0.0
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now, ev = time.perf_counter(), json.loads(data)
                if "error" in ev:
                    res.error = str(ev["error"].get("message"))
                    break
                for ch in ev.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        res.text += ch["delta"]["content"]
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
                if ev.get("usage"):
                    usage = ev["usage"]
                    res.tokens, res.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if (ev.get("ddtree") or {}).get("accept_lengths") is not None:
                    res.accept_lengths = ev["ddtree"]["accept_lengths"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.tokens = res.tokens or chunks  # a server without usage in streams: count chunks
    return res


async def closed_loop(client: httpx.AsyncClient, url: str, work: list[tuple[str, dict, list[str] | None]],
                      concurrency: int) -> tuple[list[Result], float]:
    """Runs `work` ((category, body, turns) triples) with `concurrency` clients; returns results and wall
    time. With `turns` (user messages), the body's messages are the conversation so far: each turn is
    sent after the answer to the one before, which joins the conversation."""
    todo = iter(work)  # shared: each client takes the next request when its last one ends
    results: list[Result] = []

    async def client_loop():
        for cat, body, turns in todo:
            if turns is None:
                results.append(await one_request(client, url, body, cat))
                continue
            messages: list[dict] = []
            for i, text in enumerate(turns, 1):
                messages = messages + [{"role": "user", "content": text}]
                res = await one_request(client, url, {**body, "messages": messages}, cat)
                res.turn = i
                results.append(res)
                if res.error is not None:
                    break
                messages = messages + [{"role": "assistant", "content": res.text}]

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(work)))))
    return results, time.perf_counter() - t0


def warm_up(i: int, item: tuple[str, dict, list[str] | None]) -> tuple[str, dict, list[str] | None]:
    """A warm-up request like `item`, its first user message begun with a mark of its own."""
    cat, body, turns = item
    mark = f"(warm-up request {i}) "
    if turns is not None:
        return cat, body, [mark + turns[0], *turns[1:]]
    first = body["messages"][0]
    return cat, {**body, "messages": [{**first, "content": mark + first["content"]}, *body["messages"][1:]]}, None


def parse_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in SPEC_COUNTERS}


async def spec_counters(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    """The server's counters once settled: it counts a step's verify steps just after streaming the
    step's tokens (whose accept lengths are already in the histogram), so wait briefly for them to agree."""
    deadline = time.monotonic() + 1.0
    while True:
        r = await client.get(base + "/metrics")
        r.raise_for_status()
        m = parse_metrics(r.text)
        steps, observed = m.get(SPEC_COUNTERS[0], 0.0), m.get("ddtree_spec_acceptance_length_count", 0.0)
        if steps >= observed or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.02)


def summary(name: str, values: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds of values in seconds (None without values)."""
    v = np.asarray(values, dtype=float) * 1e3
    out = {f"mean_{name}_ms": float(v.mean()) if v.size else None}
    for q in (50, 90, 99):
        out[f"p{q}_{name}_ms"] = float(np.percentile(v, q)) if v.size else None
    return out


def latency_stats(results: list[Result]) -> dict:
    return {"prompt_tokens": sum(r.prompt_tokens for r in results),
            "cached_prompt_tokens": sum(r.cached_tokens for r in results),
            **summary("ttft", [r.ttft for r in results if r.ttft is not None]),
            **summary("tpot", [r.tpot for r in results if r.tpot is not None]),
            **summary("itl", [g for r in results for g in r.itl]),
            **summary("e2e", [r.latency for r in results])}


def per_category(results: list[Result]) -> dict[str, dict]:
    """Per category: the speed one request sees (its tokens over its time, summed), latencies, tau."""
    out = {}
    for cat in sorted({r.category for r in results}):
        rs = [r for r in results if r.category == cat]
        acc = [a for r in rs for a in r.accept_lengths]
        out[cat] = {"num_requests": len(rs), "generated_tokens": sum(r.tokens for r in rs),
                    "output_tok_per_s": sum(r.tokens for r in rs) / max(sum(r.latency for r in rs), 1e-9),
                    "mean_accept_length": sum(acc) / len(acc) if acc else None,
                    "mean_ttft_ms": summary("ttft", [r.ttft for r in rs if r.ttft is not None])["mean_ttft_ms"],
                    "mean_tpot_ms": summary("tpot", [r.tpot for r in rs if r.tpot is not None])["mean_tpot_ms"]}
    return out


def row_mode(served: dict | None) -> str:
    if not served:
        return "unknown"
    if served["spec"] == "none":
        return "ar"
    return "auto" if served.get("budget") == "auto" else served["spec"]


async def bench(args) -> list[dict]:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        try:
            health = await client.get(base + "/health")
        except httpx.HTTPError as e:
            raise ValueError(f"no server at {base}: {e}") from None
        if health.status_code != 200:
            raise ValueError(f"server at {base} is not ready: /health answered {health.status_code} {health.text}")
        models = await client.get(base + "/v1/models")
        if models.status_code != 200:
            raise ValueError(f"{base}/v1/models answered {models.status_code}: {models.text} (API key?)")
        card = models.json()["data"][0]
        model, served = args.served_model or card["id"], card.get("ddtree")

        multi_turn = getattr(args, "multi_turn", False)
        rows_in = (load_conversations if multi_turn else sample_prompts)(args.dataset, args.num_prompts)
        fixed = args.output_len == "fixed"

        def body(r: dict) -> dict:
            return {"model": model, "messages": r.get("messages"), "max_tokens": args.max_tokens,
                    "temperature": args.temperature, "top_p": args.top_p, "stream": True, "stream_options": {"include_usage": True},
                    **({"ignore_eos": True} if fixed else {})}

        env = environment()
        url, rows = base + "/v1/chat/completions", []
        for c in args.concurrency:
            # Closed loop: each client sends several requests, so a level measures its concurrency and
            # not a batch draining; prompts repeat when there are fewer.
            n = max(len(rows_in), 4 * c)
            work = [(r["category"], body(r), r.get("turns")) for r in itertools.islice(itertools.cycle(rows_in), n)]
            warm = c if args.warmup is None else args.warmup
            if warm:  # (each prompt marked: the measured ones must not find the warm-up's in the prefix cache)
                await closed_loop(client, url, [warm_up(i, item) for i, item in enumerate(work[:warm])], c)
            before = await spec_counters(client, base)
            results, wall = await closed_loop(client, url, work, c)
            after = await spec_counters(client, base)
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
            ok = [r for r in results if r.error is None]
            if not ok:  # keep the levels measured so far and go on
                print(f"all {len(results)} requests at concurrency {c} failed; first: {results[0].error}")
                continue
            steps, hist_n = d["ddtree_spec_verify_steps_total"], d["ddtree_spec_acceptance_length_count"]
            tokens = sum(r.tokens for r in ok)
            cats = {r["category"] for r in rows_in}
            row = {**env, "bench": "serve", "device": (served or {}).get("device", "unknown"),
                   "mode": row_mode(served), "spec": (served or {}).get("spec"),
                   "budget": (served or {}).get("budget"), "topk": (served or {}).get("topk"),
                   "concurrency": c, "dataset": args.dataset, "num_prompts": len(rows_in), "num_requests": len(ok),
                   "num_errors": len(results) - len(ok), "max_tokens": args.max_tokens,
                   "output_len": args.output_len, "temperature": args.temperature, "top_p": args.top_p,
                   "output_tok_per_s": tokens / wall, "request_per_s": len(ok) / wall, "duration_s": wall,
                   "generated_tokens": tokens,
                   "mean_accept_length": d["ddtree_spec_acceptance_length_sum"] / hist_n if hist_n else None,
                   "verify_steps": steps, "drafted_tokens": d["ddtree_spec_drafted_tokens_total"],
                   "accepted_tokens": d["ddtree_spec_accepted_tokens_total"],
                   "accept_length_hist": accept_hist([a for r in ok for a in r.accept_lengths]),
                   **latency_stats(ok), "base_url": base, "model": model}
            if len(cats) > 1:
                row["per_category"] = per_category(ok)
            if multi_turn:
                row["per_turn"] = {str(t): {"num_requests": sum(r.turn == t for r in ok),
                                            **latency_stats([r for r in ok if r.turn == t])}
                                   for t in sorted({r.turn for r in ok})}
            limit = (served or {}).get("max_num_seqs")
            row["server_max_num_seqs"] = limit
            row["server_prefix_caching"] = (served or {}).get("prefix_caching")
            if limit and c > limit:
                print(f"  note: C={c} exceeds the server's max_num_seqs={limit}: requests queue (TTFT includes it)")
            rows.append(row)
            with open(args.out, "a") as f:  # row by row: a failure later loses nothing measured
                f.write(json.dumps(row) + "\n")
            tau = row["mean_accept_length"]
            print(f"{row['mode']:7s} budget {str(row['budget']):>4s} topk {row['topk']} C={c:3d}: "
                  f"{row['output_tok_per_s']:8.1f} tok/s  TTFT p50 {row['p50_ttft_ms'] or 0:7.1f} ms  "
                  f"TPOT p50 {row['p50_tpot_ms'] or 0:6.1f} ms  ITL p99 {row['p99_itl_ms'] or 0:6.1f} ms  "
                  f"tau {tau or 1.0:.2f}", flush=True)
            if row["num_errors"]:
                print(f"  {row['num_errors']} requests failed; first: {next(r.error for r in results if r.error)}")
    return rows


def main(args) -> int:
    if any(c < 1 for c in args.concurrency):
        raise ValueError(f"concurrency levels must be >= 1, got {args.concurrency}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    asyncio.run(bench(args))
    print(f"results appended to {args.out}")
    return 0
