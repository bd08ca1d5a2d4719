"""Restarts: what a backend restart costs the next turn, with and without ``--cache-dir``.

Per round and variant, on a fresh real mlx-lm backend (default: the demo ``bench``
model; ``--model`` takes a real one on a Mac):

1. **warm**: ``--conversations`` prompts of ``--prompt-tokens`` random token ids
   each (``/v1/completions``, one output token), one after another: each is
   computed from scratch and cached;
2. **restart**: SIGTERM, wait for the exit (with ``--cache-dir`` the backend
   writes its cache first), start again, wait until healthy;
3. **next turn**: every conversation sends its prompt plus ``--turn-tokens`` new
   ids, one after another.

Variants, interleaved per round: ``cold`` (no ``--cache-dir``: the next turn
recomputes everything) and ``cache-dir``. Reports per variant: the next turn's
hit ratio (cached prompt tokens / prompt tokens, from ``usage``) and request time
p50 / mean (one output token: about its TTFT), the warm turn's for comparison,
the stop and the start seconds, and, from the backend's log, the KV bytes
written and read and the rate. The request times are this machine's (CPU); the
save and restore rates are its disk's: a Mac's prefill is faster and its SSD
too, so compare the ratio, and the KV rate against your model's prefill rate.

    python bench/restart.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack, free_port  # noqa: E402
from mlxgw.httpget import post  # noqa: E402

LINE = re.compile(r"(saved|restored) the prompt cache (?:to|from) \S+: (\d+) entries \(([\d,]+) tokens, "
                  r"([\d.]+) MiB of KV\) in ([\d.]+) s")


def _ask(url: str, model: str, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds, cached tokens, prompt tokens) of one request with one output token."""
    t0 = time.perf_counter()
    status, _, raw = post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1}, timeout=600)
    dt = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[:300]!r}")
    u = json.loads(raw)["usage"]
    return dt, u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]


def one(args, model_path: str, variant: str, round_no: int, kv_dir: Path) -> dict:
    rng = np.random.default_rng(round_no)
    convs = [rng.integers(1000, 3000, args.prompt_tokens).tolist() for _ in range(args.conversations)]
    redis = RedisServer().start()
    s = Stack(redis.url, model_path)
    flags = ["--cache-bytes", args.cache_bytes, "--prefill-step-size", "512"]
    if variant == "cache-dir":
        flags += ["--cache-dir", str(kv_dir / f"r{round_no}")]
    try:
        b = s.add_backend("b0", free_port(), *flags)
        b.wait_healthy()
        warm = [_ask(b.url, s.model_name, c) for c in convs]
        t0 = time.perf_counter()
        b.stop()
        stop_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        b.start(s.env())
        b.wait_healthy()
        start_s = time.perf_counter() - t0
        nxt = [_ask(b.url, s.model_name, c + rng.integers(1000, 3000, args.turn_tokens).tolist()) for c in convs]
        log = b.log_path.read_text()
    finally:
        s.stop()
        redis.cleanup()
    moved = {m[0]: {"entries": int(m[1]), "tokens": int(m[2].replace(",", "")), "mib": float(m[3]),
                    "seconds": float(m[4])} for m in LINE.findall(log)}
    disk = sum(f.stat().st_size for f in (kv_dir / f"r{round_no}").rglob("*") if f.is_file()) \
        if variant == "cache-dir" else 0
    return {"variant": variant, "round": round_no, "stop_s": stop_s, "start_s": start_s,
            "warm_s": [w[0] for w in warm], "next_s": [n[0] for n in nxt],
            "next_hit": sum(n[1] for n in nxt) / sum(n[2] for n in nxt),
            "warm_hit": sum(w[1] for w in warm) / sum(w[2] for w in warm),
            "saved": moved.get("saved"), "restored": moved.get("restored"), "disk_bytes": disk}


def _drop_page_cache(directory: Path) -> bool:
    """Ask the OS to forget the files' cached pages, so the restore reads the disk (POSIX
    ``posix_fadvise``; absent on macOS: False, and the restore may read memory)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def probe(tokens: int, kv_dir: Path) -> dict:
    """Save and restore one entry of ``tokens`` tokens of real KV arrays shaped like the sim's
    reference model (Qwen3-4B: 36 layers, 8 KV heads, head dim 128, bf16; 144 KiB a token)
    through `backend.persist` with the real `KVOps`; seconds and GiB/s each way, against that
    prompt's prefill at the reference machine's measured rate (docs/sim.md)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from backend import persist, sim
    from backend.cache import PromptCache

    layers, heads, dim = sim.DEFAULT_LAYERS, sim.DEFAULT_KV_HEADS, sim.DEFAULT_HEAD_DIM
    kv = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16),
                           mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16))
        kv.append(c)
    mx.eval([c.state for c in kv])
    cache = PromptCache(layout="shared")
    cache.insert(list(range(tokens)), kv, "assistant")
    d = kv_dir / "probe"
    t0 = time.perf_counter()
    persist.save(cache, d, {"probe": 1})
    save_s = time.perf_counter() - t0
    dropped = _drop_page_cache(d)
    fresh = PromptCache(layout="shared")
    t0 = time.perf_counter()
    persist.restore(fresh, d, {"probe": 1})
    restore_s = time.perf_counter() - t0
    gib = cache.nbytes / 2**30
    assert fresh.nbytes == cache.nbytes and len(fresh.entries()[0]) == tokens
    return {"tokens": tokens, "gib": gib, "save_s": save_s, "restore_s": restore_s, "page_cache_dropped": dropped,
            "save_gib_s": gib / save_s, "restore_gib_s": gib / restore_s,
            "prefill_s_reference": tokens / sim.DEFAULT_PREFILL_RATE}


