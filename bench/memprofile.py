"""What the gateway's Python heap keeps between phases of a trace replay (tracemalloc).

`bench/soak.py` sees the gateway's RSS grow slowly (107 to 112 MB over 12,031
requests). This runs the gateway app in this process (as `mlxgw gateway`
would: same flags, same app) in front of ``--backends`` sim backends, replays
the trace's requests in ``--phases`` (16 at a time, as fast as they are
answered), and after each phase collects garbage and takes a tracemalloc
snapshot. It prints the traced heap after each phase and, between phases, the
25 source lines whose allocations grew most, and the object types that grew.

The client shares the process: its lines (this file, ``bench/replay_routers.py``,
aiohttp's client side, the tasks of a phase) grow with the phase length and are
not the gateway's. Slow: tracemalloc makes every allocation several times dearer
(about 8 minutes for 4,000 requests here).

    python bench/memprofile.py --trace ../shared/traces/conversation_trace.jsonl --phases 1000,4000,4000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.replay_routers import (_one, add_sim_replay_args, load_sim_replay, sim_backend_flags,  # noqa: E402
                                  sim_unit_flags)
from gateway import main as gateway_main  # noqa: E402
from gateway.app import make_app  # noqa: E402
from gateway.tokenize import load_model_info  # noqa: E402
from mlxgw.harness import RedisServer, Stack, free_port  # noqa: E402


def object_types() -> Counter:
    return Counter(type(o).__name__ for o in gc.get_objects())


async def replay(st: Stack, scale: float, items: list, phases: list[int], concurrency: int) -> list[tuple]:
    """Serve the gateway app here and send ``items`` in ``phases``; (snapshot, types, requests, errors) each."""
    port = free_port()
    p = argparse.ArgumentParser()
    gateway_main.add_arguments(p)
    cfg = gateway_main.config_from_args(p.parse_args([
        "--model", f"{st.model_name}={st.model_path}", "--redis-url", st.redis_url, "--namespace", st.namespace,
        "--block-size", str(st.block_size), "--port", str(port), *sim_unit_flags(scale)]))
    runner = web.AppRunner(make_app(cfg), access_log=None, handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.sleep(2)  # the registry refresh sees the backends
    url, sem, done, out = f"http://127.0.0.1:{port}", asyncio.Semaphore(concurrency), 0, []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(it):
                async with sem:
                    return await _one(session, url, "mlxgw", st.model_name, it[1], it[2])

            for n in phases:
                rows = await asyncio.gather(*[one(it) for it in items[done:done + n]])
                done += n
                errors = sum(r["status"] != 200 for r in rows)
                del rows
                gc.collect()
                out.append((tracemalloc.take_snapshot(), object_types(), done, errors))
                print(f"after {done} requests ({errors} errors): traced heap "
                      f"{tracemalloc.get_traced_memory()[0] / 2**20:.1f} MB", flush=True)
            report(out)  # before shutting the app down: a shutdown that hangs loses nothing
    finally:
        try:  # the 9,000-request run of record never finished this (not chased): bounded
            await asyncio.wait_for(runner.cleanup(), 30)
        except asyncio.TimeoutError:
            print("the gateway app did not shut down within 30 s; stopping anyway", flush=True)
    return out


def report(snaps: list[tuple]) -> None:
    """Print, between consecutive phases, the source lines and object types that grew most."""
    for (s1, t1, n1, _), (s2, t2, n2, _) in zip(snaps, snaps[1:]):
        print(f"\n## Growth from {n1} to {n2} requests\n")
        for stat in s2.compare_to(s1, "lineno")[:25]:
            print(stat)
        grown = sorted(((t2[k] - t1.get(k, 0), k) for k in t2), reverse=True)[:10]
        print("object types grown:", ", ".join(f"{k} {n:+d}" for n, k in grown if n > 0), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_replay_args(p, requests=None, budget=0.2)
    p.add_argument("--phases", default="1000,4000,4000", help="requests per phase, comma-separated")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--frames", type=int, default=6, help="traceback frames tracemalloc keeps")
    args = p.parse_args(argv)
    loaded = load_sim_replay(args)
    if loaded is None:
        return 2
    model_path, sr = loaded
    phases = [int(x) for x in args.phases.split(",")]
    items = sr.items(-(-sum(phases) // len(sr.reqs)))
    redis = RedisServer().start()
    st = Stack(redis.url, model_path, block_size=args.k, lookup_deadline_ms=None)
    per_backend = int(args.budget * sr.working_set / args.backends)
    try:
        for i in range(args.backends):
            st.add_backend(f"b{i}", None, *sim_backend_flags(sr.scale, sr.speed, per_backend))
        st.wait()
        load_model_info("warm-up", model_path)  # transformers' import is very slow under tracemalloc
        tracemalloc.start(args.frames)
        asyncio.run(replay(st, sr.scale, items, phases, args.concurrency))
    finally:
        st.stop()
        redis.cleanup()
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
