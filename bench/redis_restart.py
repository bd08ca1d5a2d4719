"""Redis restarted empty under load: how requests spread and hit while the index refills.

Replays the first ``--requests`` of a Mooncake trace through our gateway in
front of ``--backends`` sim backends (the set-up of ``bench/replay_routers.py``;
the backends heartbeat at the product's default interval), twice on the same
requests: once as a control, once with redis-server stopped and started again
empty (no persistence, the same port) at each of the ``--restart-at`` times
(seconds into the replay). For each pass, by send time (before the first
restart, within ``--after`` s of a restart, the rest): requests, errors, hit
ratio (the client's ``cached_tokens`` over prompt tokens) and the busiest
backend's share of requests (``1/backends`` is even; 1.0 is every request on
one backend); then the hit ratio per second around each restart.

    python bench/redis_restart.py --trace ../shared/traces/conversation_trace.jsonl

``--src DIR`` runs the gateway and the backends from another checkout (e.g. a
worktree of an older commit) to compare two codes under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.replay_routers import _one, add_sim_replay_args, load_sim_replay, sim_backend_flags, sim_unit_flags  # noqa: E402
from mlxgw import schema  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402


def windows_of(rows: list[dict], restarts: list[float], after: float, n_backends: int) -> list[dict]:
    """Requests by send time (s): before the first restart, within ``after`` s of a
    restart, and the rest; for each, requests, errors, hit ratio (cached / prompt tokens
    of the answered) and the busiest backend's share of requests."""
    def where(t: float) -> str:
        if t < restarts[0]:
            return "before the first restart"
        return f"first {after:g} s after a restart" if any(r <= t < r + after for r in restarts) else "the rest"

    out = []
    for name in ("before the first restart", f"first {after:g} s after a restart", "the rest"):
        w = [r for r in rows if where(r["sent"]) == name]
        ok = [r for r in w if r["status"] == 200]
        per = Counter(r["route"].get("backend", "?") for r in ok)
        out.append({"window": name, "requests": len(w), "errors": len(w) - len(ok),
                    "hit_ratio": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
                    "max_share": max(per.values()) / len(ok) if ok else float("nan"),
                    "per_backend": dict(sorted(per.items())), "even_share": 1 / n_backends})
    return out


async def _replay(url: str, model: str, items, compress: float, restarts: list[float], redis: RedisServer,
                  registry_keys: list[str]):
    rows: list[dict] = []
    t0 = time.perf_counter()
    base = items[0][0]
    # Per restart: stopped and up again (s into the replay), and each backend's delay from
    # then until its registry record is back (s; NaN: not within 5 s).
    restarted: list[dict] = []

    def restart():  # blocking (terminate, wait, start, poll): off the client's event loop
        stop = time.perf_counter() - t0
        redis.stop()
        redis.proc = None
        redis.start()
        up = time.perf_counter() - t0
        client = redis.client()
        back: dict[str, float] = {}
        while len(back) < len(registry_keys) and time.perf_counter() - t0 - up < 5:
            for k in registry_keys:
                if k not in back and client.exists(k):
                    back[k] = time.perf_counter() - t0 - up
            time.sleep(0.005)
        restarted.append({"stopped": stop, "up": up,
                          "re_registered_after": [back.get(k, float("nan")) for k in registry_keys]})

    async def go(i, at_ms, prompt, mt):
        delay = (at_ms - base) / 1000 / compress - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter() - t0
        r = await _one(session, url, "mlxgw", model, prompt, mt)
        r.update(i=i, sent=sent)
        rows.append(r)

    async def restarter():
        for at in restarts:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            th = threading.Thread(target=restart)
            th.start()
            while th.is_alive():
                await asyncio.sleep(0.05)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as session:
        jobs = [go(i, *it) for i, it in enumerate(items)]
        if restarts:
            jobs.append(restarter())
        await asyncio.gather(*jobs)
    return sorted(rows, key=lambda r: r["i"]), restarted


def run_pass(args, model_path: str, items, scale: float, speed: float, per_backend: int, restart: bool) -> dict:
    redis = RedisServer().start()
    st = Stack(redis.url, model_path, block_size=args.k, lookup_deadline_ms=None)
    try:
        for i in range(args.backends):
            st.add_backend(f"b{i}", None, *sim_backend_flags(scale, speed, per_backend),
                           "--heartbeat-interval", str(args.heartbeat_interval), "--heartbeat-ttl", str(args.heartbeat_ttl),
                           cwd=args.src)
        st.add_gateway(*sim_unit_flags(scale), cwd=args.src)
        st.wait()
        keys = schema.Keys(st.namespace, st.model_name)
        rows, restarted = asyncio.run(_replay(st.gateway.url, st.model_name, items, args.compress,
                                              args.restart_at if restart else [], redis,
                                              [keys.backend(b.name) for b in st.backends]))
        log = st.gateway.log_path.read_text()
    finally:
        st.stop()
        redis.cleanup()
    return {"restart": restart, "restarted": restarted,
            "windows": windows_of(rows, args.restart_at, args.after, args.backends),
            "errors": sum(r["status"] != 200 for r in rows),
            "error_samples": [r["error"] or r["status"] for r in rows if r["status"] != 200][:3],
            "gateway_said_lost": "Redis lost its data" in log,
            "per_request": [{k: r[k] for k in ("i", "sent", "status", "cached", "prompt")} | r["route"] for r in rows]}


