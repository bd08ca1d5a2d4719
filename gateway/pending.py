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
backend reports it (docs/routing.md).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional


class PendingClaims:
    """Block keys routed to each backend and not yet reported.

    Block keys are chained (`mlxgw.schema.block_hashes`): a key stands for
    its whole prefix, so a backend's pending depth for a request is one past
    the last of the request's keys it claims.

    Args:
        grace: seconds a claim outlives its request when the request ended
            normally (the backend's save report is on its way).
    """

    def __init__(self, grace: float = 1.0):
        self.grace = grace
        self._owners: dict[str, dict[str, int]] = {}  # block key -> backend -> claim count
        self._ending: deque[tuple[float, str, list[str]]] = deque()  # (expiry, backend, keys)

    def add(self, backend: str, keys: list[str]) -> tuple[str, list[str]]:
        """Claim ``keys`` for ``backend``; returns the handle to `release`."""
        for k in keys:
            d = self._owners.setdefault(k, {})
            d[backend] = d.get(backend, 0) + 1
        return backend, keys

    def release(self, handle: tuple[str, list[str]], ok: bool, now: Optional[float] = None) -> None:
        """The request ended: drop the claim after ``grace`` seconds (``ok``) or now."""
        now = time.monotonic() if now is None else now
        if ok and self.grace > 0:
            self._ending.append((now + self.grace, *handle))
        else:
            self._drop(*handle)
        self._expire(now)

    def depths(self, keys: list[str], now: Optional[float] = None) -> dict[str, int]:
        """Backend id -> pending prefix depth in blocks, for a request's block keys."""
        self._expire(time.monotonic() if now is None else now)
        out: dict[str, int] = {}
        for i, k in enumerate(keys):
            owners = self._owners.get(k)
            if not owners:
                break  # chained keys: no claim can match deeper
            for b in owners:
                out[b] = i + 1
        return out

    def __len__(self) -> int:
        return len(self._owners)

    def _expire(self, now: float) -> None:
        while self._ending and self._ending[0][0] <= now:
            _, backend, keys = self._ending.popleft()
            self._drop(backend, keys)

    def _drop(self, backend: str, keys: list[str]) -> None:
        for k in keys:
            d = self._owners.get(k)
            if d is None or backend not in d:
                continue
            if d[backend] <= 1:
                del d[backend]
                if not d:
                    del self._owners[k]
            else:
                d[backend] -= 1
