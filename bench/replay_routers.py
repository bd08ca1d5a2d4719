"""Replay a Mooncake trace through several routers in front of the same sim backends.

One invocation, for each cache budget, starts fresh simulated backends
(``mlxgw backend --engine sim``) and replays the same requests through:

* ``mlxgw``: our gateway (default cache_aware policy);
* ``mlxgw-rr`` / ``mlxgw-ll``: our gateway with ``--routing-policy round_robin`` /
  ``least_loaded``;
* ``sglang``: ``sglang-router`` (PyPI) ``--policy cache_aware``, default thresholds,
  requests sent to its ``/generate`` with ``input_ids`` (its completions route
  takes string prompts only);
* ``pooled``: no router, one backend with all the cache memory and all the
  compute (N times the rates and batch sizes);
* ``--variant NAME=FLAGS``: our gateway with other flags, side by side (e.g.
  ``mlxgw-lw0='--load-weight 0'``, the routing default before queued prefill counted);
  ``--backend-variant NAME=FLAGS`` gives a run's backends extra flags (NAME starts
  with ``mlxgw``, ``sglang`` or ``pooled``; per-round comparisons pair a variant with the peer
  variant of the same suffix when it ran, ``mlxgw-disk`` with ``sglang-disk``), e.g. ``mlxgw-r6='--min-shared-tokens 16'``; in FLAGS,
  ``{backend}`` becomes a name of each backend's own in this run (a disk tier kept at a clean
  stop must not warm the next run's) and ``{ws_bytes}`` the trace's KV working set in
  bytes (times the backends for the pooled one: all of their disk, as all of their memory;
  ``{ws_bytes*0.25}`` a quarter of it), e.g. ``mlxgw-disk='--disk-cache-dir /tmp/tier/{backend} --disk-cache-bytes {ws_bytes}'``,
  cache rule 8's disk tier with room for the whole working set on each backend);
* ``mlxgw-xG`` / ``sglang-xG``: G gateway (router) processes, the client
  spreading requests over them in turn (ours share one Redis; each sglang
  router has its own tree).

Mapping: each 512-token trace block becomes ``--k`` deterministic token ids
(``bench.trace.BlockMapper``); the sim counts each id as ``512/k`` real tokens
(``--sim-token-scale``) for time and KV bytes, and generates
``ceil(output_length * k / 512)`` tokens. Our gateway's token-denominated
routing settings (decode weight, balance guard, affinity slack) are divided by
the same scale (`sim_unit_flags`) so they mean the same work. Arrival times are divided by
``--compress``; the sim runs ``--sim-speed`` times faster than the cited
hardware, chosen so the offered work is ``--target-load`` of the cluster's
capacity (printed). Latencies are wall-clock on this machine; multiply by the
printed sim speed for milliseconds on the cited hardware.

Metrics: hit ratio from the backends' own counters, the oracle (one infinite
cache), TTFT and end-to-end p50/p99 (client, streaming), throughput, max/mean
requests per backend, and the router's added latency (p50 of routed minus
direct latency on cold 1-block prompts sent after the replay).

Noise: one cell moves between identical runs (which prefixes survive eviction
and which backend a burst lands on depend on arrival timing on a shared
machine). ``--repeat N`` runs every router once per round, N rounds per budget,
and reports medians with [min-max] ranges, plus per-round ratios taken inside
a round (ours / sglang-router p99 TTFT, hit-ratio differences), and, request
by request, where our gateway's cached tokens fell short of the pooled cache's
(routed past a deeper owner by the cost, or no live owner of more).

    python bench/replay_routers.py --trace ../shared/traces/conversation_trace.jsonl --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from backend import sim as simmod  # noqa: E402
from bench.replay import vocab_range  # noqa: E402
from bench.trace import DEFAULT_TRACE, TRACE_BLOCK, BlockMapper, load_trace, oracle_hits, oracle_prefixes  # noqa: E402
from gateway.route import RoutingConfig  # noqa: E402
from mlxgw import httpget  # noqa: E402
from mlxgw.harness import LOG_DIR, RedisServer, Stack, free_port  # noqa: E402

ROUTERS = ("mlxgw", "mlxgw-rr", "mlxgw-ll", "sglang", "pooled")


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def working_set_bytes(reqs, kv_per_token: int) -> int:
    """KV bytes of every distinct trace block (the oracle's infinite cache)."""
    return len({h for r in reqs for h in r.hash_ids}) * TRACE_BLOCK * kv_per_token


def offered_load(reqs, span_s: float, o_hit_tokens: int, timing: simmod.SimTiming, n_backends: int,
                 decode_batch: int, prefixes: list[int] | None = None) -> float:
    """Cluster utilisation the trace asks for at real speed (work seconds / capacity seconds).

    Prefill of the oracle's uncached tokens at the prefill rate (each request's ``prefixes``
    entry, its oracle hit, sets their depth when the timing charges depth), plus decode
    steps at the single-sequence rate shared by ``decode_batch`` sequences.
    """
    if timing.attention_parity > 0 and prefixes is not None:
        s = timing.token_scale
        prefill = sum(timing.prefill_seconds((r.input_length - h) / s, h / s) for r, h in zip(reqs, prefixes))
    else:
        prefill = (sum(r.input_length for r in reqs) - o_hit_tokens) / timing.prefill_rate
    decode = sum(r.output_length for r in reqs) / timing.decode_rate / decode_batch
    return (prefill + decode) / max(1e-9, span_s * n_backends)


@dataclass
class SimReplay:
    """A trace's requests mapped for sim backends: what `main`, bench/redis_restart.py and
    bench/soak.py all set up (see the module docstring for the mapping and the sim speed)."""

    reqs: list
    scale: float  # real tokens per sim id
    oracle_hit: int  # tokens
    oracle_total: int
    span_s: float  # the trace's own span
    load: float  # offered load at real speed
    speed: float  # the sim speed
    working_set: int  # KV bytes of every distinct block
    mapper: BlockMapper

    @property
    def period_ms(self) -> float:
        """One pass of the trace when `items` repeats it: its span plus a second."""
        return self.span_s * 1000 + 1000

    def items(self, loops: int = 1) -> list[tuple[int, list[int], int]]:
        """(arrival ms, prompt ids, max_tokens) per request, the trace ``loops`` times back to back."""
        return [(r.timestamp_ms + n * self.period_ms, self.mapper.prompt(r.hash_ids),
                 max(1, math.ceil(r.output_length / self.scale))) for n in range(loops) for r in self.reqs]


def sim_replay(reqs, model_path: str, k: int, compress: float, target_load: float, backends: int,
               sim_speed: float | None = None, attention_parity: int = 0) -> SimReplay:
    """Map ``reqs`` to ``k`` ids per 512-token block and pick the sim speed that offers
    ``target_load`` of ``backends``' capacity at ``compress`` (unless ``sim_speed``), with the
    backends' prefill charging depth when ``attention_parity`` (`backend.attention`)."""
    scale = TRACE_BLOCK / k
    timing = simmod.SimTiming(token_scale=scale, attention_parity=attention_parity)
    o_hit, o_total = oracle_hits(reqs, TRACE_BLOCK)
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000
    load = offered_load(reqs, span, o_hit, timing, backends, 8,
                        oracle_prefixes(reqs, TRACE_BLOCK) if attention_parity > 0 else None)
    lo, hi = vocab_range(model_path)
    return SimReplay(reqs, scale, o_hit, o_total, span, load,
                     sim_speed or max(1.0, compress * load / target_load),
                     working_set_bytes(reqs, timing.kv_bytes_per_token), BlockMapper(k, lo, hi))


def load_sim_replay(args, model_path: str | None = None) -> tuple[str, SimReplay] | None:
    """The demo model's path (or ``model_path``) and `sim_replay` of ``args``' trace (the
    `add_sim_replay_args` flags, plus ``sim_speed`` when the parser has it); None, after
    saying where the public trace comes from, when the trace file is missing."""
    from mlxgw.demo_model import ensure_demo_model

    model_path = model_path or str(ensure_demo_model("tiny"))
    try:
        reqs = load_trace(args.trace, args.requests)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return None
    return model_path, sim_replay(reqs, model_path, args.k, args.compress, args.target_load, args.backends,
                                  getattr(args, "sim_speed", None), getattr(args, "sim_attention_parity", 0))


def add_sim_replay_args(p: argparse.ArgumentParser, requests: int | None, budget: float) -> None:
    """The trace, mapping and cluster flags of a one-budget sim replay (redis_restart, soak)."""
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=requests,
                   help=f"first N requests of the trace (default: {requests or 'all'})")
    p.add_argument("--k", type=int, default=16, help="token ids per 512-token trace block (also the block size)")
    p.add_argument("--compress", type=float, default=10.0, help="divide trace inter-arrival times by this")
    p.add_argument("--target-load", type=float, default=0.6,
                   help="offered work / cluster capacity the sim speed is chosen for")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--budget", type=float, default=budget, help="cluster cache budget, fraction of the KV working set")


