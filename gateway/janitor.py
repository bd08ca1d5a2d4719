"""The janitor: removes what backends that died and never came back left in Redis.

A dead backend's claims are already ignored by every lookup (its registry
record expired, and claims count only for a live record's epoch), so this is
housekeeping, never correctness (it also writes a `lost` event when a listed
backend's record has expired, for the event feed): it deletes the block fields and ``owned``
sets of backends whose last heartbeat is older than ``grace`` seconds, then
forgets them in the ``backends`` sorted set; a model that has had no registered
backend and no event for ``grace`` seconds, and that no live gateway serves, leaves the
``models`` set (each
gateway's registry refresh looks up every model listed there; a backend puts
its model back with its next heartbeat). One gateway at a time does it
(a ``janitor`` lock key with a TTL), in chunks (`schema.CLEANUP_LUA`), so
Redis is never blocked for long.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack

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
                await self._report_lost(k)
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
                    await r.hdel(k.lost, bid)
                    removed.append(bid)
                    log.info("janitor: removed backend %s (no heartbeat for %.0f s)", bid, self.grace)
                await self._forget_model_if_unserved(schema.as_str(m))
        finally:
            await r.delete(lock)
        self.removed += len(removed)
        return removed

    async def _report_lost(self, k: schema.Keys) -> int:
        """A `lost` event for each backend still listed whose record expired (killed, hung,
        cut off from Redis: it never withdrew), once per run (`schema.LOST_LUA`), so the event
        feed shows crashes beside the `started` of the next run. Returns the events written."""
        r = self.index.redis
        now = time.time()
        listed = await r.zrange(k.backends, 0, -1, withscores=True)
        if not listed:
            return 0
        pipe = r.pipeline(transaction=False)  # one round trip per model, however many backends
        for bid, last in listed:
            bid = schema.as_str(bid)
            data = msgpack.packb({"silent_s": round(now - last, 1)}, use_bin_type=True)
            pipe.eval(schema.LOST_LUA, 4, k.lost, k.epoch_counter(bid), k.backend(bid), k.events,
                      bid, data, f"{now:.3f}", schema.EVENT_STREAM_MAXLEN, schema.EVENT_LOST)
        return sum(int(x) for x in await pipe.execute())

    async def _forget_model_if_unserved(self, model: str) -> bool:
        """Remove ``model`` from the models set when no backend is registered for it, its event
        stream has nothing newer than ``grace`` seconds and no live gateway serves it (a model an
        operator retired, or a backend's mistaken ``--served-name``; before, it stayed listed, and
        looked up by every gateway's refresh, forever). A model a gateway still serves stays, so
        `mlxgw status` shows it without backends (helper-59: it said "no models registered").
        Not atomic across the two keys (they are in different cluster slots): a backend that
        registers meanwhile is put back at once, or by its own next heartbeat. True if removed."""
        r, k = self.index.redis, self.index.keys(model)
        models = schema.models_key(self.index.namespace)
        pipe = r.pipeline(transaction=False)
        pipe.zcard(k.backends)
        pipe.xrevrange(k.events, count=1)
        pipe.hgetall(k.gateway_settings)
        registered, last, gateways = await pipe.execute()
        now = time.time()
        if registered or schema.fresh_gateway_settings(gateways, now) or (
                last and int(schema.as_str(last[0][0]).split("-")[0]) > (now - self.grace) * 1000):
            return False
        await r.srem(models, model)
        if await r.zcard(k.backends):  # registered between the two reads and the removal
            await r.sadd(models, model)
            return False
        log.info("janitor: model %s left the models set (no backend for %.0f s)", model, self.grace)
        return True

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
