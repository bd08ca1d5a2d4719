"""Soak: a long trace replay through our gateway, watching memory and Redis grow (or not).

Replays the first ``--requests`` of a Mooncake trace (default: all of it)
through one gateway in front of ``--backends`` sim backends (the set-up of
``bench/replay_routers.py``) with a cache budget that forces evictions, and
every ``--every`` seconds samples: requests answered, the gateway's and the
backends' resident memory (RSS, MB), Redis ``used_memory`` (MB), its key
count (block keys apart) and the event stream's length. A server that keeps
something per request, per conversation or per block without bound shows it
as growth that follows the requests, not the cache budget.

    python bench/soak.py --trace ../shared/traces/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.replay_routers import _one, add_sim_replay_args, load_sim_replay, sim_backend_flags, sim_unit_flags  # noqa: E402
from mlxgw import schema  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402


def _rss_mb(proc) -> float:
    try:
        return psutil.Process(proc.pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


def sample(st: Stack, client, keys: schema.Keys, rows: list[dict], t: float) -> dict:
    """One row of the soak table (see the module docstring)."""
    blocks = sum(1 for _ in client.scan_iter(match=keys.prefix + ":blk:*", count=10000))
    ok = [r for r in rows if r["status"] == 200]
    return {"t": round(t, 1), "answered": len(ok), "errors": len(rows) - len(ok),
            "hit_ratio_so_far": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
            "gateway_rss_mb": _rss_mb(st.gateway.proc),
            "backend_rss_mb": [_rss_mb(b.proc) for b in st.backends],
            "redis_used_mb": int(client.info("memory")["used_memory"]) / 2**20,
            "redis_keys": int(client.dbsize()), "block_keys": blocks,  # SCAN may count a changing key twice
            "events": int(client.xlen(keys.events))}


async def _replay(st: Stack, client, keys, items, compress: float, every: float) -> tuple[list[dict], list[dict]]:
    rows: list[dict] = []
    samples: list[dict] = []
    t0 = time.perf_counter()
    base = items[0][0]
    url, model = st.gateway.url, st.model_name

    async def go(at_ms, prompt, mt):
        delay = (at_ms - base) / 1000 / compress - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        rows.append(await _one(session, url, "mlxgw", model, prompt, mt))

    async def sampler():
        while True:
            samples.append(await asyncio.to_thread(sample, st, client, keys, list(rows), time.perf_counter() - t0))
            await asyncio.sleep(every)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as session:
        watch = asyncio.create_task(sampler())
        await asyncio.gather(*[go(*it) for it in items])
        watch.cancel()
    samples.append(sample(st, client, keys, rows, time.perf_counter() - t0))
    return rows, samples


def table(samples: list[dict]) -> str:
    lines = ["| s | answered | errors | hit ratio so far | gateway RSS MB | backend RSS MB (max) | Redis MB | "
             "Redis keys | of them block keys | events |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in samples:
        lines.append(f"| {s['t']:.0f} | {s['answered']} | {s['errors']} | {s['hit_ratio_so_far']:.3f} | "
                     f"{s['gateway_rss_mb']:.0f} | {max(s['backend_rss_mb']):.0f} | {s['redis_used_mb']:.1f} | "
                     f"{s['redis_keys']} | {s['block_keys']} | {s['events']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_replay_args(p, requests=None, budget=0.2)
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--loops", type=int, default=1,
                   help="replay the requests this many times back to back (a longer soak; later loops "
                        "repeat earlier prompts, which the cache budget has mostly evicted)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    loaded = load_sim_replay(args)
    if loaded is None:
        return 2
    model_path, sr = loaded
    reqs = sr.reqs
    scale, speed, items = sr.scale, sr.speed, sr.items(args.loops)
    o_hit, o_total = sr.oracle_hit, sr.oracle_total
    per_backend = int(args.budget * sr.working_set / args.backends)
    head = (f"{len(items)} requests ({args.loops} x {len(reqs)}) of {Path(args.trace).name} over "
            f"{args.loops * sr.period_ms / 1000 / args.compress:.0f} s (compress "
            f"{args.compress:g}x), sim speed {speed:.1f}x, {args.backends} sim backends, cache budget {args.budget:g} "
            f"of the KV working set; oracle hit ratio {o_hit / o_total:.3f}.")
    print(head, flush=True)
    redis = RedisServer().start()
    st = Stack(redis.url, model_path, block_size=args.k, lookup_deadline_ms=None)
    try:
        for i in range(args.backends):
            st.add_backend(f"b{i}", None, *sim_backend_flags(scale, speed, per_backend))
        st.add_gateway(*sim_unit_flags(scale))
        st.wait()
        keys = schema.Keys(st.namespace, st.model_name)
        rows, samples = asyncio.run(_replay(st, redis.client(), keys, items, args.compress, args.every))
    finally:
        st.stop()
        redis.cleanup()
    cmd = "python bench/soak.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    body = f"# Soak\n\nCommand: `{cmd}` (commit {revision()})\n\n{head}\n\n{table(samples)}\n"
    print(body)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.md").write_text(body)
    (out / "soak.json").write_text(json.dumps({"command": cmd, "commit": revision(), "samples": samples}, indent=2))
    return 0 if all(r["status"] == 200 for r in rows) else 1


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