class SglangRouter:
    """One ``sglang-router`` process (``python -m sglang_router.launch_router``)."""

    def __init__(self, workers: list[str], tag: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(LOG_DIR / f"sglang-{tag}-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *workers, "--policy", "cache_aware", "--log-level", "warn",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT)

    def wait(self, n: int, timeout: float = 60) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}")
            body = httpget.get_json(self.url + "/readiness") or {}
            if body.get("healthy_workers") == n:
                return
            time.sleep(0.2)
        raise RuntimeError("sglang-router not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _one(session, url: str, kind: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Send one streamed request; returns ttft/e2e seconds, cached tokens, status."""
    if kind == "sglang":
        path, body = "/generate", {"model": model, "input_ids": prompt, "stream": True,
                                   "sampling_params": {"max_new_tokens": max_tokens}}
    else:
        path, body = "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                         "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, cached, status, err, route = None, 0, 0, None, {}
    try:
        async with session.post(url + path, json=body) as r:
            status = r.status
            # Our gateway says where and why it routed (per-request analysis; not in the tables).
            route = {k: r.headers[h] for k, h in (("backend", "X-Mlxgw-Backend"), ("reason", "X-Mlxgw-Route-Reason"),
                                                  ("candidates", "X-Mlxgw-Candidates"), ("lookup", "X-Mlxgw-Lookup"))
                     if h in r.headers}
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"].get("message")
                if ttft is None and any(c.get("text") for c in d.get("choices") or []):
                    ttft = time.perf_counter() - t0
                u = d.get("usage")
                if u:
                    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except Exception as e:  # counted as an error, never dropped
        err = repr(e)
    e2e = time.perf_counter() - t0
    return {"status": status if err is None else 0, "error": err, "ttft": ttft if ttft is not None else e2e,
            "e2e": e2e, "cached": cached, "prompt": len(prompt), "route": route}


async def _replay(urls: list[str], kind: str, model: str, items, compress: float) -> tuple[list[dict], float]:
    results: list[dict] = []
    t0 = time.perf_counter()
    base = items[0][0]

    async def go(i, at_ms, prompt, mt):
        delay = (at_ms - base) / 1000 / compress - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        r = await _one(session, urls[i % len(urls)], kind, model, prompt, mt)
        r["i"] = i
        results.append(r)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*[go(i, *it) for i, it in enumerate(items)])
    return results, time.perf_counter() - t0


async def _overhead(routed: list[str], direct: str, kind: str, model: str, mapper: BlockMapper, n: int) -> float:
    """p50(routed) - p50(direct) end-to-end seconds of cold one-block, one-token requests."""
    a, b = [], []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            p = mapper.block(10**12 + i)  # never in the trace: a cold prompt
            a.append((await _one(session, routed[i % len(routed)], kind, model, p, 1))["e2e"])
            q = mapper.block(2 * 10**12 + i)
            b.append((await _one(session, direct, "direct", model, q, 1))["e2e"])
    return statistics.median(a) - statistics.median(b)


def dump_requests(res: dict, path: Path) -> int:
    """Write one JSON line per request of every run in ``res``; returns the lines written."""
    n = 0
    with path.open("w") as f:
        for b in res["budgets"]:
            for row in b["runs"]:
                for rnd, x in enumerate(row["rounds"], 1):
                    for r in x["per_request"]:
                        f.write(json.dumps({"budget": b["fraction"], "round": rnd, "router": row["router"],
                                            "i": r["i"], "prompt": r["prompt"], "cached": r["cached"],
                                            "ttft": r["ttft"], "e2e": r["e2e"], "status": r["status"],
                                            **r.get("route", {})}) + "\n")
                        n += 1
    return n


def multi_budget(spec: str, i: int, budgets: list[float]) -> bool:
    """Whether the ``-xG`` (several gateways) runs use budget ``i``: ``spec`` is 'first',
    'last', 'all' or a comma list of fractions. Raises ValueError on anything else."""
    if spec in ("first", "last", "all"):
        return spec == "all" or i == (0 if spec == "first" else len(budgets) - 1)
    return any(abs(float(x) - budgets[i]) < 1e-9 for x in spec.split(","))


def sim_unit_flags(scale: float) -> list[str]:
    """Our gateway's token-denominated routing defaults, converted to sim ids.

    Each sim id stands for ``scale`` real tokens, and the gateway counts ids:
    a setting of N tokens must be N / scale ids to mean the same work
    (decode weight, balance guard, affinity and placement slack). The load
    weight is a ratio and needs nothing. Flags given later (a ``--variant``'s,
    then ``--gateway-args``) win, so theirs are in sim ids.
    """
    d = RoutingConfig()

    def ids(tokens: int) -> str:  # 0 stays 0 (off); anything else at least one id
        return str(max(1, round(tokens / scale)) if tokens else 0)

    return ["--decode-weight", f"{d.decode_weight / scale:g}",
            "--balance-abs-tokens", ids(d.balance_abs_tokens),
            "--affinity-slack-tokens", ids(d.affinity_slack_tokens),
            "--placement-slack-tokens", ids(d.placement_slack_tokens)]


def sim_backend_flags(scale: float, speed: float, cache_bytes: int, mult: int = 1,
                      attention_parity: int = 0) -> list[str]:
    """``mlxgw backend`` flags of one replay sim backend: ``scale`` real tokens per sim id,
    ``speed`` times the cited hardware, ``cache_bytes`` of KV memory; ``mult`` > 1 makes it
    the pooled backend (that many backends' memory, rates and batch sizes in one);
    ``attention_parity`` > 0 makes its prefill charge depth (``--sim-attention-parity``)."""
    depth = ["--sim-attention-parity", str(attention_parity)] if attention_parity > 0 else []
    return [*depth, "--engine", "sim", "--sim-token-scale", str(scale), "--sim-speed", str(speed * mult),
            "--cache-bytes", str(cache_bytes * mult), "--cache-entries", "1000000",
            "--min-hit-tokens", str(max(1, round(1000 / scale))),
            "--prefill-step-size", str(max(1, round(512 / scale))),
            "--decode-concurrency", str(8 * mult), "--prefill-concurrency", str(2 * mult)]


def _cpu_seconds(proc) -> float:
    """User + system CPU seconds a process has used so far (0 when it is gone)."""
    try:
        t = psutil.Process(proc.pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _ws_bytes(flag: str, ws_bytes: int) -> str:
    """``{ws_bytes}`` (or ``{ws_bytes*F}``, F a number) in a backend flag: the working set's bytes (times F)."""
    return re.sub(r"\{ws_bytes(?:\*([0-9.]+))?\}", lambda m: str(int(ws_bytes * float(m.group(1) or 1))), flag)


def run_one(name: str, args, model_path: str, redis_url: str, per_backend_bytes: int, items, mapper, scale: float,
            speed: float, ws_bytes: int = 0) -> dict:
    """Start backends (+ routers) for one configuration, replay, collect, stop."""
    gws = 1
    base = name
    if "-x" in name:
        base, g = name.rsplit("-x", 1)
        gws = int(g)
    pooled = base.startswith("pooled")
    n = 1 if pooled else args.backends
    mult = args.backends if pooled else 1
    st = Stack(redis_url, model_path, block_size=args.k, lookup_deadline_ms=None)
    sim_flags = [*sim_backend_flags(scale, speed, per_backend_bytes, mult, getattr(args, "sim_attention_parity", 0)),
                 *shlex.split(dict(v.split("=", 1) for v in args.backend_variant).get(base, ""))]
    routers: list = []
    try:
        run = f"{base}-{time.time_ns()}"
        for i in range(n):
            st.add_backend(f"b{i}", None, *[_ws_bytes(f.replace("{backend}", f"{run}-b{i}"), ws_bytes * mult)
                                            for f in sim_flags])
        if base.startswith("mlxgw"):
            variants = dict(v.split("=", 1) for v in args.variant)
            if base in variants:
                flags = shlex.split(variants[base])
            else:
                pol = {"mlxgw-rr": "round_robin", "mlxgw-ll": "least_loaded"}.get(base, "cache_aware")
                flags = ["--routing-policy", pol]
            for _ in range(gws):
                st.add_gateway(*sim_unit_flags(scale), *flags, *shlex.split(args.gateway_args))
        st.wait()
        if base.startswith("mlxgw"):
            urls, kind = [g.url for g in st.gateways], "mlxgw"
        elif base.startswith("sglang"):
            routers = [SglangRouter([b.url for b in st.backends], f"{name}-{i}") for i in range(gws)]
            for r in routers:
                r.wait(n)
            urls, kind = [r.url for r in routers], "sglang"
        else:
            urls, kind = [st.backends[0].url], "direct"
        procs = [g.proc for g in st.gateways] if base.startswith("mlxgw") else [r.proc for r in routers]
        cpu0 = sum(_cpu_seconds(p) for p in procs)
        bcpu0 = sum(_cpu_seconds(b.proc) for b in st.backends)
        results, wall = asyncio.run(_replay(urls, kind, st.model_name, items, args.compress))
        router_cpu = sum(_cpu_seconds(p) for p in procs) - cpu0
        backend_cpu = sum(_cpu_seconds(b.proc) for b in st.backends) - bcpu0
        health = [httpget.get_json(b.url + "/health") or {} for b in st.backends]
        lookups: dict = {}
        for g in (st.gateways if base.startswith("mlxgw") else []):  # before the overhead probes
            gh = httpget.get_json(g.url + "/health") or {}
            for k, v in {**gh.get("lookups", {}), "stretched": gh.get("lookups_stretched", 0)}.items():
                lookups[k] = lookups.get(k, 0) + v
        overhead = None
        if not pooled and args.overhead_probes:
            overhead = asyncio.run(_overhead(urls, st.backends[0].url, kind, st.model_name, mapper,
                                             args.overhead_probes))
    finally:
        for r in routers:
            r.stop()
        st.stop()
    ok = [r for r in results if r["status"] == 200]
    reqs = [h.get("requests", 0) for h in health]
    prompt = sum(h.get("prompt_tokens", 0) for h in health)
    return {
        "router": name,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] or r["status"] for r in results if r["status"] != 200][:3],
        "hit_ratio": sum(h.get("cached_tokens", 0) for h in health) / max(1, prompt),
        "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p99": pct([r["ttft"] for r in ok], 99),
        "e2e_p50": pct([r["e2e"] for r in ok], 50), "e2e_p99": pct([r["e2e"] for r in ok], 99),
        "throughput_rps": len(ok) / wall, "wall_s": wall,
        "load_share_max_mean": (max(reqs) / (sum(reqs) / len(reqs))) if sum(reqs) and len(reqs) > 1 else 1.0,
        "per_backend": reqs,
        "overhead_ms": overhead * 1000 if overhead is not None else None,
        "router_cpu_ms_per_request": router_cpu * 1000 / max(1, len(results)) if procs else None,
        "backend_cpu_s": backend_cpu,
        # Budget evictions over the backends (0: every backend had memory for all it saved).
        "evictions": sum(h.get("cache_evictions", 0) for h in health),
        # Cache rule 8's disk tier (0 without one): entries read back, and their tokens.
        "disk_reads": sum(h.get("disk_reads", 0) for h in health),
        "disk_read_tokens": sum(h.get("disk_read_tokens", 0) for h in health),
        "disk_write_bytes": sum(h.get("disk_write_bytes", 0) for h in health),
        # The engines' own counters over the backends (docs/cache-policy.md): why hits differ.
        "engine_counters": {k: sum(h.get(k, 0) for h in health) for k in ENGINE_COUNTERS},
        # Our gateways' Redis lookups by status over the replay ({} for other routers).
        "lookups": lookups,
        "ttfts": sorted(r["ttft"] for r in ok),
        "per_request": sorted(results, key=lambda r: r["i"]),
    }


