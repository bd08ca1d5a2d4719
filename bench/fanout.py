"""Agent fan-outs: parallel calls sharing one long context, on sim backends.

A coding agent that fans out (parallel tool calls, sub-agents started on the
same context) sends K requests at once that share a long prefix and differ
only in a short tail. Prefix routing sends all K to the backend that owns the
prefix; once that backend runs ``--decode-concurrency`` sequences (mlx-lm's
``completion_batch_size``) the rest wait for a decode slot while the other
backends may idle. Moving a call costs a prefill of the shared context
elsewhere. This benchmark measures that trade-off.

Per round, ``--agents`` agents start ``--stagger`` seconds apart on fresh sim
backends; each agent:

1. sends its context once (``--context-tokens`` real tokens, one output token):
   the context is now cached on one backend and owned in Redis;
2. ``--fanouts`` times: sends ``--fanout`` calls at once, each the context plus
   its own ``--tail-tokens`` tail, each answering ``--output-tokens``; when
   all have answered, the context grows by a turn (one tail and one answer's
   worth of new tokens) and the next fan-out starts.

Token ids are deterministic random ids (``--sim-token-scale`` real tokens per
id, so a 16k-token context is 2,000 ids at scale 8); the sim's answers never
stop early. Sim backends model ``mlx-community/Qwen3-4B-Instruct-2507-4bit`` on
an M4 Max (docs/sim.md) ``--sim-speed`` times faster; multiply the latencies by
it for seconds on that hardware. Each backend is modelled as its own machine
(as in every sim benchmark here): several backends on one Mac share its GPU,
which this does not model.

Variants (each on fresh backends, interleaved per round): ``--variant
NAME='GATEWAY FLAGS'``, ``--backend-variant NAME='BACKEND FLAGS'`` (a name may
have both); ``default`` always runs. Gateway token settings are in sim ids
(`bench.replay_routers.sim_unit_flags` converts the defaults).

Reports per variant: fan-out makespan (first call sent to last call done)
p50 / max, per-call TTFT and end-to-end p50 / p99, the hit ratio (cached prompt
tokens / prompt tokens, from the answers' ``usage``), the share of fan-out
calls sent to the backend that served the agent's previous request, the
busiest backend's share, and wall time.

    python bench/fanout.py --variant-set slots
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.replay import vocab_range  # noqa: E402
from bench.replay_routers import _one, pct, sim_unit_flags  # noqa: E402
from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402
from mlxgw.rlimit import raise_open_files_limit  # noqa: E402


def ids(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return rng.integers(lo, hi, n).tolist()


async def call(session, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion (`bench.replay_routers._one`): TTFT / end-to-end seconds,
    cached and prompt ids, the backend that answered, and the error (None when answered)."""
    r = await _one(session, url, "mlxgw", model, prompt, max_tokens)
    err = r["error"] or (None if r["status"] == 200 else f"HTTP {r['status']}")
    return {**r, "backend": r["route"].get("backend"), "error": err}


async def agent(session, url: str, model: str, a: int, args, lo: int, hi: int, start: float) -> dict:
    await asyncio.sleep(start)
    rng = np.random.default_rng(1000 + a)
    s = args.sim_token_scale
    ctx = ids(rng, round(args.context_tokens / s), lo, hi)
    out_ids = max(1, round(args.output_tokens / s))
    tail_ids = max(1, round(args.tail_tokens / s))
    warm = await call(session, url, model, ctx, 1)
    home, calls, spans = warm["backend"], [], []
    for f in range(args.fanouts):
        tails = [ids(rng, tail_ids, lo, hi) for _ in range(args.fanout)]
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[call(session, url, model, ctx + t, out_ids) for t in tails])
        spans.append(time.perf_counter() - t0)
        for r in rs:
            r["home"] = r["backend"] == home
            r["fanout"] = f
        calls += rs
        # The agent's next turn: one call's tail and an answer's worth of ids join the context,
        # sent once (as the agent's own next request would), which also tells where it lives now.
        ctx = ctx + tails[0] + ids(rng, out_ids, lo, hi)
        nxt = await call(session, url, model, ctx, 1)
        home = nxt["backend"]
    return {"calls": calls, "spans": spans, "warm_error": warm["error"]}


async def run_variant(url: str, model: str, args, lo: int, hi: int) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        res = await asyncio.gather(*[agent(session, url, model, a, args, lo, hi, a * args.stagger)
                                     for a in range(args.agents)])
    wall = time.perf_counter() - t0
    calls = [c for r in res for c in r["calls"]]
    spans = [s for r in res for s in r["spans"]]
    ok = [c for c in calls if c["error"] is None]
    by_backend = Counter(c["backend"] for c in calls)
    return {
        "calls": len(calls), "errors": len(calls) - len(ok) + sum(r["warm_error"] is not None for r in res),
        "hit_ratio": sum(c["cached"] for c in ok) / max(1, sum(c["prompt"] for c in ok)),
        "home_share": sum(c["home"] for c in calls) / max(1, len(calls)),
        "max_share": max(by_backend.values()) / max(1, len(calls)),
        "makespan_p50_s": statistics.median(spans), "makespan_max_s": max(spans),
        "ttft_p50_s": pct([c["ttft"] for c in ok], 50), "ttft_p99_s": pct([c["ttft"] for c in ok], 99),
        "e2e_p50_s": pct([c["e2e"] for c in ok], 50), "e2e_p99_s": pct([c["e2e"] for c in ok], 99),
        "wall_s": wall, "spans_s": spans, "backends": dict(by_backend),
    }


