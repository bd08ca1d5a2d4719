"""The backend's reporter: mirrors the prompt cache into Redis.

* Ownership: each cache entry covers the full blocks of its tokens, and so
  does each request being computed (`Reporter.claim`, from arrival until it
  ends: its prefix will be cached here, and a sibling sent here meanwhile
  waits for it; see backend.engine). The reporter keeps two reference counts
  per block, saved entries and claims; a block's value in Redis says which
  (`schema.block_value`: the epoch for a saved copy, with a ``c`` for a claim
  only) and is written when that changes, and removed when both counts reach
  0, exactly when the last entry or request covering it is gone.
* Writes are batched: the engine thread records transitions under a lock and
  wakes the flusher; `Reporter.flush` sends them in one pipeline. The server
  awaits it (`Reporter.settle`) before it finishes an answer, so Redis is
  current before the next request to this backend is answered, unless Redis
  is failing or slow: answers never wait on a sick Redis.
* Heartbeat: the registry hash (URL, model, epoch, load, cache figures) is
  refreshed with a TTL; if Redis was down or flushed (the record is gone),
  the whole ownership is re-published from the reference counts. Each flush
  also looks for the record, so a backend with traffic re-registers as soon
  as Redis is back, without waiting for its heartbeat.
* Epochs: each start INCRs the backend's epoch; claims carry it, and old
  epochs are cleaned up in the background.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import Counter
from typing import Callable, Optional

import redis
import redis.asyncio as aioredis

from mlxgw import schema
from mlxgw.redis_client import connect_async, redis_problem, refusal_kind
from mlxgw.util import cancel_and_wait, deadline

from .cache import CacheEntry

log = logging.getLogger("mlxgw.backend.report")

# Longest a request waits for its flush before its answer goes out, seconds (`Reporter.settle`).
SETTLE_TIMEOUT = 0.5
#: Seconds each Redis step of a shutdown may take (withdrawal, closing the client).
STOP_WRITE_SECONDS = 3.0


def servable_blocks(entry: CacheEntry, model: str, block_size: int) -> list[str]:
    """Block keys an entry may claim.

    A trimmable entry serves every prefix of its tokens, so it claims all its
    full blocks. A non-trimmable one (rotating window, SSM state) serves only
    prompts that extend the whole entry; claiming its blocks would send
    requests that diverge inside it to a backend that cannot reuse it, so it
    claims none (conservative; see docs/cache-policy.md).
    """
    if not entry.trimmable:
        return []
    return schema.block_keys(model, entry.tokens, block_size)


#: Seconds after start, and between checks, before a backend no gateway serves says so
#: (`Reporter._check_served`).
ORPHAN_CHECK_SECONDS = 5.0


class DuplicateBackend(RuntimeError):
    """Another live backend holds this backend's id in the registry (`Reporter.start`)."""


class TakenOver(RuntimeError):
    """Another backend registered this backend's id, at another URL and under a later epoch,
    while this one was not heartbeating (hung, stopped, cut off from Redis): the operator
    replaced it. Raised by `Reporter.heartbeat`; ``Reporter.taken_over`` keeps the message."""