def table(rows: list[dict]) -> str:
    out = ["| variant | next-turn hit ratio | next turn p50 / mean (ms) | warm turn p50 (ms) | stop (s) | start (s) "
           "| KV saved (MiB, s) | KV restored (MiB, s) | on disk (MiB) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        nxt = [x for r in rs for x in r["next_s"]]
        warm = [x for r in rs for x in r["warm_s"]]

        def span(xs, fmt="{:.2f}"):
            return fmt.format(statistics.median(xs)) + (f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})"
                                                         if len(xs) > 1 else "")

        def moved(k):
            ms = [r[k] for r in rs if r[k]]
            if not ms:
                return "-"
            return f"{statistics.median(m['mib'] for m in ms):.1f}, {span([m['seconds'] for m in ms])}"

        out.append(f"| {v} | {span([r['next_hit'] for r in rs], '{:.3f}')} | "
                   f"{statistics.median(nxt) * 1e3:.1f} / {statistics.mean(nxt) * 1e3:.1f} | "
                   f"{statistics.median(warm) * 1e3:.1f} | {span([r['stop_s'] for r in rs])} | "
                   f"{span([r['start_s'] for r in rs])} | {moved('saved')} | {moved('restored')} | "
                   f"{statistics.median(r['disk_bytes'] for r in rs) / 2**20:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the demo 'bench' model, built offline)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--turn-tokens", type=int, default=50)
    p.add_argument("--cache-bytes", default="2GB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dir", help="where the caches are written (default: the system's temp dir)")
    p.add_argument("--probe-tokens", type=int, default=16384,
                   help="tokens of reference-model KV to save and restore in the probe (0: no probe)")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    model_path = args.model or str(ensure_demo_model("bench"))
    kv_dir = Path(tempfile.mkdtemp(prefix="mlxgw-restart-kv-", dir=args.kv_dir))
    rows, probes = [], []
    try:
        for _ in range(args.rounds if args.probe_tokens else 0):
            probes.append(probe(args.probe_tokens, kv_dir))
            print(json.dumps(probes[-1]), flush=True)
        for r in range(args.rounds):
            for v in (("cold", "cache-dir") if r % 2 == 0 else ("cache-dir", "cold")):
                rows.append(one(args, model_path, v, r, kv_dir))
                print(json.dumps({k: rows[-1][k] for k in ("variant", "round", "next_hit", "stop_s", "start_s")}),
                      flush=True)
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    cmd = "python bench/restart.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = (f"# Restarts with and without --cache-dir\n\n`{cmd}` (commit {revision()})\n\nmodel {model_path}; {args.conversations} "
          f"conversations of {args.prompt_tokens} tokens, next turn +{args.turn_tokens}; {args.rounds} rounds "
          f"(median, range over rounds)\n\n{table(rows)}\n")
    if probes:
        med = {k: statistics.median(x[k] for x in probes) for k in ("gib", "save_s", "restore_s", "save_gib_s",
                                                                    "restore_gib_s", "prefill_s_reference")}
        md += (f"\nKV probe ({len(probes)} runs, median): one entry of {args.probe_tokens} tokens of Qwen3-4B-shaped "
               f"KV ({med['gib']:.2f} GiB) saved in {med['save_s']:.2f} s ({med['save_gib_s']:.2f} GiB/s) and "
               f"restored in {med['restore_s']:.2f} s ({med['restore_gib_s']:.2f} GiB/s, page cache "
               f"{'dropped first' if probes[0]['page_cache_dropped'] else 'not dropped (no posix_fadvise)'}) on "
               f"this machine's disk; computing that prompt takes {med['prefill_s_reference']:.1f} s at the "
               f"reference M4 Max's measured prefill rate ({sim.DEFAULT_PREFILL_RATE:.0f} tokens/s, docs/sim.md).\n")
    print(md)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "restart.md").write_text(md)
    (out / "restart.json").write_text(json.dumps({"command": cmd, "commit": revision(), "rows": rows, "probes": probes}, indent=1))
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    raise SystemExit(main())
