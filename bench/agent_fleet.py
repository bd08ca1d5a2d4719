"""A fleet of coding agents on sim backends: closed-loop conversations sharing one system prompt.

Where a trace replay sends requests at fixed times, a fleet of agents sends each
conversation's next turn when the last one has answered (after a think time), so a
slow backend slows its agents down instead of growing a queue forever. This is the
set-up of helper-86 (session 46), who ran 16 agents of ~3k-token contexts against
two backends with the sim's default 2 GiB budget and saw one backend take every
request (16 of 16 decode slots busy, 13-26k tokens queued, p50 6-8 s) beside an
idle one for two minutes: each request's system prompt was claimed on the busy
backend by a request in flight and saved nowhere (its cache held nothing, the KV in
flight filling the budget), and an idle backend is seeded only past a *saved* prefix.

``--agents`` agents start ``--stagger`` s apart on fresh backends (all started
together, nothing cached) and run for ``--duration`` s. Each runs conversations of
``--turns-min`` to ``--turns-max`` turns: the first turn is the shared system prompt
(``--system-tokens``) and a task of its own (``--task-tokens``); each later turn adds
an answer's worth and a tool output (``--turn-tokens`` in all) to the context. Token
ids are deterministic random ids of the demo model's vocabulary, ``--sim-token-scale``
real tokens per id. Sim backends model ``mlx-community/Qwen3-4B-Instruct-2507-4bit`` on
an M4 Max (docs/sim.md) at ``--sim-speed`` (1: real time on that hardware), with
``--cache-bytes`` of KV memory each (its default is the backend's own, 2 GiB: about
14,500 tokens of that model).

Routers, side by side in each of ``--repeat`` rounds on fresh backends: ours
(``mlxgw``), ``--variant NAME='GATEWAY FLAGS'`` of ours, and ``sglang`` (the
sglang-router wheel, ``cache_aware`` with its default thresholds) when it is
installed and listed in ``--routers``. Reported per run, from the client (the sim's
answers carry ``cached_tokens``): requests answered, hit ratio, TTFT and end-to-end
p50 / p99, the busiest backend's share of requests overall and in the first quarter
of the run, the seconds until each backend took its first request, and our
gateway's route reasons (``X-Mlxgw-Route-Reason``).

    python bench/agent_fleet.py --agents 16 --backends 2 --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.replay import vocab_range  # noqa: E402
from bench.replay_routers import SglangRouter, _one, pct, sim_unit_flags  # noqa: E402
from bench.scale_out import _counters  # noqa: E402
from mlxgw import httpget  # noqa: E402
from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402
from mlxgw.rlimit import raise_open_files_limit  # noqa: E402


def _ids(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return rng.integers(lo, hi, max(1, n)).tolist()


async def agent(session, url: str, kind: str, model: str, a: int, args, lo: int, hi: int, t0: float,
                system: list[int], rows: list[dict]) -> None:
    """One agent: conversations one after another until ``args.duration`` s after ``t0``."""
    s = args.sim_token_scale
    rng = np.random.default_rng(1000 + a)
    await asyncio.sleep(a * args.stagger)
    conv = 0
    while time.perf_counter() - t0 < args.duration:
        conv += 1
        ctx = system + _ids(rng, round(args.task_tokens / s), lo, hi)
        for turn in range(int(rng.integers(args.turns_min, args.turns_max + 1))):
            sent = time.perf_counter() - t0
            if sent >= args.duration:
                return
            r = await _one(session, url, kind, model, ctx, max(1, round(args.output_tokens / s)))
            rows.append({"agent": a, "conv": conv, "turn": turn + 1, "sent": sent, "ttft": r["ttft"],
                         "e2e": r["e2e"], "cached": r["cached"], "prompt": r["prompt"], "error": r["error"],
                         "status": r["status"], "backend": r["route"].get("backend"),
                         "reason": r["route"].get("reason")})
            ctx = ctx + _ids(rng, round(args.turn_tokens / s), lo, hi)
            await asyncio.sleep(float(rng.uniform(0, args.think)))


def _requests_per_backend(st: Stack) -> dict[str, int]:
    """Requests each backend answered, from its own /health counters (`bench.scale_out._counters`)."""
    return {b.name: int(c.get("requests", 0)) for b, c in zip(st.backends, _counters(st))}


async def fleet(url: str, kind: str, model: str, args, lo: int, hi: int, join=None) -> tuple[list[dict], float, dict]:
    """Run the agents against ``url``; ``join`` (blocking, run in a thread at ``args.join_at`` s)
    starts the last backend. Returns the rows, the wall time and the join's figures (``ready``:
    s from the start to its /health answering, ``first``: to its first request, from its own
    counter sampled every 0.25 s; ``before``: every backend's request counts at ``ready``)."""
    rng = np.random.default_rng(7)
    system = _ids(rng, round(args.system_tokens / args.sim_token_scale), lo, hi)
    rows: list[dict] = []
    ev: dict = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()

        async def joiner():
            await asyncio.sleep(args.join_at)
            p, before = await asyncio.to_thread(join)
            ev["ready"], ev["before"] = time.perf_counter() - t0, before
            while time.perf_counter() - t0 < args.duration:
                n = (await asyncio.to_thread(httpget.get_json, p.url + "/health", timeout=5) or {}).get("requests", 0)
                if n:
                    ev["first"] = time.perf_counter() - t0
                    return
                await asyncio.sleep(0.25)

        await asyncio.gather(*([joiner()] if join else []),
                             *[agent(session, url, kind, model, a, args, lo, hi, t0, system, rows)
                               for a in range(args.agents)])
    return rows, time.perf_counter() - t0, ev


