"""Gateway overhead alone, side by side with sglang-router, in front of an instant sim backend.

One invocation starts one simulated backend (``mlxgw backend --engine sim``
with ``--sim-speed`` 1e9, so a 32k-token prefill is modelled as ~20 µs), our
gateway, a second gateway with the token-id segment cache off
(``--token-cache-mb 0``) and ``sglang-router --policy cache_aware`` (PyPI,
default thresholds), all in front of that backend, and measures client
latency of the same chat requests (``POST /v1/chat/completions``, one user
message, ``max_tokens`` 1, not streamed) on each path:

* ``direct``: to the backend (the backend renders and tokenizes the chat);
* ``mlxgw``: through our gateway (template, tokenization, block hashing, one
  Redis lookup, ranking, msgpack forward of the token ids: the backend does
  not tokenize);
* ``sglang``: through sglang-router (it accepts the chat request, routes on
  the messages' text and forwards the JSON unchanged, so the backend
  tokenizes as in ``direct``);
* ``floor``: the gateway's own forward (msgpack with the token ids) sent by
  the client straight to the backend: what the backend costs on the
  ``mlxgw`` path;
* ``aiohttp``: through `bench/bare_hop.py`, a bare aiohttp pass-through
  proxy (no parsing, routing or Redis): the cost of the extra hop alone,
  which any aiohttp gateway pays before doing any work of its own.

"Added latency" is a path's percentile minus ``direct``'s at the same
percentile (same client request, routed vs not). Because our gateway takes
the backend's tokenization over, ``mlxgw - direct`` can be below the
gateway's own work; ``mlxgw - floor`` is all of the gateway's work.

Prompts: a chat whose rendered prompt has 100, 8k, 32k tokens of the demo
tokenizer, each request distinct (a fixed-width tag opens the message), so
every cache (ours, sglang's tree, the backend's) is cold. Sequential (one
request at a time, the paths interleaved) and 64 concurrent (64 closed-loop
clients per path, paths one after another, twice in alternating order).

Second part: the token-id segment cache on a growing agent conversation to
~30k tokens: in-process ``render_chat`` time per turn, plain vs cached, and
end to end per turn through the gateway with the cache on and off (and
direct, sglang).

Context: the demo model's config says 8192 tokens. The run makes a copy of
the demo model directory whose ``config.json`` (and
``tokenizer_config.json``'s ``model_max_length``) say ``--context`` tokens,
every other file a symlink to the original; the gateway and the sim read
their context length from there. Nothing else differs.

    python bench/overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

import aiohttp
import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench import bare_hop  # noqa: E402
from bench.replay_routers import SglangRouter  # noqa: E402
from mlxgw import schema  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402
from mlxgw.protocol import INTERNAL_FIELD  # noqa: E402

PATHS = ("direct", "mlxgw", "sglang", "floor", "aiohttp")
VOCAB = ("the of and to in is for that with on as by at from this which are be was it an or not have has but "
         "gateway backend cache prefix token router request response stream session model prompt memory latency "
         "function return value error result config server client file path import class module test run edit "
         "agent tool system user assistant search code read write list open close start stop hash block index "
         "Redis HTTP JSON Python aiohttp mlx Apple Silicon GPU CPU queue batch prefill decode").split()
PUNCT = ("", "", "", "", ",", ".", ".\n", ":", ";", "?", "!", " (x)", " `y`", "\n\n", " 42", " 3.14")


def filler(n_words: int, seed: int) -> str:
    """Deterministic English-like text with punctuation, numbers and line breaks."""
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) + rng.choice(PUNCT) for _ in range(n_words))


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_idle(threshold: float, max_wait: float) -> list[float]:
    """Wait (up to ``max_wait`` s) for the 1-minute load average to drop below ``threshold``."""
    t0 = time.time()
    while os.getloadavg()[0] > threshold and time.time() - t0 < max_wait:
        print(f"  load average {loadavg()} > {threshold}: waiting", flush=True)
        time.sleep(15)
    return loadavg()


def long_context_copy(src: Path, context: int, dst_root: Path) -> Path:
    """A copy of model dir ``src`` whose configs say ``context`` tokens; other files symlinked."""
    dst = dst_root / f"{src.name}-ctx{context}"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["max_position_embeddings"] = context
            (dst / f.name).write_text(json.dumps(cfg, indent=2))
        elif f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg["model_max_length"] = context
            (dst / f.name).write_text(json.dumps(cfg, indent=2))
        else:
            (dst / f.name).symlink_to(f.resolve())
    return dst


class PromptMaker:
    """Chat requests whose rendered prompt has about ``n`` tokens of the model's tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def count(self, content: str) -> int:
        from mlxgw.prompt import render_chat

        return len(render_chat(self.tok, [{"role": "user", "content": content}]).token_ids)

    def words_for(self, n_tokens: int, seed: int) -> int:
        """Most words of `filler` whose tagged chat renders to at most ``n_tokens`` tokens."""
        lo, hi = 1, max(2, n_tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(self.content(0, 0, mid, seed)) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def content(path_i: int, i: int, n_words: int, seed: int) -> str:
        # Fixed-width tag first: every request distinct, same token count
        # (the tokenizer splits digits one by one).
        return f"[{path_i}{i:06d}] " + filler(n_words, seed)


async def timed(session, url: str, data: bytes, ctype: str, path: str, errors: list) -> float:
    t0 = time.perf_counter()
    async with session.post(url + path, data=data, headers={"Content-Type": ctype}) as r:
        body = await r.read()
        if r.status != 200:
            errors.append(f"{r.status} {body[:200]!r}")
    return time.perf_counter() - t0


class Paths:
    """The four ways a request reaches the backend; builds each path's request bytes."""

    def __init__(self, urls: dict[str, str], model: str, tokenizer):
        self.urls = urls
        self.model = model
        self.tok = tokenizer

    def request(self, name: str, content: str) -> tuple[str, bytes, str, str]:
        """(url, body, content type, http path) of one chat request on path ``name``."""
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        if name == "floor":
            from mlxgw.prompt import render_chat

            cp = render_chat(self.tok, body["messages"])
            body[INTERNAL_FIELD] = {"prompt_ids": schema.token_bytes(cp.token_ids), "system_tokens": 0, "request_id": os.urandom(8).hex()}
            return self.urls["direct"], msgpack.packb(body, use_bin_type=True), "application/x-msgpack", \
                "/v1/chat/completions"
        return self.urls[name], json.dumps(body).encode(), "application/json", "/v1/chat/completions"


async def run_sequential(paths: Paths, names, n: int, n_words: int, seed: int, warmup: int) -> dict:
    """``n`` requests per path, one at a time, the paths interleaved (rotating order)."""
    lat = {k: [] for k in names}
    errors: list = []
    reqs = {k: [paths.request(k, PromptMaker.content(pi + 1, i, n_words, seed)) for i in range(n + warmup)]
            for pi, k in enumerate(names)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for i in range(n + warmup):
            order = names[i % len(names):] + names[: i % len(names)]
            for k in order:
                url, data, ct, p = reqs[k][i]
                t = await timed(s, url, data, ct, p, errors)
                if i >= warmup:
                    lat[k].append(t)
    return {"lat": lat, "errors": errors}


async def run_concurrent(paths: Paths, names, n: int, conc: int, n_words: int, seed: int) -> dict:
    """Per path, ``n`` requests from ``conc`` closed-loop clients; two rounds, order reversed in the second."""
    lat = {k: [] for k in names}
    errors: list = []
    half = n // 2
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for rnd, order in enumerate((list(names), list(reversed(names)))):
            for pi, k in enumerate(order):
                base = 500000 + rnd * half
                reqs = [paths.request(k, PromptMaker.content(names.index(k) + 1, base + i, n_words, seed))
                        for i in range(half)]
                # Warm the connection pool so connection setup is not measured.
                await asyncio.gather(*[timed(s, *paths.request(k, PromptMaker.content(
                    names.index(k) + 1, 900000 + rnd * 1000 + j, min(n_words, 20), seed)), errors)
                    for j in range(conc)])
                it = iter(reqs)

                async def client():
                    for url, data, ct, p in it:
                        lat[k].append(await timed(s, url, data, ct, p, errors))

                await asyncio.gather(*[client() for _ in range(conc)])
    return {"lat": lat, "errors": errors}


def median_ci95(xs: list[float]) -> tuple[float, float, float]:
    """Median of ``xs`` and a distribution-free 95% interval for it: order statistics k and
    n+1-k with k the largest such that P(Binomial(n, 1/2) < k) <= 2.5%.

    Raises:
        ValueError: fewer than 6 values (no such k exists).
    """
    n = len(xs)
    ys = sorted(xs)
    k, tail = 0, 0.0
    while True:  # tail = P(B < k + 1)
        tail += math.comb(n, k) / 2 ** n
        if tail > 0.025:
            break
        k += 1
    if k == 0:
        raise ValueError(f"need at least 6 values for a 95% interval of the median, got {n}")
    return statistics.median(ys), ys[k - 1], ys[n - k]


def paired_added(lat: dict, name: str) -> Optional[dict]:
    """Request-by-request added latency of path ``name`` over ``direct`` (ms), for the
    sequential run, where request i of every path is sent in the same interleaved round:
    ``{"median_ms", "lo_ms", "hi_ms"}`` (`median_ci95`), or None without both paths."""
    if name not in lat or "direct" not in lat or len(lat[name]) != len(lat["direct"]) or len(lat[name]) < 6:
        return None
    m, lo, hi = median_ci95([(a - d) * 1000 for a, d in zip(lat[name], lat["direct"])])
    return {"median_ms": m, "lo_ms": lo, "hi_ms": hi}


def summarize(lat: dict, paired: bool = False) -> dict:
    """Per path: n, p50/p99 ms, added p50/p99 over direct; with ``paired`` (sequential runs)
    also the per-round paired added latency (`paired_added`)."""
    out = {}
    for k, xs in lat.items():
        out[k] = {"n": len(xs), "p50_ms": pct(xs, 50) * 1000, "p99_ms": pct(xs, 99) * 1000}
    d = out.get("direct")
    for k, v in out.items():
        if d and k != "direct":
            v["added_p50_ms"] = v["p50_ms"] - d["p50_ms"]
            v["added_p99_ms"] = v["p99_ms"] - d["p99_ms"]
    if paired:
        for k in out:
            if k != "direct" and (pa := paired_added(lat, k)) is not None:
                out[k]["paired_added"] = pa
    f = out.get("floor")
    if f and "mlxgw" in out:
        out["mlxgw"]["work_p50_ms"] = out["mlxgw"]["p50_ms"] - f["p50_ms"]
        out["mlxgw"]["work_p99_ms"] = out["mlxgw"]["p99_ms"] - f["p99_ms"]
    return out


# -- growing conversation ------------------------------------------------------

def agent_conversation(target_tokens: int, tokenizer, seed: int, turn_words: int = 700) -> list[list[dict]]:
    """Turns of an agent-like chat (user task, tool call, tool result, reply) up to ``target_tokens``.

    Returns the message list sent at each turn (each ends with a user or tool message).
    """
    from mlxgw.prompt import render_chat

    msgs = [{"role": "system", "content": "You are a coding agent.\n" + filler(300, seed)}]
    turns = []
    t = 0
    while True:
        msgs.append({"role": "user", "content": filler(turn_words // 4, seed * 1000 + t)})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{t}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": f"src/f{t}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{t}", "content": filler(turn_words, seed * 1000 + 500 + t)})
        turns.append([dict(m) for m in msgs])
        if len(render_chat(tokenizer, msgs).token_ids) >= target_tokens:
            return turns
        msgs.append({"role": "assistant", "content": filler(60, seed * 1000 + 900 + t)})
        t += 1


def bench_render(tokenizer, turns, reps: int = 5) -> dict:
    """In-process ``render_chat`` per turn, plain vs segment cache; median of ``reps`` replays.

    Each replay starts a fresh cache at turn 1 and goes through the turns in
    order, so turn i finds what turns 1..i-1 left, as in a live session.
    """
    from gateway.segcache import SegmentEncoder
    from mlxgw.prompt import render_chat

    hf = tokenizer._tokenizer
    plain_ms = [[] for _ in turns]
    cached_ms = [[] for _ in turns]
    tokens = []
    for rep in range(reps):
        enc = SegmentEncoder(hf)
        for i, msgs in enumerate(turns):
            t0 = time.perf_counter()
            plain = render_chat(tokenizer, msgs)
            t1 = time.perf_counter()
            cached = render_chat(tokenizer, msgs, encode=enc.encode)
            t2 = time.perf_counter()
            assert cached.token_ids == plain.token_ids, f"segment cache differs at turn {i + 1}"
            plain_ms[i].append((t1 - t0) * 1000)
            cached_ms[i].append((t2 - t1) * 1000)
            if rep == 0:
                tokens.append(len(plain.token_ids))
    rows = [{"turn": i + 1, "tokens": tokens[i], "plain_ms": statistics.median(plain_ms[i]),
             "cached_ms": statistics.median(cached_ms[i])} for i in range(len(turns))]
    return {"rows": rows, "reps": reps, "cache": enc.stats()}


async def run_conversation(urls: dict, model: str, turns, names) -> dict:
    """Send the turns in order on each path (interleaved per turn); latency per turn and path."""
    lat = {k: [] for k in names}
    errors: list = []
    async with aiohttp.ClientSession() as s:
        for i, msgs in enumerate(turns):
            order = names[i % len(names):] + names[: i % len(names)]
            for k in order:
                body = json.dumps({"model": model, "messages": msgs, "max_tokens": 1}).encode()
                lat[k].append(await timed(s, urls[k], body, "application/json", "/v1/chat/completions", errors))
    return {"lat": lat, "errors": errors}


# -- report ---------------------------------------------------------------------

def fmt(x) -> str:
    return "" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.2f}"


def tables(res: dict) -> str:
    out = []
    for mode in ("sequential", "concurrent"):
        runs = [r for r in res["overhead"] if r["mode"] == mode]
        if not runs:
            continue
        title = "one request at a time" if mode == "sequential" else f"{res['config']['concurrency']} concurrent"
        out.append(f"\n**{title}** (ms; added = path − direct at the same percentile)\n")
        out.append("| prompt tokens | direct p50 / p99 | mlxgw p50 / p99 | sglang p50 / p99 | floor p50 / p99 "
                   "| mlxgw added p50 / p99 | sglang added p50 / p99 | bare aiohttp hop added p50 / p99 "
                   "| mlxgw work (− floor) p50 / p99 | n/path | load avg before → after |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            s = r["summary"]
            g = s.get("mlxgw", {})
            sg = s.get("sglang", {})
            hop = s.get("aiohttp", {})
            out.append(
                f"| {r['prompt_tokens']} | {fmt(s['direct']['p50_ms'])} / {fmt(s['direct']['p99_ms'])} "
                f"| {fmt(g.get('p50_ms'))} / {fmt(g.get('p99_ms'))} | {fmt(sg.get('p50_ms'))} / {fmt(sg.get('p99_ms'))} "
                f"| {fmt(s.get('floor', {}).get('p50_ms'))} / {fmt(s.get('floor', {}).get('p99_ms'))} "
                f"| **{fmt(g.get('added_p50_ms'))}** / {fmt(g.get('added_p99_ms'))} "
                f"| **{fmt(sg.get('added_p50_ms'))}** / {fmt(sg.get('added_p99_ms'))} "
                f"| {fmt(hop.get('added_p50_ms'))} / {fmt(hop.get('added_p99_ms'))} "
                f"| {fmt(g.get('work_p50_ms'))} / {fmt(g.get('work_p99_ms'))} | {s['direct']['n']} "
                f"| {r['load_before'][0]} → {r['load_after'][0]} |"
                + (f" errors: {r['errors']} {r['error_samples'][:1]}" if r["errors"] else ""))
    seq = [r for r in res["overhead"] if r["mode"] == "sequential"
           and any("paired_added" in v for v in r["summary"].values())]
    if seq:
        out.append("\n**One request at a time, paired**: added latency request by request (each path's "
                   "request i minus direct's request i, sent in the same interleaved round), median and "
                   "its distribution-free 95% interval, ms\n")
        out.append("| prompt tokens | mlxgw | sglang | bare aiohttp hop | mlxgw − sglang (difference of medians) |")
        out.append("|---|---|---|---|---|")
        for r in seq:
            s = r["summary"]
            cells = []
            for k in ("mlxgw", "sglang", "aiohttp"):
                pa = s.get(k, {}).get("paired_added")
                cells.append(f"{fmt(pa['median_ms'])} [{fmt(pa['lo_ms'])}, {fmt(pa['hi_ms'])}]" if pa else "")
            g, sg = (s.get(k, {}).get("paired_added") for k in ("mlxgw", "sglang"))
            diff = fmt(g["median_ms"] - sg["median_ms"]) if g and sg else ""
            out.append(f"| {r['prompt_tokens']} | {' | '.join(cells)} | {diff} |")
    conv = res.get("conversation")
    if conv:
        rows = conv["render"]["rows"]
        later = rows[1:]
        last = rows[-1]
        out.append(f"\n**Growing agent conversation**, {len(rows)} turns to {last['tokens']} tokens "
                   "(system prompt, then per turn: user message, tool call, tool result, assistant reply)\n")
        out.append(f"In-process `render_chat` (template + tokenization + system-prefix probe), ms, median of "
                   f"{conv['render']['reps']} replays of the conversation per turn:\n")
        out.append("| | turn 1 (cold) | turns 2+ p50 | turns 2+ max | last turn |")
        out.append("|---|---|---|---|---|")
        for k, name in (("plain_ms", "plain transformers call"), ("cached_ms", "segment cache")):
            out.append(f"| {name} | {fmt(rows[0][k])} | {fmt(statistics.median(r[k] for r in later))} "
                       f"| {fmt(max(r[k] for r in later))} | {fmt(last[k])} |")
        out.append("\n| turn | prompt tokens | plain ms | segment cache ms |\n|---|---|---|---|")
        for r in rows:
            out.append(f"| {r['turn']} | {r['tokens']} | {fmt(r['plain_ms'])} | {fmt(r['cached_ms'])} |")
        sp = statistics.median(r["plain_ms"] / r["cached_ms"] for r in later)
        out.append(f"\nSpeedup on turns 2+ (median of per-turn ratios): {sp:.1f}x; "
                   f"last turn {last['plain_ms'] / last['cached_ms']:.1f}x.\n")
        e = conv["e2e"]["summary"]
        out.append("End to end, client latency per turn through each path (ms; turns ≥ 2, "
                   f"{conv['e2e']['rounds']} conversations):\n")
        out.append(f"Errors: {conv['e2e']['errors']}.\n")
        out.append("| path | p50 | p99 | last-turn mean |")
        out.append("|---|---|---|---|")
        for k, v in e.items():
            out.append(f"| {k} | {fmt(v['p50_ms'])} | {fmt(v['p99_ms'])} | {fmt(v['last_ms'])} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,8192,32768", help="prompt sizes in tokens (demo tokenizer)")
    p.add_argument("--sequential", type=int, default=200, help="requests per path and size, one at a time")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--concurrent-requests", type=int, default=256, help="requests per path and size, concurrent")
    p.add_argument("--conv-tokens", type=int, default=30000, help="growing conversation's final size")
    p.add_argument("--conv-rounds", type=int, default=3, help="conversations replayed end to end")
    p.add_argument("--context", type=int, default=65536, help="context length of the long-context demo copy")
    p.add_argument("--sim-speed", type=float, default=1e9)
    p.add_argument("--idle-load", type=float, default=1.0, help="wait for a 1-min load average below this")
    p.add_argument("--idle-wait", type=float, default=600.0, help="...for at most this many seconds, before starting")
    p.add_argument("--skip", default="", help="comma list of parts to skip: sequential,concurrent,conversation")
    p.add_argument("--backend-args", default="", help="extra flags for the sim backend, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    from mlx_lm.utils import load_tokenizer

    from mlxgw.demo_model import ensure_demo_model

    skip = set(filter(None, args.skip.split(",")))
    cmd = "python bench/overhead.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    tmp = Path(tempfile.mkdtemp(prefix="mlxgw-overhead-"))
    model = long_context_copy(ensure_demo_model("tiny"), args.context, tmp)
    tok = load_tokenizer(model)
    maker = PromptMaker(tok)
    sizes = [int(x) for x in args.sizes.split(",")]
    plan = {}
    for n in sizes:
        w = maker.words_for(n, args.seed + n)
        counts = {maker.count(PromptMaker.content(pi, i, w, args.seed + n)) for pi in (1, 4) for i in (0, 7, 123456)}
        plan[n] = {"words": w, "tokens": sorted(counts)}
        print(f"size {n}: {w} words -> {sorted(counts)} tokens", flush=True)
    res = {"command": cmd, "commit": revision(), "config": {**vars(args), "model_copy": str(model)},
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "sglang_router": metadata.version("sglang-router"), "mlx_lm": metadata.version("mlx-lm"),
                       "transformers": metadata.version("transformers"), "tokenizers": metadata.version("tokenizers")},
           "plan": plan, "overhead": []}
    redis = RedisServer().start()
    st = Stack(redis.url, str(model), block_size=schema.DEFAULT_BLOCK_SIZE, lookup_deadline_ms=None)
    router = hop = None
    t_all = time.time()
    try:
        st.add_backend("b0", None, "--engine", "sim", "--sim-speed", str(args.sim_speed), *shlex.split(args.backend_args))
        st.add_gateway()
        st.add_gateway("--token-cache-mb", "0")
        st.wait()
        res["load_at_start"] = wait_idle(args.idle_load, args.idle_wait)
        router = SglangRouter([st.backends[0].url], "overhead")
        router.wait(1)
        hop = bare_hop.start(st.backends[0].url, st.env())
        urls = {"direct": st.backends[0].url, "mlxgw": st.gateways[0].url, "sglang": router.url,
                "mlxgw-nocache": st.gateways[1].url, "aiohttp": hop.url}
        paths = Paths(urls, st.model_name, tok)
        for mode in ("sequential", "concurrent"):
            if mode in skip:
                continue
            for n in sizes:
                before = loadavg()
                t = time.time()
                if mode == "sequential":
                    r = asyncio.run(run_sequential(paths, list(PATHS), args.sequential, plan[n]["words"],
                                                   args.seed + n, warmup=5))
                else:
                    r = asyncio.run(run_concurrent(paths, list(PATHS), args.concurrent_requests, args.concurrency,
                                                   plan[n]["words"], args.seed + n))
                row = {"mode": mode, "size": n, "prompt_tokens": "/".join(map(str, plan[n]["tokens"])),
                       "summary": summarize(r["lat"], paired=mode == "sequential"), "errors": len(r["errors"]),
                       "error_samples": r["errors"][:3], "load_before": before, "load_after": loadavg(),
                       "seconds": time.time() - t}
                res["overhead"].append(row)
                s = row["summary"]
                print(f"{mode:10s} {n:6d} tok: " + "  ".join(
                    f"{k} {v['p50_ms']:.2f}/{v['p99_ms']:.2f}" for k, v in s.items())
                    + f"  errors {row['errors']}  load {before[0]}->{row['load_after'][0]}", flush=True)
        if "conversation" not in skip:
            before = loadavg()
            turns = agent_conversation(args.conv_tokens, tok, args.seed + 1)
            render = bench_render(tok, turns)
            names = ["direct", "mlxgw", "mlxgw-nocache", "sglang"]
            lat = {k: [] for k in names}
            last = {k: [] for k in names}
            errors = []
            for rnd in range(args.conv_rounds):
                conv = agent_conversation(args.conv_tokens, tok, args.seed + 100 + rnd)
                r = asyncio.run(run_conversation(urls, st.model_name, conv, names))
                errors += r["errors"]
                for k in names:
                    lat[k] += r["lat"][k][1:]
                    last[k].append(r["lat"][k][-1])
            summ = {k: {"n": len(v), "p50_ms": pct(v, 50) * 1000, "p99_ms": pct(v, 99) * 1000,
                        "last_ms": statistics.mean(last[k]) * 1000} for k, v in lat.items()}
            res["conversation"] = {"render": render, "e2e": {"summary": summ, "rounds": args.conv_rounds,
                                                             "errors": len(errors), "error_samples": errors[:3]},
                                   "load_before": before, "load_after": loadavg()}
            print("conversation e2e:", {k: round(v["p50_ms"], 2) for k, v in summ.items()}, flush=True)
    finally:
        if router:
            router.stop()
        if hop:
            hop.stop()
        st.stop()
        redis.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    res["total_seconds"] = time.time() - t_all
    md = tables(res)
    m = res["machine"]
    head = (f"# Gateway overhead alone\n\nCommand: `{cmd}` (commit {revision()})\n\n"
            f"One sim backend (`--engine sim --sim-speed {args.sim_speed:g}`: a 32k-token prefill is modelled as "
            f"~20 µs), our gateway (block size {schema.DEFAULT_BLOCK_SIZE}, Redis lookup), sglang-router "
            f"{m['sglang_router']} `--policy cache_aware` (default thresholds), all on this machine "
            f"({m['cpus']} CPUs, {m['platform']}, Python {m['python']}); the client runs here too. "
            f"Chat requests, `max_tokens` 1, every prompt distinct (cold caches). Demo tokenizer "
            f"(transformers {m['transformers']}, tokenizers {m['tokenizers']}); context raised to {args.context} "
            f"in a copy of the demo model dir (config only). Load averages are 1-minute and include this benchmark's "
            f"own processes; at start: {res.get('load_at_start')} (the run waits up to {args.idle_wait:g} s for "
            f"< {args.idle_load:g}, then starts anyway). Run took "
            f"{res['total_seconds']:.0f} s.\n\n"
            "Paths: **direct** = chat request to the backend (it templates and tokenizes); **mlxgw** = through "
            "our gateway (it templates, tokenizes, hashes, looks up Redis, forwards token ids; the backend does "
            "not tokenize); **sglang** = through sglang-router (it takes the same chat request, routes on the "
            "messages' text and forwards the JSON; the backend tokenizes); **floor** = our gateway's msgpack "
            "forward sent straight to the backend (what the backend costs on the mlxgw path); **aiohttp** = "
            "through a bare aiohttp pass-through proxy (`bench/bare_hop.py`: the extra hop alone, no work). "
            "Added = path − direct; work = mlxgw − floor (everything the gateway does).\n")
    body = head + md + "\n"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.md").write_text(body)
    (out / "overhead.json").write_text(json.dumps(res, indent=2))
    print(body)
    errs = sum(r["errors"] for r in res["overhead"]) + (res.get("conversation") or {}).get("e2e", {}).get("errors", 0)
    return 0 if errs == 0 else 1


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
