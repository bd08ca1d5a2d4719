"""``mlxgw status``: the cluster at a glance, from Redis alone (no gateway needed)."""

from __future__ import annotations

import json
import sys
import time

import redis

from . import schema
from .util import redact_url


def collect(r: redis.Redis, namespace: str) -> dict:
    """Live backends per model with their registry records, and recent events."""
    out = {}
    for m in sorted(r.smembers(schema.models_key(namespace))):
        k = schema.Keys(namespace, m)
        backends = []
        for bid in r.zrange(k.backends, 0, -1):
            rec = r.hgetall(k.backend(bid))
            if rec:
                backends.append(rec)
        events = [{kk: vv for kk, vv in f.items() if kk != "data"}
                  for _, f in r.xrevrange(k.events, count=10)]
        out[m] = {"backends": backends, "recent_events": events}
    return out


def run(args) -> int:
    if not args.redis_url:
        from .util import serve_url_file

        f = serve_url_file()
        args.redis_url = f.read_text().strip() if f.exists() else "redis://127.0.0.1:6379/0"
    try:
        r = redis.Redis.from_url(args.redis_url, decode_responses=True, encoding_errors="replace",
                                 socket_timeout=3)
        data = collect(r, args.namespace)
    except redis.RedisError as e:
        print(f"Redis unreachable at {redact_url(args.redis_url)}: {e}", file=sys.stderr)
        return 4
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not data:
        con.print(f"no models registered under namespace '{args.namespace}'")
    for m, d in data.items():
        t = Table(title=f"model {m}")
        for col in ("backend", "state", "url", "active", "queued", "entries", "cache MB", "hit ratio", "age s"):
            t.add_column(col)
        for b in d["backends"]:
            pt = float(b.get("prompt_tokens", 0) or 0)
            hit = float(b.get("cached_tokens", 0) or 0) / pt if pt else 0.0
            t.add_row(b.get("id", "?"), b.get("state", "?"), b.get("url", "?"), b.get("active", "0"),
                      b.get("queued_prefill_tokens", "0"), b.get("cache_entries", "0"),
                      f"{float(b.get('cache_bytes', 0) or 0) / 2**20:.1f}", f"{hit:.2f}",
                      f"{time.time() - float(b.get('last_heartbeat', 0) or 0):.1f}")
        con.print(t)
        for e in d["recent_events"]:
            con.print(f"  {e.get('ts', '')} {e.get('type', ''):8} {e.get('backend', '')}")
    return 0
