"""Bursts: do prefix routing and the Redis lookup deadline survive many requests at once?

Starts Redis, ``--backends`` sim backends (cache room for every conversation, so
memory never decides) and one gateway per variant, then:

1. **warm**: ``--conversations`` agent conversations each send a first turn (a
   distinct ~``--prompt-words``-word user message), a few at a time, so each
   one's prompt is cached on one backend and owned in Redis;
2. **burst**: every conversation sends its second turn (the first turn, the
   answer, a new user message) at the same moment, one connection each.

A second turn that goes back to its conversation's backend finds its whole
first-turn prompt cached. Per variant: the burst's hit ratio (cached prompt
tokens / prompt tokens, from the answers' ``usage``), the share of second turns
sent to the backend that served the first (``X-Mlxgw-Backend``), the gateway's
lookups by status (``mlxgw:redis_lookups_total``: ``timeout`` means routing
fell back to load alone), and client latency. ``--variant NAME='FLAGS'`` adds a
gateway with extra flags (``ref='--lookup-deadline-ms 2000'`` is the run where
no lookup times out); ``--src NAME=DIR`` runs that variant's gateway from
another checkout. Variants run one after another on fresh backends, in
``--rounds`` interleaved rounds. ``--cpu-hogs N`` runs N busy-looping processes
through each variant's warm-up and burst, so Redis, the gateway and the backends
wait for a core (a machine busy with other work; helper-70 saw lookups time out
then); the warm-up's lookups are counted apart from the burst's.

    python bench/burst.py --conversations 300 --variant ref='--lookup-deadline-ms 2000'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.replay_routers import pct  # noqa: E402
from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402
from mlxgw.rlimit import raise_open_files_limit  # noqa: E402

WORDS = ("alpha beta gamma delta kernel cache block prefix token route backend gateway socket "
         "thread queue batch decode prefill layer head model agent tool file patch diff test").split()


def first_turn(i: int, words: int) -> list[dict]:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"task {i}: {text}"}]


async def _send(session, url: str, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            out = await r.json(content_type=None)
            if r.status != 200:
                return {"ok": False, "status": r.status, "seconds": time.perf_counter() - t0}
            usage = out["usage"]
            return {"ok": True, "backend": r.headers.get("X-Mlxgw-Backend"), "prompt": usage["prompt_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "answer": out["choices"][0]["message"].get("content") or "",
                    "seconds": time.perf_counter() - t0}
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return {"ok": False, "status": type(e).__name__, "seconds": time.perf_counter() - t0}


async def run_variant(url: str, model: str, n: int, words: int, warm_concurrency: int) -> dict:
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        sem = asyncio.Semaphore(warm_concurrency)

        async def warm(i):
            async with sem:
                return await _send(session, url, model, first_turn(i, words))

        at_start = await _lookups(session, url)
        firsts = await asyncio.gather(*[warm(i) for i in range(n)])
        before = await _lookups(session, url)
        seconds = [
            first_turn(i, words) + [{"role": "assistant", "content": f["answer"] or "ok"},
                                    {"role": "user", "content": f"now run the tests for task {i}"}]
            for i, f in enumerate(firsts)]
        t0 = time.perf_counter()
        burst = await asyncio.gather(*[_send(session, url, model, m) for m in seconds])
        wall = time.perf_counter() - t0
        after = await _lookups(session, url)
    ok = [b for b in burst if b["ok"]]
    home = sum(1 for f, b in zip(firsts, burst) if f["ok"] and b["ok"] and f["backend"] == b["backend"])
    lat = [b["seconds"] * 1000 for b in ok]
    return {
        "warm_errors": sum(1 for f in firsts if not f["ok"]),
        "errors": len(burst) - len(ok),
        "hit_ratio": sum(b["cached"] for b in ok) / max(1, sum(b["prompt"] for b in ok)),
        "home_share": home / max(1, len(ok)),
        "max_share": max(Counter(b["backend"] for b in ok).values(), default=0) / max(1, len(ok)),
        "lookups": {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)},
        "warm_lookups": {k: before.get(k, 0) - at_start.get(k, 0) for k in set(before) | set(at_start)},
        "latency_p50_ms": pct(lat, 50), "latency_p99_ms": pct(lat, 99), "wall_s": wall,
    }


async def _lookups(session, url: str) -> dict:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {m.group(1): float(m.group(2))
           for m in re.finditer(r'^mlxgw:redis_lookups_total\{status="(\w+)"\}\s+(\S+)', text, re.M)}
    m = re.search(r"^mlxgw:redis_lookups_stretched_total\s+(\S+)", text, re.M)  # absent before 9fac2f8
    out["stretched"] = float(m.group(1)) if m else 0.0
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=300, help="conversations, and so second turns at once")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=400, help="words in each first user message")
    p.add_argument("--warm-concurrency", type=int, default=4, help="first turns in flight at once")
    p.add_argument("--sim-speed", type=float, default=20.0, help="sim backends' speed factor")
    p.add_argument("--block-size", type=int, default=64, help="gateway and backend block size (the default 64)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="a gateway variant with extra flags; 'default' (no flags) always runs first")
    p.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                   help="run variant NAME's gateway from checkout DIR (e.g. the code before a change)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cpu-hogs", type=int, default=0, help="busy-looping processes beside each variant's run")
    p.add_argument("--label", default="", help="suffix of the output files")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    raise_open_files_limit()
    variants = {"default": []}
    for v in args.variant:
        name, _, flags = v.partition("=")
        variants[name] = shlex.split(flags)
    srcs = dict(s.partition("=")[::2] for s in args.src)
    model = str(ensure_demo_model("tiny"))
    room = ["--cache-entries", str(args.conversations * 2), "--cache-bytes", "10000GB"]
    results: dict[str, list[dict]] = {name: [] for name in variants}
    redis = RedisServer().start()
    try:
        for rnd in range(args.rounds):
            for name, flags in variants.items():
                st = Stack(redis.url, model, block_size=args.block_size, lookup_deadline_ms=None)
                try:
                    for i in range(args.backends):
                        st.add_backend(f"b{i}", None, "--engine", "sim", "--sim-speed", str(args.sim_speed), *room)
                    st.add_gateway(*flags,
                                   cwd=str(Path(srcs[name]).resolve()) if name in srcs else None)
                    st.wait()
                    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                            for _ in range(args.cpu_hogs)]
                    try:
                        r = asyncio.run(run_variant(st.gateway.url, st.model_name, args.conversations,
                                                    args.prompt_words, args.warm_concurrency))
                    finally:
                        for h in hogs:
                            h.kill()
                            h.wait()
                finally:
                    st.stop()
                r["round"] = rnd + 1
                results[name].append(r)
                print(name, json.dumps(r), flush=True)
    finally:
        redis.cleanup()
    cmd = "python bench/burst.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    body = report(cmd, args, variants, srcs, results)
    print(body)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "burst" + (f"-{args.label}" if args.label else "")
    (out / f"{stem}.md").write_text(body)
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "commit": revision(), "variants": {k: shlex.join(v) for k, v in
                                                                               variants.items()},
                                                  "src": srcs, "results": results}, indent=2))
    return 0


def report(cmd: str, args, variants: dict, srcs: dict, results: dict) -> str:
    lines = [f"# Burst: {args.conversations} second turns at once", "", f"Command: `{cmd}` (commit {revision()})", "",
             f"{args.backends} sim backends (speed {args.sim_speed:g}, room for every conversation), block size "
             f"{args.block_size}, first user messages of {args.prompt_words} words; {args.rounds} round(s), "
             + (f"{args.cpu_hogs} busy-looping processes beside each run; " if args.cpu_hogs else "") +
             "figures per round. The gateway's default lookup deadline (50 ms; 10 ms before session 27) unless a variant's flags say otherwise.", "",
             "| variant | flags | round | hit ratio | to first turn's backend | busiest backend's share | "
             "lookups ok / timeout / error (stretched) | warm-up lookups ok / timeout | latency p50 / p99 (ms) | "
             "burst wall (s) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        flags = shlex.join(variants[name]) + (f" (from {srcs[name]})" if name in srcs else "")
        for r in rows:
            lk, wl = r["lookups"], r.get("warm_lookups", {})
            lines.append(
                f"| {name} | {flags or '(defaults)'} | {r['round']} | {r['hit_ratio']:.3f} | {r['home_share']:.3f} | "
                f"{r['max_share']:.3f} | {lk.get('ok', 0):.0f} / {lk.get('timeout', 0):.0f} / {lk.get('error', 0):.0f} "
                f"({lk.get('stretched', 0):.0f}) | {wl.get('ok', 0):.0f} / {wl.get('timeout', 0):.0f} | "
                f"{r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f} | {r['wall_s']:.2f} | "
                f"{r['errors'] + r['warm_errors']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
