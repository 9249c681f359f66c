"""Prometheus metrics of one server (its own registry, so several servers can live in one process, e.g. tests).

Gauges are sampled when /metrics is scraped; counters and histograms are fed by the engine-loop thread (the
prometheus-client types are thread-safe).

    nfjax_queue_depth                   requests accepted and waiting for a batch slot
    nfjax_running_requests              requests holding a batch slot (prefilling, decoding or swapped out)
    nfjax_kv_pages_used / _total        device KV-cache pages in use / in the pool
    nfjax_generation_tokens_per_second  generated tokens per second over the last `window_s` seconds
    nfjax_prompt_tokens_total, nfjax_generation_tokens_total
    nfjax_requests_total{finish_reason}  finished requests: stop | length | abort (client gone or shutdown)
    nfjax_rejected_requests_total{status}  requests answered 4xx/5xx before reaching the engine
    nfjax_time_to_first_token_seconds   HTTP arrival -> first token known on the host
    nfjax_inter_token_latency_seconds   time between a request's consecutive tokens
    nfjax_e2e_request_latency_seconds   HTTP arrival -> last token
    nfjax_prefix_cache_hit_rate         prompt tokens reused from the prefix cache / prompt tokens (since start)
    nfjax_prefix_cache_hit_tokens{tier}  prompt tokens reused, by tier: gpu | host | disk
    nfjax_prefix_cache_bytes{direction}  bytes moved: to_host | from_host | to_disk | from_disk
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, window_s: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("nfjax_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("nfjax_running_requests", "Requests holding a batch slot", registry=r)
        self.pages_used = Gauge("nfjax_kv_pages_used", "KV-cache pages in use", registry=r)
        self.pages_total = Gauge("nfjax_kv_pages_total", "KV-cache pages in the pool", registry=r)
        self.tokens_per_s = Gauge("nfjax_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {window_s:g} s", registry=r)
        self.prompt_tokens = Counter("nfjax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.gen_tokens = Counter("nfjax_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("nfjax_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("nfjax_rejected_requests", "Requests rejected before reaching the engine",
                                ["status"], registry=r)
        self.ttft = Histogram("nfjax_time_to_first_token_seconds", "HTTP arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nfjax_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("nfjax_e2e_request_latency_seconds", "HTTP arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefix_hit_rate = Gauge("nfjax_prefix_cache_hit_rate", "Prompt tokens reused from the prefix cache / "
                                     "prompt tokens", registry=r)
        self.prefix_hits = Gauge("nfjax_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache",
                                 ["tier"], registry=r)
        self.prefix_bytes = Gauge("nfjax_prefix_cache_bytes", "Bytes moved between the prefix cache's tiers",
                                  ["direction"], registry=r)
        self.window_s = window_s
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.tokens_per_s.set_function(self._rate)

    def bind(self, queue_depth: Callable[[], float], running: Callable[[], float], pages_used: Callable[[], float],
             pages_total: Callable[[], float]) -> None:
        """Sample the state gauges from these callables at scrape time (they must be cheap and thread-safe)."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)
        self.pages_used.set_function(pages_used)
        self.pages_total.set_function(pages_total)

    def bind_prefix(self, stats: Callable[[], dict]) -> None:
        """Sample the prefix cache gauges from `stats()` (the engine's `prefix_stats`, as a published snapshot)."""
        self.prefix_hit_rate.set_function(lambda: stats().get("hit_rate", 0.0))
        for tier in ("gpu", "host", "disk"):
            self.prefix_hits.labels(tier).set_function(lambda t=tier: stats().get(f"hit_tokens_{t}", 0))
        for d in ("to_host", "from_host", "to_disk", "from_disk"):
            self.prefix_bytes.labels(d).set_function(lambda d=d: stats().get(f"bytes_{d}", 0))

    def add_tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        self.gen_tokens.inc(n)
        with self._lock:
            self._recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def _rate(self) -> float:
        now = time.perf_counter()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / self.window_s

    def render(self) -> bytes:
        return generate_latest(self.registry)