def summarize(rows: list[dict], wall: float, per_backend: dict[str, int], args, ev: dict) -> dict:
    """The run's figures (module docstring); ``per_backend``: requests each backend counted;
    ``ev``: the join's (`fleet`), {} without one."""
    ok = [r for r in rows if r["error"] is None and r["status"] == 200]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    named = [r for r in ok if r["backend"]]
    firsts: dict[str, float] = {}
    for r in sorted(named, key=lambda r: r["sent"]):
        firsts.setdefault(r["backend"], r["sent"])
    q1 = [r for r in named if r["sent"] < args.duration / 4]
    total = sum(per_backend.values())
    return {
        "requests": len(rows), "answered": len(ok), "errors": len(rows) - len(ok),
        "throughput_rps": len(ok) / wall if wall else 0.0,
        "hit_ratio": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "max_share": max(per_backend.values()) / total if total else 0.0,
        "max_share_q1": (max(Counter(r["backend"] for r in q1).values()) / len(q1)) if q1 else None,
        "first_request_s": dict(sorted(firsts.items())),
        "per_backend": per_backend,
        "reasons": dict(Counter(r["reason"] for r in ok if r["reason"])),
        "wall_s": wall,
        **(_join_figures(rows, per_backend, ev) if ev else {}),
    }


def _join_figures(rows: list[dict], per_backend: dict[str, int], ev: dict) -> dict:
    """The joined backend (the last one): seconds from its /health answering to its first
    request (None: none), its share of the requests the backends counted after that, and
    TTFT p50 / p99 (s) of the requests sent after it."""
    joined = list(per_backend)[-1]
    after = {b: n - ev["before"].get(b, 0) for b, n in per_backend.items()}
    later = [r["ttft"] for r in rows if r["sent"] >= ev["ready"] and r["error"] is None and r["status"] == 200]
    return {"join_ready_s": ev["ready"], "join_first_s": ev["first"] - ev["ready"] if "first" in ev else None,
            "join_share": after[joined] / max(1, sum(after.values())),
            "ttft_after_join_p50_s": pct(later, 50), "ttft_after_join_p99_s": pct(later, 99)}


