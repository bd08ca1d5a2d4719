"""How much of each backend's cache budget its requests in flight take, from a replay's dump.

A backend counts the KV of its live requests against its cache budget (docs/cache-policy.md,
"Budgets"): when the prompts in flight reach the budget, every save evicts down to what is
left, and at tight budgets that empties the cache. Four backends of a quarter budget each
reach that point more often than one pooled backend with all of it, whose peaks are the sum
of four smoother ones. This reads a `bench/replay_routers.py --dump-requests` file (each
request's backend, prompt length in sim ids and end-to-end time) and the trace (arrival
times), and prints per router and round the share of the replay's time each backend had
prompts in flight above ``--above`` of its budget, and its peak as a multiple of the budget.

A request counts from its arrival to its end with its whole prompt (queued requests hold no
KV yet, so this overstates; the comparison between routers is the point).

    python bench/inflight.py --trace ../shared/traces/conversation_trace.jsonl --dump /tmp/conv-requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace import TRACE_BLOCK, load_trace  # noqa: E402


def inflight_shares(reqs, rows: dict[int, dict], budget: float, compress: float, above: float) -> dict:
    """``{backend: (share of time above, peak / budget)}`` for one router and round.

    Args:
        reqs: the trace's requests (`bench.trace.load_trace`), in the dump's order.
        rows: request index -> dump row (``backend``, ``prompt`` in sim ids, ``e2e`` seconds).
        budget: the cluster budget as a fraction of the working set.
        compress: the replay's ``--compress`` (trace times are divided by it).
        above: the fraction of a backend's budget that counts as full.
    """
    scale = statistics.median(len(reqs[i].hash_ids) * TRACE_BLOCK / max(1, r["prompt"]) for i, r in rows.items())
    ws_ids = len({h for r in reqs for h in r.hash_ids}) * TRACE_BLOCK / scale
    names = sorted({r.get("backend", "pooled") for r in rows.values()})
    cap = ws_ids * budget / len(names)
    events = []
    for i, r in rows.items():
        t0 = (reqs[i].timestamp_ms - reqs[0].timestamp_ms) / 1000 / compress
        b = r.get("backend", "pooled")
        events += [(t0, r["prompt"], b), (t0 + r["e2e"], -r["prompt"], b)]
    events.sort(key=lambda e: (e[0], e[1]))
    cur: dict = defaultdict(float)
    full: dict = defaultdict(float)
    peak: dict = defaultdict(float)
    last: dict = {}
    for t, d, b in events:
        if cur[b] > above * cap:
            full[b] += t - last.get(b, t)
        last[b] = t
        cur[b] += d
        peak[b] = max(peak[b], cur[b])
    span = max(1e-9, events[-1][0] - events[0][0])
    return {b: (full[b] / span, peak[b] / cap) for b in names}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="../shared/traces/conversation_trace.jsonl")
    p.add_argument("--dump", required=True, help="a bench/replay_routers.py --dump-requests file")
    p.add_argument("--compress", type=float, default=10.0, help="the replay's --compress")
    p.add_argument("--above", type=float, default=0.9, help="fraction of a backend's budget counted as full")
    args = p.parse_args()
    runs: dict = defaultdict(dict)
    with open(args.dump) as f:
        for line in f:
            r = json.loads(line)
            if r.get("status") == 200:
                runs[(r["budget"], r["router"], r["round"])][r["i"]] = r
    reqs = load_trace(args.trace, max(i for rows in runs.values() for i in rows) + 1)
    print(f"| budget | router | round | time share above {args.above:g} of the budget, per backend | peak / budget |")
    print("|---|---|---|---|---|")
    for (budget, router, rnd), rows in sorted(runs.items()):
        got = inflight_shares(reqs, rows, budget, args.compress, args.above)
        print(f"| {budget:g} | {router} | {rnd} | " + " / ".join(f"{s:.2f}" for s, _ in got.values())
              + " | " + " / ".join(f"{pk:.2f}" for _, pk in got.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