def table(passes: list[dict]) -> str:
    lines = ["| pass | window | requests | errors | hit ratio | max backend share | requests per backend |",
             "|---|---|---|---|---|---|---|"]
    for p in passes:
        for w in p["windows"]:
            lines.append(f"| {'restart' if p['restart'] else 'control'} | {w['window']} | {w['requests']} | "
                         f"{w['errors']} | {w['hit_ratio']:.3f} | {w['max_share']:.2f} | "
                         f"{' '.join(f'{k}:{v}' for k, v in w['per_backend'].items())} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_replay_args(p, requests=2000, budget=1.0)
    p.add_argument("--restart-at", default="15,25,35,45,55",
                   help="comma list of seconds into the replay at which redis-server restarts empty")
    p.add_argument("--after", type=float, default=5.0, help="length of the window after each restart, s")
    p.add_argument("--heartbeat-interval", type=float, default=schema.DEFAULT_HEARTBEAT_INTERVAL,
                   help="the backends' (default: the product's)")
    p.add_argument("--heartbeat-ttl", type=float, default=schema.DEFAULT_HEARTBEAT_TTL)
    p.add_argument("--src", help="run the gateway and backends from this checkout (default: this one)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"),
                   help="writes redis-restart[-LABEL].md and .json here")
    p.add_argument("--label", default="", help="suffix of the output files' names")
    args = p.parse_args(argv)
    args.restart_at = sorted(float(x) for x in args.restart_at.split(","))
    loaded = load_sim_replay(args)
    if loaded is None:
        return 2
    model_path, sr = loaded
    reqs = sr.reqs
    scale, span, speed, items = sr.scale, sr.span_s, sr.speed, sr.items()
    per_backend = int(args.budget * sr.working_set / args.backends)
    head = (f"{len(reqs)} requests of {Path(args.trace).name} over {span / args.compress:.0f} s (compress "
            f"{args.compress:g}x), sim speed {speed:.1f}x, {args.backends} sim backends (heartbeat "
            f"{args.heartbeat_interval:g} s, TTL {args.heartbeat_ttl:g} s), cache budget {args.budget:g} of the KV "
            f"working set; Redis restarted empty at {', '.join(f'{x:g}' for x in args.restart_at)} s.")
    print(head, flush=True)
    passes = [run_pass(args, model_path, items, scale, speed, per_backend, restart) for restart in (False, True)]
    print(table(passes))
    lines = ["Hit ratio (answered requests) per second around each restart, control / restart:", "",
             "| s | control | restart |", "|---|---|---|"]
    for at in args.restart_at:
        for t in range(int(at) - 1, int(at + args.after)):
            cells = []
            for pa in passes:
                w = [r for r in pa["per_request"] if t <= r["sent"] < t + 1 and r["status"] == 200]
                cells.append(f"{sum(r['cached'] for r in w) / max(1, sum(r['prompt'] for r in w)):.3f} ({len(w)})")
            lines.append(f"| {t}-{t + 1} | {cells[0]} | {cells[1]} |")
    per_second = "\n".join(lines)
    print(per_second)
    tail = "\n".join(
        [f"- redis-server stopped at {r['stopped']:.2f} s, up at {r['up']:.2f} s; the backends' registry records "
         f"back after {', '.join(f'{x * 1000:.0f}' for x in r['re_registered_after'])} ms"
         for r in passes[1]["restarted"]]
        + [f"- the gateway logged the data loss: {passes[1]['gateway_said_lost']}; error samples (control, "
           f"restart): {[p['error_samples'] for p in passes]}"])
    print(tail)
    cmd = "python bench/redis_restart.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    stem = Path(args.out_dir) / ("redis-restart" + (f"-{args.label}" if args.label else ""))
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(
        f"# Redis restarted empty under load\n\nCommand: `{cmd}` (commit {revision()})" + (f" (code: {args.src})" if args.src else "")
        + f"\n\n{head}\n\n{table(passes)}\n\n{per_second}\n\n{tail}\n")
    for pa in passes:
        pa.pop("per_request")  # ~200 KB a pass: not kept
    stem.with_suffix(".json").write_text(json.dumps({"command": cmd, "commit": revision(), "src": args.src, "passes": passes}, indent=2))
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