def run_one(name: str, kind: str, gw_flags: list[str], args, redis_url: str, model: str, lo: int, hi: int) -> dict:
    s = args.sim_token_scale
    backend_flags = ["--engine", "sim", "--sim-token-scale", str(s), "--sim-speed", str(args.sim_speed),
                     "--min-hit-tokens", str(max(1, round(1000 / s))),
                     "--prefill-step-size", str(max(1, round(512 / s))),
                     *(["--cache-bytes", args.cache_bytes] if args.cache_bytes else [])]
    st = Stack(redis_url, model, block_size=16, lookup_deadline_ms=None)
    router = None
    first = args.backends - (1 if args.join_at else 0)

    def join():
        p = st.add_backend(f"b{args.backends - 1}", None, *backend_flags)
        p.wait_healthy()
        if router is not None:  # sglang-router learns of a worker only when told
            httpget.post(router.url + "/workers", {"url": p.url}, timeout=10)
            router.wait(args.backends)
        return p, _requests_per_backend(st)

    try:
        for i in range(first):
            st.add_backend(f"b{i}", None, *backend_flags)
        if kind == "sglang":
            st.wait()
            router = SglangRouter([b.url for b in st.backends], f"fleet-{name}")
            router.wait(first)
            url = router.url
        else:
            st.add_gateway(*sim_unit_flags(s), *gw_flags)
            st.wait()
            url = st.gateway.url
        rows, wall, ev = asyncio.run(fleet(url, kind, st.model_name, args, lo, hi, join if args.join_at else None))
        per_backend = _requests_per_backend(st)
    finally:
        if router:
            router.stop()
        st.stop()
    if kind == "sglang":  # sglang-router names no backend per request: first requests from the counters only
        for r in rows:
            r["backend"] = None
    out = summarize(rows, wall, per_backend, args, ev)
    out["rows"] = rows
    return out


