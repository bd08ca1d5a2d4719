"""Scale-out and restart under load: how fast a backend with an empty cache takes its share.

A trace replay (the set-up of ``bench/replay_routers.py``: sim backends, one cache
budget) in which, at ``--at`` of the replay's span, one of two events happens:

* ``join`` (default): the cluster runs on ``--backends`` - 1 backends, and a new one
  starts (it registers by URL, as a Mac added to the cluster would; sglang-router
  is told through its ``POST /workers``);
* ``restart``: backend ``b0`` is killed (SIGKILL) and started again at the same URL
  with nothing cached (sglang-router's tree still thinks it holds its prefixes).

The sim speed is chosen for ``--target-load`` of the *full* cluster, so before a
join the remaining backends run hotter. Per router (ours, ``--variant``s of ours,
``sglang``), side by side in each of ``--repeat`` rounds, from the backends' own
counters (``/health``, sampled every ``--every`` s) and the client:

* ``first request s``: from the event's backend answering ``/health`` to its first request;
* ``share``: its share of the requests the cluster took after that, overall and per
  quarter of the remaining time (1 / backends is an even share);
* hit ratio (cached / prompt tokens, backends' counters) and TTFT p50 / p99 (ms, client)
  of the requests sent after the event, and errors over the whole replay.

    python bench/scale_out.py --trace ../shared/traces/conversation_trace.jsonl --requests 1200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402
from bench.trace import TRACE_BLOCK  # noqa: E402

from bench.replay_routers import (SglangRouter, _one, add_sim_replay_args, load_sim_replay, pct,  # noqa: E402
                                  sim_backend_flags, sim_unit_flags)
from mlxgw import httpget  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402

SYSTEM_BLOCK = 10**13  # trace block ids of the shared system prompt (the trace's own are far smaller)
COUNTERS = ("requests", "prompt_tokens", "cached_tokens")


def _counters(st: Stack) -> list[dict]:
    """Each backend's cumulative counters now ({} for one not answering)."""
    out = []
    for b in st.backends:
        h = httpget.get_json(b.url + "/health", timeout=2) if b.proc and b.proc.poll() is None else None
        out.append({k: (h or {}).get(k, 0) for k in COUNTERS} if h else {})
    return out


def _delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in COUNTERS}


async def _run(st: Stack, router, urls, kind: str, items, args, flags: list[str]) -> dict:
    """Replay ``items`` with the event at ``args.at`` of the span; returns the run's figures."""
    rows: list[dict] = []
    samples: list[tuple[float, list[dict]]] = []
    base = items[0][0]
    span = (items[-1][0] - base) / 1000 / args.compress
    ev: dict = {}
    t0 = time.perf_counter()

    async def go(i, at_ms, prompt, mt):
        delay = (at_ms - base) / 1000 / args.compress - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter() - t0
        r = await _one(session, urls[0], kind, st.model_name, prompt, mt)
        r["sent"] = sent
        rows.append(r)

    def event():
        ev["at"] = time.perf_counter() - t0
        if args.event == "join":
            p = st.add_backend(f"b{args.backends - 1}", None, *flags)
        else:
            p = st.backends[0]
            p.kill()
            p.start(st.env())
        p.wait_healthy()
        ev["ready"] = time.perf_counter() - t0
        if router is not None and args.event == "join":  # sglang-router learns of it only when told
            httpget.post(router.url + "/workers", {"url": p.url}, timeout=10)
            router.wait(args.backends)
        ev["after"] = _counters(st)

    async def sampler():
        while True:
            samples.append((time.perf_counter() - t0, await asyncio.to_thread(_counters, st)))
            await asyncio.sleep(args.every)

    async def trigger():
        await asyncio.sleep(max(0.0, args.at * span))
        await asyncio.to_thread(event)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as session:
        watch = asyncio.create_task(sampler())
        await asyncio.gather(trigger(), *[go(i, *it) for i, it in enumerate(items)])
        watch.cancel()
    end = time.perf_counter() - t0
    final = _counters(st)
    return _figures(rows, samples, ev, final, end, args)


