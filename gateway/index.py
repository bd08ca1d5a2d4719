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

from mlxgw import schema
from mlxgw.schema import Candidate
from mlxgw.util import cancel_and_wait

log = logging.getLogger("mlxgw.gateway.index")


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
        self._lookup = self.redis.register_script(schema.LOOKUP_LUA)
        self.snapshot: dict[str, list[Candidate]] = {}  # model -> live backends
        self.snapshot_at = 0.0
        self.healthy = False
        self.lookups = {"ok": 0, "timeout": 0, "error": 0}
        self._task: Optional[asyncio.Task] = None

    def keys(self, model: str) -> schema.Keys:
        return schema.Keys(self.namespace, model)

    async def lookup(self, model: str, block_hexes: list[str]) -> Lookup:
        """Each live backend's owned prefix of the request, in one round trip."""
        k = self.keys(model)
        t0 = time.perf_counter()
        try:
            rows = await asyncio.wait_for(
                self._lookup(keys=[k.backends, *k.blocks(block_hexes)], args=self._args(k)),
                self.deadline,
            )
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
        return [dataclasses.replace(c, depth_blocks=0) for c in self.snapshot.get(model, [])]

    async def refresh(self) -> None:
        """Re-read every model's live backends (the registry snapshot)."""
        models = await self.redis.smembers(schema.models_key(self.namespace))
        snap = {}
        for m in models:
            m = m.decode() if isinstance(m, bytes) else m
            k = self.keys(m)
            rows = await self._lookup(keys=[k.backends], args=self._args(k))
            snap[m] = schema.parse_lookup(rows)
        self.snapshot = snap
        self.snapshot_at = time.time()
        self.healthy = True

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

    async def record_routed(self, model: str, fields: dict) -> None:
        """Append a routing decision to the event stream (best effort)."""
        try:
            await self.redis.xadd(
                self.keys(model).events, fields, maxlen=schema.EVENT_STREAM_MAXLEN, approximate=True
            )
        except Exception:
            pass

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await self.redis.aclose()
