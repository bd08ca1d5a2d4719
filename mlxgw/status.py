"""``mlxgw status``: the cluster at a glance, from Redis alone (no gateway needed).

`collect` reads one snapshot; `backend_view` derives the per-backend figures
people look at; `History` turns successive snapshots into rates. ``mlxgw top``
(`mlxgw.top`) and the gateway's dashboard (`gateway.dashboard`) use the same
three, so every view computes a hit ratio the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from typing import Optional

import redis

from gateway.route import spare_slots

from . import schema
from .redis_client import connect as redis_connect
from .redis_client import redis_problem, refusal_kind
from .util import count, redact_url, serve_url_file

# Event data fields worth showing (block lists are long and meaningless to people).
_EVENT_FIELDS = ("request", "reason", "matched", "prompt_tokens", "lookup", "tokens", "cache_type", "tier", "url",
                 "previous", "silent_s")


#: ``--event-types`` shorthand: a backend's run starting, ending (`cleared` is also written when
#: it re-publishes after a Redis restart) and a gateway's janitor finding it gone without a word.
EVENT_TYPE_GROUPS = {"lifecycle": (schema.EVENT_STARTED, schema.EVENT_CLEARED, schema.EVENT_LOST)}
#: How far back a type filter looks, in events per model (the stream keeps up to
#: `schema.EVENT_STREAM_MAXLEN`; saves and routing decisions make most of it).
EVENT_SCAN = 2000


def event_types_arg(text: str) -> frozenset:
    """``--event-types``: a comma list of event types (`schema` ``EVENT_*``) and groups
    (`EVENT_TYPE_GROUPS`). Raises argparse.ArgumentTypeError on an unknown name."""
    known = {v for k, v in vars(schema).items() if k.startswith("EVENT_") and isinstance(v, str)}
    out: set = set()
    for name in filter(None, (x.strip() for x in text.split(","))):
        if name in EVENT_TYPE_GROUPS:
            out |= set(EVENT_TYPE_GROUPS[name])
        elif name in known:
            out.add(name)
        else:
            raise argparse.ArgumentTypeError(
                f"unknown event type {name!r}; one of {', '.join(sorted(known | set(EVENT_TYPE_GROUPS)))}")
    if not out:
        raise argparse.ArgumentTypeError("no event type given")
    return frozenset(out)


def _decode_events(entries, events: int, types: Optional[frozenset]) -> list[dict]:
    """Stream entries (newest first) as `collect`'s event dicts: the first ``events`` of
    ``types`` (None: any)."""
    evs: list[dict] = []
    for _, f in entries if events > 0 else ():
        try:
            e = schema.decode_event(f)
        except Exception:  # a foreign or corrupt entry: show its plain fields only
            e = {schema.as_str(a): schema.as_str(b) for a, b in f.items() if schema.as_str(a) != "data"}
        if types is not None and e.get("type") not in types:
            continue
        data = e.pop("data", {}) or {}
        e.update({kk: data[kk] for kk in _EVENT_FIELDS if kk in data})
        evs.append(e)
        if len(evs) >= events:
            break
    return evs


def _events_to_read(events: int, types: Optional[frozenset]) -> int:
    """Stream entries to read per model for ``events`` events of ``types`` (`_decode_events`)."""
    return max(1, events) if types is None else EVENT_SCAN


def recent_events(r: redis.Redis, namespace: str, models: list[str], events: int = 10,
                  types: Optional[frozenset] = None) -> dict:
    """``{model: [event]}``: each model's last ``events`` events (of ``types``, among its last
    `EVENT_SCAN`), newest first, in one round trip: the models `collect` leaves out (every
    backend gone) keep their history, which says how they went. Raises redis.RedisError."""
    pipe = r.pipeline(transaction=False)
    for m in models:
        pipe.xrevrange(schema.Keys(namespace, m).events, count=_events_to_read(events, types))
    return {m: _decode_events(entries, events, types) for m, entries in zip(models, pipe.execute())}


def collect(r: redis.Redis, namespace: str, events: int = 10, dead: Optional[dict] = None,
            types: Optional[frozenset] = None) -> dict:
    """One snapshot of the cluster from Redis.

    Args:
        r: a client returning bytes (an event's msgpack data need not decode as text: a
            ``decode_responses`` client can raise UnicodeDecodeError, as it did in a test).
        namespace: key namespace.
        events: how many recent events per model.
        types: only events of these types (`event_types_arg`), the last ``events`` of them
            among the model's last `EVENT_SCAN` (None: any type).
        dead: filled (if given) with ``{model: [backend ids]}`` for the models left out whose
            registry still lists backends with expired records (every backend died, no gateway
            serves it; `mlxgw status` names them instead of "no models registered").

    Returns:
        ``{model: {"backends": [registry record (str -> str)], "gateways": {gateway id:
        settings}, "recent_events": [{"type", "backend", "epoch", "ts", <data fields>}],
        "silent": [backend ids still listed whose record expired: dead, until a janitor
        sweeps them]}}``, models sorted, backends in heartbeat order, events newest first; a
        model with neither a live backend nor a live gateway is left out (a backend's
        mistaken ``--served-name``, gone, drops out of status, top and the dashboard). ``gateways`` are
        the live gateways' published settings (`schema.fresh_gateway_settings`); each
        record gains ``left_out_by``: gateway id -> why that gateway does not route to it
        (`schema.incompatibility`, the gateways' own rule) and ``left_out``: whether every
        gateway that routes to any of the model's backends leaves this one out;
        ``refused_gateways`` maps each gateway every live backend refuses to why
        (`refused_gateways`), ``stray_gateways`` each that routes to none of the backends
        the others use (`stray_gateways`; neither counts in ``left_out_by``).

    Raises:
        redis.RedisError: Redis unreachable or failing.
    """
    out = {}
    models = sorted(schema.as_str(x) for x in r.smembers(schema.models_key(namespace)))
    # Three round trips in all, however many models and backends: each one waits its turn
    # behind the backends' writes on a busy Redis (`mlxgw status` under load, helper-38).
    pipe = r.pipeline(transaction=False)
    for m in models:
        k = schema.Keys(namespace, m)
        pipe.zrange(k.backends, 0, -1)
        pipe.xrevrange(k.events, count=_events_to_read(events, types))
        pipe.hgetall(k.gateway_settings)
    listed = pipe.execute()
    now = time.time()
    pipe = r.pipeline(transaction=False)
    for i, m in enumerate(models):
        for bid in listed[3 * i]:
            pipe.hgetall(schema.Keys(namespace, m).backend(schema.as_str(bid)))
    records = iter(pipe.execute())
    for i, m in enumerate(models):
        gateways = schema.fresh_gateway_settings(listed[3 * i + 2], now)
        backends = []
        for _ in listed[3 * i]:
            rec = next(records)
            if rec:
                backends.append(schema.registry_record(rec))
        refused_by_all = refused_gateways(gateways, [str(b.get("id", "")) for b in backends])
        for rec in backends:
            rec["left_out_by"] = left_out_by(rec, gateways, refused_by_all)
        stray = stray_gateways(gateways, backends, refused_by_all)
        routing = set(gateways) - set(refused_by_all) - set(stray)
        for rec in backends:  # the odd gateway is named on its own line, not against each backend
            rec["left_out_by"] = {g: w for g, w in rec["left_out_by"].items() if g not in stray}
            rec["left_out"] = bool(rec["left_out_by"]) and set(rec["left_out_by"]) >= routing
        evs = _decode_events(listed[3 * i + 1], events, types)
        # Backends still listed whose record expired: dead (SIGKILL, a lost host) until a gateway's
        # janitor sweeps them after its --janitor-grace (helper-59: a model whose every backend
        # died read as "no models registered").
        live = {b.get("id") for b in backends}
        silent = sorted(schema.as_str(x) for x in listed[3 * i] if schema.as_str(x) not in live)
        if backends or gateways:
            out[m] = {"backends": backends, "gateways": gateways, "recent_events": evs, "silent": silent,
                      "refused_gateways": refused_by_all, "stray_gateways": stray}
        elif silent and dead is not None:
            dead[m] = silent
    served = sorted(m for m, d in out.items() if d["gateways"])
    for d in out.values():  # for `no_gateway_lines`: what the gateways serve instead
        d["served_by_gateways"] = served
    return out


def refused_gateways(gateways: dict[str, dict], backend_ids: list[str]) -> dict[str, str]:
    """Gateway id -> why, for each live gateway that every one of ``backend_ids`` (the model's
    live backends, at least one) refuses (its settings' ``refused``, `schema.gateway_settings_value`):
    that gateway's internal token is the wrong one, not theirs. helper-70: one gateway started
    with a wrong token made status, top and the dashboard show every backend ``left out``
    (``0 live``) while the other gateways served from them."""
    out = {}
    for gid, g in gateways.items():
        refused = g.get("refused")
        if backend_ids and isinstance(refused, dict) and all(b in refused for b in backend_ids):
            out[gid] = str(refused[backend_ids[0]])
    return out


def stray_gateways(gateways: dict[str, dict], backends: list[dict], refused_by_all: dict) -> dict[str, str]:
    """Gateway id -> why, for each live gateway (not in ``refused_by_all``) that routes to none
    of the model's live ``backends`` (each record's ``left_out_by`` names it) while another
    gateway routes to at least one: that gateway's settings are the odd ones (helper-76: one
    gateway started with another --block-size made status, top and the dashboard show every
    backend ``left out``, ``0 live``, while the other gateway served from them)."""
    others = set(gateways) - set(refused_by_all)
    out = {}
    for gid in sorted(others):
        if backends and all(gid in (r.get("left_out_by") or {}) for r in backends) and any(
                g != gid and g not in (r.get("left_out_by") or {}) for r in backends for g in others):
            out[gid] = str(backends[0]["left_out_by"][gid])
    return out


def left_out_by(rec: dict, gateways: dict[str, dict], refused_by_all: Optional[dict] = None) -> dict[str, str]:
    """Gateway id -> why that gateway does not route to the backend of registry record
    ``rec`` (`schema.left_out_reason`); empty when every gateway does. A refused token counts
    against the backend unless the gateway is in ``refused_by_all`` (`refused_gateways`)."""
    out = {}
    for gid, g in gateways.items():
        why = schema.left_out_reason(g, gid, str(rec.get("id", "")), int(_f(rec, "block_size")),
                                     str(rec.get("tokenizer") or ""), refusals=gid not in (refused_by_all or {}))
        if why:
            out[gid] = why
    return out


def _f(rec: dict, key: str) -> float:
    try:
        return float(rec.get(key, 0) or 0)
    except ValueError:
        return 0.0


#: Missed heartbeats after which status and top show a backend as silent (its record lives
#: until the heartbeat TTL, 5 beats by default).
SILENT_AFTER_BEATS = 2.5


def backend_view(rec: dict, now: Optional[float] = None) -> dict:
    """Derived figures of one registry record.

    Returns ``id, state (``silent Ns`` once `SILENT_AFTER_BEATS` heartbeats were missed;
    ``left out`` when a live gateway does not route to it: ``left_out_by``, from `collect`),
    ``url problem`` when its check of its own registered URL failed: ``url_problem``),
    silent, left_out, unreachable, url, active, slots (decode slots, 0: not published), waiting (requests
    not yet in the batch), active_text (``active/slots``), queued (prefill tokens), rates_text (measured
    prefill tokens/s and mean decode seconds, `rates_text`), entries,
    cache_mb (MiB), cache_use (bytes / budget, 0..1, 0 without a budget),
    evictions (entries the budget evicted since start), disk_mb (MiB of KV in the disk tier, cache rule 8;
    0 without one), disk_reads (entries read back from it since start), requests, hit_ratio (cached / prompt tokens since start), age_s (since the
    last heartbeat), up_s (seconds since the backend process started, None if unpublished), epoch, load`` where ``load`` (active requests, then queued
    tokens) is the sort key of ``mlxgw top``.
    """
    now = time.time() if now is None else now
    age = now - _f(rec, "last_heartbeat")
    # A backend that missed its heartbeats (killed, hung, cut off) keeps its record until the
    # TTL; say so rather than show its last state.
    every = _f(rec, "heartbeat_interval") or schema.DEFAULT_HEARTBEAT_INTERVAL
    silent = age > SILENT_AFTER_BEATS * every
    pt = _f(rec, "prompt_tokens")
    budget = _f(rec, "cache_budget_bytes")
    active, queued = int(_f(rec, "active")), int(_f(rec, "queued_prefill_tokens"))
    slots = int(_f(rec, "decode_slots"))
    # Left out when no gateway routes to it (`collect`'s ``left_out``); one that some gateway
    # routes to serves, with a line naming the others.
    left_out = bool(rec.get("left_out", rec.get("left_out_by")))
    # Its own check found nothing, or something else, at its registered URL (helper-68: shown
    # `ready` and counted live beside the line saying gateways cannot reach it).
    unreachable = bool(rec.get("url_problem"))
    return {
        "id": rec.get("id", "?"),
        "state": f"silent {age:.0f}s" if silent else ("left out" if left_out else
                                                      "url problem" if unreachable else rec.get("state", "?")),
        "silent": silent,
        "left_out": left_out,
        "unreachable": unreachable,
        "url": rec.get("url", "?"),
        "active": active,
        "slots": slots,
        "waiting": int(_f(rec, "waiting")),
        # "12/16": active requests of the backend's decode slots; above them, requests wait
        "active_text": f"{active}/{slots}" if slots else str(active),
        "queued": queued,
        "entries": int(_f(rec, "cache_entries")),
        # Unrounded: the table's format rounds once (rounding here first turned 0.7498 MiB into
        # "0.8" where /health's figure formats as "0.7").
        "cache_mb": _f(rec, "cache_bytes") / 2**20,
        "cache_use": round(_f(rec, "cache_bytes") / budget, 4) if budget else 0.0,
        "evictions": int(_f(rec, "cache_evictions")),
        "disk_mb": _f(rec, "disk_bytes") / 2**20,
        "disk_reads": int(_f(rec, "disk_reads")),
        "requests": int(_f(rec, "requests")),
        "hits": int(_f(rec, "hits")),
        "hit_ratio": round(_f(rec, "cached_tokens") / pt, 4) if pt else 0.0,
        "decode_tps": _f(rec, "decode_tps"),
        # the two figures the routing's wait for a decode slot is built from (docs/routing.md)
        "rates_text": rates_text(_f(rec, "prefill_tps"), _f(rec, "decode_seconds")),
        "age_s": round(age, 1),
        # since its process started, and its epoch (one more per start under this id): a
        # restarted or crash-looping backend shows here, not only in serve's log (helper-64)
        "up_s": round(now - _f(rec, "started_at"), 1) if _f(rec, "started_at") else None,
        "epoch": int(_f(rec, "epoch")),
        "load": (active, queued),
    }


def rates_text(prefill_tps: float, decode_seconds: float) -> str:
    """``"1840 / 3.2"`` (``"3369 / 0.048"``): a backend's measured prefill rate (prompt tokens/s)
    and mean decode time of a request (s), the two figures the gateways turn a wait for a decode slot into tokens
    with (docs/routing.md, "The wait for a decode slot"); ``-`` for one not measured yet (0)."""
    # two significant digits below a second: a 48 ms decode read "0.0", a measured zero (helper-94)
    d = "-" if decode_seconds <= 0 else f"{decode_seconds:.1f}" if decode_seconds >= 1 else f"{decode_seconds:.2g}"
    return (f"{prefill_tps:.0f}" if prefill_tps > 0 else "-") + " / " + d


def duration_text(seconds: Optional[float]) -> str:
    """``45s``, ``12m``, ``3.5h``, ``2.1d``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds / 60:.0f}m" if seconds >= 60 else f"{max(0.0, seconds):.0f}s"