def _figures(rows, samples, ev, final, end, args) -> dict:
    """The run's figures (module docstring) from its per-request rows and counter samples."""
    new = args.backends - 1 if args.event == "join" else 0
    after = ev["after"]
    if args.event == "join":
        after = after[:new] + [{k: 0 for k in COUNTERS}]  # counted from its start
    d = [_delta(a, f) for a, f in zip(after, final)]
    took = sum(x["requests"] for x in d)
    first = next((t for t, c in samples if t >= ev["ready"] and len(c) > new and c[new].get("requests", 0)
                  > (ev["after"][new].get("requests", 0) if args.event == "restart" else 0)), None)
    quarters = []
    span = end - ev["ready"]
    for q in range(4):
        lo, hi = ev["ready"] + span * q / 4, ev["ready"] + span * (q + 1) / 4
        s_lo = next((c for t, c in samples if t >= lo and len(c) > new), None)
        s_hi = next((c for t, c in samples if t >= hi and len(c) > new), final)
        if s_lo is None:
            quarters.append(None)
            continue
        dq = [_delta(a, b) for a, b in zip(s_lo, s_hi)]
        tot = sum(x["requests"] for x in dq)
        quarters.append(dq[new]["requests"] / tot if tot else None)
    post = [r for r in rows if r["sent"] >= ev["ready"] and r["status"] == 200]
    pre = [r for r in rows if r["sent"] < ev["at"] and r["status"] == 200]
    return {
        "event_at_s": ev["at"], "ready_s": ev["ready"] - ev["at"],
        "first_request_s": (first - ev["ready"]) if first is not None else None,
        "share": d[new]["requests"] / took if took else None, "share_quarters": quarters,
        "hit_ratio_after": sum(x["cached_tokens"] for x in d) / max(1, sum(x["prompt_tokens"] for x in d)),
        "ttft_p50_after_ms": pct([r["ttft"] * 1000 for r in post], 50),
        "ttft_p99_after_ms": pct([r["ttft"] * 1000 for r in post], 99),
        "ttft_p99_before_ms": pct([r["ttft"] * 1000 for r in pre], 99),
        "requests": len(rows), "errors": sum(1 for r in rows if r["status"] != 200),
        "error_samples": [r["error"] or r["status"] for r in rows if r["status"] != 200][:3],
        "requests_after_per_backend": [x["requests"] for x in d],
    }


def run_one(name: str, args, model_path: str, redis_url: str, sr, per_backend: int) -> dict:
    """Start ``name``'s cluster, replay with the event, stop."""
    st = Stack(redis_url, model_path, block_size=args.k, lookup_deadline_ms=None)
    flags = sim_backend_flags(sr.scale, sr.speed, per_backend)
    router = None
    try:
        for i in range(args.backends - (1 if args.event == "join" else 0)):
            st.add_backend(f"b{i}", None, *flags)
        if name.startswith("mlxgw"):
            variants = dict(v.split("=", 1) for v in args.variant)
            st.add_gateway(*sim_unit_flags(sr.scale), *shlex.split(variants.get(name, "")))
        st.wait()
        if name == "sglang":
            router = SglangRouter([b.url for b in st.backends], f"scale-{name}")
            router.wait(len(st.backends))
            urls, kind = [router.url], "sglang"
        else:
            urls, kind = [st.gateway.url], "mlxgw"
        out = asyncio.run(_run(st, router, urls, kind, sr.items(), args, flags))
    finally:
        if router is not None:
            router.stop()
        st.stop()
    return {"router": name, **out}


