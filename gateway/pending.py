"""Pending ownership: prefixes this gateway sent to a backend that has not yet reported them.

A backend reports a prompt's blocks to Redis when it saves the prompt cache,
which is when the request ends. Until then, requests sharing that prefix
that arrive meanwhile (a burst on one system prompt, a fan-out of agent
calls) would see no owner and spread, each recomputing the prefix somewhere
else. sglang-router avoids this by inserting a request's text into the chosen
worker's tree at routing time; Dynamo's KV router tracks the blocks of active
requests per worker the same way. We do the same, but only for the time
Redis cannot know yet: a claim lives while its request is in flight and
``grace`` seconds after (`RoutingConfig.pending_grace`: 0 by default since
session 47, the backend's reports landing before its answer ends), then Redis
alone speaks. A failed request's claim is dropped at once.

Claims are local to one gateway; other gateways see the prefix once the
backend claims it in Redis, which it does when the request arrives
(`backend.report.Reporter.claim`; docs/routing.md).
"""

from __future__ import annotations

import time
# _count_elements: the loop Counter.update runs (C in CPython, a Python fallback in
# collections elsewhere) on a plain dict; a Counter itself deletes through a Python-level
# __delitem__, which made add-and-drop 4x slower (214 against 55 us for 512 keys).
from collections import _count_elements, deque
from typing import Optional


class _Prefix:
    """One prompt's chained block keys sent to one backend: a pending claim or a
    remembered route (compared by identity; ``live`` until dropped)."""

    __slots__ = ("backend", "keys", "live")

    def __init__(self, backend: str, keys: list[str]):
        self.backend, self.keys, self.live = backend, keys, True


class _HeldKeys:
    """Backend id -> how many live prefixes sent there hold each block key.

    A depth query then costs O(backends x log blocks) whatever the number of prefixes:
    block keys are chained (`mlxgw.schema.block_hashes`), so a backend holding key ``i``
    of a request holds its whole prefix up to ``i``, and membership is monotone along the
    request's keys (bisection). Filing prefixes under their first key and comparing the
    request with each one instead cost O(prefixes) per query, and agent traffic puts them
    all under one first key (a shared system prompt): 0.37 of a 2.7 ms request at ~330
    live claims (cProfile, sequential sim requests). Adding or dropping a prefix costs a
    dict operation per block (about 50 us for a 32k-token prompt's 512 blocks).
    """

    __slots__ = ("_by_backend",)

    def __init__(self):
        self._by_backend: dict[str, dict[str, int]] = {}

    def add(self, p: _Prefix) -> None:
        _count_elements(self._by_backend.setdefault(p.backend, {}), p.keys)

    def drop(self, p: _Prefix) -> None:
        held = self._by_backend[p.backend]
        for k in p.keys:
            n = held[k] - 1
            if n:
                held[k] = n
            else:
                del held[k]
        if not held:
            del self._by_backend[p.backend]

    def depths(self, keys: list[str]) -> dict[str, int]:
        """Backend id -> the longest prefix (blocks) of ``keys`` some live prefix there holds."""
        out: dict[str, int] = {}
        if not keys:
            return out
        first = keys[0]
        for backend, held in self._by_backend.items():
            if first not in held:
                continue
            lo, hi = 1, len(keys)  # answer in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if keys[mid - 1] in held:
                    lo = mid
                else:
                    hi = mid - 1
            out[backend] = lo
        return out


class PendingClaims:
    """Block keys routed to each backend and not yet reported.

    Block keys are chained (`mlxgw.schema.block_hashes`): a key stands for
    its whole prefix, so a backend's pending depth for a request is the
    longest prefix of the request's keys a claim there holds (`_HeldKeys`).

    Args:
        grace: seconds a claim outlives its request when the request ended
            normally (the backend's save report is on its way).
    """

    def __init__(self, grace: float = 1.0):
        self.grace = grace
        self._held = _HeldKeys()
        self._ending: deque[tuple[float, _Prefix]] = deque()  # (expiry, claim)
        self._n = 0

    def add(self, backend: str, keys: list[str]) -> Optional[_Prefix]:
        """Claim ``keys`` for ``backend``; returns the handle to `release` (None: nothing claimed)."""
        if not keys:
            return None
        claim = _Prefix(backend, keys)
        self._held.add(claim)
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
        return self._held.depths(keys)

    def __len__(self) -> int:
        """Claims in flight or within their grace as of the last `depths` / `release` (see `live`)."""
        return self._n

    def live(self, now: Optional[float] = None) -> int:
        """Claims in flight or within their grace at ``now`` (monotonic seconds), those past
        their grace dropped first: `len` counted them until the next routing (helper-59: 3
        claims in `/health` 50 s after the last request, a 1 s grace)."""
        self._expire(time.monotonic() if now is None else now)
        return self._n

    def _expire(self, now: float) -> None:
        while self._ending and self._ending[0][0] <= now:
            self._drop(self._ending.popleft()[1])

    def _drop(self, claim: _Prefix) -> None:
        if claim.live:  # released twice (a caller's retry path): counted once
            claim.live = False
            self._held.drop(claim)
            self._n -= 1


class RecentRoutes:
    """This gateway's recent routes, to route by while Redis cannot answer.

    A lookup that times out or fails leaves routing with load, session affinity and the
    pending claims, which end with their request (`--pending-grace`, 0 s): without a session key, a
    conversation's next turn then goes wherever load sends it and computes its whole prompt
    again (minutes on a real model; helper-43's Redis outage beside two gateways). So the
    gateway remembers where it sent each prompt that ended well and, only when a lookup
    failed, counts those prefixes like its pending claims (`gateway.route.servable_blocks`).
    Last known, not current: the backend may have evicted the prefix since; Redis speaks
    again as soon as it answers.

    A route that a later one to the same backend continues (the conversation's previous
    turn) is dropped for it, so memory holds about one route per conversation branch; the
    oldest go first past ``max_keys`` block keys in all (~110 bytes each with their
    `_HeldKeys` count, measured with tracemalloc: 262,144 keys, about 28 MB, are 16.8M
    tokens of prompts at 64-token blocks).
    """

    def __init__(self, max_keys: int = 262_144):
        self.max_keys = max_keys
        self._held = _HeldKeys()
        self._n = 0  # live routes
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
        self._held.add(r)
        self._n += 1
        self._by_last[(keys[-1], backend)] = r
        self._fifo.append(r)
        self.keys += len(keys)
        while self.keys > self.max_keys and self._fifo:
            self._drop(self._fifo.popleft())
        while self._fifo and not self._fifo[0].live:  # dropped ones left at the front
            self._fifo.popleft()

    def forget(self, backend: str) -> None:
        """Drop every route to ``backend``: it restarted (a new epoch), so what it held in memory
        is gone (helper-63: during a Redis outage a conversation went back to a restarted backend
        and computed its whole prompt, while the backend it was retried on held it). O(routes)."""
        for r in [r for r in self._fifo if r.live and r.backend == backend]:
            self._drop(r)

    def depths(self, keys: list[str]) -> dict[str, int]:
        """Backend id -> depth in blocks of the longest remembered prefix of ``keys`` there."""
        return self._held.depths(keys)

    def __len__(self) -> int:
        """Routes remembered."""
        return self._n

    def _drop(self, r: _Prefix) -> None:
        if not r.live:
            return
        r.live = False
        self.keys -= len(r.keys)
        self._n -= 1
        self._held.drop(r)
        if self._by_last.get((r.keys[-1], r.backend)) is r:
            del self._by_last[(r.keys[-1], r.backend)]
