"""Mooncake FAST'25 traces: loading, mapping hash ids to real tokens, the oracle.

Each trace line has ``timestamp`` (ms), ``input_length`` / ``output_length``
(tokens) and ``hash_ids`` (one id per 512-token block; equal ids mean equal
blocks). The public files come from the Mooncake repository,
``FAST25-release/traces/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the trace


@dataclass
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace; ``limit`` keeps the first N lines.

    Raises:
        FileNotFoundError: with where the public file comes from.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"{p} not found: get the Mooncake traces from https://github.com/kvcache-ai/Mooncake, folder "
            "FAST25-release/traces/ (the README's Benchmarks section has the commands), or pass --trace PATH"
        )
    out = []
    with p.open() as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            d = json.loads(line)
            out.append(TraceRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                    list(d["hash_ids"])))
    return out


class BlockMapper:
    """Maps a trace hash id to a deterministic block of ``k`` token ids.

    Token ids are drawn from ``[lo, hi)`` (ordinary vocabulary, no special
    tokens) with a generator seeded by the hash id, so equal ids give equal
    blocks in every run and on every machine.
    """

    def __init__(self, k: int, lo: int, hi: int):
        self.k, self.lo, self.hi = k, lo, hi
        self._memo: dict[int, list[int]] = {}

    def block(self, h: int) -> list[int]:
        b = self._memo.get(h)
        if b is None:
            b = np.random.default_rng(h).integers(self.lo, self.hi, self.k).tolist()
            self._memo[h] = b
        return b

    def prompt(self, hash_ids: list[int]) -> list[int]:
        out: list[int] = []
        for h in hash_ids:
            out.extend(self.block(h))
        return out


def oracle_prefixes(requests: list[TraceRequest], tokens_per_block: int) -> list[int]:
    """Per request, in arrival order, the prefix tokens a single infinite cache reuses.

    A request reuses the longest prefix of its blocks that any earlier request
    had (capped at its length minus one token, as a real cache must prefill
    one). This is all the sharing the trace itself holds: anything a cache
    reuses beyond it comes from chance collisions of the token ids a block maps to.
    """
    nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: a trie of seen prefixes
    out = []
    for r in requests:
        n = len(r.hash_ids)
        depth, node, matching = 0, 0, True
        for i, h in enumerate(r.hash_ids):
            nxt = nodes.get((node, h))
            if nxt is None:
                matching = False
                nxt = nodes[(node, h)] = len(nodes) + 1
            elif matching:
                depth = i + 1
            node = nxt
        out.append(min(depth * tokens_per_block, n * tokens_per_block - 1))
    return out


def oracle_hits(requests: list[TraceRequest], tokens_per_block: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of a single infinite cache over the requests (`oracle_prefixes`)."""
    return sum(oracle_prefixes(requests, tokens_per_block)), sum(len(r.hash_ids) for r in requests) * tokens_per_block
