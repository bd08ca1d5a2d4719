"""A/B of two versions of our gateway side by side, plus the floor of a bare aiohttp hop.

One sim backend (``--sim-speed 1e9``: compute is free), one Redis, and in front
of the backend: our gateway from this checkout (``new``), our gateway from a git
revision (``base``, checked out into a temporary worktree and run from there:
``python -m`` imports from its working directory before ``PYTHONPATH``, so
before session 19, when the base ran from this checkout's directory, both
sides ran this checkout's code; `code_root` now checks each side's imports
before the run), and a pass-through aiohttp proxy that does no
work at all (``proxy``: read the body, post it on, return the answer), so the
cost of the Python hop itself is measured in the same run. Chat requests as in
``bench/overhead.py`` (every prompt distinct, ``max_tokens`` 1).

Modes:

* ``sequential``: one request at a time, the paths interleaved, the order
  alternating; p50 per path and the median of per-request ``new - base``.
* ``concurrent``: ``--concurrency`` requests at once per path, paths in
  alternating order, ``--rounds`` times.
* ``stream``: ``--stream-requests`` streamed requests per gateway of
  ``--stream-tokens`` output tokens each (one SSE event a token), gateways
  alternating, ``--stream-concurrency`` at a time; each gateway process's CPU
  time per streamed event (``psutil``), the cost of the pass-through loop.
* ``mixed``: two clients keep a gateway busy with cold 32k-token prompts while a
  third sends 100-token ones; the short requests' latency through ``base`` vs
  ``new`` (phases alternate, ``--mixed-rounds`` each). This is where holding the
  GIL during tokenization shows.

On a shared machine, compare paths within one run, not across runs.

    python bench/ab_gateways.py --base bca4793
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.provenance import revision  # noqa: E402

from bench import bare_hop  # noqa: E402
from bench.overhead import PromptMaker, filler, loadavg, long_context_copy  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402


async def _post(session, url: str, body: bytes) -> float:
    t = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t


async def _wait_answering(url: str, body: bytes, timeout: float = 30.0) -> None:
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                await _post(s, url, body)
                return
            except (aiohttp.ClientError, RuntimeError):
                if time.perf_counter() - t0 > timeout:
                    raise
                await asyncio.sleep(0.1)


def code_root(env: dict, cwd: Path) -> Path:
    """The checkout whose ``gateway/app.py`` ``python -m mlxgw`` would import when started in
    ``cwd`` with ``env`` (the directory holding ``gateway/``, resolved)."""
    out = subprocess.run([sys.executable, "-c", "import gateway.app as m; print(m.__file__)"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out).resolve().parent.parent


def _ms(x: float) -> float:
    return round(x * 1000, 2)


class Bodies:
    """Distinct chat bodies of a given rendered size (demo tokenizer), after a shared system
    message of ``system_words`` words when not 0 (agent traffic: every prompt then shares its
    first blocks, and this gateway's pending claims all fall under one first block)."""

    def __init__(self, pm: PromptMaker, system_words: int = 0):
        self.pm, self.words, self.n = pm, {}, 0
        self.system = [{"role": "system", "content": filler(system_words, 1)}] if system_words else []

    def __call__(self, tokens: int) -> bytes:
        if tokens not in self.words:
            self.words[tokens] = self.pm.words_for(tokens, 0)
        self.n += 1
        content = PromptMaker.content(9, self.n, self.words[tokens], 0)
        return json.dumps({"model": "demo-tiny", "messages": self.system + [{"role": "user", "content": content}],
                           "max_tokens": 1}).encode()


async def sequential(urls: dict, bodies: Bodies, tokens: int, n: int) -> dict:
    lat = {k: [] for k in urls}
    async with aiohttp.ClientSession() as s:
        for i in range(n + 3):
            order = list(urls) if i % 2 else list(urls)[::-1]
            for k in order:
                x = await _post(s, urls[k], bodies(tokens))
                if i >= 3:  # warm-up
                    lat[k].append(x)
    return _summary(lat)


async def concurrent(urls: dict, bodies: Bodies, tokens: int, conc: int, rounds: int) -> dict:
    lat = {k: [] for k in urls}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for rnd in range(rounds):
            for k in (list(urls) if rnd % 2 else list(urls)[::-1]):
                lat[k] += await asyncio.gather(*[_post(s, urls[k], bodies(tokens)) for _ in range(conc)])
    return _summary(lat)


async def mixed(urls: dict, bodies: Bodies, seconds: float, rounds: int) -> dict:
    lat = {"base": [], "new": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for rnd in range(rounds):
            for k in (("base", "new") if rnd % 2 else ("new", "base")):
                stop = time.perf_counter() + seconds

                async def load():
                    while time.perf_counter() < stop:
                        await _post(s, urls[k], bodies(32768))

                async def probe():
                    out = []
                    await asyncio.sleep(0.5)
                    while time.perf_counter() < stop:
                        out.append(await _post(s, urls[k], bodies(100)))
                        await asyncio.sleep(0.01)
                    return out

                lat[k] += (await asyncio.gather(load(), load(), probe()))[2]
    out = {}
    for k, xs in lat.items():
        xs.sort()
        out[k] = {"n": len(xs), "p50_ms": _ms(statistics.median(xs)), "p90_ms": _ms(xs[int(0.9 * len(xs))]),
                  "p99_ms": _ms(xs[int(0.99 * len(xs))])}
    return out


async def _stream(session, url: str, body: bytes) -> int:
    """One streamed chat request; returns the SSE data events received."""
    events = 0
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        async for line in r.content:
            events += line.startswith(b"data:")
    return events


async def streaming(urls: dict, procs: dict, bodies: "Bodies", n: int, tokens: int, conc: int, rounds: int = 4) -> dict:
    """Gateway CPU per streamed event, base vs new (see the module docstring)."""
    import psutil

    cpu = {k: 0.0 for k in procs}
    events = {k: 0 for k in procs}
    wall = {k: 0.0 for k in procs}
    per_round = max(1, n // rounds)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for rnd in range(rounds):
            for k in (list(procs) if rnd % 2 else list(procs)[::-1]):
                p = psutil.Process(procs[k])
                c0, t0 = sum(p.cpu_times()[:2]), time.perf_counter()
                sem = asyncio.Semaphore(conc)

                async def one():
                    async with sem:
                        body = json.loads(bodies(100))
                        body.update(stream=True, max_tokens=tokens)
                        return await _stream(s, urls[k], json.dumps(body).encode())

                events[k] += sum(await asyncio.gather(*[one() for _ in range(per_round)]))
                cpu[k] += sum(p.cpu_times()[:2]) - c0
                wall[k] += time.perf_counter() - t0
    return {k: {"events": events[k], "cpu_s": round(cpu[k], 3), "wall_s": round(wall[k], 3),
                "cpu_us_per_event": round(cpu[k] / max(1, events[k]) * 1e6, 2)} for k in procs}


def _summary(lat: dict) -> dict:
    d = statistics.median(lat["direct"])
    out = {k: {"n": len(v), "p50_ms": _ms(statistics.median(v)), "added_p50_ms": _ms(statistics.median(v) - d)}
           for k, v in lat.items()}
    pairs = sorted(a - b for a, b in zip(lat["new"], lat["base"]))
    out["new_minus_base"] = {"median_ms": _ms(statistics.median(pairs)),
                             "iqr_ms": [_ms(pairs[len(pairs) // 4]), _ms(pairs[3 * len(pairs) // 4])]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision of the base gateway")
    p.add_argument("--sizes", default="100,8192,32768", help="prompt sizes in tokens")
    p.add_argument("--sequential", type=int, default=40, help="requests per path and size")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="concurrent rounds per size")
    p.add_argument("--mixed-seconds", type=float, default=8.0)
    p.add_argument("--mixed-rounds", type=int, default=4)
    p.add_argument("--stream-requests", type=int, default=200, help="streamed requests per gateway")
    p.add_argument("--stream-tokens", type=int, default=256, help="output tokens per streamed request")
    p.add_argument("--stream-concurrency", type=int, default=8)
    p.add_argument("--system-words", type=int, default=0,
                   help="a shared system message of this many words before every prompt (the sizes then "
                        "count the user message only)")
    p.add_argument("--skip", default="", help="comma list: sequential,concurrent,stream,mixed")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    from mlx_lm.utils import load_tokenizer

    from mlxgw.demo_model import ensure_demo_model

    skip = set(filter(None, args.skip.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="ab-gateways-"))
    base_dir = tmp / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base_dir), args.base], check=True)
    rev = subprocess.run(["git", "-C", str(base_dir), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    model = long_context_copy(ensure_demo_model(), 65536, tmp)
    bodies = Bodies(PromptMaker(load_tokenizer(model)), args.system_words)
    redis = RedisServer().start()
    stack = Stack(redis.url, str(model), block_size=64, lookup_deadline_ms=None)
    proxy = None
    res = {"command": "python bench/ab_gateways.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": revision(), "base": rev, "load_before": loadavg(), "sequential": {}, "concurrent": {}}
    try:
        backend = stack.add_backend("b0", None, "--engine", "sim", "--sim-speed", "1e9")
        gateways = {}
        for side, root in (("new", ROOT), ("base", base_dir)):
            stack.env_extra = {"PYTHONPATH": str(root)}
            got = code_root(stack.env(), root)
            if got != root.resolve():
                raise SystemExit(f"the {side} gateway would import its code from {got}, not {root}")
            gateways[side] = stack.add_gateway(cwd=str(root))
        new, base = gateways["new"], gateways["base"]
        stack.env_extra = {}
        proxy = bare_hop.start(backend.url, stack.env())
        stack.wait()
        urls = {"direct": backend.url, "proxy": proxy.url, "base": base.url, "new": new.url}
        asyncio.run(_wait_answering(urls["proxy"], bodies(100)))
        sizes = [int(x) for x in args.sizes.split(",")]
        for n in sizes:
            if "sequential" not in skip:
                res["sequential"][n] = r = asyncio.run(sequential(urls, bodies, n, args.sequential))
                print(f"sequential {n:6d} tok: " + "  ".join(
                    f"{k} {v['p50_ms']:.2f} (+{v['added_p50_ms']:.2f})" for k, v in r.items() if k in urls)
                    + f"  | new-base per request {r['new_minus_base']['median_ms']:+.2f} ms", flush=True)
        for n in sizes:
            if "concurrent" not in skip:
                res["concurrent"][n] = r = asyncio.run(concurrent(urls, bodies, n, args.concurrency, args.rounds))
                print(f"{args.concurrency} concurrent {n:6d} tok: " + "  ".join(
                    f"{k} {v['p50_ms']:.1f}" for k, v in r.items() if k in urls), flush=True)
        if "stream" not in skip:
            res["stream"] = r = asyncio.run(streaming(
                {"base": base.url, "new": new.url}, {"base": base.proc.pid, "new": new.proc.pid}, bodies,
                args.stream_requests, args.stream_tokens, args.stream_concurrency))
            print("streamed: " + "  ".join(f"{k} {v['cpu_us_per_event']:.1f} us CPU/event ({v['events']} events, "
                                           f"{v['wall_s']:.1f} s)" for k, v in r.items()), flush=True)
        if "mixed" not in skip:
            res["mixed"] = r = asyncio.run(mixed(urls, bodies, args.mixed_seconds, args.mixed_rounds))
            print("100-token requests while two clients send cold 32k-token prompts: " + "  ".join(
                f"{k} p50/p90/p99 {v['p50_ms']:.1f}/{v['p90_ms']:.1f}/{v['p99_ms']:.1f} ms (n={v['n']})"
                for k, v in r.items()), flush=True)
    finally:
        if proxy is not None:
            proxy.stop()
        stack.stop()
        redis.cleanup()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_after"] = loadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
