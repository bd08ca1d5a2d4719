"""The janitor: removes what backends that died and never came back left in Redis.

A dead backend's claims are already ignored by every lookup (its registry
record expired, and claims count only for a live record's epoch), so this is
housekeeping, never correctness: it deletes the block fields and ``owned``
sets of backends whose last heartbeat is older than ``grace`` seconds, then
forgets them in the ``backends`` sorted set. One gateway at a time does it
(a ``janitor`` lock key with a TTL), in chunks (`schema.CLEANUP_LUA`), so
Redis is never blocked for long.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mlxgw import schema
from mlxgw.util import cancel_and_wait

log = logging.getLogger("mlxgw.gateway.janitor")


class Janitor:
    """Periodic cleanup of dead backends (see module doc).

    Args:
        index: the gateway's `OwnershipIndex` (Redis client, namespace, snapshot).
        grace: seconds since a backend's last heartbeat before it counts as gone.
        interval: seconds between sweeps.
    """

    def __init__(self, index, grace: float = 300.0, interval: float = 10.0):
        self.index = index
        self.grace = grace
        self.interval = interval
        self.removed = 0
        self._task = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="janitor")

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def sweep(self) -> list[str]:
        """One pass over every model; returns the backend ids removed."""
        r = self.index.redis
        lock = f"{self.index.namespace}:janitor"
        if not await r.set(lock, self.index.gateway_id or "gateway", nx=True, ex=max(5, int(self.interval))):
            return []  # another gateway is sweeping
        removed = []
        try:
            for m in await r.smembers(schema.models_key(self.index.namespace)):
                k = self.index.keys(schema.as_str(m))
                stale = await r.zrangebyscore(k.backends, "-inf", time.time() - self.grace)
                for bid in stale:
                    bid = schema.as_str(bid)
                    if await r.exists(k.backend(bid)):
                        continue  # alive after all (clock skew, or just re-registered)
                    async for key in r.scan_iter(match=k.owned(bid, "*"), count=500):
                        key = schema.as_str(key)
                        epoch = key.rsplit(":", 1)[1]
                        while int(await r.eval(schema.CLEANUP_LUA, 1, key, bid, epoch, 500)):
                            pass
                        await r.delete(key)
                    await r.zrem(k.backends, bid)
                    removed.append(bid)
                    log.info("janitor: removed backend %s (no heartbeat for %.0f s)", bid, self.grace)
        finally:
            await r.delete(lock)
        self.removed += len(removed)
        return removed

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # Redis away is reported by the index already; anything else is news.
                (log.warning if self.index.healthy else log.debug)("janitor sweep failed: %s", e)
