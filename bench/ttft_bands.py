"""TTFT by prompt-length band, per router and paired request by request, from a
``bench/replay_routers.py --dump-requests`` file.

A router's overall median TTFT can hinge on a thin band of prompt lengths when
the distribution is bimodal; this prints each band's median per router and the
median of per-request differences (same request, same round) against a
reference router.

    python bench/ttft_bands.py /tmp/syn-requests.jsonl --budget 1.0

With ``--tail IDS_PER_S`` it prints instead what the slowest 1% of each
router's requests waited for: their own prefill (uncached ids at that rate,
the sim's ``prefill_rate * sim_speed / token_scale``) and the rest, with the
least prefill any backend had queued when the request was routed.

With ``--estimate IDS_PER_S`` it prints, for our gateway's requests, the wait
the gateway predicted (prefill queued at the chosen backend, at that rate)
against the wait that followed (TTFT minus own prefill), and how often the
chosen backend was the least queued one: whether the tail comes from routing
or from what happens after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT_BANDS = (0, 128, 256, 512, 1024)  # prompt length in sim ids (x32 real tokens in the replay)


def bands_table(rows: list[dict], budget: float, routers: list[str], ref: str,
                edges: tuple[int, ...] = DEFAULT_BANDS) -> dict:
    """Per band: request count, each router's median TTFT (s), and each router's median paired
    difference to ``ref`` (s; requests answered by both in the same round).

    Returns {"bands": [(lo, hi)], "median": {router: [s | None]}, "paired": {router: [s | None]},
    "n": {router: [count]}}; ``hi`` of the last band is None (open).
    """
    by: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        if r["budget"] == budget and r["status"] == 200:
            by[(r["router"], r["round"])][r["i"]] = r
    bands = [(lo, edges[k + 1] if k + 1 < len(edges) else None) for k, lo in enumerate(edges)]

    def inside(p, band):
        return p >= band[0] and (band[1] is None or p < band[1])

    out = {"bands": bands, "median": {}, "paired": {}, "n": {}}
    for name in routers:
        med, pair, n = [], [], []
        for band in bands:
            xs = [r["ttft"] for (rt, _), reqs in by.items() if rt == name for r in reqs.values() if inside(r["prompt"], band)]
            ds = [r["ttft"] - by[(ref, rnd)][i]["ttft"] for (rt, rnd), reqs in by.items() if rt == name
                  for i, r in reqs.items() if inside(r["prompt"], band) and i in by.get((ref, rnd), {})]
            med.append(statistics.median(xs) if xs else None)
            pair.append(statistics.median(ds) if ds else None)
            n.append(len(xs))
        out["median"][name], out["paired"][name], out["n"][name] = med, pair, n
    return out


def _queued(candidates: str) -> dict[str, int]:
    """Backend id -> ``queued=N`` (ids) of a dumped candidates string."""
    out = {}
    for c in candidates.split():
        bid, _, rest = c.partition(":")
        for part in rest.split(","):
            if part.startswith("queued="):
                out[bid] = int(part.split("=", 1)[1])
    return out


def _least_queued(candidates: str) -> int | None:
    """The smallest ``queued=N`` (ids) in a dumped candidates string; None without one."""
    return min(_queued(candidates).values(), default=None)


def tail_table(rows: list[dict], budget: float, routers: list[str], ids_per_s: float, share: float = 0.01) -> dict:
    """The slowest ``share`` of each router's requests per round, pooled over rounds.

    Returns {router: {"n": count, "prefill": median own prefill s, "wait": median TTFT minus own
    prefill s, "queued": median least queued ids over the backends at routing (None when the
    router dumps no candidates), "cold": requests with nothing cached}}. Own prefill is
    ``(prompt - cached) / ids_per_s``: the time the prompt alone would take on an idle backend.
    """
    by: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        if r["budget"] == budget and r["status"] == 200 and r["router"] in routers:
            by[(r["router"], r["round"])].append(r)
    out = {}
    for name in routers:
        tail = []
        for (rt, _), reqs in by.items():
            if rt == name:
                reqs = sorted(reqs, key=lambda r: -r["ttft"])
                tail += reqs[: max(1, round(share * len(reqs)))]
        if not tail:
            continue
        pre = [(r["prompt"] - r["cached"]) / ids_per_s for r in tail]
        qs = [q for q in (_least_queued(r.get("candidates") or "") for r in tail) if q is not None]
        out[name] = {"n": len(tail), "prefill": statistics.median(pre),
                     "wait": statistics.median(r["ttft"] - p for r, p in zip(tail, pre)),
                     "queued": statistics.median(qs) if qs else None,
                     "cold": sum(1 for r in tail if r["cached"] == 0)}
    return out


def estimate_table(rows: list[dict], budget: float, router: str, ids_per_s: float, share: float = 0.01) -> dict:
    """Predicted against actual wait for ``router``'s requests (those that dumped candidates).

    Predicted: prefill ids queued at the chosen backend when routed, / ``ids_per_s`` (s).
    Actual: TTFT minus own prefill ((prompt - cached) / ``ids_per_s``), s.
    Returns {"n", "predicted": [p50, p90], "actual": [p50, p90, p99], "error": [p10, p50, p90]
    (actual - predicted), "tail_n", "tail_least" (slowest ``share`` per round sent to a least
    queued backend), "tail_predicted" / "tail_actual" (their medians)}; {} without such requests.
    """
    def q(xs, f):
        xs = sorted(xs)
        return xs[int(f * (len(xs) - 1))]

    by_round: dict[int, list] = defaultdict(list)
    for r in rows:
        if r["budget"] != budget or r["router"] != router or r["status"] != 200:
            continue
        queued = _queued(r.get("candidates") or "")
        if r.get("backend") not in queued:
            continue
        own = (r["prompt"] - r["cached"]) / ids_per_s
        by_round[r["round"]].append((r["ttft"], queued[r["backend"]] / ids_per_s, r["ttft"] - own,
                                     queued[r["backend"]] == min(queued.values())))
    reqs = [x for xs in by_round.values() for x in xs]
    if not reqs:
        return {}
    tail = [x for xs in by_round.values() for x in sorted(xs, reverse=True)[: max(1, round(share * len(xs)))]]
    pred, act = [x[1] for x in reqs], [x[2] for x in reqs]
    err = [a - p for p, a in zip(pred, act)]
    return {"n": len(reqs), "predicted": [q(pred, .5), q(pred, .9)], "actual": [q(act, .5), q(act, .9), q(act, .99)],
            "error": [q(err, .1), q(err, .5), q(err, .9)], "tail_n": len(tail), "tail_least": sum(x[3] for x in tail),
            "tail_predicted": statistics.median(x[1] for x in tail), "tail_actual": statistics.median(x[2] for x in tail)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help="a --dump-requests file of bench/replay_routers.py")
    p.add_argument("--budget", type=float, default=1.0)
    p.add_argument("--routers", default="mlxgw,sglang,pooled")
    p.add_argument("--ref", default="sglang", help="router the paired differences are taken against")
    p.add_argument("--tail", type=float, metavar="IDS_PER_S",
                   help="print the slowest 1%% instead, own prefill taken at this many ids/s")
    p.add_argument("--estimate", type=float, metavar="IDS_PER_S",
                   help="print our gateway's predicted against actual wait instead (first of --routers)")
    args = p.parse_args(argv)
    rows = [json.loads(x) for x in Path(args.dump).read_text().splitlines() if x]
    routers = args.routers.split(",")
    if args.estimate:
        e = estimate_table(rows, args.budget, routers[0], args.estimate)
        if not e:
            print(f"no {routers[0]} requests with routing candidates at budget {args.budget:g}")
            return 1
        ms = lambda xs: " / ".join(f"{x * 1000:.0f}" for x in xs)  # noqa: E731
        print(f"{routers[0]}, budget {args.budget:g}, {e['n']} requests; waits in ms")
        print(f"- predicted (queued at the chosen backend) p50 / p90: {ms(e['predicted'])}")
        print(f"- actual (TTFT minus own prefill) p50 / p90 / p99: {ms(e['actual'])}")
        print(f"- actual minus predicted p10 / p50 / p90: {ms(e['error'])}")
        print(f"- slowest 1% per round: {e['tail_n']} requests, {e['tail_least']} sent to a least queued backend; "
              f"median predicted {e['tail_predicted'] * 1000:.0f}, actual {e['tail_actual'] * 1000:.0f}")
        return 0
    if args.tail:
        print(f"budget {args.budget:g}; slowest 1% of requests per round, pooled over rounds; medians")
        print("| router | requests | cold | own prefill ms | rest of TTFT ms | least queued at routing (ids) |")
        print("|---|---|---|---|---|---|")
        for name, t in tail_table(rows, args.budget, routers, args.tail).items():
            q = "-" if t["queued"] is None else f"{t['queued']:.0f}"
            print(f"| {name} | {t['n']} | {t['cold']} | {t['prefill'] * 1000:.0f} | {t['wait'] * 1000:.0f} | {q} |")
        return 0
    t = bands_table(rows, args.budget, routers, args.ref)
    head = [f"{lo}-{hi if hi is not None else ''} ids" for lo, hi in t["bands"]]
    print(f"budget {args.budget:g}; TTFT median ms (requests), and median per-request difference to {args.ref} ms")
    print("| router | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(head))
    for name in routers:
        cells = []
        for m, d, n in zip(t["median"][name], t["paired"][name], t["n"][name]):
            cells.append("-" if m is None else f"{m * 1000:.0f} ({n})" + ("" if d is None or name == args.ref else f", {d * 1000:+.1f}"))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