def table(rows: list[dict], backends: int) -> str:
    """Markdown: one line per router and round."""
    lines = ["| router | round | first request s | share after (even: "
             f"{1 / backends:.2f}) | share per quarter | hit ratio after | TTFT p50 / p99 after (ms) | "
             "p99 before (ms) | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = " / ".join("-" if x is None else f"{x:.2f}" for x in r["share_quarters"])
        fr = "never" if r["first_request_s"] is None else f"{r['first_request_s']:.1f}"
        sh = "-" if r["share"] is None else f"{r['share']:.3f}"
        lines.append(f"| {r['router']} | {r['round']} | {fr} | {sh} | {q} | {r['hit_ratio_after']:.3f} | "
                     f"{r['ttft_p50_after_ms']:.0f} / {r['ttft_p99_after_ms']:.0f} | "
                     f"{r['ttft_p99_before_ms']:.0f} | {r['errors']} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Median per router over the rounds."""
    out = []
    for name in dict.fromkeys(r["router"] for r in rows):
        rs = [r for r in rows if r["router"] == name]

        def med(k):
            v = [r[k] for r in rs if r[k] is not None]
            return statistics.median(v) if v else float("nan")
        out.append(f"- {name}: share after {med('share'):.3f}, first request {med('first_request_s'):.1f} s, "
                   f"hit ratio after {med('hit_ratio_after'):.3f}, TTFT p99 after {med('ttft_p99_after_ms'):.0f} ms "
                   f"(medians of {len(rs)} rounds)")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_replay_args(p, requests=1200, budget=1.0)
    p.add_argument("--event", choices=("join", "restart"), default="join")
    p.add_argument("--at", type=float, default=0.3, help="when the event happens, as a fraction of the replay's span")
    p.add_argument("--routers", default="mlxgw,sglang", help="comma list: mlxgw, sglang, and --variant names")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="our gateway with extra flags, e.g. mlxgw-lw1='--load-weight 1' (NAME starts with mlxgw)")
    p.add_argument("--repeat", type=int, default=2, help="rounds; every router once per round")
    p.add_argument("--system-blocks", type=int, default=0,
                   help="put one shared system prompt of this many 512-token blocks before every request's "
                        "prompt (an agent tool's), so no prompt is cold anywhere the system prompt is cached")
    p.add_argument("--every", type=float, default=0.5, help="seconds between counter samples")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    loaded = load_sim_replay(args)
    if loaded is None:
        return 2
    model_path, sr = loaded
    system = [SYSTEM_BLOCK + j for j in range(args.system_blocks)]
    for r in sr.reqs:
        r.hash_ids = system + r.hash_ids
        r.input_length += len(system) * TRACE_BLOCK
    per_backend = int(args.budget * sr.working_set / args.backends)
    head = (f"{len(sr.reqs)} requests of {Path(args.trace).name} over {sr.span_s / args.compress:.0f} s (compress "
            f"{args.compress:g}x), sim speed {sr.speed:.1f}x (offered load {args.target_load:g} of {args.backends} "
            f"backends), cache budget {args.budget:g} of the KV working set ({per_backend / 2**30:.2f} GiB per "
            f"backend); event `{args.event}` at {args.at:g} of the span"
            + (f"; a shared {args.system_blocks}-block system prompt before every prompt." if system else "."))
    print(head, flush=True)
    names = args.routers.split(",")
    redis = RedisServer().start()
    rows = []
    try:
        for rnd in range(1, args.repeat + 1):
            for name in names:
                r = run_one(name, args, model_path, redis.url, sr, per_backend)
                r["round"] = rnd
                rows.append(r)
                print(table([r], args.backends).splitlines()[-1], flush=True)
    finally:
        redis.cleanup()
    cmd = "python bench/scale_out.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    body = (f"# Scale-out: {args.event}\n\nCommand: `{cmd}` (commit {revision()})\n\n{head}\n\n"
            f"{table(rows, args.backends)}\n\n{summary(rows)}\n")
    print(body)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"scale-out-{args.event}"
    (out / f"{stem}.md").write_text(body)
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "commit": revision(), "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
