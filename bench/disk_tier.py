"""The disk tier (cache rule 8) on a real backend: conversations that come back after the
memory budget evicted them, with and without ``--disk-cache-bytes``.

Per round and variant, on a fresh real mlx-lm backend (default: the demo ``bench`` model;
``--model`` takes a real one on a Mac) whose ``--cache-bytes`` holds about
``--fits`` conversations: ``--conversations`` prompts of ``--prompt-tokens`` random
token ids each send their first turn one after another (each computed and cached, the
oldest evicted once memory is full), then ``--turns`` more rounds of turns, every
conversation in turn adding ``--turn-tokens`` ids: with more conversations than fit, each
turn finds its conversation evicted from memory (``none``: computed again) or on disk
(``disk``: read back; ``disk-whole``: the same with one whole file per entry, each eviction
writing the whole conversation again, ``--disk-chain-parts 1``; ``disk-nobranch``: chains that
branch off only at a part's end, ``--disk-branch-share 1``). ``--opening-tokens`` makes every
conversation start with the same ids (an agent's system prompt and tools), ``--cache-layout``
sets the backend's. Variants (``--variants``) are interleaved per round. Reports per variant: the later turns' hit ratio (cached prompt tokens / prompt tokens,
from ``usage``) and request time p50 / mean (one output token: about the TTFT), and the
backend's disk figures (with the KV bytes it wrote).

Then a probe: one entry of ``--probe-tokens`` tokens of KV shaped like the sim's reference
model (Qwen3-4B, bf16, 144 KiB a token) written and read back through the tier's own path
(`KVOps.to_host` + `write_host`, then `prefetch` + `load_kv`), the page cache dropped before the
read: this machine's rates, against that prompt's prefill at the reference M4 Max's rate.

    python bench/disk_tier.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402

from backend import sim  # noqa: E402
from backend.main import model_kv_bytes_per_token  # noqa: E402
from bench.restart import _ask, _drop_page_cache  # noqa: E402
from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack, free_port  # noqa: E402
from mlxgw.httpget import get_json  # noqa: E402


#: ``none``: no tier; ``disk``: the tier (chains of parts); ``disk-whole``: ``--disk-chain-parts 1``;
#: ``disk-nobranch``: ``--disk-branch-share 1``.
VARIANTS = ("none", "disk", "disk-whole", "disk-nobranch")


def one(args, model_path: str, variant: str, round_no: int, tier_dir: Path, kv_per_token: int) -> dict:
    rng = np.random.default_rng(round_no)
    opening = rng.integers(1000, 3000, args.opening_tokens).tolist()
    convs = [opening + rng.integers(1000, 3000, args.prompt_tokens - len(opening)).tolist()
             for _ in range(args.conversations)]
    # Room for `fits` conversations at their final length, plus one in flight.
    final = args.prompt_tokens + args.turns * args.turn_tokens + 2 * (args.turns + 1)
    budget = int(kv_per_token * final * (args.fits + 1))
    flags = ["--cache-bytes", str(budget), "--prefill-step-size", "512"]
    if args.cache_layout:
        flags += ["--cache-layout", args.cache_layout]
    if variant.startswith("disk"):
        flags += ["--disk-cache-dir", str(tier_dir / f"{variant}-{round_no}"), "--disk-cache-bytes", "8GB"]
    if variant == "disk-whole":  # session 33's tier: one whole file per entry, rewritten at each eviction
        flags += ["--disk-chain-parts", "1"]
    if variant == "disk-nobranch":  # session 34's chains: shared only where a part ends
        flags += ["--disk-branch-share", "1"]
    redis = RedisServer().start()
    s = Stack(redis.url, model_path)
    try:
        b = s.add_backend("b0", free_port(), *flags)
        b.wait_healthy()
        first = [_ask(b.url, s.model_name, c) for c in convs]
        later = []
        for _ in range(args.turns):
            for i, c in enumerate(convs):
                c += [int(x) for x in rng.integers(1000, 3000, args.turn_tokens)]
                later.append(_ask(b.url, s.model_name, c))
                c += [1]  # stands for the answer token, as the next turn would resend it
        health = get_json(b.url + "/health") or {}
    finally:
        s.stop()
        redis.cleanup()
    return {"variant": variant, "round": round_no, "budget_bytes": budget,
            "first_s": [x[0] for x in first], "later_s": [x[0] for x in later],
            "later_hit": sum(x[1] for x in later) / sum(x[2] for x in later),
            **{k: health.get(k, 0) for k in ("cache_evictions", "disk_spills", "disk_reads", "disk_read_tokens",
                                             "disk_write_bytes")}}


def probe(tokens: int, tier_dir: Path) -> dict:
    """Write and read one entry of Qwen3-4B-shaped KV through the disk tier's own path."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from backend.cache import KVOps

    ops = KVOps()
    kv = []
    for _ in range(sim.DEFAULT_LAYERS):
        c = KVCache()
        shape = (1, sim.DEFAULT_KV_HEADS, tokens, sim.DEFAULT_HEAD_DIM)
        c.update_and_fetch(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
        kv.append(c)
    mx.eval([c.state for c in kv])
    path = tier_dir / "probe.safetensors"
    t0 = time.perf_counter()
    host = ops.to_host(kv)
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ops.write_host(host, str(path))
    write_s = time.perf_counter() - t0
    dropped = _drop_page_cache(tier_dir)
    t0 = time.perf_counter()
    ops.prefetch(str(path))
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = ops.load_kv(str(path), prefetched=True)
    arrays_s = time.perf_counter() - t0
    assert got[0].offset == tokens and mx.array_equal(got[-1].keys, kv[-1].keys[..., :tokens, :]).item()
    gib = ops.host_nbytes(host) / 2**30
    path.unlink()
    return {"tokens": tokens, "gib": gib, "host_copy_s": copy_s, "write_s": write_s, "read_s": read_s,
            "to_arrays_s": arrays_s, "page_cache_dropped": dropped, "write_gib_s": gib / write_s,
            "read_gib_s": gib / read_s, "prefill_s_reference": tokens / sim.DEFAULT_PREFILL_RATE}


def table(rows: list[dict]) -> str:
    out = ["| variant | later turns' hit ratio | later turn p50 / mean (ms) | first turn p50 (ms) | budget evictions "
           "| disk writes / reads | disk MB written |", "|---|---|---|---|---|---|---|"]
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        later = [x for r in rs for x in r["later_s"]]
        hits = [r["later_hit"] for r in rs]
        out.append(f"| {v} | {statistics.median(hits):.3f} ({min(hits):.3f}-{max(hits):.3f}) | "
                   f"{statistics.median(later) * 1e3:.1f} / {statistics.mean(later) * 1e3:.1f} | "
                   f"{statistics.median(x for r in rs for x in r['first_s']) * 1e3:.1f} | "
                   f"{statistics.median(r['cache_evictions'] for r in rs):.0f} | "
                   f"{statistics.median(r['disk_spills'] for r in rs):.0f} / {statistics.median(r['disk_reads'] for r in rs):.0f} | "
                   f"{statistics.median(r.get('disk_write_bytes', 0) for r in rs) / 1e6:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the demo 'bench' model, built offline)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--fits", type=int, default=2, help="conversations the memory budget holds")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--opening-tokens", type=int, default=0,
                   help="first tokens every conversation shares (of --prompt-tokens)")
    p.add_argument("--cache-layout", choices=("shared", "whole"), help="the backend's (default: its default)")
    p.add_argument("--variants", default="none,disk,disk-whole", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--turn-tokens", type=int, default=50)
    p.add_argument("--turns", type=int, default=2, help="turns after the first, per conversation")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tier-dir", help="where the tier's files go (default: the system's temp dir)")
    p.add_argument("--probe-tokens", type=int, default=16384, help="0: no probe")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS) or not 0 <= args.opening_tokens < args.prompt_tokens:
        p.error(f"--variants are of {', '.join(VARIANTS)}; --opening-tokens below --prompt-tokens")
    model_path = args.model or str(ensure_demo_model("bench"))
    kv_per_token = model_kv_bytes_per_token(model_path)
    tier_dir = Path(tempfile.mkdtemp(prefix="mlxgw-disk-tier-", dir=args.tier_dir))
    rows, probes = [], []
    try:
        for _ in range(args.rounds if args.probe_tokens else 0):
            probes.append(probe(args.probe_tokens, tier_dir))
            print(json.dumps(probes[-1]), flush=True)
        for r in range(args.rounds):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:  # interleaved, each first in turn
                rows.append(one(args, model_path, v, r, tier_dir, kv_per_token))
                print(json.dumps({k: rows[-1][k] for k in ("variant", "round", "later_hit", "disk_reads")}), flush=True)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    cmd = "python bench/disk_tier.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = (f"# Conversations back after eviction, with and without the disk tier\n\n`{cmd}` (commit {revision()})\n\nmodel {model_path}; "
          f"{args.conversations} conversations of {args.prompt_tokens} tokens (the first {args.opening_tokens} "
          f"shared), layout {args.cache_layout or 'default'}, memory for about {args.fits}; "
          f"{args.turns} later turns each (+{args.turn_tokens} tokens, one output token); {args.rounds} rounds "
          f"(median, range over rounds)\n\n{table(rows)}\n")
    if probes:
        med = {k: statistics.median(x[k] for x in probes) for k in
               ("gib", "host_copy_s", "write_s", "read_s", "to_arrays_s", "write_gib_s", "read_gib_s",
                "prefill_s_reference")}
        md += (f"\nKV probe ({len(probes)} runs, median): one entry of {args.probe_tokens} tokens of Qwen3-4B-shaped "
               f"KV ({med['gib']:.2f} GiB) through the tier's path: host views {med['host_copy_s']:.3f} s (engine "
               f"thread), written in {med['write_s']:.2f} s ({med['write_gib_s']:.2f} GiB/s, writer thread), read in "
               f"{med['read_s']:.2f} s ({med['read_gib_s']:.2f} GiB/s, reader thread, page cache "
               f"{'dropped first' if probes[0]['page_cache_dropped'] else 'not dropped (no posix_fadvise)'}), "
               f"loaded from the page cache in {med['to_arrays_s']:.2f} s (engine thread) on this machine; computing that prompt "
               f"takes {med['prefill_s_reference']:.1f} s at the reference M4 Max's measured prefill rate "
               f"({sim.DEFAULT_PREFILL_RATE:.0f} tokens/s, docs/sim.md).\n")
    print(md)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "disk-tier.md").write_text(md)
    (out / "disk-tier.json").write_text(json.dumps({"command": cmd, "commit": revision(), "rows": rows, "probes": probes}, indent=1))
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    raise SystemExit(main())