_MEDIAN_KEYS = ("hit_ratio", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "throughput_rps", "wall_s",
                "load_share_max_mean", "overhead_ms", "router_cpu_ms_per_request", "backend_cpu_s", "evictions",
                "disk_reads", "disk_write_bytes")
_RANGE_KEYS = ("hit_ratio", "ttft_p50", "ttft_p99")


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per router over the rounds: medians, [min, max] ranges, errors summed.

    ``ttfts`` pools every round's TTFTs (the CDF over all requests sent);
    ``rounds`` keeps each round's own result.
    """
    out = []
    for name in [r["router"] for r in rounds[0]]:
        rs = [r for runs in rounds for r in runs if r["router"] == name]
        row = {"router": name, "rounds": rs, "repeats": len(rs),
               "requests": sum(r["requests"] for r in rs), "errors": sum(r["errors"] for r in rs),
               "error_samples": [e for r in rs for e in r["error_samples"]][:3],
               "per_backend": rs[0]["per_backend"], "ttfts": sorted(t for r in rs for t in r["ttfts"])}
        for k in _MEDIAN_KEYS:
            vals = [r[k] for r in rs if r.get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
        row["range"] = {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k in _RANGE_KEYS}
        out.append(row)
    return out


def paired(rounds: list[list[dict]]) -> dict:
    """Per-round comparisons of each of our gateway runs (and of the pooled cache, the
    reference with no routing at all) with sglang-router and the pooled cache from the same
    round (side by side, so machine noise hits both): p99 and p50 TTFT ratios, hit-ratio
    differences. ``{router: {metric: [one value per round]}}``."""
    out: dict = {}
    for runs in rounds:
        by = {r["router"]: r for r in runs}
        for name, r in by.items():
            if not name.startswith(("mlxgw", "pooled")):
                continue
            d = out.setdefault(name, {})
            d["peers"] = [_peer(by, "sglang", name), _peer(by, "pooled", name)]
            sg = by.get(d["peers"][0])
            if sg is not None:
                d.setdefault("p99_vs_sglang", []).append(r["ttft_p99"] / sg["ttft_p99"])
                d.setdefault("p50_vs_sglang", []).append(r["ttft_p50"] / sg["ttft_p50"])
                d.setdefault("hit_minus_sglang", []).append(r["hit_ratio"] - sg["hit_ratio"])
            pooled = _peer(by, "pooled", name)
            if pooled in by and pooled != name:
                d.setdefault("hit_minus_pooled", []).append(r["hit_ratio"] - by[pooled]["hit_ratio"])
    return out


def _peer(by: dict, ref: str, name: str) -> str:
    """The run of router ``ref`` to compare ``name`` with: the one with the longest shared variant
    suffix (``mlxgw-disk`` -> ``sglang-disk`` when it ran, else ``sglang``), so variants that
    change the backends (``--backend-variant``) meet the peer in front of the same backends."""
    parts = name.split("-")[1:]
    for k in range(len(parts), 0, -1):
        cand = "-".join([ref, *parts[:k]])
        if cand in by:
            return cand
    return ref


def _candidates(header: str) -> dict[str, int]:
    """``X-Mlxgw-Candidates`` ("b0:matched=16,queued=...,..." per backend) -> backend -> matched ids."""
    out = {}
    for part in header.split():
        bid, _, rest = part.partition(":")
        fields = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
        if "matched" in fields:
            out[bid] = int(fields["matched"])
    return out


ENGINE_COUNTERS = ("hits", "misses", "prefill_saves", "prefill_handoffs", "abandoned_saves_skipped",
                   "shared_prefixes_kept", "cache_evicted_tokens", "memory_waits", "reports_late")
LOST_CAUSES = ("moved", "behind", "unowned", "no_lookup", "sub_block", "chance")  # see `lost_hits`


def lost_hits(runs: list[dict], block: int = 1, router: str = "mlxgw", reference: str = "pooled",
              shared: list[int] | None = None) -> dict | None:
    """Where one of our gateway runs' cached tokens fall short of a reference run's, request by request.

    The reference is the pooled cache (no routing at all) or another router of the same
    round, e.g. ``sglang``. Each request the reference served with more cached ids than
    ``router`` did falls in one of:

    * ``moved``: routed past a backend that owned a longer prefix (the cost preferred less
      queued work; ``guard_requests`` of them by the balance guard, route reason ``balance``);
    * ``behind``: sent to a backend that owned (or had a pending claim on) at least the
      prefix the reference reused, but that backend's cache held less when the request
      got there (the prefix was still being computed, or was evicted);
    * ``unowned``: no live backend owned that prefix, by at least a block (never computed on
      one backend whole, or evicted everywhere);
    * ``no_lookup``: as ``unowned`` as far as the route shows, but the Redis lookup timed out
      or failed (``X-Mlxgw-Lookup``), so the gateway never saw who owned what;
    * ``sub_block``: the shortfall is less than one ``block`` of ids, below what ownership
      tracks;
    * ``chance`` (given ``shared``, per request index the ids the trace itself shares,
      `bench.trace.oracle_prefixes`): ``router`` reused all of that, and the reference
      reused more only because unrelated blocks' random ids happened to start alike (a
      cache holding more entries finds more such collisions). Checked first.

    Units are sim ids; ``reference_cached_ids`` is all the reference reused. None unless
    both ran in this round.
    """
    by = {r["router"]: r for r in runs}
    if router not in by or reference not in by:
        return None
    out = {"reference": reference, "requests": 0, "ids": 0, "reference_cached_ids": 0, "guard_requests": 0}
    for k in LOST_CAUSES:
        out[f"{k}_requests"] = out[f"{k}_ids"] = 0
    for ours, theirs in zip(by[router]["per_request"], by[reference]["per_request"]):
        out["reference_cached_ids"] += theirs["cached"]
        short = theirs["cached"] - ours["cached"]
        if short <= 0:
            continue
        out["requests"] += 1
        out["ids"] += short
        cands = _candidates(ours["route"].get("candidates", ""))
        chosen = cands.get(ours["route"].get("backend", ""), 0)
        if shared is not None and ours["cached"] >= shared[ours["i"]]:
            kind = "chance"
        elif cands and max(cands.values()) > chosen:
            kind = "moved"
            out["guard_requests"] += ours["route"].get("reason") == "balance"
        elif short < block:
            kind = "sub_block"
        elif chosen + block > theirs["cached"]:
            kind = "behind"
        elif ours["route"].get("lookup", "ok") != "ok":
            kind = "no_lookup"
        else:
            kind = "unowned"
        out[f"{kind}_requests"] += 1
        out[f"{kind}_ids"] += short
    return out


def lost_hits_by_router(runs: list[dict], block: int, shared: list[int] | None = None) -> dict[str, list[dict]]:
    """`lost_hits` of each of our gateway runs in one round against the pooled cache and
    sglang-router (those that ran; the variants in front of the same backends when they ran,
    `_peer`): ``{router: [result, ...]}``."""
    by = {r["router"]: r for r in runs}
    out = {}
    for name in by:
        if name.startswith("mlxgw"):
            refs = (_peer(by, "pooled", name), _peer(by, "sglang", name))
            out[name] = [lh for ref in refs if (lh := lost_hits(runs, block, name, ref, shared))]
    return out


def _spread(r: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """``median`` or, over several rounds, ``median (min-max)``."""
    med = fmt.format(r[key] * scale)
    if r.get("repeats", 1) < 2:
        return med
    lo, hi = r["range"][key]
    return f"{med} ({fmt.format(lo * scale)}-{fmt.format(hi * scale)})"


# Two-sided 95% Student t quantiles by degrees of freedom (normal beyond the table).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


def mean_ci95(xs: list[float]) -> tuple[float, float]:
    """Mean of per-round values and the half-width of its 95% t-interval (rounds taken as independent).

    Raises:
        statistics.StatisticsError: fewer than 2 values.
    """
    n = len(xs)
    return statistics.fmean(xs), _T975.get(n - 1, 1.96) * statistics.stdev(xs) / n ** 0.5


def _series(xs: list[float], fmt: str) -> str:
    s = " / ".join(fmt.format(x) for x in xs)
    if len(xs) < 2:
        return s
    s = f"{s} (median {fmt.format(statistics.median(xs))}"
    if len(xs) >= 4:  # enough rounds for an interval that says something
        m, h = mean_ci95(xs)
        s += f"; mean {fmt.format(m)}, 95% CI {fmt.format(m - h)} to {fmt.format(m + h)}"
    return s + ")"


def table(res: dict) -> str:
    """Markdown: one table per budget (medians over rounds, ranges in brackets), then the
    per-round comparisons and where our hits fell short of the pooled cache."""
    lines = []
    for b in res["budgets"]:
        lines.append(f"\n**Cache budget {b['fraction']:g} x working set** ({b['per_backend_gb']:.2f} GiB per backend, "
                     f"{b['per_backend_gb'] * res['config']['backends']:.2f} GiB in all)\n")
        lines.append("| router | hit ratio | hit/oracle | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) | req/s "
                     "| max/mean load | added latency p50 (ms) | router CPU ms/request | budget evictions | disk reads "
                     "| disk GB written | errors |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in b["runs"]:
            ov = "" if r["overhead_ms"] is None else f"{r['overhead_ms']:.2f}"
            cpu = "" if r.get("router_cpu_ms_per_request") is None else f"{r['router_cpu_ms_per_request']:.2f}"
            ev = "" if r.get("evictions") is None else f"{r['evictions']:.0f}"
            dr = f"{r['disk_reads']:.0f}" if r.get("disk_reads") else ""  # cache rule 8's tier
            dw = f"{r['disk_write_bytes'] / 1e9:.1f}" if r.get("disk_write_bytes") else ""
            lines.append(
                f"| {r['router']} | {_spread(r, 'hit_ratio', '{:.3f}')} | {r['hit_ratio'] / res['oracle_ratio']:.3f} | "
                f"{_spread(r, 'ttft_p50', '{:.0f}', 1000)} / {_spread(r, 'ttft_p99', '{:.0f}', 1000)} | "
                f"{r['e2e_p50'] * 1000:.0f} / {r['e2e_p99'] * 1000:.0f} | {r['throughput_rps']:.2f} | "
                f"{r['load_share_max_mean']:.2f} | {ov} | {cpu} | {ev} | {dr} | {dw} | {r['errors']} |")
        notes = []
        for name, d in b.get("paired", {}).items():
            sg, pooled = d.get("peers", ["sglang", "pooled"])
            if "p99_vs_sglang" in d:
                notes.append(f"- {name} / {sg} per round: p99 TTFT {_series(d['p99_vs_sglang'], '{:.2f}x')}; "
                             f"p50 TTFT {_series(d['p50_vs_sglang'], '{:.2f}x')}; hit ratio difference "
                             f"{_series(d['hit_minus_sglang'], '{:+.3f}')}")
            if "hit_minus_pooled" in d:
                notes.append(f"- {name} hit ratio minus {pooled} per round: {_series(d['hit_minus_pooled'], '{:+.4f}')}")
        for i, per_router in enumerate(b.get("lost_hits") or []):
            for name, lhs in per_router.items():
                for lh in lhs:
                    parts = ", ".join(f"{k.replace('_', ' ')} {lh[k + '_requests']} ({lh[k + '_ids']} ids)"
                                      for k in LOST_CAUSES)
                    ref = lh["reference"]
                    notes.append(f"- round {i + 1}, {name} short of {ref}: {lh['requests']} requests, {lh['ids']} of "
                                 f"{ref}'s {lh['reference_cached_ids']} cached ids; by cause (`lost_hits`): {parts}; "
                                 f"moved by the balance guard: {lh['guard_requests']}")
        if notes:
            lines.append("")
            lines.extend(notes)
    return "\n".join(lines)


def plots(res: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e .[bench])")
        return []
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    # Every router of any budget (the -xG runs may run at one budget only: a lone marker), one
    # colour each in both figures.
    names = list(dict.fromkeys(r["router"] for b in res["budgets"] for r in b["runs"]))
    color = {name: f"C{i % 10}" for i, name in enumerate(names)}
    xs = [b["fraction"] for b in res["budgets"]]
    for name in names:
        ys = [next((r["hit_ratio"] for r in b["runs"] if r["router"] == name), np.nan) for b in res["budgets"]]
        ax.plot(xs, ys, marker="o", label=name, color=color[name])
    ax.axhline(res["oracle_ratio"], color="k", ls="--", lw=1, label="oracle")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the budgets run, not log-scale minor ticks
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("cache budget (fraction of the trace's working set, whole cluster)")
    ax.set_ylabel("prefix-hit ratio")
    ax.set_title(f"{Path(res['config']['trace']).stem}, {res['config']['requests']} requests")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / f"{res['stem']}-hit-vs-budget.png"
    fig.savefig(p, dpi=110)
    files.append(p.name)
    plt.close(fig)
    if not all("ttfts" in r for b in res["budgets"] for r in b["runs"]):
        return files  # re-plotted from a results JSON, which keeps no per-request TTFTs
    fig, axes = plt.subplots(1, len(res["budgets"]), figsize=(4.5 * len(res["budgets"]), 3.6), squeeze=False)
    for ax, b in zip(axes[0], res["budgets"]):
        for r in b["runs"]:
            t = np.array(r["ttfts"]) * 1000
            ax.plot(t, np.arange(1, len(t) + 1) / max(1, len(t)), label=r["router"], color=color[r["router"]])
        ax.set_xscale("log")
        # 1-2-5 labels: over a narrow range matplotlib labels every minor tick and they overlap
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT (ms, wall)")
        ax.set_title(f"budget {b['fraction']:g} x working set")
    axes[0][0].set_ylabel("fraction of requests")
    shown: dict = {}  # one legend for every panel's routers (the -xG ones may be in one panel only)
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            shown.setdefault(label, h)
    axes[0][-1].legend(list(shown.values()), list(shown), fontsize=8)
    fig.tight_layout()
    p = out / f"{res['stem']}-ttft-cdf.png"
    fig.savefig(p, dpi=110)
    files.append(p.name)
    plt.close(fig)
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=600, help="first N requests of the trace")
    p.add_argument("--k", type=int, default=16, help="token ids per 512-token trace block (also the block size)")
    p.add_argument("--compress", type=float, default=10.0, help="divide trace inter-arrival times by this")
    p.add_argument("--target-load", type=float, default=0.6,
                   help="offered work / cluster capacity the sim speed is chosen for")
    p.add_argument("--sim-speed", type=float, help="override the computed sim speed")
    p.add_argument("--sim-attention-parity", type=int, default=0, metavar="TOKENS",
                   help="the sim backends' --sim-attention-parity (real tokens; 12320 for the cited Qwen3-4B), "
                        "counted in the offered load too; 0, the default: prefill cost flat in depth")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--budgets", default="0.05,0.2,1.0",
                   help="cluster cache budgets as fractions of the trace's KV working set")
    p.add_argument("--routers", default=",".join(ROUTERS) + ",mlxgw-x2,sglang-x2")
    p.add_argument("--multi-budgets", default="first",
                   help="budgets the -xG runs use: 'first', 'last', 'all' or a comma list of fractions")
    p.add_argument("--overhead-probes", type=int, default=20)
    p.add_argument("--gateway-args", default="", help="extra flags for mlxgw gateway, one string")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="an extra router: our gateway with these flags, e.g. mlxgw-lw0='--load-weight 0' "
                        "(NAME must start with mlxgw and be listed in --routers)")
    p.add_argument("--backend-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="extra backend flags for the run NAME (mlxgw... or pooled..., listed in --routers), "
                        "e.g. mlxgw-r6='--min-shared-tokens 16'")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds per budget (every router once per round, side by side); tables give the median "
                        "and the range over rounds, and per-round ratios to sglang-router and the pooled cache")
    p.add_argument("--model", help="tokenizer dir (default: the tiny demo model)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--dump-requests", metavar="FILE",
                   help="also write every request's result (budget, round, router, prompt ids, cached ids, "
                        "TTFT and E2E s, backend, route reason and candidates) as JSON lines, for per-request "
                        "analysis such as bench/ttft_bands.py (~10 MB for 3 rounds of 8 routers: keep it out of git)")
    args = p.parse_args(argv)
    loaded = load_sim_replay(args, args.model)
    if loaded is None:
        return 2
    model_path, sr = loaded
    reqs = sr.reqs
    scale, o_hit, o_total, span, load, speed, ws, mapper = (
        sr.scale, sr.oracle_hit, sr.oracle_total, sr.span_s, sr.load, sr.speed, sr.working_set, sr.mapper)
    items = sr.items()
    shared = oracle_prefixes(reqs, args.k)  # sim ids per request, for `lost_hits`' chance cause
    cmd = "python bench/replay_routers.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(f"trace {args.trace}: {len(reqs)} requests over {span:.0f} s; oracle hit ratio {o_hit / o_total:.3f}")
    print(f"offered load at real speed on {args.backends} backends: {load:.2f}; compress {args.compress:g}x, "
          f"sim speed {speed:.1f}x (latencies x {speed:.1f} = the same unit on the cited hardware)")
    print(f"KV working set {ws / 2**30:.1f} GiB; token scale {scale:g}; our routing settings in sim ids: "
          f"{' '.join(sim_unit_flags(scale))}")
    budgets = [float(x) for x in args.budgets.split(",")]
    names = [x for x in args.routers.split(",") if x]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = {"config": {**vars(args), "sim_speed": speed, "token_scale": scale, "offered_load": load,
                      "working_set_gb": ws / 2**30},
           "command": cmd, "commit": revision(), "oracle_ratio": o_hit / o_total, "budgets": [],
           "stem": f"routers-{Path(args.trace).stem.split('_')[0]}-{args.requests}"}
    redis = RedisServer().start()
    t_all = time.time()
    try:
        for bi, frac in enumerate(budgets):
            per_backend = int(frac * ws / args.backends)
            rounds: list[list[dict]] = []
            for rep in range(args.repeat):
                runs = []
                for name in names:
                    if "-x" in name and not multi_budget(args.multi_budgets, bi, budgets):
                        continue
                    t = time.time()
                    r = run_one(name, args, model_path, redis.url, per_backend, items, mapper, scale, speed, ws)
                    print(f"  budget {frac:g} round {rep + 1} {name:10s} hit {r['hit_ratio']:.3f} ttft p50/p99 "
                          f"{r['ttft_p50'] * 1000:.0f}/{r['ttft_p99'] * 1000:.0f} ms errors {r['errors']} "
                          f"router cpu {r['router_cpu_ms_per_request'] or 0:.2f} ms/req "
                          f"backend cpu {r['backend_cpu_s']:.0f} s ({time.time() - t:.0f} s)"
                          + (f" lookups {r['lookups']}" if r["lookups"] else "")
                          + (f" disk reads {r['disk_reads']} written {r['disk_write_bytes'] / 1e9:.1f} GB"
                             if r["disk_reads"] or r["disk_write_bytes"] else "")
                          + " " + " ".join(f"{k} {v}" for k, v in r["engine_counters"].items()), flush=True)
                    runs.append(r)
                rounds.append(runs)
            res["budgets"].append({"fraction": frac, "per_backend_gb": per_backend / 2**30,
                                   "runs": combine_rounds(rounds), "paired": paired(rounds),
                                   "lost_hits": [lost_hits_by_router(runs, args.k, shared) for runs in rounds]})
    finally:
        redis.cleanup()
    res["total_seconds"] = time.time() - t_all
    md = table(res)
    pngs = plots(res, out)
    head = (f"# Router replay: {Path(args.trace).name}, first {len(reqs)} requests\n\n"
            f"Command: `{cmd}` (commit {revision()})\n\n"
            f"Oracle hit ratio {res['oracle_ratio']:.3f}; {args.backends} sim backends "
            f"(Qwen3-4B-Instruct-2507-4bit on M4 Max rates, docs/sim.md"
            f"{'; prefill cost growing with depth, attention parity %d tokens' % args.sim_attention_parity if args.sim_attention_parity else ''}"
            f"); trace time compressed "
            f"{args.compress:g}x; sim speed {speed:.1f}x (offered load {load:.2f} of capacity at real speed, "
            f"target {args.target_load:g}); KV working set {ws / 2**30:.1f} GiB; token scale {scale:g} (our "
            f"gateway's token-denominated defaults converted to sim ids: `{' '.join(sim_unit_flags(scale))}`); "
            f"run took {res['total_seconds']:.0f} s.\n"
            f"Latencies are wall-clock ms on this machine; x {speed:.1f} gives ms on the cited hardware.\n")
    body = head + md + "\n\n" + "\n".join(f"![{f}]({f})" for f in pngs) + "\n"
    (out / f"{res['stem']}.md").write_text(body)
    if args.dump_requests:
        dump_requests(res, Path(args.dump_requests))
    for b in res["budgets"]:
        for r in b["runs"]:
            r.pop("ttfts")
            for x in r["rounds"]:
                x.pop("ttfts")
                x.pop("per_request")
    (out / f"{res['stem']}.json").write_text(json.dumps(res, indent=2))
    print(body)
    return 0 if all(r["errors"] == 0 for b in res["budgets"] for r in b["runs"]) else 1


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