VARIANT_SETS = {
    # decode slots (backend --decode-concurrency): 8 was the default until session 31, 16 since
    "slots": {"slots8": ("", "--decode-concurrency 8"), "slots32": ("", "--decode-concurrency 32")},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--stagger", type=float, default=0.5, help="seconds between agents' starts")
    p.add_argument("--fanout", type=int, default=12, help="calls at once per fan-out")
    p.add_argument("--fanouts", type=int, default=3, help="fan-outs per agent, the context growing between them")
    p.add_argument("--context-tokens", type=int, default=16000, help="shared context, real tokens")
    p.add_argument("--tail-tokens", type=int, default=300, help="each call's own tail, real tokens")
    p.add_argument("--output-tokens", type=int, default=400, help="each call's answer, real tokens")
    p.add_argument("--sim-token-scale", type=int, default=8, help="real tokens per sim id")
    p.add_argument("--sim-speed", type=float, default=8.0, help="sim backends' speed factor")
    p.add_argument("--decode-concurrency", type=int, help="every backend's decode slots (default: the backend's, 16)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", help="gateway flags of a variant")
    p.add_argument("--backend-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="backend flags of a variant")
    p.add_argument("--variant-set", choices=sorted(VARIANT_SETS), help="add a named set of variants")
    p.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                   help="run variant NAME's gateway from checkout DIR")
    p.add_argument("--repeat", type=int, default=1, help="rounds; variants interleaved within each")
    p.add_argument("--label", default="", help="suffix of the output files")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    raise_open_files_limit()
    variants: dict[str, tuple[list[str], list[str]]] = {"default": ([], [])}
    for name, (gw, be) in VARIANT_SETS.get(args.variant_set, {}).items():
        variants[name] = (shlex.split(gw), shlex.split(be))
    for spec, i in [(v, 0) for v in args.variant] + [(v, 1) for v in args.backend_variant]:
        name, _, flags = spec.partition("=")
        pair = list(variants.get(name, ([], [])))
        pair[i] = shlex.split(flags)
        variants[name] = tuple(pair)
    srcs = dict(s.partition("=")[::2] for s in args.src)
    model = str(ensure_demo_model("tiny"))
    lo, hi = vocab_range(model)
    s = args.sim_token_scale
    backend_flags = ["--engine", "sim", "--sim-token-scale", str(s), "--sim-speed", str(args.sim_speed),
                     "--cache-bytes", "10000GB", "--cache-entries", "1000",
                     "--min-hit-tokens", str(max(1, round(1000 / s))), "--prefill-step-size", str(max(1, round(512 / s))),
                     *(["--decode-concurrency", str(args.decode_concurrency)] if args.decode_concurrency else [])]
    results: dict[str, list[dict]] = {name: [] for name in variants}
    redis = RedisServer().start()
    try:
        for rnd in range(args.repeat):
            for name, (gw, be) in variants.items():
                st = Stack(redis.url, model, block_size=16, lookup_deadline_ms=None)
                try:
                    for i in range(args.backends):
                        st.add_backend(f"b{i}", None, *backend_flags, *be)
                    st.add_gateway(*sim_unit_flags(s), *gw,
                                   cwd=str(Path(srcs[name]).resolve()) if name in srcs else None)
                    st.wait()
                    r = asyncio.run(run_variant(st.gateway.url, st.model_name, args, lo, hi))
                finally:
                    st.stop()
                r["round"] = rnd + 1
                results[name].append(r)
                print(name, json.dumps({k: v for k, v in r.items() if k != "spans_s"}), flush=True)
    finally:
        redis.cleanup()
    cmd = "python bench/fanout.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    body = report(cmd, args, variants, srcs, results)
    print(body)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "fanout" + (f"-{args.label}" if args.label else "")
    (out / f"{stem}.md").write_text(body)
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "commit": revision(), "args": vars(args),
                                                  "variants": {k: [shlex.join(g), shlex.join(b)]
                                                               for k, (g, b) in variants.items()},
                                                  "src": srcs, "results": results}, indent=2))
    return 0


def report(cmd: str, args, variants: dict, srcs: dict, results: dict) -> str:
    ms = 1000.0
    lines = [f"# Fan-outs: {args.agents} agents x {args.fanouts} fan-outs of {args.fanout} calls", "",
             f"Command: `{cmd}` (commit {revision()})", "",
             f"{args.backends} sim backends ({args.decode_concurrency or 'the default'} decode slots each unless a "
             f"variant says otherwise; speed {args.sim_speed:g}: multiply latencies by it for the cited M4 Max), "
             f"context {args.context_tokens} real tokens, tails {args.tail_tokens}, answers {args.output_tokens}, "
             f"{args.sim_token_scale} real tokens per sim id, agents {args.stagger:g} s apart; "
             f"{args.repeat} round(s), one line per round. Latencies in ms on this machine.", "",
             "| variant | gateway flags | backend flags | round | makespan p50 / max | TTFT p50 / p99 | "
             "E2E p50 / p99 | hit ratio | calls to the agent's backend | busiest backend's share | wall (s) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        gw, be = variants[name]
        g = (shlex.join(gw) or "-") + (f" (from {srcs[name]})" if name in srcs else "")
        for r in rows:
            lines.append(
                f"| {name} | {g} | {shlex.join(be) or '-'} | {r['round']} | {r['makespan_p50_s'] * ms:.0f} / "
                f"{r['makespan_max_s'] * ms:.0f} | {r['ttft_p50_s'] * ms:.0f} / {r['ttft_p99_s'] * ms:.0f} | "
                f"{r['e2e_p50_s'] * ms:.0f} / {r['e2e_p99_s'] * ms:.0f} | {r['hit_ratio']:.3f} | "
                f"{r['home_share']:.2f} | {r['max_share']:.2f} | {r['wall_s']:.1f} | {r['errors']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