def report(cmd: str, args, variants: dict, results: dict) -> str:
    ms = 1000.0
    lines = [f"# Agent fleet: {args.agents} agents, {args.backends} backends, {args.duration:g} s", "",
             f"Command: `{cmd}` (commit {revision()})", "",
             f"Sim backends (speed {args.sim_speed:g}: multiply latencies by it for the cited M4 Max; "
             f"{args.sim_token_scale} real tokens per sim id; cache budget "
             f"{args.cache_bytes or 'the backend default, 2 GiB'} each), all fresh at the start; system prompt "
             f"{args.system_tokens} real tokens, task {args.task_tokens}, {args.turn_tokens} more per turn, "
             f"{args.turns_min}-{args.turns_max} turns per conversation, answers {args.output_tokens}, think "
             f"0-{args.think:g} s, agents {args.stagger:g} s apart. One line per round; latencies in ms on this "
             "machine; shares of requests from the backends' own counters (q1: the first quarter of the run, "
             "ours only); first request: seconds from the start to each backend's first request (ours only).", "",
             "| router | gateway flags | round | answered | req/s | hit ratio | TTFT p50 / p99 | E2E p50 / p99 | "
             "busiest share (q1) | per backend | first request s | route reasons | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        for r in runs:
            q1 = f"{r['max_share_q1']:.2f}" if r["max_share_q1"] is not None else "-"
            firsts = ", ".join(f"{b} {t:.1f}" for b, t in r["first_request_s"].items()) or "-"
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())) or "-"
            lines.append(
                f"| {name} | {shlex.join(variants[name][1]) or '-'} | {r['round']} | {r['answered']} | "
                f"{r['throughput_rps']:.2f} | {r['hit_ratio']:.3f} | {r['ttft_p50_s'] * ms:.0f} / "
                f"{r['ttft_p99_s'] * ms:.0f} | {r['e2e_p50_s'] * ms:.0f} / {r['e2e_p99_s'] * ms:.0f} | "
                f"{r['max_share']:.2f} ({q1}) | {', '.join(str(v) for v in r['per_backend'].values())} | "
                f"{firsts} | {reasons} | {r['errors']} |")
    if args.join_at:
        lines += ["", f"The last backend (b{args.backends - 1}) started {args.join_at:g} s into the run: seconds from "
                  "its /health answering to its first request (its own counter, sampled every 0.25 s; '-': none), "
                  f"its share of the requests after that (1/{args.backends} is even), TTFT of the requests sent "
                  "after it (ms).", "",
                  "| router | round | ready at s | first request s | share after | TTFT p50 / p99 after |",
                  "|---|---|---|---|---|---|"]
        for name, runs in results.items():
            for r in runs:
                first = f"{r['join_first_s']:.1f}" if r.get("join_first_s") is not None else "-"
                lines.append(f"| {name} | {r['round']} | {r['join_ready_s']:.1f} | {first} | {r['join_share']:.3f} | "
                             f"{r['ttft_after_join_p50_s'] * ms:.0f} / {r['ttft_after_join_p99_s'] * ms:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--duration", type=float, default=120.0, help="seconds each run sends new turns")
    p.add_argument("--stagger", type=float, default=0.1, help="seconds between agents' starts")
    p.add_argument("--system-tokens", type=int, default=1600, help="the shared system prompt, real tokens")
    p.add_argument("--task-tokens", type=int, default=80, help="each conversation's own first message")
    p.add_argument("--turn-tokens", type=int, default=400, help="added to the context each turn (answer + tool output)")
    p.add_argument("--turns-min", type=int, default=3)
    p.add_argument("--turns-max", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=16, help="each answer, real tokens")
    p.add_argument("--think", type=float, default=1.0, help="most seconds an agent waits between turns")
    p.add_argument("--join-at", type=float, default=0.0,
                   help="start the last backend this many seconds into the run (0: all at the start)")
    p.add_argument("--cache-bytes", default="", help="each backend's KV budget (default: the backend's, 2 GiB)")
    p.add_argument("--sim-token-scale", type=int, default=8, help="real tokens per sim id")
    p.add_argument("--sim-speed", type=float, default=1.0, help="sim backends' speed factor")
    p.add_argument("--routers", default="mlxgw,sglang", help="comma list: mlxgw, sglang")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="our gateway with extra flags, as router NAME")
    p.add_argument("--repeat", type=int, default=1, help="rounds; routers interleaved within each")
    p.add_argument("--label", default="", help="suffix of the output files")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    raise_open_files_limit()
    variants: dict[str, tuple[str, list[str]]] = {}
    for r in args.routers.split(","):
        if r == "sglang":
            try:
                import sglang_router  # noqa: F401
            except ImportError:
                print("sglang-router is not installed (pip install sglang-router): left out", flush=True)
                continue
        variants[r] = ("sglang" if r == "sglang" else "mlxgw", [])
    for spec in args.variant:
        name, _, flags = spec.partition("=")
        variants[name] = ("mlxgw", shlex.split(flags))
    model = str(ensure_demo_model("tiny"))
    lo, hi = vocab_range(model)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    redis = RedisServer().start()
    try:
        for rnd in range(args.repeat):
            for name, (kind, flags) in variants.items():
                r = run_one(name, kind, flags, args, redis.url, model, lo, hi)
                r["round"] = rnd + 1
                results[name].append(r)
                print(name, json.dumps({k: v for k, v in r.items() if k != "rows"}), flush=True)
    finally:
        redis.cleanup()
    cmd = "python bench/agent_fleet.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    body = report(cmd, args, variants, results)
    print(body)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "agent-fleet" + (f"-{args.label}" if args.label else "")
    (out / f"{stem}.md").write_text(body)
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "commit": revision(), "args": vars(args),
                                                  "variants": {k: shlex.join(f) for k, (_, f) in variants.items()},
                                                  "results": results}))
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
