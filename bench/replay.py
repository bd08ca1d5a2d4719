"""Replay a Mooncake trace through the gateway against real mlx-lm backends.

Each 512-token trace block becomes a deterministic block of ``--k`` real
tokens of the demo model; requests go out as token-array completions at the
trace's times divided by ``--compress``; outputs are capped at
``--max-output`` tokens so the run fits a laptop CPU.

Prints: requests, errors, the prefix-hit ratio the backends measured
(cached prompt tokens / prompt tokens, from their own counters), the oracle
ratio of the same requests (one infinite cache), and requests per backend.

    python bench/replay.py --requests 300 --backends 2
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from bench.trace import DEFAULT_TRACE, BlockMapper, load_trace, oracle_hits  # noqa: E402
from mlxgw import httpget  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402


def vocab_range(model_path: str) -> tuple[int, int]:
    """Ordinary-token id range of the model's tokenizer (below the first special/added id)."""
    tok = json.loads((Path(model_path) / "tokenizer.json").read_text())
    first_added = min((t["id"] for t in tok.get("added_tokens", [])), default=None)
    hi = first_added if first_added is not None else len(tok["model"]["vocab"])
    return 16, hi


async def _send(session, url, model, prompt, max_tokens, t_at, t0, results):
    delay = t_at - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions",
                                json={"model": model, "prompt": prompt, "max_tokens": max_tokens}) as r:
            body = await r.json(content_type=None)
            results.append({
                "status": r.status,
                "backend": r.headers.get("X-Mlxgw-Backend"),
                "matched": int(r.headers.get("X-Mlxgw-Matched-Tokens", 0)),
                "cached": ((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "prompt": len(prompt),
                "latency": time.perf_counter() - start,
            })
    except Exception as e:  # counted as an error, never dropped silently
        results.append({"status": 0, "error": repr(e), "backend": None, "prompt": len(prompt), "cached": 0,
                        "matched": 0, "latency": time.perf_counter() - start})


def _backend_totals(stack: Stack) -> dict:
    tot = Counter()
    for b in stack.backends:
        h = httpget.get_json(b.url + "/health") or {}
        tot["prompt_tokens"] += h.get("prompt_tokens", 0)
        tot["cached_tokens"] += h.get("cached_tokens", 0)
        tot["requests"] += h.get("requests", 0)
    return tot


async def replay(args) -> dict:
    """One replay of the first ``args.requests`` trace requests through a fresh stack.

    Raises:
        FileNotFoundError: the trace is missing (``main`` checks first).
    """
    from mlxgw.demo_model import ensure_demo_model

    model_path = args.model or str(ensure_demo_model("tiny"))
    reqs = load_trace(args.trace, args.requests)
    lo, hi = vocab_range(model_path)
    mapper = BlockMapper(args.k, lo, hi)
    prompts = [mapper.prompt(r.hash_ids) for r in reqs]
    o_hit, o_total = oracle_hits(reqs, args.k)

    redis = RedisServer().start()
    stack = Stack(redis.url, model_path, block_size=args.block_size, lookup_deadline_ms=None)
    extra = ["--cache-bytes", args.cache_bytes, "--cache-entries", str(args.cache_entries)]
    try:
        for i in range(args.backends):
            stack.add_backend(f"b{i}", None, *extra)
        stack.add_gateway(*shlex.split(args.gateway_args))
        stack.wait()
        # Internal token off in this harness: backends are loopback-only test processes.
        results: list[dict] = []
        t0 = time.perf_counter()
        base_ms = reqs[0].timestamp_ms
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(*[
                _send(session, stack.gateway.url, stack.model_name, p,
                      max(1, min(r.output_length, args.max_output)),
                      (r.timestamp_ms - base_ms) / 1000 / args.compress, t0, results)
                for r, p in zip(reqs, prompts)
            ])
        wall = time.perf_counter() - t0
        tot = _backend_totals(stack)
        if args.screenshot:
            from mlxgw import browser

            time.sleep(2.5)  # the dashboard samples Redis every second; let it see the last heartbeat
            browser.screenshot(stack.gateway.url + "/dashboard", Path(args.screenshot), size=(1280, 860))
    finally:
        stack.stop()
        redis.cleanup()
    errors = [r for r in results if r["status"] != 200]
    per_backend = Counter(r["backend"] for r in results if r["status"] == 200)
    return {
        "requests": len(results),
        "errors": len(errors),
        "error_samples": [e.get("error") or e["status"] for e in errors[:3]],
        "backend_hit_ratio": tot["cached_tokens"] / max(1, tot["prompt_tokens"]),
        "oracle_hit_ratio": o_hit / max(1, o_total),
        "client_cached_ratio": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
        "per_backend": dict(sorted(per_backend.items())),
        "wall_seconds": wall,
        "prompt_tokens": tot["prompt_tokens"],
        "config": {"trace": str(args.trace), "requests": args.requests, "k": args.k, "compress": args.compress,
                   "backends": args.backends, "block_size": args.block_size, "max_output": args.max_output,
                   "cache_bytes": args.cache_bytes, "cache_entries": args.cache_entries},
    }


def table(res: dict) -> str:
    share = res["per_backend"]
    rows = [
        "| metric | value |",
        "|---|---|",
        f"| requests | {res['requests']} |",
        f"| errors | {res['errors']} |",
        f"| prefix-hit ratio (backends' counters) | {res['backend_hit_ratio']:.3f} |",
        f"| oracle hit ratio (one infinite cache) | {res['oracle_hit_ratio']:.3f} |",
        f"| hit / oracle | {res['backend_hit_ratio'] / max(1e-9, res['oracle_hit_ratio']):.3f} |",
        f"| requests per backend | {', '.join(f'{k}: {v}' for k, v in share.items())} |",
        f"| max/mean request share | {share_ratio(res):.2f} |",
        f"| wall time (s) | {res['wall_seconds']:.1f} |",
    ]
    return "\n".join(rows)


def share_ratio(res: dict) -> float:
    """max/mean requests per backend over every backend of the run, idle ones included
    (1.0 = perfectly even; equal to the backend count when one took everything)."""
    share = list(res["per_backend"].values())
    n = max(res["config"]["backends"], len(share))
    return max(share) / (sum(share) / n) if share else 0.0


def compare(args) -> int:
    """Replay once per routing policy (fresh stack each) and print them side by side."""
    base = args.gateway_args
    runs = {}
    for spec in [x.strip() for x in args.policies.split(",") if x.strip()]:
        pol, _, flags = spec.partition("=")  # "label=gateway flags" runs a variant under its own label
        args.gateway_args = f"{base} {flags or '--routing-policy ' + pol}".strip()
        runs[pol] = asyncio.run(replay(args))
    cmd = "python bench/replay.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [f"`{cmd}` (commit {revision()})", "", "| policy | errors | hit ratio | oracle | hit/oracle | max/mean share | per backend | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for pol, r in runs.items():
        lines.append(
            f"| {pol} | {r['errors']} | {r['backend_hit_ratio']:.3f} | {r['oracle_hit_ratio']:.3f} | "
            f"{r['backend_hit_ratio'] / max(1e-9, r['oracle_hit_ratio']):.3f} | {share_ratio(r):.2f} | "
            f"{', '.join(f'{k}: {v}' for k, v in r['per_backend'].items())} | {r['wall_seconds']:.1f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": cmd, "commit": revision(), "runs": runs}, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for r in runs.values()) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--k", type=int, default=16, help="real tokens per 512-token trace block")
    p.add_argument("--compress", type=float, default=20.0, help="divide trace inter-arrival times by this")
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-output", type=int, default=4)
    p.add_argument("--cache-bytes", default="2GB")
    p.add_argument("--cache-entries", type=int, default=1000)
    p.add_argument("--model", help="model dir (default: the tiny demo model)")
    p.add_argument("--gateway-args", default="", help="extra flags for mlxgw gateway, one string")
    p.add_argument("--policies", default="",
                   help="comma-separated routing policies to replay side by side (e.g. longest_prefix,cache_aware); "
                        "an entry LABEL=FLAGS runs the gateway with FLAGS under that label")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--screenshot", help="after the run, save a PNG of the gateway's /dashboard here (needs chromium)")
    args = p.parse_args(argv)
    try:
        load_trace(args.trace, 1)  # missing: one clear message and exit 2, before any stack starts
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if args.policies:
        return compare(args)
    res = asyncio.run(replay(args))
    print(table(res))
    if res["error_samples"]:
        print("errors:", res["error_samples"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0 if res["errors"] == 0 else 1


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
