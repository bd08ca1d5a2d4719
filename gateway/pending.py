"""Pending ownership: prefixes this gateway sent to a backend that has not yet reported them.

A backend reports a prompt's blocks to Redis when it saves the prompt cache,
which is when the request ends. Until then, requests sharing that prefix
that arrive meanwhile (a burst on one system prompt, a fan-out of agent
calls) would see no owner and spread, each recomputing the prefix somewhere
else. sglang-router avoids this by inserting a request's text into the chosen
worker's tree at routing time; Dynamo's KV router tracks the blocks of active
requests per worker the same way. We do the same, but only for the time
Redis cannot know yet: a claim lives while its request is in flight and
``grace`` seconds after (long enough for the backend's report to land), then
Redis alone speaks. A failed request's claim is dropped at once.

Claims are local to one gateway; other gateways see the prefix once the
backend claims it in Redis, which it does when the request arrives
(`backend.report.Reporter.claim`; docs/routing.md).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional


class _Prefix:
    """One prompt's chained block keys sent to one backend: a pending claim or a
    remembered route (compared by identity; ``live`` until dropped)."""

    __slots__ = ("backend", "keys", "live")

    def __init__(self, backend: str, keys: list[str]):
        self.backend, self.keys, self.live = backend, keys, True


def _common_blocks(a: list[str], b: list[str]) -> int:
    """Length of the common prefix of two chained key lists, by bisection.

    Chained keys (`mlxgw.schema.block_hashes`) are equal at ``i`` only if they
    are equal at every earlier position, so equality is monotone: O(log n)
    comparisons instead of walking a 32k-token prompt's 512 keys.
    """
    lo, hi = 0, min(len(a), len(b))  # answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _deepest(prefixes, keys: list[str]) -> dict[str, int]:
    """Backend id -> the longest common prefix (blocks) of ``keys`` with any of
    ``prefixes`` sent there (all filed under ``keys[0]``)."""
    out: dict[str, int] = {}
    for p in prefixes:
        d = _common_blocks(p.keys, keys)
        if d > out.get(p.backend, 0):
            out[p.backend] = d
    return out


class PendingClaims:
    """Block keys routed to each backend and not yet reported.

    Block keys are chained (`mlxgw.schema.block_hashes`): a key stands for
    its whole prefix, so a backend's pending depth for a request is the
    common prefix of the request's keys with a claim's. Claims are filed
    under their first key; adding or dropping one costs O(1), not one dict
    operation per block (~1.4 ms per 32k-token request before).

    Args:
        grace: seconds a claim outlives its request when the request ended
            normally (the backend's save report is on its way).
    """

    def __init__(self, grace: float = 1.0):
        self.grace = grace
        self._by_root: dict[str, list[_Prefix]] = {}  # first block key -> live claims
        self._ending: deque[tuple[float, _Prefix]] = deque()  # (expiry, claim)
        self._n = 0

    def add(self, backend: str, keys: list[str]) -> Optional[_Prefix]:
        """Claim ``keys`` for ``backend``; returns the handle to `release` (None: nothing claimed)."""
        if not keys:
            return None
        claim = _Prefix(backend, keys)
        self._by_root.setdefault(keys[0], []).append(claim)
        self._n += 1
        return claim

    def release(self, handle: Optional[_Prefix], ok: bool, now: Optional[float] = None) -> None:
        """The request ended: drop the claim after ``grace`` seconds (``ok``) or now."""
        now = time.monotonic() if now is None else now
        if handle is not None:
            if ok and self.grace > 0:
                self._ending.append((now + self.grace, handle))
            else:
                self._drop(handle)
        self._expire(now)

    def depths(self, keys: list[str], now: Optional[float] = None) -> dict[str, int]:
        """Backend id -> pending prefix depth in blocks, for a request's block keys."""
        self._expire(time.monotonic() if now is None else now)
        return _deepest(self._by_root.get(keys[0], ()), keys) if keys else {}

    def __len__(self) -> int:
        """Live claims (in flight or within their grace)."""
        return self._n

    def _expire(self, now: float) -> None:
        while self._ending and self._ending[0][0] <= now:
            self._drop(self._ending.popleft()[1])

    def _drop(self, claim: _Prefix) -> None:
        claims = self._by_root.get(claim.keys[0])
        if not claims:
            return
        for i, c in enumerate(claims):
            if c is claim:
                del claims[i]
                self._n -= 1
                break
        if not claims:
            del self._by_root[claim.keys[0]]


class RecentRoutes:
    """This gateway's recent routes, to route by while Redis cannot answer.

    A lookup that times out or fails leaves routing with load, session affinity and the
    pending claims, which end a second after their request: without a session key, a
    conversation's next turn then goes wherever load sends it and computes its whole prompt
    again (minutes on a real model; helper-43's Redis outage beside two gateways). So the
    gateway remembers where it sent each prompt that ended well and, only when a lookup
    failed, counts those prefixes like its pending claims (`gateway.route.servable_blocks`).
    Last known, not current: the backend may have evicted the prefix since; Redis speaks
    again as soon as it answers.

    A route that a later one to the same backend continues (the conversation's previous
    turn) is dropped for it, so memory holds about one route per conversation branch; the
    oldest go first past ``max_keys`` block keys in all (~90 bytes each: 262,144 keys,
    about 24 MB, are 16.8M tokens of prompts at 64-token blocks).
    """

    def __init__(self, max_keys: int = 262_144):
        self.max_keys = max_keys
        self._by_root: dict[str, dict[int, _Prefix]] = {}  # first key -> routes (by id)
        self._by_last: dict[tuple[str, str], _Prefix] = {}  # (last key, backend) -> route
        self._fifo: deque[_Prefix] = deque()
        self.keys = 0  # block keys held by live routes

    def add(self, backend: str, keys: list[str]) -> None:
        """Remember that ``keys`` (a prompt's chained block keys) went to ``backend`` and ended well."""
        if not keys or self.max_keys <= 0:
            return
        for k in keys:  # O(blocks) dict lookups: the routes this one continues
            old = self._by_last.get((k, backend))
            if old is not None:
                self._drop(old)
        r = _Prefix(backend, keys)
        self._by_root.setdefault(keys[0], {})[id(r)] = r
        self._by_last[(keys[-1], backend)] = r
        self._fifo.append(r)
        self.keys += len(keys)
        while self.keys > self.max_keys and self._fifo:
            self._drop(self._fifo.popleft())
        while self._fifo and not self._fifo[0].live:  # dropped ones left at the front
            self._fifo.popleft()

    def depths(self, keys: list[str]) -> dict[str, int]:
        """Backend id -> depth in blocks of the longest remembered prefix of ``keys`` there."""
        return _deepest(self._by_root.get(keys[0], {}).values(), keys) if keys else {}

    def __len__(self) -> int:
        """Routes remembered."""
        return sum(len(v) for v in self._by_root.values())

    def _drop(self, r: _Prefix) -> None:
        if not r.live:
            return
        r.live = False
        self.keys -= len(r.keys)
        routes = self._by_root.get(r.keys[0])
        if routes is not None:
            routes.pop(id(r), None)
            if not routes:
                del self._by_root[r.keys[0]]
        if self._by_last.get((r.keys[-1], r.backend)) is r:
            del self._by_last[(r.keys[-1], r.backend)]
