"""The gateway's Prometheus metrics (``GET /metrics``) and its per-request log line.

Names carry the ``mlxgw:`` prefix and follow vLLM's conventions (docs.vllm.ai,
"Production Metrics": ``*_total`` counters, ``*_seconds`` histograms,
``model_name`` label); gateway-only series say ``gateway`` or ``routing`` so
they never collide with a backend's when one Prometheus scrapes both. Every
metric is listed in ``docs/metrics.md``; ``tests/test_metrics.py`` checks the
list against a live scrape.

`request_done` is the one hook the request path calls, once the answer is
written (`gateway.app` schedules it with ``call_soon``, so the log's blocking
write is not in the client's latency): it updates the request metrics and
writes one logfmt line per request to the ``mlxgw.requests`` logger.
`request_refused` writes the line of a request the gateway answered with an
error itself, before any backend saw it (bad JSON, auth, limits, no backend).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlxgw import metric_buckets as B
from mlxgw import schema

from .index import LEFT_SHOWN

reqlog = logging.getLogger("mlxgw.requests")

# No ``*_created`` series (as vLLM): they double the output and nobody charts them.
disable_created_metrics()


class _StateCollector:
    """Series read from the gateway's state at scrape time (no hook needed)."""

    def __init__(self, state):
        self.st = state

    def collect(self):
        st = self.st
        g = GaugeMetricFamily("mlxgw:gateway_degraded",
                              "1 while Redis lookups fail and routing uses the last registry snapshot.")
        g.add_metric([], 0.0 if st.index.healthy else 1.0)
        yield g
        up = GaugeMetricFamily("mlxgw:backend_up",
                               "1 per registered backend that is ready and had no recent connect failure.",
                               labels=["model_name", "backend"])
        for model, cands in sorted(st.index.snapshot.items()):
            for c in cands:
                ok = c.state == "ready" and not st.proxy.recently_failed(c.backend_id)
                up.add_metric([model, c.backend_id], 1.0 if ok else 0.0)
        # Registered but never routed to (another block size or tokenizer: /health
        # `incompatible`): down for this gateway (helper-85 found them absent, not 0).
        for model, bs in sorted(st.index.incompatible.items()):
            for b in sorted(bs):
                up.add_metric([model, b], 0.0)
        now = time.monotonic()
        for (model, b), t in sorted(st.index.left.items()):
            if now - t < LEFT_SHOWN:
                up.add_metric([model, b], 0.0)
        yield up
        run = GaugeMetricFamily("mlxgw:gateway_num_requests_running", "Requests this gateway is forwarding, per backend.",
                                labels=["backend"])
        # Registered backends (0 when idle) and any still answering; a backend gone from the
        # registry with nothing in flight drops out instead of showing 0 for good.
        inflight = st.proxy.inflight.view()
        live = {c.backend_id for cs in st.index.snapshot.values() for c in cs}
        for b in sorted(live | {b for b, (n, _) in inflight.items() if n}):
            run.add_metric([b], inflight.get(b, (0, 0))[0])
        yield run
        r = CounterMetricFamily("mlxgw:gateway_retries", "Requests re-sent to the next backend before the first byte.")
        r.add_metric([], st.proxy.retries)
        yield r
        e = CounterMetricFamily("mlxgw:gateway_request_errors",
                                "Requests answered with an error (the gateway's own or a backend's 4xx/5xx passed "
                                "through) or whose stream ended in a backend failure; /health errors.")
        e.add_metric([], st.counters.get("errors", 0))
        yield e
        adm = st.admission
        if adm is not None:
            a = GaugeMetricFamily("mlxgw:gateway_requests_admitted",
                                  "Requests holding a slot of the global in-flight cap (all but /health, /metrics, "
                                  "/dashboard).")
            a.add_metric([], adm.admitted)
            yield a
            cap = GaugeMetricFamily("mlxgw:gateway_max_in_flight", "The global in-flight cap (0: none).")
            cap.add_metric([], adm.cfg.max_in_flight)
            yield cap
            rj = CounterMetricFamily("mlxgw:gateway_requests_rejected",
                                     "Requests refused by the gateway for its limits: overloaded (global cap, 503), "
                                     "out_of_files (EMFILE connecting upstream, 503), connections (over "
                                     "--max-connections, 503 or reset), rate or concurrency (per API key, 429).",
                                     labels=["reason"])
            for reason, n in sorted(adm.rejected.items()):
                rj.add_metric([reason], n)
            yield rj
        lk = CounterMetricFamily("mlxgw:redis_lookups", "Ownership lookups by status.", labels=["status"])
        for status, n in sorted(st.index.lookups.items()):
            lk.add_metric([status], n)
        yield lk
        yield CounterMetricFamily("mlxgw:redis_lookups_stretched",
                                  "Lookups given more than --lookup-deadline-ms because Redis was answering other "
                                  "lookups or the gateway's event loop was busy when the deadline came "
                                  "(gateway.index.LookupDeadline).",
                                  value=st.index.lookups_stretched)


