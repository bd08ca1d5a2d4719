"""The gateway's view of Redis: the one-round-trip ownership lookup and the registry.

`OwnershipIndex.lookup` runs `schema.LOOKUP_LUA` under a deadline. Its result
says which of three things happened, never mixing them up (the SGLang
gateway's distinction): ``ok`` (asked and answered), ``timeout`` / ``error``
(asked, no usable answer: route on load only from the last registry
snapshot). A failed lookup never writes anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import redis.asyncio as aioredis

try:  # redis-py internals (5.x-8.x); without them commands are packed in Python as before
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover
    HiredisRespSerializer, HIREDIS_AVAILABLE = None, False

from mlxgw import schema
from mlxgw.schema import Candidate
from mlxgw.util import cancel_and_wait, deadline

log = logging.getLogger("mlxgw.gateway.index")

EVENT_FLUSH_S = 0.02  # seconds routing events wait to share one pipeline
EVENT_QUEUE_MAX = 10_000


def hiredis_packing(client: aioredis.Redis) -> bool:
    """Make an asyncio client pack commands with hiredis, as redis-py's sync client does.

    redis-py's asyncio connections pack every command in Python: 0.35 ms for
    the 513-argument lookup of a 32k-token prompt (``bench/micro_gateway.py``).
    Swaps the pool's connection class (plain, TLS or Unix socket alike) for a
    subclass using ``redis.connection.HiredisRespSerializer``; call it before
    the first command. Returns False (and changes nothing) without hiredis or
    when redis-py no longer has that serializer.
    """
    if not HIREDIS_AVAILABLE or HiredisRespSerializer is None:
        return False
    pool = client.connection_pool
    packer = HiredisRespSerializer()
    pool.connection_class = type(
        f"Hiredis{pool.connection_class.__name__}",
        (pool.connection_class,),
        {"pack_command": lambda self, *args: packer.pack(*args)},
    )
    return True


@dataclass
class Lookup:
    """Outcome of one lookup: ``status`` in {"ok", "timeout", "error"}; ``seconds`` spent."""

    status: str
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0


class OwnershipIndex:
    """Redis client for lookups, the registry snapshot and routing events.

    Args:
        redis_url: Redis URL (``redis://``, ``rediss://``, with password/ACL user).
        namespace: key namespace.
        deadline: seconds a lookup may take before routing falls back to load.
    """

    def __init__(self, redis_url: str, namespace: str = schema.DEFAULT_NAMESPACE, deadline: float = 0.05,
                 gateway_id: str = ""):
        self.namespace = namespace
        self.gateway_id = gateway_id
        self.deadline = deadline
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        hiredis_packing(self.redis)
        self._lookup = self.redis.register_script(schema.LOOKUP_LUA)
        self.snapshot: dict[str, list[Candidate]] = {}  # model -> live backends
        self.snapshot_at = 0.0
        self.healthy = False
        self.lookups = {"ok": 0, "timeout": 0, "error": 0}
        self._task: Optional[asyncio.Task] = None
        self._events: list[tuple[str, dict]] = []
        self._flusher: Optional[asyncio.Future] = None
        self.events_dropped = 0

    def keys(self, model: str) -> schema.Keys:
        return schema.Keys(self.namespace, model)

    async def lookup(self, model: str, block_hexes: list[str]) -> Lookup:
        """Each live backend's owned prefix of the request, in one round trip."""
        k = self.keys(model)
        t0 = time.perf_counter()
        try:
            async with deadline(self.deadline):
                rows = await self._lookup(keys=[k.backends, *k.blocks(block_hexes)], args=self._args(k))
        except asyncio.TimeoutError:
            self.lookups["timeout"] += 1
            return Lookup("timeout", self._fallback(model), time.perf_counter() - t0)
        except Exception as e:
            self.lookups["error"] += 1
            self.healthy = False
            log.debug("lookup failed: %s", e)
            return Lookup("error", self._fallback(model), time.perf_counter() - t0)
        cands = schema.parse_lookup(rows)
        self.healthy = True
        self.lookups["ok"] += 1
        return Lookup("ok", cands, time.perf_counter() - t0)

    def _args(self, k: schema.Keys) -> list[str]:
        return [k.backend_prefix, k.gateways, k.gateway_load_prefix, self.gateway_id]

    def _fallback(self, model: str) -> list[Candidate]:
        # Last known live backends, ownership unknown (depth 0): load-only routing.
        return [dataclasses.replace(c, depth_blocks=0, saved_blocks=0) for c in self.snapshot.get(model, [])]

    def url_of(self, backend_id: str) -> Optional[str]:
        """The URL a live backend registered, from the last snapshot (None: not registered)."""
        return next((c.url for cs in self.snapshot.values() for c in cs if c.backend_id == backend_id), None)

    async def refresh(self) -> None:
        """Re-read every model's live backends (the registry snapshot)."""
        models = await self.redis.smembers(schema.models_key(self.namespace))
        snap = {}
        for m in models:
            m = m.decode() if isinstance(m, bytes) else m
            k = self.keys(m)
            rows = await self._lookup(keys=[k.backends], args=self._args(k))
            snap[m] = schema.parse_lookup(rows)
        self._log_changes(self.snapshot, snap)
        self.snapshot = snap
        self.snapshot_at = time.time()
        self.healthy = True

    def _log_changes(self, old: dict[str, list[Candidate]], new: dict[str, list[Candidate]]) -> None:
        """One line per backend that joined or left the registry (or moved), for the operator."""
        if not self.snapshot_at:
            return  # the first snapshot: `ready` lines are the launcher's
        before = {(m, c.backend_id): c for m, cs in old.items() for c in cs}
        after = {(m, c.backend_id): c for m, cs in new.items() for c in cs}
        for (m, b), c in after.items():
            was = before.get((m, b))
            if was is None:
                log.info("backend %s (%s) joined the registry at %s, epoch %d", b, m, c.url, c.epoch)
            elif (was.url, was.epoch) != (c.url, c.epoch):
                log.info("backend %s (%s) is back at %s, epoch %d", b, m, c.url, c.epoch)
        for (m, b) in before.keys() - after.keys():
            log.warning("backend %s (%s) left the registry: stopped, or no heartbeat within its TTL", b, m)

    async def registry(self, model: str) -> list[dict]:
        """Full registry records of a model's live backends (for status and the dashboard)."""
        k = self.keys(model)
        ids = await self.redis.zrange(k.backends, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(k.backend(i.decode()))
        out = []
        for rec in await pipe.execute():
            if rec:
                out.append({a.decode(): b.decode() for a, b in rec.items()})
        return out

    def start(self, interval: float = 1.0) -> None:
        async def loop():
            while True:
                try:
                    await self.refresh()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if self.healthy:
                        log.warning("Redis unreachable, routing on last known backends: %s", e)
                    self.healthy = False
                await asyncio.sleep(interval)

        self._task = asyncio.create_task(loop(), name="registry-refresh")

    def record_routed(self, model: str, fields: dict) -> None:
        """Queue a routing decision for the event stream (best effort).

        Decisions are written in one pipeline at most every ``EVENT_FLUSH_S``
        seconds, not one command and task per request; at most
        ``EVENT_QUEUE_MAX`` wait (the oldest are dropped while Redis is away).
        """
        if len(self._events) >= EVENT_QUEUE_MAX:
            self._events.pop(0)
            self.events_dropped += 1
        self._events.append((self.keys(model).events, fields))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_events())

    async def _flush_events(self) -> None:
        await asyncio.sleep(EVENT_FLUSH_S)
        batch, self._events = self._events, []
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key, fields in batch:
                pipe.xadd(key, fields, maxlen=schema.EVENT_STREAM_MAXLEN, approximate=True)
            await pipe.execute()
        except Exception:
            self.events_dropped += len(batch)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)  # the last decisions still land
        await self.redis.aclose()
