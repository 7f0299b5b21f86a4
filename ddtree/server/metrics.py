"""Prometheus metrics of one server, in its own registry (no process-global state).

Request and token metrics are recorded by the engine thread as tokens are committed; the gauges
(KV pages, queue) are refreshed after every engine step and every add or abort, so `/metrics`
shows freed pages as soon as a request ends.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0)
ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "Finished requests, by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("ddtree_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ddtree_inter_token_latency_seconds",
                             "Time between generated tokens (a step's gap shared by the tokens it committed)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.verify_steps = Counter("ddtree_spec_verify_steps", "Speculative verify steps (one per request per step)",
                                    registry=r)
        self.drafted_tokens = Counter("ddtree_spec_drafted_tokens", "Draft tokens sent to verification", registry=r)
        self.accepted_tokens = Counter("ddtree_spec_accepted_tokens", "Draft tokens accepted by verification",
                                       registry=r)
        self.accept_length = Histogram("ddtree_spec_acceptance_length",
                                       "Tokens committed per verify step (accepted drafts + the bonus token)",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.kv_pages_used = Gauge("ddtree_kv_pages_used", "KV cache pages held by requests", registry=r)
        self.kv_pages_total = Gauge("ddtree_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.waiting = Gauge("ddtree_requests_waiting", "Requests queued for admission", registry=r)
        self.running = Gauge("ddtree_requests_running", "Requests admitted and generating", registry=r)
        self.prefix_queries = Counter("ddtree_prefix_cache_queried_tokens",
                                      "Tokens of admitted requests looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("ddtree_prefix_cache_hit_tokens",
                                   "Tokens of admitted requests whose K/V the prefix cache held", registry=r)
        self.prefix_pages = Gauge("ddtree_prefix_cache_pages", "KV pages holding cached prefixes (held or idle)",
                                  registry=r)
        self._spec_seen = (0, 0, 0)  # (verify steps, accepted drafts, drafted nodes) already counted
        self._prefix_seen = (0, 0)  # (queried, hit tokens) already counted

    def tokens(self, n: int, first: bool, gap: float) -> None:
        """`n` new tokens of one request; `gap`: seconds since its arrival (first) or its last tokens."""
        self.generation_tokens.inc(n)
        if first:
            self.ttft.observe(gap)
            return
        for _ in range(n):
            self.itl.observe(gap / n)

    def engine_state(self, engine, waiting_extra: int = 0) -> None:
        """Refresh the gauges and the speculation counters from the engine (engine thread only)."""
        self.kv_pages_used.set(engine.allocator.num_used)
        self.kv_pages_total.set(engine.allocator.num_pages)
        self.waiting.set(len(engine.scheduler.waiting) + waiting_extra)
        self.running.set(len(engine.scheduler.running))
        alloc = engine.allocator
        self.prefix_pages.set(alloc.num_cached_pages)
        self.prefix_queries.inc(alloc.queried_tokens - self._prefix_seen[0])
        self.prefix_hits.inc(alloc.hit_tokens - self._prefix_seen[1])
        self._prefix_seen = (alloc.queried_tokens, alloc.hit_tokens)
        if engine.speculator is not None:
            st = engine.speculator.stats
            steps, accepted = st.steps, sum(st.depth_accepted)
            new_steps = steps - self._spec_seen[0]
            self.verify_steps.inc(new_steps)
            self.drafted_tokens.inc(st.drafted - self._spec_seen[2])
            self.accepted_tokens.inc(accepted - self._spec_seen[1])
            self._spec_seen = (steps, accepted, st.drafted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