class Reporter:
    """Keeps Redis in step with one backend's prompt cache.

    Args:
        redis_url: ``redis://`` or ``rediss://`` URL (password/ACL user allowed).
        namespace / model: select the `schema.Keys`.
        backend_id: stable name of this backend (the same across restarts).
        url: the URL gateways reach this backend at.
        block_size: tokens per block (must equal the gateways').
        info: callable returning the engine's load/cache figures for the
            heartbeat.
        heartbeat_interval / ttl: seconds.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        model: str,
        backend_id: str,
        url: str,
        block_size: int = schema.DEFAULT_BLOCK_SIZE,
        info: Optional[Callable[[], dict]] = None,
        heartbeat_interval: float = schema.DEFAULT_HEARTBEAT_INTERVAL,
        ttl: float = schema.DEFAULT_HEARTBEAT_TTL,
        extra: Optional[dict] = None,
    ):
        self.redis_url = redis_url
        self.keys = schema.Keys(namespace, model)
        self.namespace = namespace
        self.model = model
        self.backend_id = backend_id
        self.url = url
        self.block_size = block_size
        self.info = info or (lambda: {})
        # `schema.CACHE_FIGURES` alone, for every report batch (the engine's `cache_figures`)
        self.cache_figures: Callable[[], dict] = lambda: {}
        self.heartbeat_interval = heartbeat_interval
        self.ttl = ttl
        self.extra = extra or {}
        self.epoch = 0
        self.state = "starting"
        self.started_at = time.time()
        self.redis: Optional[aioredis.Redis] = None
        self._lock = threading.Lock()
        self._refs: Counter[str] = Counter()  # block -> saved entries covering it
        self._claims: Counter[str] = Counter()  # block -> requests in flight claiming it
        self._pending: dict[str, Optional[bool]] = {}  # block -> after the change: saved (True), claim only (False), gone (None)
        self._unsure: set[str] = set()  # blocks whose last write may not have landed (a failed flush)
        self._events: list[dict] = []
        self._dirty = True  # needs a full re-publish
        self._said_kind: Optional[str] = None  # the Redis refusal last logged (`refusal_kind`)
        self.redis_problem: Optional[str] = None  # why Redis last failed (`redis_problem`), None once it answers
        self._registered = False
        self.taken_over: Optional[str] = None  # set once a later backend took this id (TakenOver)
        self._flush_lock = asyncio.Lock()
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._tasks: list[asyncio.Task] = []
        self.redis_ok = False
        self._slow = False  # a request's flush outlasted SETTLE_TIMEOUT and has not finished yet
        self.write_failures = 0
        # Answers that went out before the cache changes made for them were in Redis (`settle`).
        self.reports_late = 0
        self.republishes = 0
        self.left_out_by: dict[str, str] = {}  # gateway id -> why it does not route here (`_check_gateways`)
        self._served_checked = 0.0  # `_check_served`
        self._said_unserved = False

    # -- engine-thread side (CacheListener) --------------------------------
    def on_saved(self, entry: CacheEntry) -> None:
        blocks = servable_blocks(entry, self.model, self.block_size)
        self._change(blocks, +1, schema.EVENT_SAVED, entry)

    def on_evicted(self, entry: CacheEntry) -> None:
        blocks = servable_blocks(entry, self.model, self.block_size)
        self._change(blocks, -1, schema.EVENT_EVICTED, entry)

    def claim(self, tokens) -> list[str]:
        """Own a prompt's full blocks while a request computes it; returns the handle for `release`.

        Reporting only finished saves leaves a window, as long as the prefill,
        in which nobody owns the prompt, and a sibling routed by another
        gateway (whose pending claims this one cannot see) goes elsewhere and
        computes it again. sglang-router and Dynamo's KV router both count a
        request's prefix on its worker from the moment it is routed; here the
        backend says so itself, so every gateway sees it. Only for trimmable
        caches (the engine decides, as for `servable_blocks`). No event: the
        stream records cache contents.
        """
        blocks = schema.block_keys(self.model, tokens, self.block_size)
        self._change(blocks, +1, claim=True)
        return blocks

    def release(self, blocks: list[str]) -> None:
        """Drop a `claim` (the request ended; its own save, if any, already holds the blocks)."""
        self._change(blocks, -1, claim=True)

    def _state(self, b: str) -> Optional[bool]:
        """A block's ownership: True (a saved copy), False (claimed only), None (neither)."""
        return True if b in self._refs else (False if b in self._claims else None)

    def _change(self, blocks: list[str], delta: int, event: str = "", entry: Optional[CacheEntry] = None,
                claim: bool = False) -> None:
        """Add ``delta`` (+1/-1) to each block's count of saved entries (or of claims, with
        ``claim``); Redis hears of a block only when its `_state` changes."""
        counts = self._claims if claim else self._refs
        with self._lock:
            for b in blocks:
                before = self._state(b)
                n = counts[b] + delta
                if n > 0:
                    counts[b] = n
                else:
                    counts.pop(b, None)
                after = self._state(b)
                if after is not before:
                    self._pending[b] = after
            if event:
                self._events.append(
                    schema.event_fields(
                        event,
                        self.backend_id,
                        self.epoch,
                        {"tokens": len(entry), "blocks": len(blocks), "cache_type": entry.cache_type,
                         **({"tier": "disk"} if entry.on_disk else {})},
                    )
                )
        self._notify()

    def owned_blocks(self) -> set[str]:
        """The blocks this backend owns now, saved or claimed (from its own reference counts)."""
        with self._lock:
            return set(self._refs) | set(self._claims)

    def _owned_count(self) -> int:
        """``len(owned_blocks())`` without building the set (claims are few, saved blocks many)."""
        with self._lock:
            return len(self._refs) + sum(1 for b in self._claims if b not in self._refs)

    def _notify(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- asyncio side ----------------------------------------------------------
    async def start(self) -> None:
        """Connect, take a new epoch, publish the blocks of what is cached already (a
        restored cache), register, and start heartbeat and flusher.

        Raises:
            redis.exceptions.ConnectionError: Redis unreachable at start (the
                launcher reports it; later outages only degrade).
            DuplicateBackend: a live record of this backend id has another URL.
        """
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.redis = connect_async(self.redis_url, 2.0)
        # A second backend under a live one's id took its place in the registry without a word,
        # and the first kept running with no traffic (helper-63). Only a backend that answers
        # as this id counts: one restarted on another port after a crash finds its own record
        # still there, for up to its TTL.
        other = await self.redis.hget(self.keys.backend(self.backend_id), "url")
        if other is not None and other.decode() != self.url:
            from mlxgw.httpget import get_json

            h = await self._loop.run_in_executor(None, get_json, other.decode() + "/health", 1.0)
            if isinstance(h, dict) and h.get("backend") == self.backend_id:
                import os

                from mlxgw.stopping import PARENT_ENV

                # Started by `mlxgw serve`, which names its backends itself and has no --id
                # (helper-68): a second serve on one Redis needs its own key namespace.
                fix = ("another `mlxgw serve` uses this Redis: give this serve another --namespace (or "
                       "[redis] namespace)" if os.environ.get(PARENT_ENV) else "give this one another --id")
                raise DuplicateBackend(f"backend id {self.backend_id!r} is in use by a live backend at "
                                       f"{other.decode()}; {fix}")
        self.epoch = int(await self.redis.incr(self.keys.epoch_counter(self.backend_id)))
        # The prompts restored from --cache-dir or a disk tier are owned before the backend is
        # listed: a gateway that saw it listed first routed them on load (their publication
        # waited for the flusher's first wake-up). Unlisted, its blocks are no gateway's
        # candidate yet (a failure here marks a re-publish, and the heartbeat then fails too).
        # The restored entries' `saved` events, queued before there was an epoch: they go out
        # under this one (the re-publish drops the queue), so a reader of the event stream sees
        # what the new epoch holds, not a `cleared` and then nothing.
        with self._lock:
            early, self._events = self._events, []
        for ev in early:
            ev["epoch"] = str(self.epoch)
        async with self._flush_lock:
            await self._republish()
        with self._lock:
            self._events[:0] = early
        if early:
            self._notify()  # for the flusher's first wake-up
        await self.heartbeat()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._flush_loop(), name="flusher"),
        ]
        self._spawn_cleanup()

    async def stop(self) -> None:
        """Withdraw ownership and the registry record (clean shutdown). Bounded: each step
        gives up after `STOP_WRITE_SECONDS` (a Redis gone or hung must not hold the exit)."""
        await cancel_and_wait(*self._tasks)
        if self.redis is None:
            return
        try:
            async with deadline(STOP_WRITE_SECONDS):
                await self.cleanup_epoch(self.backend_id, self.epoch)
                pipe = self.redis.pipeline(transaction=False)
                if self.taken_over is None:  # else the record is the replacement's
                    pipe.delete(self.keys.backend(self.backend_id))
                    pipe.zrem(self.keys.backends, self.backend_id)
                pipe.xadd(
                    self.keys.events,
                    schema.event_fields(schema.EVENT_CLEARED, self.backend_id, self.epoch, {}),
                    maxlen=schema.EVENT_STREAM_MAXLEN,
                    approximate=True,
                )
                await pipe.execute()
        except Exception as e:  # asyncio.TimeoutError included
            log.warning("backend %s could not withdraw from Redis at shutdown: %s", self.backend_id,
                        e or type(e).__name__)
        try:
            async with deadline(STOP_WRITE_SECONDS):
                await self.redis.aclose()
        except Exception:
            pass

    async def settle(self, answer: bool = True) -> None:
        """Flush before an answer goes out, without holding answers up for a sick Redis.

        The routing contract wants Redis current before the next request here is
        answered (a flush takes about a millisecond). But while a re-publish is due (a
        write failed, or the record was gone) the flusher retries in the background and
        this returns at once; otherwise it waits at most `SETTLE_TIMEOUT` seconds and
        leaves the flush running. Every answer used to wait for its flush, so a frozen
        Redis (SIGSTOP, a partition) held each one for seconds (ops trial, session 23).
        Never raises. ``answer``: an answer goes out next (False: a request arrived), so
        changes not yet in Redis count in `reports_late`.
        """
        if self.redis is None:
            return
        if self._dirty or self._slow:
            if answer and (self._pending or self._events):
                self.reports_late += 1
            self._notify()
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.flush()), SETTLE_TIMEOUT)
        except asyncio.TimeoutError:
            self._slow = True
            self.reports_late += answer

    async def flush(self) -> None:
        """Send pending ownership changes and events in one pipeline.

        Never raises: on failure the backend marks itself for a full
        re-publish and keeps serving.
        """
        if self.redis is None:
            return
        async with self._flush_lock:
            if self._dirty:
                await self._recover()
                return
            with self._lock:
                pending, self._pending = self._pending, {}
                events, self._events = self._events, []
            if not pending and not events:
                return
            owned = self.keys.owned(self.backend_id, self.epoch)
            adds = [(self.keys.block(b), schema.block_value(self.epoch, v)) for b, v in pending.items() if v is not None]
            dels = [self.keys.block(b) for b, v in pending.items() if v is None]
            pipe = self.redis.pipeline(transaction=False)
            # Redis may have restarted empty since the last write (redis-py reconnects
            # without an error): every flush looks for the registry record, so a busy
            # backend re-registers at once, not at its next heartbeat (a second or two of
            # requests routed without its ownership; bench/redis_restart.py).
            pipe.exists(self.keys.backend(self.backend_id))
            for k, v in adds:
                pipe.hset(k, self.backend_id, v)
            for k in dels:
                pipe.hdel(k, self.backend_id)
            if adds:
                pipe.sadd(owned, *(k for k, _ in adds))
            if dels:
                pipe.srem(owned, *dels)
            for ev in events:
                pipe.xadd(self.keys.events, ev, maxlen=schema.EVENT_STREAM_MAXLEN, approximate=True)
            self._update_cache_figures(pipe)  # claims change blocks_owned too
            try:
                registered = (await pipe.execute())[0]
                self.redis_ok, self.redis_problem = True, None
                self._slow = False
            except Exception as e:
                # Some of these writes may have landed, some not (a pipeline cut off
                # midway): the re-publish settles each of these blocks.
                with self._lock:
                    self._unsure.update(pending)
                self._mark_dirty(e)
                return
            if not registered and self._registered:
                self._dirty = True
                await self._recover()

    async def _recover(self) -> None:
        """Re-register, then re-publish the whole ownership; never raises.

        The first write after Redis restarted empty fails (the old connection is closed)
        or lands unregistered, and the registry record is gone with the data: re-publishing
        without it left this backend's ownership unused by gateways until its heartbeat.
        Called with the flush lock held.
        """
        try:
            await self.heartbeat()  # logs a record it finds gone
        except Exception as e:
            self._mark_dirty(e)
            return
        await self._republish()
        if not self._dirty:
            # A Redis back from an older snapshot (RDB, AOF) holds this backend's earlier epochs
            # again: the start's cleanup of them ran before (helper-81: 1,188 stale fields and an
            # old owned set stayed until the next restart).
            self._spawn_cleanup()

    def _update_cache_figures(self, pipe) -> None:
        """Queue the registry's cache figures (`schema.CACHE_FIGURES`) on ``pipe``: a cache
        that changed is visible to placement before the next heartbeat."""
        figures = {**self.cache_figures(), "blocks_owned": self._owned_count()}
        args = [x for f in schema.CACHE_FIGURES if f in figures for x in (f, figures[f])]
        if args:
            # EVAL, not EVALSHA: a flushed script cache must not fail the ownership writes beside it
            pipe.eval(schema.UPDATE_IF_LIVE_LUA, 1, self.keys.backend(self.backend_id), *args)

    def _mark_dirty(self, e: BaseException) -> None:
        kind = refusal_kind(e)
        if not self._dirty or (kind is not None and kind != self._said_kind):
            # Said again when Redis comes back refusing (helper-76: restarted with another
            # password, the log kept its "connection refused")
            log.warning("backend %s: Redis write failed (%s); will re-publish ownership", self.backend_id,
                        redis_problem(self.redis_url, e) if kind else e)
            self._said_kind = kind
        self._dirty = True
        self.redis_ok = False
        self.redis_problem = redis_problem(None, e)  # for /health: no address (helper-77: no reason shown)
        self.write_failures += 1

    async def _republish(self) -> None:
        """Write this backend's whole ownership again (after an outage or a flush),
        and put back the epoch counter if Redis lost it (`schema.RAISE_EPOCH_LUA`).

        Blocks Redis may still name for this backend but it no longer owns lose
        its field: those in the owned set Redis kept (it survives a dropped
        connection, or comes back from a restart with persistence) and those
        whose write failed or was still queued. Else the deletions lost with a
        failed flush left fields with the live epoch that nothing would ever
        remove, routing prompts to a cache that no longer held them.
        """
        with self._lock:
            current = set(self._refs) | set(self._claims)
            blocks = [(b, schema.block_value(self.epoch, self._state(b))) for b in current]
            unsure = (self._unsure | set(self._pending)) - current
            self._unsure = set()
            self._pending = {}
            self._events = []
        owned = self.keys.owned(self.backend_id, self.epoch)
        keyed = [(self.keys.block(b), v) for b, v in blocks]  # Redis key names, made once
        try:
            kept = {schema.as_str(k) for k in await self.redis.smembers(owned)}
            stale = (kept | set(self.keys.blocks(unsure))) - {k for k, _ in keyed}
            pipe = self.redis.pipeline(transaction=False)
            pipe.eval(schema.RAISE_EPOCH_LUA, 1, self.keys.epoch_counter(self.backend_id), self.epoch)
            for k in stale:
                pipe.hdel(k, self.backend_id)
            pipe.delete(owned)
            for i in range(0, len(keyed), 2000):
                chunk = keyed[i : i + 2000]
                for k, v in chunk:
                    pipe.hset(k, self.backend_id, v)
                pipe.sadd(owned, *(k for k, _ in chunk))
            await pipe.execute()
        except Exception as e:
            with self._lock:
                self._unsure |= unsure  # still to settle at the next try
            self._mark_dirty(e)
            return
        self._dirty = False
        self.redis_ok, self.redis_problem = True, None
        self._slow = False
        self.republishes += 1
        log.info("backend %s published ownership of %d blocks (epoch %d)", self.backend_id, len(blocks), self.epoch)

    async def heartbeat(self) -> None:
        """Refresh the registry record; detect a lost record and re-publish."""
        info = dict(self.info())
        now = time.time()
        owned = self._owned_count()
        fields = {
            "id": self.backend_id,
            "url": self.url,
            "model": self.model,
            "epoch": self.epoch,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state": self.state,
            "block_size": self.block_size,
            "started_at": f"{self.started_at:.3f}",
            "last_heartbeat": f"{now:.3f}",
            "blocks_owned": owned,
            "redis_write_failures": self.write_failures,
            "reports_late": self.reports_late,
            **self.extra,
            **info,
        }
        fields = {k: (str(v) if not isinstance(v, (int, float, str, bytes)) else v) for k, v in fields.items()}
        key = self.keys.backend(self.backend_id)
        if self._registered:
            # Read before writing: a resumed backend overwrote its replacement's record every
            # second, so the registry flipped between the two URLs (helper-64). The later epoch wins.
            url, epoch = await self.redis.hmget(key, "url", "epoch")
            if url is not None and url.decode() != self.url and int(epoch or 0) > self.epoch:
                self.taken_over = (f"backend id {self.backend_id!r} was registered by a backend at {url.decode()} "
                                   f"(epoch {int(epoch)}) while this one (epoch {self.epoch}) was not heartbeating; "
                                   "this one steps aside")
                raise TakenOver(self.taken_over)
        first = not self._registered
        if first:
            # Still listed: the previous run under this id never withdrew (killed, hung, cut
            # off; a clean stop unlists). Read before this run lists itself.
            listed = await self.redis.zscore(self.keys.backends, self.backend_id) is not None
            previous = "vanished" if listed else "stopped" if self.epoch > 1 else None
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(key)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, int(self.ttl * 1000))
        pipe.zadd(self.keys.backends, {self.backend_id: now})
        pipe.sadd(schema.models_key(self.namespace), self.model)
        pipe.hgetall(self.keys.gateway_settings)
        if first:
            data = {"url": self.url, **({"previous": previous} if previous else {})}
            pipe.xadd(self.keys.events, schema.event_fields(schema.EVENT_STARTED, self.backend_id, self.epoch, data),
                      maxlen=schema.EVENT_STREAM_MAXLEN, approximate=True)
            pipe.hdel(self.keys.lost, self.backend_id)
        res = await pipe.execute()
        existed = res[0]
        settings = res[5]
        self._check_gateways(settings, now)
        if not schema.fresh_gateway_settings(settings, now):
            await self._check_served(now)
        if self._registered and not existed:
            # Flushed, or expired while we could not reach Redis.
            log.warning("backend %s: registry record was gone; re-publishing ownership", self.backend_id)
            self._dirty = True
            await self.redis.hdel(self.keys.lost, self.backend_id)  # a later loss gets its own event
        self._registered = True
        self.redis_ok, self.redis_problem = True, None

    def _check_gateways(self, raw: dict, now: float) -> None:
        """Tell the operator, once per gateway and reason, that a live gateway of this model
        will not route here (another block size or tokenizer, or a reason the gateway published:
        `schema.left_out_reason`, the gateways' own rule), and when it does again; ``left_out_by`` (in ``/health``) is the
        current set. ``raw`` is the `Keys.gateway_settings` hash."""
        gateways = schema.fresh_gateway_settings(raw, now)
        left_out = {}
        for gid, d in gateways.items():
            why = schema.left_out_reason(d, gid, self.backend_id, self.block_size, str(self.extra.get("tokenizer", "")))
            if why:
                left_out[gid] = why
        for gid, why in left_out.items():
            if self.left_out_by.get(gid) != why:
                log.warning("backend %s: gateway %s does not route to it: %s", self.backend_id, gid, why)
        for gid in self.left_out_by.keys() - left_out.keys():
            if gid in gateways:
                log.info("backend %s: gateway %s routes to it now", self.backend_id, gid)
        self.left_out_by = left_out
        if gateways:
            self._said_unserved = False

    async def _check_served(self, now: float) -> None:
        """With no live gateway serving this backend's model name: if gateways serve other
        models on this Redis, tell the operator once (a `--served-name` that matches no
        gateway's model name, e.g. a model folder's name instead of ``demo-tiny``, leaves the
        backend registered and never routed to). Asked at most every `ORPHAN_CHECK_SECONDS`,
        from that long after start (gateways publish every second)."""
        if now - self.started_at < ORPHAN_CHECK_SECONDS or now - self._served_checked < ORPHAN_CHECK_SECONDS:
            return
        self._served_checked = now
        try:  # advice only: a failure here must not count as a failed heartbeat (a re-publish)
            models = sorted(schema.as_str(m) for m in await self.redis.smembers(schema.models_key(self.namespace)))
            others = [m for m in models if m != self.model]
            pipe = self.redis.pipeline(transaction=False)
            for m in others:
                pipe.hgetall(schema.Keys(self.namespace, m).gateway_settings)
            raws = await pipe.execute() if others else []
        except (redis.RedisError, OSError):
            return
        served = [m for m, raw in zip(others, raws) if schema.fresh_gateway_settings(raw, now)]
        if served and not self._said_unserved:
            log.warning("backend %s: no gateway serves model %r, so none routes to it; the gateways on this Redis "
                        "serve %s (is --served-name the gateway's model name?)", self.backend_id, self.model,
                        ", ".join(repr(m) for m in served))
        self._said_unserved = bool(served)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                await self.heartbeat()
                if self._dirty:
                    await self.flush()
            except asyncio.CancelledError:
                raise
            except TakenOver:
                return  # the backend watches `taken_over` and exits
            except Exception as e:
                self._mark_dirty(e)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def cleanup_epoch(self, backend_id: str, epoch: int) -> None:
        """Remove one (backend, epoch)'s claims, in chunks (never blocks Redis long)."""
        key = self.keys.owned(backend_id, epoch)
        while True:
            left = await self.redis.eval(schema.CLEANUP_LUA, 1, key, backend_id, epoch, 500)
            if int(left) == 0:
                break
        await self.redis.delete(key)

    def _spawn_cleanup(self) -> None:
        """Run `_cleanup_old_epochs` in the background unless it runs already (at start, and
        after each re-publish that followed a failure: Redis may be back from a snapshot)."""
        self._tasks = [t for t in self._tasks if not t.done()]
        if not any(t.get_name() == "cleanup" for t in self._tasks):
            self._tasks.append(asyncio.create_task(self._cleanup_old_epochs(), name="cleanup"))

    async def _cleanup_old_epochs(self) -> None:
        """Background: drop claims of this backend's earlier epochs; a failure is retried
        (every 1 to 30 s), so a Redis that failed mid-way is cleaned once it answers."""
        delay = 1.0
        while True:
            try:
                pattern = self.keys.owned(self.backend_id, "*")
                async for k in self.redis.scan_iter(match=pattern, count=500):
                    k = schema.as_str(k)
                    ep = int(k.rsplit(":", 1)[1])
                    if ep != self.epoch:
                        await self.cleanup_epoch(self.backend_id, ep)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("backend %s: old-epoch cleanup failed: %s; retrying in %.0f s", self.backend_id, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
