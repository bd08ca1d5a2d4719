"""Overload: more clients at once than the gateway has open files for.

Starts Redis, ``--backends`` sim backends and one gateway, each under an
open-files limit of ``--nofile`` (soft and hard; 4096 is what importing
mlx-lm used to leave every process with), then sends ``--clients`` chat
requests at once, each on its own connection, and counts how each ended:
answered (200), shed (503 ``overloaded``: the gateway's global in-flight cap),
another HTTP status, or a connection error (EMFILE on the gateway's accept or
upstream connect shows up here, as resets or timeouts). Also: seconds to each
kind of answer (p50/p99), the gateway's peak open files, and the lines of its
log naming a resource failure ("out of system resource", "Too many open files").

The gateway holds two sockets per request in flight (client and backend); with
no cap, ``--clients`` above about half of ``--nofile`` runs it out of files.
``--src DIR`` runs the gateway and backends from another checkout (e.g. the
code before the cap), the client from this one.

``--idle-clients N`` first has N keep-alive clients send one request each and
then go quiet with their connections open (as SDK clients between an agent's
turns), for the whole burst: with ``--gateway-args '--max-connections C'`` and
N near C, the burst's clients find the cap taken by idle connections, which the
gateway now closes to make room (`gateway/connguard.py`, session 31); before,
they were refused.

    python bench/overload.py --clients 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.replay_routers import pct  # noqa: E402
from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402
from mlxgw.rlimit import raise_open_files_limit  # noqa: E402

RESOURCE_LINES = ("out of system resource", "Too many open files")


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"request {i}: say something about the number {i}"}]}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            raw = await r.read()
            kind = "answered" if r.status == 200 else f"http_{r.status}"
            if r.status == 503:
                try:
                    code = json.loads(raw)["error"].get("code")
                except (ValueError, KeyError, TypeError):
                    code = None
                kind = "shed" if code == "overloaded" else f"http_503_{code}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        kind = f"connection_error:{type(e).__name__}"
    return {"kind": kind, "seconds": time.perf_counter() - t0}


async def burst(url: str, model: str, clients: int, max_tokens: int, timeout: float) -> list[dict]:
    """``clients`` requests at once, one connection each (no pooling: each client is its own)."""
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        return await asyncio.gather(*[_one(session, url, model, i, max_tokens) for i in range(clients)])


async def hold_idle(url: str, model: str, n: int, ready: asyncio.Event, release: asyncio.Event) -> dict:
    """``n`` keep-alive connections, each used for one request and then left open and idle
    until ``release``; returns how many of those requests were answered and how many of the
    connections the gateway closed meanwhile."""
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=3600)
    async with aiohttp.ClientSession(connector=conn) as session:
        rows = await asyncio.gather(*[_one(session, url, model, -1 - i, 1) for i in range(n)])
        # aiohttp's pool of idle connections (private; deques of (protocol, time) per host)
        held = sum(len(v) for v in conn._conns.values())
        ready.set()
        await release.wait()
        left = sum(1 for v in conn._conns.values() for proto, _ in v if proto.is_connected())
    return {"idle_answered": sum(r["kind"] == "answered" for r in rows), "idle_held": held,
            "idle_closed_by_gateway": held - left}


async def burst_beside_idle(url: str, model: str, args) -> tuple[list[dict], dict]:
    ready, release = asyncio.Event(), asyncio.Event()
    idle = asyncio.create_task(hold_idle(url, model, args.idle_clients, ready, release))
    await ready.wait()
    rows = await burst(url, model, args.clients, args.max_tokens, args.timeout)
    release.set()
    return rows, await idle


def _fds(pid: int) -> int:
    try:
        return psutil.Process(pid).num_fds()
    except psutil.Error:
        return 0


def _sockets_by_kind(pid: int, port: int, redis_port: int) -> dict:
    """The process's TCP sockets: from clients (to ``port``), to Redis, to backends (the rest)."""
    out = Counter()
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.Error, AttributeError):
        return {}
    for c in conns:
        if c.status == psutil.CONN_LISTEN:
            continue
        kind = ("client" if c.laddr and c.laddr.port == port else
                "redis" if c.raddr and c.raddr.port == redis_port else "backend")
        out[kind] += 1
    return dict(out)


def summarize(rows: list[dict]) -> list[dict]:
    """Per outcome kind: count and seconds to the end of the answer (p50, p99)."""
    kinds = Counter(r["kind"] for r in rows)
    out = []
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        secs = [r["seconds"] for r in rows if r["kind"] == kind]
        out.append({"kind": kind, "requests": n, "p50_s": pct(secs, 50), "p99_s": pct(secs, 99)})
    return out


