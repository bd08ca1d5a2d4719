"""Offline model: does eviction-aware placement make four LRU caches evict like one?

No processes, no sim: the trace's 512-token blocks are the unit. Each backend
is an LRU of whole-prompt entries with a block budget (a prompt that continues
an entry replaces it, as cache-policy rule 3 lets a conversation do); a
request's hit is its longest common prefix with an entry. Routing follows the
gateway's cost rule (``prefill + load_weight * queued work``) with one FIFO
prefill queue per backend, served at a rate that makes the offered work
``--util`` of the cluster. ``pooled`` is one LRU with the whole budget and
four times the rate. ``placement`` applies the gateway's eviction-aware choice
(`gateway.route`, docs/routing.md) when the cheapest backend would evict:
among candidates with its matched prefix within ``slack`` tokens of its cost,
room first, then the oldest LRU tail (the queued-KV rule is left out: this
model's saves happen at routing time). The real replays (``bench/replay_routers.py``) decide; this model only
says how much placement could take back when nothing else moves.

    python bench/placement_model.py --trace ../shared/traces/conversation_trace.jsonl --requests 600

``--follow SRC:DST --dump FILE --budget B`` instead replays a replay's own
routing (``bench/replay_routers.py --dump-requests``) into the same LRUs and
says, per round, whether request SRC's entry is still held when request DST
arrives, and how many entries would be evicted before it: where an
``unowned`` loss against the pooled cache comes from.

    python bench/placement_model.py --trace ../shared/traces/synthetic_trace.jsonl --follow 412:518 --dump /tmp/syn-requests.jsonl --budget 0.2

``--layouts`` instead compares how the caches store prompts, pooled and on four
backends with the same routing rule: ``whole`` (one KV copy per entry, as mlx-lm's
``LRUPromptCache`` and our backend store it: a prefix shared by several entries is
held once per entry) against ``shared`` (each block held once, blocks evicted least
recently used, the deepest block of a prompt first: what a radix-tree KV store such
as SGLang's ``RadixCache`` holds with the same budget).

    python bench/placement_model.py --trace ../shared/traces/synthetic_trace.jsonl --requests 3000 --layouts
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace import TRACE_BLOCK, load_trace  # noqa: E402
from gateway.stability import common_prefix  # noqa: E402


class BlockLRU:
    """Whole-prompt entries (tuples of block ids) within ``budget`` blocks, LRU order."""

    def __init__(self, budget: float):
        self.budget = budget
        self.entries: OrderedDict[tuple, float] = OrderedDict()  # entry -> last use (s)
        self.size = 0

    def match(self, ids: tuple) -> tuple[int, tuple | None]:
        best, key = 0, None
        for k in self.entries:
            m = common_prefix(k, ids)
            if m > best:
                best, key = m, k
        return best, key

    def use(self, ids, now: float) -> int:
        """Serve ``ids`` at time ``now``: returns the blocks reused, stores the prompt, evicts."""
        m, k = self.match(ids)
        if k is not None and m == len(k):
            self.size -= len(k)
            del self.entries[k]
        elif k is not None:
            self.entries[k] = now
            self.entries.move_to_end(k)
        key = tuple(ids)
        if key not in self.entries:
            self.size += len(key)
        self.entries[key] = now
        self.entries.move_to_end(key)
        while self.size > self.budget and self.entries:
            old, _ = self.entries.popitem(last=False)
            self.size -= len(old)
        return m

    def eviction_key(self, need: int) -> tuple:
        if self.budget - self.size >= need:
            return (0, self.size)
        return (1, next(iter(self.entries.values())) if self.entries else 0.0)


class SharedBlockLRU:
    """Blocks held once however many prompts share them, within ``budget`` blocks.

    A prompt's hit is its longest run of held blocks from its start (trace hash ids chain
    their prefix, so a held id means that whole prefix was computed). Serving a prompt
    stamps each of its blocks with (time, -position); eviction takes the smallest stamp, so
    the least recently used prompt loses its last blocks first and a prefix other prompts
    still use outlives them: the leaf-first LRU of a radix tree (SGLang ``RadixCache.evict``).
    Same interface as ``BlockLRU`` for ``hit_ratio``.
    """

    def __init__(self, budget: float):
        self.budget = budget
        self.stamp: dict[int, tuple[float, int]] = {}  # block id -> (last use, -position)
        self.heap: list[tuple[float, int, int]] = []  # lazy: stale stamps are skipped
        self.size = 0

    def match(self, ids) -> tuple[int, None]:
        m = 0
        while m < len(ids) and ids[m] in self.stamp:
            m += 1
        return m, None

    def use(self, ids, now: float) -> int:
        m = self.match(ids)[0]
        for p, h in enumerate(ids):
            self.stamp[h] = (now, -p)
            heapq.heappush(self.heap, (now, -p, h))
        while len(self.stamp) > self.budget and self.heap:
            t, negp, h = heapq.heappop(self.heap)
            if self.stamp.get(h) == (t, negp):
                del self.stamp[h]
        self.size = len(self.stamp)
        return m

    def eviction_key(self, need: int) -> tuple:
        if self.budget - self.size >= need:
            return (0, self.size)
        while self.heap and self.stamp.get(self.heap[0][2]) != self.heap[0][:2]:
            heapq.heappop(self.heap)
        return (1, self.heap[0][0] if self.heap else 0.0)


LAYOUTS = {"whole": BlockLRU, "shared": SharedBlockLRU}


def hit_ratio(reqs, frac: float, pooled: bool = False, slack: float = 0.0, n: int = 4,
              util: float = 0.6, load_weight: float = 0.03, layout: str = "whole") -> float:
    """Prompt tokens reused / prompt tokens over ``reqs`` (block granularity, one token always prefilled).

    ``layout`` names the cache model (``LAYOUTS``: ``whole`` or ``shared``); ``frac`` is the
    cluster's budget as a fraction of the distinct blocks. Raises KeyError for another layout.
    """
    ws = len({h for r in reqs for h in r.hash_ids})
    lru = LAYOUTS[layout]
    caches = [lru(ws * frac)] if pooled else [lru(ws * frac / n) for _ in range(n)]
    span = max(1e-9, (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000)
    work = sum(len(r.hash_ids) * TRACE_BLOCK for r in reqs)
    rate = work / (span * n * util) * 0.5  # tokens/s per backend; hits roughly halve the work
    if pooled:
        rate *= n
    busy = [0.0] * len(caches)
    hit = total = 0
    for r in reqs:
        now = (r.timestamp_ms - reqs[0].timestamp_ms) / 1000
        ids, tokens = tuple(r.hash_ids), len(r.hash_ids) * TRACE_BLOCK
        scored = []
        for k, c in enumerate(caches):
            m = min(c.match(ids)[0] * TRACE_BLOCK, tokens - 1)
            scored.append(((tokens - m) + load_weight * max(0.0, busy[k] - now) * rate, k, m))
        scored.sort()
        j = scored[0][1]
        if slack > 0 and caches[j].eviction_key(len(ids))[0] == 1:  # only when the cheapest would evict
            near = [k for cost, k, m in scored if cost <= scored[0][0] + slack and m == scored[0][2]]
            j = min(near, key=lambda k: caches[k].eviction_key(len(ids)))
        reused = min(caches[j].use(ids, now) * TRACE_BLOCK, tokens - 1)
        busy[j] = max(busy[j], now) + (tokens - reused) / rate
        hit += reused
        total += tokens
    return hit / total


def follow(reqs, routing: dict[int, str], frac: float, src: int, dst: int) -> tuple[bool, int, int]:
    """Replay ``reqs[:dst]`` into one LRU per backend named in ``routing`` (request index ->
    backend id; one name for the pooled cache), each with ``frac`` of the distinct blocks
    divided among them, and follow request ``src``'s entry.

    Returns ``(held, older, new_blocks)``: whether the entry is still held when request
    ``dst`` arrives, how many entries of its backend would be evicted before it (0: next
    victim; -1 when not held), and the trace blocks (512 tokens each) its backend took in
    between that it did not reuse. Raises ``KeyError`` when ``routing`` lacks a request below ``dst``.
    """
    ws = len({h for r in reqs for h in r.hash_ids})
    names = sorted(set(routing[i] for i in range(dst)))
    caches = {b: BlockLRU(ws * frac / len(names)) for b in names}
    home, key, new = routing[src], tuple(reqs[src].hash_ids), 0
    for i, r in enumerate(reqs[:dst]):
        reused = caches[routing[i]].use(r.hash_ids, i)
        if i > src and routing[i] == home:
            new += len(r.hash_ids) - reused
    order = list(caches[home].entries)
    return (key in caches[home].entries, order.index(key) if key in order else -1, new)


def _follow_main(args) -> int:
    reqs = load_trace(args.trace, args.requests)
    src, dst = (int(x) for x in args.follow.split(":"))
    routes: dict[tuple, dict[int, str]] = defaultdict(dict)
    with open(args.dump) as f:
        for line in f:
            r = json.loads(line)
            if r["budget"] == args.budget and "backend" in r:
                routes[(r["router"], r["round"])][r["i"]] = r["backend"]
    print(f"| routing | held at request {dst} | entries evicted before it | new blocks on its backend since {src} |")
    print("|---|---|---|---|")
    rows = [("pooled", {i: "pooled" for i in range(dst)})]
    rows += [(f"{router} round {rnd}", routing) for (router, rnd), routing in sorted(routes.items())
             if router == args.router]
    for name, routing in rows:
        held, older, new = follow(reqs, routing, args.budget, src, dst)
        print(f"| {name} | {'yes' if held else 'no'} | {older if held else '-'} | {new} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="../shared/traces/conversation_trace.jsonl")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--budgets", default="0.05,0.2,1.0", help="cluster budgets, fractions of the distinct blocks")
    p.add_argument("--slacks", default="256,2048,8192,32768", help="placement slacks to model (tokens)")
    p.add_argument("--follow", metavar="SRC:DST", help="follow request SRC's entry up to request DST (needs --dump)")
    p.add_argument("--dump", help="a replay's --dump-requests file, whose routing --follow replays")
    p.add_argument("--budget", type=float, default=0.2, help="with --follow: the dump's budget to replay")
    p.add_argument("--router", default="mlxgw", help="with --follow: the dump's router to replay")
    p.add_argument("--layouts", action="store_true",
                   help="compare whole-prompt entries with blocks held once (pooled and 4 backends)")
    args = p.parse_args()
    if args.follow:
        if not args.dump:
            p.error("--follow needs --dump")
        return _follow_main(args)
    reqs = load_trace(args.trace, args.requests)
    if args.layouts:
        print("| budget | pooled, whole | pooled, shared | 4 backends, whole | 4 backends, shared |")
        print("|---|---|---|---|---|")
        for frac in (float(x) for x in args.budgets.split(",")):
            row = [hit_ratio(reqs, frac, pooled=pooled, layout=lay) for pooled in (True, False)
                   for lay in ("whole", "shared")]
            print(f"| {frac:g} | " + " | ".join(f"{x:.4f}" for x in row) + " |", flush=True)
        return 0
    slacks = [float(x) for x in args.slacks.split(",")]
    print("| budget | pooled | no placement | " + " | ".join(f"slack {s:g}" for s in slacks) + " |")
    print("|---" * (3 + len(slacks)) + "|")
    for frac in (float(x) for x in args.budgets.split(",")):
        row = [hit_ratio(reqs, frac, pooled=True), hit_ratio(reqs, frac)]
        row += [hit_ratio(reqs, frac, slack=s) for s in slacks]
        print(f"| {frac:g} | " + " | ".join(f"{x:.4f}" for x in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