class GatewayMetrics:
    """The gateway's metrics in their own registry; `bind` it to the state at startup."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]
        self.requests = Counter("mlxgw:gateway_requests", "Forwarded requests by outcome.", lab + ["outcome"], registry=r)
        self.decisions = Counter("mlxgw:routing_decisions", "Routing decisions: prefix (best backend owned a prefix), "
                                 "load (it owned none), fallback (lookup failed; load on the last snapshot).",
                                 lab + ["outcome"], registry=r)
        self.matched = Histogram("mlxgw:routing_matched_prefix_tokens",
                                 "Prompt tokens the chosen backend held per Redis and pending claims.",
                                 lab, buckets=B.TOKENS, registry=r)
        self.prompt_tokens = Counter("mlxgw:gateway_prompt_tokens",
                                     "Prompt tokens of forwarded requests a backend began answering.", lab, registry=r)
        self.cached_tokens = Counter("mlxgw:gateway_cached_tokens", "Prompt tokens the backends reported reused.",
                                     lab, registry=r)
        self.lookup = Histogram("mlxgw:redis_lookup_duration_seconds", "One ownership lookup round trip.",
                                ["status"], buckets=B.LOOKUP, registry=r)
        self.overhead = Histogram("mlxgw:routing_overhead_seconds",
                                  "Request arrival to forward: parse, template, tokenize, hash, lookup, rank.",
                                  lab, buckets=B.OVERHEAD, registry=r)
        self.ttft = Histogram("mlxgw:gateway_time_to_first_token_seconds",
                              "Request arrival to the first answer byte from the backend (streamed: the first event; "
                              "not streamed: the whole answer).",
                              lab, buckets=B.TTFT, registry=r)
        self.e2e = Histogram("mlxgw:gateway_e2e_request_latency_seconds", "Request arrival to end of answer.",
                             lab, buckets=B.E2E, registry=r)
        for status in ("ok", "timeout", "error"):
            self.lookup.labels(status)

    def bind(self, state) -> None:
        """Register the scrape-time series of ``state`` (a `gateway.app.GatewayState`)."""
        self.registry.register(_StateCollector(state))

    def prime(self, model: str) -> None:
        """Export zeros for ``model`` before its first request."""
        for c in (self.matched, self.prompt_tokens, self.cached_tokens, self.overhead, self.ttft, self.e2e):
            c.labels(model)
        for o in ("prefix", "load", "fallback"):
            self.decisions.labels(model, o)
        self.requests.labels(model, "ok")

    async def handler(self, request: web.Request) -> web.Response:
        """``GET /metrics`` in the Prometheus text format."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def request_done(m: GatewayMetrics, *, rid: str, model: str, prompt_tokens: int, lookup, t0: float,
                 route_s: float, attempts: list, resp: Optional[web.StreamResponse], outcome: str) -> dict:
    """Record one forwarded request in the metrics and the request log.

    Args:
        lookup: the `gateway.index.Lookup` (its ``status`` and ``seconds``).
        t0: ``time.perf_counter()`` at arrival; route_s: seconds until forwarding.
        attempts: the `gateway.proxy.Attempt` list; the answering one is marked
            ``answered`` and carries ``first_byte_at``.
        resp: the response sent to the client, or None when none was.
        outcome: ``ok``, ``unavailable``, ``backend_failed`` (mid-stream) or ``client_disconnected``.

    Returns the logged fields (``ttft_ms`` and ``cached_tokens`` are None when unknown).
    """
    now = time.perf_counter()
    # The attempt whose answer the client got (a stream retried after its first backend failed
    # still carries that one's headers, so they are not read here); else the last that answered.
    used = (next((a for a in attempts if a.answered), None)
            or next((a for a in reversed(attempts) if a.answer_headers is not None), None)
            or (attempts[0] if attempts else None))
    backend = used.backend_id if used is not None else "-"
    matched = int(used.headers.get("X-Mlxgw-Matched-Tokens", 0)) if used is not None else 0
    # A client that left mid-stream has no response here; the backend's own header counts it.
    raw = (used.answer_headers or {}).get(schema.CACHED_TOKENS) if used is not None else None
    cached = int(raw) if raw is not None else None
    ttft = (used.first_byte_at - t0) if used is not None and used.first_byte_at else None
    if resp is not None and resp.status >= 400 and outcome == "ok":
        outcome = f"http_{resp.status}"
    # The gateway's choice, the first try (helper-70: classed by the backend that answered, a
    # retry's, it disagreed with /health's routed_* counts, which class the choice).
    chosen = int(attempts[0].headers.get("X-Mlxgw-Matched-Tokens", 0)) if attempts else 0
    decision = "fallback" if lookup.status != "ok" else ("prefix" if chosen > 0 else "load")

    m.requests.labels(model, outcome).inc()
    m.decisions.labels(model, decision).inc()
    m.matched.labels(model).observe(matched)
    if cached is not None:
        # Both or neither: a client that left before its backend began answering leaves
        # its reuse unknown, and counting its prompt alone read the hit ratio low.
        m.prompt_tokens.labels(model).inc(prompt_tokens)
        m.cached_tokens.labels(model).inc(cached)
    m.lookup.labels(lookup.status).observe(lookup.seconds)
    m.overhead.labels(model).observe(route_s)
    if ttft is not None and not outcome.startswith("http_"):  # an error answer is no first token
        m.ttft.labels(model).observe(ttft)
    m.e2e.labels(model).observe(now - t0)

    fields = {
        "id": rid, "model": model, "backend": backend, "prompt_tokens": prompt_tokens, "matched_tokens": matched,
        "cached_tokens": cached, "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "duration_ms": round((now - t0) * 1000, 1), "route_ms": round(route_s * 1000, 2),
        "lookup": lookup.status, "retries": max(0, sum(a.tried for a in attempts) - 1),
        "outcome": outcome,
    }
    reqlog.info("request " + " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()))
    return fields


def request_refused(request: web.Request, err) -> dict:
    """Log one request the gateway refused itself (``err``: a `mlxgw.protocol.RequestError`).

    The message is cut to 200 characters (it can quote the client's input); it is the
    message the client got, which never holds a secret (``tests/test_security.py``).
    Returns the logged fields.
    """
    fields = {
        "method": request.method, "path": request.path, "status": err.status, "type": err.type, "code": err.code,
        "param": err.param, "remote": request.remote, "message": json.dumps(err.message[:200], ensure_ascii=False),
    }
    reqlog.info("refused " + " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()))
    return fields
