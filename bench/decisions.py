"""Where two routers' cached tokens differ, by routing decision, from `replay_routers.py` dumps.

Reads the per-request dumps ``bench/replay_routers.py --dump-requests F`` writes (one JSON
object per request: budget, round, router, i, prompt, cached, ttft, reason, candidates, ...)
and prints, per run (budget, router, round): the prompt and cached tokens, the decisions by
reason (``prefix``, ``load``, ``seed``, ...) and the prefix the seeded requests left behind
(the longest ``matched`` among their candidates: what staying would have reused); then, for
each router's round against ``--base``'s same round (same budget), the cached tokens it lost and
gained request by request, and how many of the lost ones were on requests it seeded.

    python bench/decisions.py /tmp/dump.jsonl --base mlxgw

Session 55 used it to find that two gateways' shortfall on the synthetic trace was seeding
decisions (docs/routing.md, "Several gateways").
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def owner_matched(candidates: str) -> int:
    """The longest ``matched=`` among an ``X-Mlxgw-Candidates`` string's backends (tokens)."""
    best = 0
    for part in candidates.split():
        for kv in part.split(":", 1)[-1].split(","):
            if kv.startswith("matched="):
                best = max(best, int(kv.split("=", 1)[1]))
    return best


def load_runs(paths: list[str]) -> dict[tuple, dict[int, dict]]:
    """(budget, router, round) -> request index -> dumped request."""
    runs: dict[tuple, dict[int, dict]] = collections.defaultdict(dict)
    for p in paths:
        with open(p) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    runs[(r["budget"], r["router"], r["round"])][r["i"]] = r
    return runs


def summary(runs: dict[tuple, dict[int, dict]], base: str) -> list[str]:
    out = ["| budget | router | round | prompt tokens | cached tokens | decisions | seeded: prompt / owner's matched / cached |",
           "|---|---|---|---|---|---|---|"]
    for key in sorted(runs):
        reqs = runs[key].values()
        reasons = collections.Counter(r.get("reason") or "-" for r in reqs)
        seeded = [r for r in reqs if r.get("reason") == "seed"]
        out.append(f"| {key[0]:g} | {key[1]} | {key[2]} | {sum(r['prompt'] for r in reqs)} "
                   f"| {sum(r['cached'] or 0 for r in reqs)} "
                   f"| {', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))} "
                   f"| {sum(r['prompt'] for r in seeded)} / {sum(owner_matched(r.get('candidates') or '') for r in seeded)}"
                   f" / {sum(r['cached'] or 0 for r in seeded)} |")
    out += ["", f"Against {base}'s same round, request by request (cached tokens):", "",
            "| budget | router | round | lost (requests) | of it on requests seeded here | gained (requests) |",
            "|---|---|---|---|---|---|"]
    for (budget, router, rnd), reqs in sorted(runs.items()):
        ref = runs.get((budget, base, rnd))
        if router == base or ref is None:
            continue
        lost = gained = on_seed = n_lost = n_gained = 0
        for i, r in reqs.items():
            if i not in ref:
                continue
            d = (r["cached"] or 0) - (ref[i]["cached"] or 0)
            if d < 0:
                lost, n_lost = lost - d, n_lost + 1
                on_seed += -d if r.get("reason") == "seed" else 0
            elif d > 0:
                gained, n_gained = gained + d, n_gained + 1
        out.append(f"| {budget:g} | {router} | {rnd} | {lost} ({n_lost}) | {on_seed} | {gained} ({n_gained}) |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dumps", nargs="+", help="files written by replay_routers.py --dump-requests")
    p.add_argument("--base", default="mlxgw", help="the router the others are compared with (default mlxgw)")
    args = p.parse_args(argv)
    print("\n".join(summary(load_runs(args.dumps), args.base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
