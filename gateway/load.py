"""Publishing this gateway's in-flight work to Redis, so every gateway sees it.

With several gateways each one sees only its own share of the load (smg
issue 1621). Each gateway therefore writes, per model, one hash
``gwload:<gateway id>`` (backend id -> ``"requests:prefill_tokens"`` it has in
flight there) with a 3 s expiry, and registers itself in the model's
``gateways`` sorted set; the lookup script sums the other live gateways'
figures into each candidate (`schema.LOOKUP_LUA`). A dead gateway's load
disappears with its hash's expiry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from mlxgw.util import cancel_and_wait

log = logging.getLogger("mlxgw.gateway.load")

LOAD_TTL_MS = 3000  # a gateway silent this long no longer counts
GATEWAY_FORGET_S = 60  # registry entries older than this are pruned


class LoadPublisher:
    """Writes the in-flight view every ``interval`` seconds when it changed
    (and at least once a second, to keep the expiry fresh).

    Args:
        index: the gateway's `OwnershipIndex` (its Redis client, snapshot, id).
        view: returns backend id -> (requests, fresh prefill tokens).
        interval: seconds between checks.
    """

    def __init__(self, index, view: Callable[[], dict[str, tuple[int, int]]], interval: float = 0.1):
        self.index = index
        self.view = view
        self.interval = interval
        self._last: dict = {}
        self._last_at = 0.0
        self._task = None
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="load-publisher")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        try:  # withdraw at once rather than waiting for the expiry
            pipe = self.index.redis.pipeline(transaction=False)
            for model in self.index.snapshot:
                k = self.index.keys(model)
                pipe.delete(k.gateway_load(self.index.gateway_id))
                pipe.zrem(k.gateways, self.index.gateway_id)
            await pipe.execute()
        except Exception:
            pass

    async def publish_once(self, view: Optional[dict] = None) -> None:
        """Write ``view`` (default: the current one) in one pipeline over every model this gateway knows."""
        view = self.view() if view is None else view
        now = time.time()
        pipe = self.index.redis.pipeline(transaction=False)
        gid = self.index.gateway_id
        for model, cands in self.index.snapshot.items():
            k = self.index.keys(model)
            fields = {c.backend_id: f"{view[c.backend_id][0]}:{view[c.backend_id][1]}"
                      for c in cands if c.backend_id in view and view[c.backend_id] != (0, 0)}
            key = k.gateway_load(gid)
            pipe.delete(key)
            if fields:
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, LOAD_TTL_MS)
            pipe.zadd(k.gateways, {gid: now})
            pipe.zremrangebyscore(k.gateways, "-inf", now - GATEWAY_FORGET_S)
        await pipe.execute()
        self._last, self._last_at = view, time.monotonic()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                view = self.view()
                if view != self._last or time.monotonic() - self._last_at > 1.0:
                    await self.publish_once(view)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down: routing already degrades; keep trying
                self.failures += 1
                log.debug("in-flight publish failed: %s", e)