def table(label: str, summary: list[dict], extra: dict) -> str:
    lines = [f"### {label}", "",
             f"Gateway peak open files {extra['gateway_peak_fds']} (limit {extra['nofile']}; TCP sockets then: "
             + ", ".join(f"{n} {k}" for k, n in sorted(extra["sockets_at_peak"].items())) + "); "
             f"resource-failure lines in its log: {extra['resource_lines']}; log {extra['log_kb']:.0f} KB; "
             f"wall time {extra['wall_s']:.1f} s.", "",
             "| outcome | requests | seconds to answer p50 | p99 |", "|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['kind']} | {s['requests']} | {s['p50_s']:.2f} | {s['p99_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=3000, help="requests sent at once, one connection each")
    p.add_argument("--idle-clients", type=int, default=0,
                   help="keep-alive clients that send one request first and then hold their connections idle")
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (holds each request this long)")
    p.add_argument("--sim-speed", type=float, default=4.0, help="sim backends' speed factor (--sim-speed)")
    p.add_argument("--nofile", type=int, default=4096, help="open-files limit (soft = hard) of every server process")
    p.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    p.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. '--max-in-flight 0'")
    p.add_argument("--src", help="run gateway and backends from this checkout (default: this one)")
    p.add_argument("--label", help="name of this run in the output (default: the code's git revision)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    raise_open_files_limit()  # the client holds --clients sockets
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < args.clients + args.idle_clients + 200:
        print(f"this process may open only {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} files; "
              f"--clients {args.clients} needs about {args.clients + 200}", file=sys.stderr)
        return 2
    src = str(Path(args.src).resolve()) if args.src else None
    label = args.label or _revision(src or str(Path(__file__).resolve().parent.parent))
    model = str(ensure_demo_model("tiny"))

    def limit():  # in each server process before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    redis = RedisServer().start()
    st = Stack(redis.url, model, lookup_deadline_ms=None)
    try:
        procs = [st.add_backend(f"b{i}", None, "--engine", "sim", "--sim-speed", str(args.sim_speed), start=False,
                                cwd=src) for i in range(args.backends)]
        procs.append(st.add_gateway(*shlex.split(args.gateway_args), start=False, cwd=src))
        for proc in procs:
            proc.preexec_fn = limit
            proc.start(st.env())
        st.wait()
        pid = st.gateway.proc.pid
        peak = [0]
        at_peak: dict = {}
        done = threading.Event()

        def watch():
            while not done.is_set():
                n = _fds(pid)
                if n > peak[0]:
                    peak[0] = n
                    at_peak.update(_sockets_by_kind(pid, st.gateway.port, redis.port) or {})
                time.sleep(0.05)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t0 = time.perf_counter()
        idle = {}
        if args.idle_clients:
            rows, idle = asyncio.run(burst_beside_idle(st.gateway.url, st.model_name, args))
        else:
            rows = asyncio.run(burst(st.gateway.url, st.model_name, args.clients, args.max_tokens, args.timeout))
        wall = time.perf_counter() - t0
        done.set()
        w.join()
        log = st.gateway.log_path.read_text(errors="replace")
    finally:
        st.stop()
        redis.cleanup()
    extra = {"gateway_peak_fds": peak[0], "sockets_at_peak": at_peak, "nofile": args.nofile, "wall_s": wall, "log_kb": len(log) / 1024,
             "resource_lines": sum(log.count(s) for s in RESOURCE_LINES), **idle}
    summary = summarize(rows)
    cmd = "python bench/overload.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    head = (f"{args.clients} chat requests at once (max_tokens {args.max_tokens}, one connection each), "
            f"{args.backends} sim backends (speed {args.sim_speed:g}), every server at {args.nofile} open files.")
    if args.idle_clients:
        head += (f" Beside {args.idle_clients} idle keep-alive clients ({idle['idle_answered']} answered first, "
                 f"{idle['idle_held']} connections then held idle, {idle['idle_closed_by_gateway']} of them closed "
                 f"by the gateway during the burst).")
    body = f"# Overload ({label})\n\nCommand: `{cmd}` (commit {revision()})\n\n{head}\n\n{table(label, summary, extra)}\n"
    print(body)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "overload" + (f"-{args.label}" if args.label else "")
    (out / f"{stem}.md").write_text(body)
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "commit": revision(), "label": label, "summary": summary, **extra},
                                                 indent=2))
    return 0


def _revision(path: str) -> str:
    import subprocess

    r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