def layouts_note(records: list[dict]) -> str:
    """``" (cache layout shared)"``, or with mixed layouts each with its count (``" (cache
    layouts shared x2, whole x1)"``); empty when no record names one (docs/cache-policy.md, rule 7)."""
    from collections import Counter

    n = Counter(r["cache_layout"] for r in records if r.get("cache_layout"))
    if not n:
        return ""
    if len(n) == 1:
        return f" (cache layout {next(iter(n))})"
    return " (cache layouts " + ", ".join(f"{k} x{v}" for k, v in sorted(n.items())) + ")"


def console():
    """A rich Console; piped or captured output gets 200 columns so no column is cut (at 150 a
    `left out` total row cut every URL, helper-49)."""
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=max(con.width, 200))


def event_time(event: dict) -> str:
    """An event's ``ts`` (unix seconds) as local HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(float(event.get("ts", 0) or 0)))


_COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_seconds_sum", "ttft_count")


def event_line(event: dict) -> str:
    """One event as a console line: time, type, backend and its details (``key=value``).

    The details are the `collect` fields an event has: a routing decision's
    ``matched`` / ``prompt_tokens`` (tokens) and ``lookup`` outcome, a save's or
    eviction's ``tokens``, ``cache_type`` and ``tier`` (``disk`` for the disk tier's), a
    start's ``url`` and ``previous`` (how the run before ended), a loss's ``silent_s``.
    """
    extra = " ".join(f"{k}={event[k]}" for k in _EVENT_FIELDS if k in event and k != "request")
    return f"  {event_time(event)} {event.get('type', ''):8} {event.get('backend', ''):10} {extra}".rstrip()


def _rates(prev: dict, cur: dict, dt: float) -> dict:
    """Rates between two sets of counters (a counter that went down restarted: count it from 0)."""
    d = {k: (cur[k] - prev[k]) if cur[k] >= prev[k] else cur[k] for k in _COUNTERS}
    return {
        "rps": round(d["requests"] / dt, 3),
        "hit_ratio": round(d["cached_tokens"] / d["prompt_tokens"], 4) if d["prompt_tokens"] else None,
        "gen_tps": round(d["generated_tokens"] / dt, 2),
        "ttft_ms": round(1000 * d["ttft_seconds_sum"] / d["ttft_count"], 2) if d["ttft_count"] else None,
    }


class History:
    """Rates over time from successive `collect` snapshots.

    Each `add` after the first appends one point per model and per backend:
    ``{"t": unix s, "rps": requests/s, "hit_ratio": cached/prompt tokens in
    the interval (None without prompt tokens), "gen_tps": generated tokens/s,
    "ttft_ms": mean TTFT of the interval (None without first tokens)}``.
    A model's point sums the backends present in both snapshots.

    Args:
        maxlen: points kept per series.
    """

    def __init__(self, maxlen: int = 120):
        self.maxlen = maxlen
        self._prev: Optional[tuple[float, dict]] = None
        self.models: dict[str, deque] = {}
        self.backends: dict[tuple[str, str], deque] = {}

    @staticmethod
    def _counters(data: dict) -> dict:
        return {(m, b.get("id", "?")): {k: _f(b, k) for k in _COUNTERS}
                for m, d in data.items() for b in d["backends"]}

    def add(self, data: dict, t: Optional[float] = None) -> None:
        """Add one snapshot taken at ``t`` (unix s, default now)."""
        t = time.time() if t is None else t
        cur = self._counters(data)
        if self._prev is not None and t > self._prev[0]:
            t0, prev = self._prev
            dt = t - t0
            totals: dict[str, tuple[dict, dict]] = {}
            for key, c in cur.items():
                if key not in prev:
                    continue
                p = prev[key]
                self.backends.setdefault(key, deque(maxlen=self.maxlen)).append({"t": t, **_rates(p, c, dt)})
                tp, tc = totals.setdefault(key[0], ({k: 0.0 for k in _COUNTERS}, {k: 0.0 for k in _COUNTERS}))
                for k in _COUNTERS:
                    # Per-backend deltas summed, so a restarted backend does not subtract.
                    tc[k] += (c[k] - p[k]) if c[k] >= p[k] else c[k]
            for m, (zero, delta) in totals.items():
                self.models.setdefault(m, deque(maxlen=self.maxlen)).append({"t": t, **_rates(zero, delta, dt)})
        self._prev = (t, cur)

    def model_series(self, model: str) -> list[dict]:
        return list(self.models.get(model, ()))

    def backend_series(self, model: str, backend: str) -> list[dict]:
        return list(self.backends.get((model, backend), ()))


REPLY_TIMEOUT = 3.0  # s per reply (one retry): `status` on a frozen Redis gives up after ~6 s


def connect(args) -> redis.Redis:
    """The Redis client of ``status``/``top``: ``--redis-url``, else the last ``mlxgw serve``'s.

    Sets ``args.url_source`` to ``flag``, ``env`` (``MLXGW_REDIS_URL``, the flag's default),
    ``serve`` (the file `mlxgw serve` leaves) or ``default``.
    """
    if args.redis_url:
        # The flag's default is the variable (helper-59: "from --redis-url" when it came from there).
        args.url_source = "env" if args.redis_url == os.environ.get("MLXGW_REDIS_URL") else "flag"
    else:
        f = serve_url_file()
        args.url_source = "serve" if f.exists() else "default"
        args.redis_url = f.read_text().strip() if f.exists() else schema.DEFAULT_REDIS_URL
    return redis_connect(args.redis_url, REPLY_TIMEOUT)


def unreachable(args, e: BaseException) -> int:
    """Tell the operator which Redis did not answer and where its URL came from (`connect`),
    on stderr; with ``--json`` also on stdout, as ``{"error": {"type": "redis_unreachable"``
    (or ``"redis_refused"``: a password, database or Cluster node refused, `refusal_kind`)``,
    "redis_url", "message", "hint"}}`` (``hint`` null when there is none), so a script reading
    stdout gets JSON either way.
    Returns the exit code of ``status`` and ``top`` for it, 4."""
    refused = refusal_kind(e) is not None
    if refused:  # it answered, and refused the URL: the message says what to change
        hint = ""
    elif isinstance(e, redis.TimeoutError):  # connected, then no answer: not a wrong URL
        hint = (f"it accepted the connection but did not answer within {REPLY_TIMEOUT:g} s, twice: "
                "overloaded, or stopped with SIGSTOP?")
    else:
        hint = {"serve": "the URL a `mlxgw serve` left: is that serve still running, and the Redis it uses?",
                "default": f"no `mlxgw serve` left its URL in {serve_url_file()} (none running, or it runs with "
                           "another MLXGW_CACHE_DIR); start one, or pass --redis-url"}.get(args.url_source, "")
    print(redis_problem(args.redis_url, e), file=sys.stderr)
    if hint:
        print(f"({hint})", file=sys.stderr)
    if getattr(args, "json", False):
        # A refusal (password, database, a Cluster node) is no outage (helper-77: "redis_unreachable")
        print(json.dumps({"error": {"type": "redis_refused" if refused else "redis_unreachable",
                                    "redis_url": redact_url(args.redis_url),
                                    "message": redis_problem(args.redis_url, e) if refused else str(e),
                                    "hint": hint or None}}, indent=2))
    return 4


def model_total(records: list[dict]) -> dict:
    """A model's figures over its backends: ``live`` (not silent, and routed to by the
    gateways: not ``left out``, and no ``url problem``), ``left_out`` (how many a gateway does not
    route to), ``unreachable`` (how many others have a URL problem); sums over
    the live ones of ``active``, ``slots``, ``waiting`` and ``queued`` (the capacity requests can
    use now: a silent backend's figures are stale and a left-out one gets no requests); sums
    over them all of ``entries``, ``cache_mb``, ``evictions``, ``prompt_tokens``, ``cached_tokens``,
    and ``hit_ratio``: cached over prompt tokens of them all (not the mean of their ratios)."""
    views = [backend_view(r) for r in records]
    live = [v for v in views if not (v["silent"] or v["left_out"] or v["unreachable"])]
    pt = sum(_f(r, "prompt_tokens") for r in records)
    ct = sum(_f(r, "cached_tokens") for r in records)
    out = {k: sum(v[k] for v in live) for k in ("active", "slots", "waiting", "queued")}
    out.update({k: sum(v[k] for v in views) for k in ("entries", "evictions", "disk_reads")})
    return {"live": len(live),
            "left_out": sum(v["left_out"] for v in views),
            "unreachable": sum(v["unreachable"] and not v["left_out"] and not v["silent"] for v in views), **out, "cache_mb": sum(v["cache_mb"] for v in views),
            "disk_mb": sum(v["disk_mb"] for v in views),
            "prompt_tokens": int(pt), "cached_tokens": int(ct), "hit_ratio": round(ct / pt, 4) if pt else 0.0}


def has_disk_tier(records: list[dict]) -> bool:
    """Whether any of a model's backends runs a disk tier (cache rule 8): the status table then
    has a ``disk MiB / reads`` column."""
    return any(_f(r, "disk_budget_bytes") > 0 for r in records)


def _disk_cell(v: dict) -> str:
    return f"{v['disk_mb']:.1f} / {v['disk_reads']}"


def live_text(t: dict) -> str:
    """``N live[, M left out][, K url problem]`` of a `model_total` (status's total row, top's
    model line)."""
    return (f"{t['live']} live" + (f", {t['left_out']} left out" if t["left_out"] else "")
            + (f", {t['unreachable']} url problem" if t["unreachable"] else ""))


def total_row(records: list[dict]) -> list[str]:
    """The ``total`` row of a model's status table (`model_total`)."""
    t = model_total(records)
    live = live_text(t)
    active = f"{t['active']}/{t['slots']}" if t["slots"] else str(t["active"])
    return ["total", live, "", active, str(t["queued"]), "", str(t["entries"]), f"{t['cache_mb']:.1f}",
            str(t["evictions"]), *([_disk_cell(t)] if has_disk_tier(records) else []), f"{t['hit_ratio']:.2f}", "", ""]


DISAGREEMENT_NOTES = {
    "block_size": "a gateway routes only to those matching its own",
    "tokenizer": "a gateway routes only to those matching its own",
    # Same tokenizer, other files: routed to all, so a request's answer depends on where it lands.
    "model_files": "other weights or config under one name: answers differ by backend (see each one's model_path)",
}


def disagreement(records: list[dict]) -> list[str]:
    """One line per setting the backends of one model disagree on, naming who has which:
    ``block_size`` and ``tokenizer`` (a gateway routes only to the backends matching its own,
    docs/routing.md "Failures") and ``model_files`` (`backend.persist.model_files`: another
    model, variant or quantization served under the same name; helper-85). Empty when they
    agree (unpublished values not counted)."""
    out = []
    for field, note in DISAGREEMENT_NOTES.items():
        groups: dict[str, list[str]] = {}
        for r in records:
            v = r.get(field)
            if v not in (None, "", 0):
                groups.setdefault(str(v), []).append(str(r.get("id", "?")))
        if len(groups) > 1:
            out.append(f"backends disagree on {field}: " + "; ".join(
                f"{v} ({', '.join(sorted(ids))})" for v, ids in sorted(groups.items(), key=lambda kv: -len(kv[1]))) +
                f"; {note}")
    return out


def shared_url_lines(records: list[dict]) -> list[str]:
    """One line per URL that several of a model's backends registered: one backend answers
    there, the others are unreachable as registered (a backend on another Mac that registered
    a loopback URL, helper-64; a gateway skips them: its ``/health`` ``misaddressed``)."""
    by_url: dict[str, list[str]] = {}
    for r in records:
        if r.get("url"):
            by_url.setdefault(str(r["url"]), []).append(str(r.get("id", "?")))
    return [f"backends {', '.join(sorted(ids))} registered the same URL {url}: only one of them answers there "
            "(start the others with --url and an address the gateways reach them at)"
            for url, ids in sorted(by_url.items()) if len(ids) > 1]


def open_backends(records: list[dict]) -> list[dict]:
    """The records of a model's backends that answer without the internal token (registry
    ``auth``) when others of the model require it: anything that reaches one skips the
    gateways' keys and limits, which the token on the others was meant to prevent. Empty
    when they all agree (a stack without tokens is a choice, not a slip)."""
    auth = {str(r.get("auth") or "") for r in records}
    return [r for r in records if r.get("auth") == "none"] if {"token", "none"} <= auth else []


def open_lines(records: list[dict]) -> list[str]:
    """One line per `open_backends` record, for the status table."""
    return [f"backend {r.get('id', '?')} answers without the internal token the others require: anything that "
            f"reaches {r.get('url', '?')} can skip the gateways' keys and limits (start it with "
            "MLXGW_INTERNAL_TOKEN; docs/security.md)" for r in open_backends(records)]


def url_problem_lines(records: list[dict]) -> list[str]:
    """One line per backend whose own check of its registered URL failed (registry
    ``url_problem``: nothing, or something else, answers there; helper-66: such a backend
    showed `ready` here while no gateway could reach it)."""
    return [str(r["url_problem"]) for r in records if r.get("url_problem")]


def refused_gateway_lines(refused: dict[str, str]) -> list[str]:
    """One line per gateway every live backend refuses (`refused_gateways`)."""
    return [f"gateway {gid} is refused by every backend: "
            + ("it has no internal token and they require one" if schema.NO_TOKEN_MARK in why else
               "its internal token is not theirs")
            + " (start it with the backends' --internal-token / MLXGW_INTERNAL_TOKEN)"
            for gid, why in sorted(refused.items())]


def left_out_lines(records: list[dict]) -> list[str]:
    """One line per backend a live gateway does not route to, naming the gateways and why
    (``left_out_by``, from `collect`)."""
    out = []
    for r in records:
        for gid, why in sorted((r.get("left_out_by") or {}).items()):
            out.append(f"gateway {gid} does not route to {r.get('id', '?')}: {why}")
    return out


def oversize_lines(records: list[dict]) -> list[str]:
    """One line per backend that met prompts larger than its whole cache budget (registry
    ``cache_oversize``: never cached; helper-73 saw no sign of it anywhere)."""
    return [f"backend {r.get('id', '?')}: {int(_f(r, 'cache_oversize'))} prompt(s) larger than its whole cache "
            "budget were not kept in memory (raise --cache-bytes)" for r in records if _f(r, "cache_oversize") > 0]


def starved_cache_lines(records: list[dict]) -> list[str]:
    """One line per backend whose prompt cache holds nothing while requests run there and its
    budget has evicted entries: the KV in flight fills the budget (the engine counts it against
    ``--cache-bytes``), so nothing outlives its request and each conversation's next turn is
    computed whole (helper-86: 16 running 3k-token contexts in 2 GiB, and no sign of it but
    ``cache MiB`` 0). A snapshot: one such moment between saves is possible, a line that stays
    is the budget."""
    out = []
    for r in records:
        active, evicted = int(_f(r, "active")), int(_f(r, "cache_evictions"))
        if active >= 2 and evicted > 0 and _f(r, "cache_entries") == 0:
            out.append(f"backend {r.get('id', '?')}: its prompt cache holds nothing while {active} requests run "
                       f"({evicted} entries evicted so far): their KV fills its "
                       f"{_f(r, 'cache_budget_bytes') / 2**20:.0f} MiB budget, so each next turn is computed whole "
                       "(raise --cache-bytes, or lower --decode-concurrency)")
    return out


def idle_beside_busy_lines(records: list[dict]) -> list[str]:
    """One line per live backend with nothing to do, or at most a quarter of its decode slots in
    use and none waiting, while another of the model has every decode slot busy and requests
    waiting for one (helper-88: b1 idle at 0/16 beside b0 at 16/16 with ~40k tokens queued, and
    only the table showed it). The gateways send a request where its
    prefix is cached unless the load there outweighs it; since session 48 a backend holding none
    of it takes a request that would wait for a slot (docs/routing.md, "Seeding an empty
    backend"), and since session 49 one holding part of it (a shared system prompt) takes it when
    the wait for a slot outweighs the prefill the longer prefix saves ("The wait for a decode
    slot"); a short wait beside a long cached history keeps it there, and gateways that do not
    see the slots (an older backend) do neither. A snapshot: one such moment as a burst arrives is
    possible; a line that stays is not."""
    views = [backend_view(r) for r in records]
    live = [v for v in views if not (v["silent"] or v["left_out"] or v["unreachable"])]
    full = [v for v in live if v["slots"] and v["active"] >= v["slots"] and v["waiting"] > 0]
    if not full:
        return []
    busiest = max(full, key=lambda v: (v["waiting"], v["queued"]))
    out = []
    for v in live:
        # Idle, or nearly (helper-89: 1 of 16 slots used beside a peer at 19/16 said nothing).
        if v["state"] != "ready" or v["waiting"] or v["active"] > spare_slots(v["slots"]):  # no slots published: idle only
            continue
        doing = ("has nothing to do" if v["active"] == 0 and v["queued"] == 0
                 else f"runs {v['active']} of its {v['slots']} decode slots")
        out.append(f"backend {v['id']} {doing} while {busiest['id']} has all {busiest['slots']} decode slots "
                   f"busy and {count(busiest['waiting'], 'request')} waiting for one ({busiest['queued']} prompt tokens "
                   f"queued): the gateways send a request where the longest prefix of it is cached unless the "
                   f"load there, or its wait for a slot, outweighs the prefill that saves, so conversations with "
                   f"a long history cached there stay (docs/routing.md, \"The wait for a decode slot\")")
    return out


def stray_gateway_lines(stray: dict[str, str]) -> list[str]:
    """One line per gateway that routes to none of the backends the other gateways use
    (`stray_gateways`)."""
    return [f"gateway {gid} routes to none of this model's backends, which the other gateways use: {why}"
            for gid, why in sorted(stray.items())]


def problem_lines(d: dict, namespace: str = "") -> list[str]:
    """Every warning line of one model's `collect` entry ``d``, in status's order: backends whose
    record expired (`silent_text`), no backend or no gateway, settings the backends disagree on, shared URLs, URL problems, gateways every backend refuses, backends
    left out, backends open without the token, prompts too large for a backend's cache, caches
    the KV in flight empties, idle backends beside one whose requests wait for a decode slot
    (status's text and the dashboard show them)."""
    b = d["backends"]
    return (([silent_text(d["silent"])] if d.get("silent") else []) + no_backend_lines(d)
            + no_gateway_lines(d, namespace) + disagreement(b) + shared_url_lines(b) + url_problem_lines(b)
            + refused_gateway_lines(d.get("refused_gateways") or {})
            + stray_gateway_lines(d.get("stray_gateways") or {}) + left_out_lines(b) + open_lines(b)
            + oversize_lines(b) + starved_cache_lines(b) + idle_beside_busy_lines(b))


def no_backend_lines(d: dict) -> list[str]:
    """The line for a model its live gateways serve while no backend is registered (helper-74:
    status exited 3 under an empty table and no line said why)."""
    # Also beside the silent line (dead backends still listed): the gateways answer 503 meanwhile
    # (helper-87: the line was missing for the janitor's 300 s grace after the last one died).
    gws = sorted(d.get("gateways") or {})
    if d["backends"] or not gws:
        return []
    one = len(gws) == 1
    what = "no live backend" if d.get("silent") else "no backend registered"
    return [f"{what} for this model: {'gateway' if one else 'gateways'} "
            f"{', '.join(gws)} {'answers' if one else 'answer'} 503 no_backend until one registers (`mlxgw backend` with this "
            "--namespace and --served-name)"]


def no_gateway_lines(d: dict, namespace: str = "") -> list[str]:
    """The line for a model with live backends that no live gateway serves (helper-76: status
    showed them live and said nothing): a backend --served-name that is not the gateways'
    model name when gateways serve other models (``served_by_gateways``), else no gateway
    under this namespace at all (none started, or another --namespace)."""
    if not d["backends"] or d.get("gateways"):
        return []
    served = d.get("served_by_gateways") or []
    if served:
        why = (f"the gateways here serve {', '.join(repr(m) for m in served)} (is the backends' --served-name "
               "the gateways' model name?)")
    else:
        why = (f"no gateway runs under namespace {namespace!r}" if namespace else "no gateway runs under this namespace") + \
              " (start `mlxgw gateway`, or is its --namespace another?)"
    return [f"no live gateway serves this model, so nothing routes to its backends: {why}"]


def silent_text(ids: list) -> str:
    """The line naming backends still listed whose record expired (status's text, the dashboard)."""
    # "Silent", not "dead": a stopped (SIGSTOP) or swapping backend resumes and re-registers (helper-66).
    return ("no heartbeat past their TTL (silent: dead, stopped or cut off; one that resumes registers again, "
            "and a gateway's janitor removes the others after its --janitor-grace): " + ", ".join(ids))


#: `mlxgw status`'s exit code when no backend is registered under the namespace (nothing
#: serves; helper-70: it was 0, as for a healthy cluster, so a script could not tell).
NO_BACKENDS_EXIT = 3


def run(args) -> int:
    """Print the cluster (a table, or ``--json``). Returns 0; `NO_BACKENDS_EXIT` (3) when no
    backend is registered under the namespace; 4 when Redis does not answer (`unreachable`)."""
    dead: dict = {}
    n, types = getattr(args, "events", 10), getattr(args, "event_types", None)
    try:
        r = connect(args)
        data = collect(r, args.namespace, events=n, dead=dead, types=types)
        before = [] if data or dead else sorted(schema.as_str(x) for x in r.smembers(schema.models_key(args.namespace)))
        # The models with no live backend or gateway keep their history: how they went.
        gone = recent_events(r, args.namespace, sorted(dead) + before, n, types) if dead or before else {}
    except redis.RedisError as e:
        return unreachable(args, e)
    code = 0 if any(d["backends"] for d in data.values()) else NO_BACKENDS_EXIT
    if args.json:
        now = time.time()
        for d in data.values():
            for rec in d["backends"]:  # what the table shows: "left out", "silent 4s", or the record's state
                rec["shown_state"] = backend_view(rec, now)["state"]
            d["total"] = model_total(d["backends"])
            d["disagreements"] = disagreement(d["backends"])
            d["open_backends"] = sorted(str(r.get("id")) for r in open_backends(d["backends"]))
        # Every backend dead (listed, as the text output names them), or a clean stop (none listed):
        # no live record, the history stays.
        for m, ids in [*dead.items(), *((m, []) for m in before)]:
            data[m] = {"backends": [], "gateways": {}, "recent_events": gone.get(m, []), "silent": ids,
                       "total": model_total([]), "disagreements": [], "open_backends": []}
        print(json.dumps(dict(sorted(data.items())), indent=2))
        return code
    con = console()
    source = {"flag": "--redis-url", "env": "MLXGW_REDIS_URL", "serve": str(serve_url_file()),
              "default": "default"}[args.url_source]
    con.print(f"Redis {redact_url(args.redis_url)} (from {source}), namespace {args.namespace}", markup=False,
              highlight=False, soft_wrap=True)
    if not data and not dead:
        # The models set outlives the backends (a clean stop leaves it): say what served before.
        con.print(f"no live backend or gateway under namespace '{args.namespace}'"
                  + (f" (models registered before: {', '.join(before)})" if before else ""),
                  markup=False, highlight=False, soft_wrap=True)
    for m, ids in dead.items():
        con.print(f"model {m}: no live backend or gateway; {silent_text(ids)}", markup=False, highlight=False,
                  soft_wrap=True)
        _print_events(con, gone.get(m, []))
    for m in before:
        if gone.get(m):
            con.print(f"model {m}, recent events:", markup=False, highlight=False)
        _print_events(con, gone.get(m, []))
    now = time.time()
    for m, d in data.items():
        t, dropped = status_table(m, d["backends"], now, con.width if con.is_terminal else None)
        if d["backends"]:
            con.print(t)
            if dropped:
                con.print(dropped_line(dropped), markup=False, highlight=False, soft_wrap=True)
        else:  # an empty table's header says nothing; the model's name heads its line instead
            con.print(f"model {m}", markup=False, highlight=False)
        for line in problem_lines(d, args.namespace):
            con.print(line, markup=False, highlight=False, soft_wrap=True)
        _print_events(con, d["recent_events"])
    return code


def _need(header: str, cells: list[str]) -> int:
    """Terminal columns one table column takes whole: its header or widest cell, plus rich's
    padding and rule (3)."""
    return max([len(c) for c in cells] + [len(header)]) + 3


def fit_table(title: Optional[str], spec: list[tuple[str, str, int]], rows: list[list[str]],
              width: Optional[int], total: Optional[list[str]] = None):
    """A rich Table of ``rows`` (and a ``total`` row in a section of its own) that fits ``width``
    terminal columns (None: every column, whole headers) without cutting or folding a figure.
    ``spec`` gives each column's ``(header, short header, drop)``: the whole headers when every
    column fits at its widest cell; else the short ones, then columns leave in ``drop`` order (1
    first; 0: never) until the rest fit. Cells never wrap (helper-98: at 80 columns a URL broke
    over 8 lines, ``0/16`` into ``0/1`` and ``6``); headers do not wrap either. Returns
    ``(table, whole headers of the columns left out)``."""
    from rich.table import Table

    body = rows + ([total] if total else [])
    cells = [[r[i] for r in body] for i in range(len(spec))]
    heads = [h for h, _, _ in spec]
    shown = list(range(len(spec)))
    if width is not None and 1 + sum(_need(h, c) for h, c in zip(heads, cells)) > width:
        heads = [sh for _, sh, _ in spec]
        for i in sorted((i for i, (_, _, d) in enumerate(spec) if d), key=lambda i: spec[i][2]):
            if 1 + sum(_need(heads[j], cells[j]) for j in shown) <= width:
                break
            shown.remove(i)
    t = Table(title=title) if title is not None else Table(expand=False)
    for i in shown:
        t.add_column(heads[i], no_wrap=True, min_width=_need(heads[i], cells[i]) - 3)
    for r in rows:
        t.add_row(*[r[i] for i in shown])
    if total:
        t.add_section()
        t.add_row(*[total[i] for i in shown])
    return t, [spec[i][0] for i in range(len(spec)) if i not in shown]


def dropped_line(headers: list[str], json_hint: str = "--json") -> str:
    """The line under a table that left columns out for a narrow terminal; ``json_hint``: the
    command that shows every field (helper-99: `mlxgw top` pointed at a --json it lacks)."""
    return f"(left out to fit this terminal: {', '.join(headers)}; a wider terminal or {json_hint} shows them)"


def status_table(model: str, records: list[dict], now: float, width: Optional[int] = None):
    """The rich Table of one model's backends (`backend_view` of each registry record in
    ``records``, and a ``total`` row when there are several), fitted to ``width`` terminal
    columns (`fit_table`: short headers, then the URL, rates, evictions, disk tier, uptime,
    heartbeat age, entries and cache size leave in that order; the backend id, state, active
    requests, queued tokens and hit ratio stay). Returns ``(table, headers left out)``."""
    disk = has_disk_tier(records)
    views = [backend_view(r, now) for r in records]
    rows = [[b["id"], b["state"], b["url"], b["active_text"], str(b["queued"]), b["rates_text"], str(b["entries"]),
             f"{b['cache_mb']:.1f}", str(b["evictions"]), *([_disk_cell(b)] if disk else []),
             f"{b['hit_ratio']:.2f}", f"{b['age_s']:.1f}", f"{duration_text(b['up_s'])} ({b['epoch']})"]
            for b in views]
    total = total_row(records) if len(records) > 1 else None
    spec = [("backend", "backend", 0), ("state", "state", 0), ("url", "url", 1), ("active/slots", "act/slots", 0),
            ("queued tok", "queued", 0), ("prefill tok/s / decode s", "pf tok/s / dec s", 2),
            ("entries", "entries", 7), ("cache MiB", "MiB", 8), ("evictions", "evict", 3),
            *([("disk MiB / reads", "disk", 4)] if disk else []), ("hit ratio (tokens)", "hit", 0),
            ("heartbeat s", "hb s", 6), ("up (epoch)", "up", 5)]
    return fit_table(f"model {model}{layouts_note(records)}", spec, rows, width, total)


def _print_events(con, events: list[dict]) -> None:
    for e in events:
        con.print(event_line(e), markup=False, highlight=False)
