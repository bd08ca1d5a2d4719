"""The backend's Prometheus metrics (``GET /metrics``).

Names follow vLLM's ``vllm:*`` metrics (docs.vllm.ai, "Production Metrics")
with the ``mlxgw:`` prefix, so existing vLLM dashboards chart a backend after
a prefix rename; bucket edges are vLLM's too (`mlxgw.metric_buckets`). Every metric is listed in ``docs/metrics.md``
(``tests/test_metrics.py`` checks the list against a live scrape).

The engine thread calls the ``on_*`` hooks; prometheus-client's metric
objects take their own locks, so the HTTP thread may scrape at any time.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# No ``*_created`` series (vLLM turns them off too): they double the output and nobody charts them.
disable_created_metrics()

from mlxgw import metric_buckets as B


class BackendMetrics:
    """One backend's metrics in its own registry (label ``model_name``, as vLLM).

    Args:
        model_name: the served model name (the label value).

    Counters count tokens where vLLM does: prefix cache queries and hits are
    prompt tokens looked up and prompt tokens reused, so
    ``rate(hits) / rate(queries)`` is the token hit ratio.
    """

    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, lab + list(extra), registry=r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r)

        self.running = Gauge("mlxgw:num_requests_running", "Requests admitted to the batch (prefill or decode).", lab, registry=r)
        self.waiting = Gauge("mlxgw:num_requests_waiting", "Requests submitted but not yet admitted to the batch.", lab, registry=r)
        self.cache_usage = Gauge("mlxgw:kv_cache_usage_perc", "Prompt-cache bytes over the cache budget (0..1).", lab, registry=r)
        self.cache_entries = Gauge("mlxgw:prompt_cache_entries", "Entries in the prompt cache.", lab, registry=r)
        self.cache_bytes = Gauge("mlxgw:prompt_cache_bytes", "Bytes held by the prompt cache.", lab, registry=r)
        self.queued_prefill = Gauge("mlxgw:num_prefill_tokens_waiting", "Prompt tokens still to compute of the requests not yet through their prefill (cache hits left out).", lab, registry=r)
        self.prompt_tokens = counter("mlxgw:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("mlxgw:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("mlxgw:prefix_cache_queries", "Prompt tokens looked up in the prompt cache.")
        self.prefix_hits = counter("mlxgw:prefix_cache_hits", "Prompt tokens reused from the prompt cache.")
        self.success = counter("mlxgw:request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.unparsed_calls = counter("mlxgw:tool_calls_unparsed", "Tool-call blocks returned as text because they did not parse.")
        self.ttft = hist("mlxgw:time_to_first_token_seconds", "Submit to first generated token.", B.TTFT)
        self.itl = hist("mlxgw:inter_token_latency_seconds", "Time between consecutive generated tokens.", B.ITL)
        self.e2e = hist("mlxgw:e2e_request_latency_seconds", "Submit to end of generation.", B.E2E)
        self.queue_time = hist("mlxgw:request_queue_time_seconds", "Submit to admission into the batch.", B.TTFT)
        self.req_prompt = hist("mlxgw:request_prompt_tokens", "Prompt length of each request.", B.TOKENS)
        self.req_gen = hist("mlxgw:request_generation_tokens", "Generated tokens of each request.", B.TOKENS)
        for c in (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits,
                  self.unparsed_calls, self.ttft,
                  self.itl, self.e2e, self.queue_time, self.req_prompt, self.req_gen):
            c.labels(model_name)  # export zeros before the first request
        for reason in ("stop", "length", "cancelled", "error"):
            self.success.labels(model_name, reason)
        self._last_token: dict[str, float] = {}
        self._admitted = 0  # admitted and not finished (engine-thread writes only)
        self._lock = threading.Lock()
        # Plain sums for the Redis heartbeat (the dashboard's TTFT over time).
        self.ttft_sum = 0.0
        self.ttft_count = 0

    # -- engine-thread hooks ---------------------------------------------
    def on_admit(self, rid: str, submitted_at: float, prompt_tokens: int, reused: int, spare: bool = False) -> None:
        """A request entered the batch; ``reused`` prompt tokens came from the cache. ``spare``:
        a choice after the first of an ``n`` > 1 request, counted only as running and in its
        tokens (the request, its prompt and its TTFT count once, with its first choice)."""
        m = self.model_name
        self._admitted += 1
        if spare:
            return
        self.queue_time.labels(m).observe(time.monotonic() - submitted_at)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.prefix_queries.labels(m).inc(prompt_tokens)
        self.prefix_hits.labels(m).inc(reused)
        self.req_prompt.labels(m).observe(prompt_tokens)

    def on_token(self, rid: str, submitted_at: float, spare: bool = False) -> None:
        """One token generated for request ``rid`` (first one: TTFT, later ones: ITL)."""
        now = time.monotonic()
        m = self.model_name
        self.generation_tokens.labels(m).inc()
        last = self._last_token.get(rid)
        self._last_token[rid] = now
        if last is None and spare:
            return
        if last is None:
            dt = now - submitted_at
            self.ttft.labels(m).observe(dt)
            with self._lock:
                self.ttft_sum += dt
                self.ttft_count += 1
        else:
            self.itl.labels(m).observe(now - last)

    def on_finish(self, rid: str, submitted_at: float, generated: int, reason: str, spare: bool = False) -> None:
        """Request ``rid`` ended with ``reason`` (stop, length, cancelled, error)."""
        m = self.model_name
        self._last_token.pop(rid, None)
        self._admitted -= 1
        if spare:
            return
        self.e2e.labels(m).observe(time.monotonic() - submitted_at)
        self.success.labels(m, reason).inc()
        self.req_gen.labels(m).observe(generated)

    def on_dropped(self) -> None:
        """A request cancelled before it was admitted (its client gone while it waited)."""
        self.success.labels(self.model_name, "cancelled").inc()

    def on_unparsed_calls(self, n: int) -> None:
        """``n`` tool-call blocks of one answer did not parse and went back as text (HTTP side)."""
        if n:
            self.unparsed_calls.labels(self.model_name).inc(n)

    # -- scrape side -------------------------------------------------------
    def bind(self, stats: Callable[[], dict], budget_bytes: Optional[int]) -> None:
        """Read gauges at scrape time from the engine's ``stats()`` (keys of ``Engine.stats``).

        ``active`` counts submitted requests; those not admitted yet are waiting.
        """
        m = self.model_name
        self.running.labels(m).set_function(lambda: self._admitted)
        self.waiting.labels(m).set_function(lambda: max(0, stats()["active"] - self._admitted))
        self.cache_entries.labels(m).set_function(lambda: stats()["cache_entries"])
        self.cache_bytes.labels(m).set_function(lambda: stats()["cache_bytes"])
        self.queued_prefill.labels(m).set_function(lambda: stats()["queued_prefill_tokens"])
        self.cache_usage.labels(m).set_function(
            lambda: stats()["cache_bytes"] / budget_bytes if budget_bytes else 0.0)
        self.registry.register(_EvictionCounters(m, stats))

    def record_fields(self) -> dict:
        """Fields added to the Redis registry record at each heartbeat."""
        with self._lock:
            return {"ttft_seconds_sum": round(self.ttft_sum, 6), "ttft_count": self.ttft_count}

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    async def handler(self, request: web.Request) -> web.Response:
        """``GET /metrics``: no internal token needed (aggregates only; docs/security.md)."""
        return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class _EvictionCounters:
    """The prompt cache's budget evictions and its disk tier's figures, read from ``stats()``
    at scrape time (the cache counts them on the engine thread; a Counter object cannot be
    read from a function)."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name, self.stats = model_name, stats

    def describe(self):
        return []  # collected only at scrape time: ``stats`` needs a running engine

    def collect(self):
        s = self.stats()
        for name, key, doc in (
            ("mlxgw:prompt_cache_evictions", "cache_evictions", "Prompt-cache entries evicted to keep within the budget."),
            ("mlxgw:prompt_cache_evicted_tokens", "cache_evicted_tokens", "Tokens of the entries evicted by the budget."),
            ("mlxgw:memory_waits", "memory_waits",
             "Requests whose admission --max-inflight-share put off (their KV would not fit; 0 without it)."),
            # Cache rule 8's disk tier (zeros without one).
            ("mlxgw:disk_cache_spills", "disk_spills", "Prompt-cache entries the memory budget moved to the disk tier."),
            ("mlxgw:disk_cache_reads", "disk_reads", "Disk-tier entries read back for a prompt."),
            ("mlxgw:disk_cache_read_tokens", "disk_read_tokens", "Tokens of those entries: prefill the disk tier saved."),
            ("mlxgw:disk_cache_evictions", "disk_evictions", "Disk-tier entries its own budget evicted."),
            ("mlxgw:disk_cache_failures", "disk_failures", "Disk-tier writes or reads that failed (the entry dropped)."),
            ("mlxgw:disk_cache_write_bytes", "disk_write_bytes", "KV bytes the disk tier wrote to its files."),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], s.get(key, 0))
            yield c
        for name, key, doc in (
            ("mlxgw:disk_cache_entries", "disk_entries", "Entries in the disk tier."),
            ("mlxgw:disk_cache_bytes", "disk_bytes", "KV bytes in the disk tier."),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], s.get(key, 0))
            yield g

