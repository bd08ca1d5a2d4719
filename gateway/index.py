"""The gateway's view of Redis: the one-round-trip ownership lookup and the registry.

`OwnershipIndex.lookup` runs `schema.LOOKUP_LUA` under a deadline. Its result
says which of three things happened, never mixing them up (the SGLang
gateway's distinction): ``ok`` (asked and answered), ``timeout`` / ``error``
(asked, no usable answer: route on load only from the last registry
snapshot). A failed lookup never writes anything.

When Redis loses its data (a restart without persistence, ``FLUSHALL``) the
registry is empty until each backend's next heartbeat, up to a heartbeat
interval apart: a lookup then named no backend (503 ``no_backend``) or only
the first one back, which drew every request meanwhile and, through the
claims of those requests, their conversations' next turns for seconds after.
So a backend of the last snapshot that a lookup does not name stays a
load-only candidate until the next refresh, and, when that refresh finds
Redis lost its data (`schema.redis_id_key`), until it re-registers or
``keep_after_loss`` seconds pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import redis
import redis.asyncio as aioredis

try:  # redis-py internals (5.x-8.x); without them commands are packed in Python as before
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # pragma: no cover
    HiredisRespSerializer, HIREDIS_AVAILABLE = None, False

from mlxgw import schema
from mlxgw.redis_client import connect_async, redis_problem, refusal_kind
from mlxgw.schema import Candidate
from mlxgw.util import Tally, cancel_and_wait, deadline

log = logging.getLogger("mlxgw.gateway.index")

EVENT_FLUSH_S = 0.02  # seconds routing events wait to share one pipeline
EVENT_QUEUE_MAX = 10_000
# Seconds /metrics shows a backend that left the registry (killed, stopped) with `backend_up` 0
# before its series goes: longer than an alert's usual `for: 5m`.
LEFT_SHOWN = 600.0


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


#: A deadline period whose timer fired this late (a fraction of the deadline) had the
#: event loop busy elsewhere, so the lookup waits another period (`LookupDeadline`).
LATE_FRACTION = 0.25
#: The Redis client's socket timeout (seconds): no lookup waits longer than this in all.
REDIS_SOCKET_TIMEOUT = 1.0
#: Seconds of waiting lookups with no answer after which Redis counts as silent, and a late
#: timer no longer buys a lookup more time.
SILENCE = 0.25
#: Deadline (seconds) of a lookup that starts while Redis is silent (`RedisPulse.silent`): a
#: frozen Redis costs each request this, not the whole `--lookup-deadline-ms`, until it
#: answers again (the registry refresh asks it every second).
SILENT_DEADLINE = 0.01


@dataclass
class RedisPulse:
    """Whether Redis is answering, as `LookupDeadline` needs to know it (event-loop
    time, seconds): when it last answered a lookup or refresh, and since when a lookup
    it has not answered has been waiting (a timed-out one keeps counting until Redis
    answers something)."""

    answered_at: float = float("-inf")
    outstanding: int = 0
    unanswered_since: float = float("inf")

    def asked(self, now: float) -> None:
        self.outstanding += 1
        self.unanswered_since = min(self.unanswered_since, now)

    def done(self, now: float, answered: bool) -> None:
        self.outstanding -= 1
        if answered:
            self.alive(now)

    def alive(self, now: float) -> None:
        """Redis answered (a lookup, a refresh)."""
        self.answered_at = now
        self.unanswered_since = now if self.outstanding else float("inf")

    def silent(self, now: float) -> bool:
        """A lookup has waited ``SILENCE`` seconds and Redis has answered nothing since."""
        return now - self.unanswered_since >= SILENCE


class LookupDeadline:
    """``async with LookupDeadline(seconds, pulse):`` — a lookup deadline that counts
    only time in which Redis was silent and the event loop kept up.

    A plain wall-clock deadline cannot tell a silent Redis from a busy gateway: in a
    burst (300 chat requests at once on 2 cores) the gateway's loop and its template
    threads share the CPU, a lookup needs several loop turns to be sent and read,
    and 292 of 300 lookups timed out, so prefix routing was off exactly when many
    turns arrived together (`bench/burst.py`). So when a period of ``seconds`` ends,
    the block gets another period if Redis answered a lookup during it (it is alive;
    this answer is queued behind others), or if the timer ran at least
    ``LATE_FRACTION`` of a period late (the loop was busy, the answer may sit unread)
    and Redis is not silent (`RedisPulse.silent`: lookups have waited ``SILENCE``
    seconds with no answer, so a Redis that hangs in a burst costs the lookups then
    waiting about that, later ones one period). On a loop that keeps up, a Redis
    that answers nobody still ends the block after ``seconds``. Never past
    ``max(seconds, REDIS_SOCKET_TIMEOUT)`` in all. Raises asyncio.TimeoutError when
    it ends the block (which is cancelled). ``stretched``: periods added.
    """

    def __init__(self, seconds: float, pulse: Optional[RedisPulse] = None):
        self.seconds = seconds
        self.pulse = pulse or RedisPulse()
        self.stretched = 0
        self._cm = deadline(None)
        self._handle: Optional[asyncio.TimerHandle] = None

    async def __aenter__(self) -> "LookupDeadline":
        self._loop = asyncio.get_running_loop()
        await self._cm.__aenter__()
        now = self._loop.time()
        self._due = now + self.seconds
        self._end = now + max(self.seconds, REDIS_SOCKET_TIMEOUT)
        self._handle = self._loop.call_at(self._due, self._check)
        return self

    def _check(self) -> None:
        now = self._loop.time()
        answering = self.pulse.answered_at >= self._due - self.seconds
        late = now - self._due >= self.seconds * LATE_FRACTION and not self.pulse.silent(now)
        if (answering or late) and now < self._end:
            self.stretched += 1
            self._due = min(now + self.seconds, self._end)
            self._handle = self._loop.call_at(self._due, self._check)
        else:  # expire now: the deadline's own timer cancels the block, which raises TimeoutError
            (getattr(self._cm, "reschedule", None) or self._cm.update)(now)

    async def __aexit__(self, *exc) -> Optional[bool]:
        if self._handle is not None:
            self._handle.cancel()
        return await self._cm.__aexit__(*exc)


@dataclass
class Lookup:
    """Outcome of one lookup: ``status`` in {"ok", "timeout", "error"}; ``seconds`` spent."""

    status: str
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0


#: Redis connections one gateway opens at most (`gateway.connguard` keeps files for them).
REDIS_POOL_SIZE = 64


class OwnershipIndex:
    """Redis client for lookups, the registry snapshot and routing events.

    Args:
        redis_url: Redis URL (``redis://``, ``rediss://``, with password/ACL user).
        namespace: key namespace.
        deadline: seconds a lookup may take before routing falls back to load
            (at most `SILENT_DEADLINE` while Redis is silent).
        keep_after_loss: seconds the backends of the last snapshot stay candidates
            after Redis lost its data, unless they re-register sooner (default: a
            backend's heartbeat TTL).
    """

    def __init__(self, redis_url: str, namespace: str = schema.DEFAULT_NAMESPACE, deadline: float = 0.05,
                 gateway_id: str = "", keep_after_loss: float = schema.DEFAULT_HEARTBEAT_TTL):
        self.namespace = namespace
        self.gateway_id = gateway_id
        self.deadline = deadline
        # Bounded: lookups past it wait (within their deadline) instead of opening files.
        self.redis = connect_async(redis_url, REDIS_SOCKET_TIMEOUT, max_connections=REDIS_POOL_SIZE)
        hiredis_packing(self.redis)
        self._lookup = self.redis.register_script(schema.LOOKUP_LUA)
        self.snapshot: dict[str, list[Candidate]] = {}  # model -> live backends
        # Backend id -> why this gateway skips it (gateway.proxy: another backend answers at its
        # URL), and -> why it refuses this gateway (its internal token), published with its settings.
        self.skipped: Callable[[], dict[str, str]] = dict
        self.refused: Callable[[], dict[str, str]] = dict
        self._refused_writes = Tally(lambda n: log.warning(
            "Redis refuses writes: its used memory is over its maxmemory (OOM, %d refusal(s)); lookups still "
            "work, but backends cannot publish saves or heartbeats, so the index goes stale and they show as "
            "silent: raise maxmemory (the index grows with the cached blocks; `redis-cli info memory` shows its "
            "use)", n), every=60.0)
        self.snapshot_at = 0.0
        self.healthy = False
        self.redis_url = redis_url
        self.redis_error: Optional[BaseException] = None  # Redis's last failure, None once it answers
        self._said_down = False  # the operator was told Redis is unreachable, and not yet that it is back
        self._said_kind: Optional[str] = None  # the refusal last told (`refusal_kind`), None for unreachable
        self.lookups = {"ok": 0, "timeout": 0, "error": 0}
        self.lookups_stretched = 0  # lookups given more time: the loop was busy or Redis busy answering others
        self.pulse = RedisPulse()  # what `LookupDeadline` reads
        self._task: Optional[asyncio.Task] = None
        self._events: list[tuple[str, dict]] = []
        self._flusher: Optional[asyncio.Future] = None
        self.events_dropped = 0
        self.keep_after_loss = keep_after_loss
        # Called with a backend id when it comes back under a new epoch (restarted: its memory
        # cache is gone unless it restored one), e.g. `gateway.pending.RecentRoutes.forget`.
        self.on_restart: list[Callable[[str], None]] = []
        # Called with each new snapshot (model -> live backends), e.g. `gateway.proxy.Proxy.note_registry`.
        self.on_snapshot: list[Callable[[dict[str, list[Candidate]]], None]] = []
        self._redis_id: Optional[bytes] = None  # `schema.redis_id_key` as last read
        self._kept: dict[tuple[str, str], tuple[Candidate, float]] = {}  # (model, id) -> (record, until)
        self.data_losses = 0
        # model -> (block size, tokenizer fingerprint) a backend must have to be routed to
        self.expect: dict[str, tuple[int, str]] = {}
        self.incompatible: dict[str, dict[str, str]] = {}  # model -> backend id -> why (last refresh)
        self._settings_pruned_at = 0.0  # `_publish_settings`
        # (model, id) -> when it left the registry (monotonic s), for `LEFT_SHOWN` s: /metrics keeps
        # its `backend_up` at 0 that long, so an alert on `== 0` sees a killed backend.
        self.left: dict[tuple[str, str], float] = {}

    def keys(self, model: str) -> schema.Keys:
        return schema.Keys(self.namespace, model)

    async def lookup(self, model: str, block_hexes: list[str]) -> Lookup:
        """Each live backend's owned prefix of the request, in one round trip."""
        k = self.keys(model)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        silent = self.pulse.silent(loop.time())
        limit = LookupDeadline(min(self.deadline, SILENT_DEADLINE) if silent else self.deadline, self.pulse)
        self.pulse.asked(loop.time())
        try:
            async with limit:
                rows = await self._lookup(keys=[k.backends, *k.blocks(block_hexes)], args=self._args(k))
        except asyncio.TimeoutError:
            self.pulse.done(loop.time(), answered=False)
            self.lookups_stretched += limit.stretched > 0
            self.lookups["timeout"] += 1
            return Lookup("timeout", self._fallback(model), time.perf_counter() - t0)
        except BaseException as e:
            self.pulse.done(loop.time(), answered=False)
            if not isinstance(e, Exception):  # cancelled: the client went away
                raise
            self.lookups["error"] += 1
            self._set_healthy(False, e)
            return Lookup("error", self._fallback(model), time.perf_counter() - t0)
        self.pulse.done(loop.time(), answered=True)
        self.lookups_stretched += limit.stretched > 0
        cands = self._with_unlisted(model, self._compatible(model, schema.parse_lookup(rows)))
        self._set_healthy(True)
        self.lookups["ok"] += 1
        return Lookup("ok", cands, time.perf_counter() - t0)

    def problem(self, for_clients: bool = False) -> Optional[str]:
        """Why Redis last failed (`redis_problem`; None once it answers); ``for_clients`` leaves
        out Redis's address (helper-67: a 503 showed its host and port)."""
        if self.redis_error is None:
            return None
        return redis_problem(None if for_clients else self.redis_url, self.redis_error)

    def _set_healthy(self, ok: bool, err: Optional[BaseException] = None) -> None:
        """Record whether Redis answered; tell the operator once when it stops answering
        and once when it is back (under traffic a lookup notices first, so the refresh
        loop alone used to stay silent through an outage)."""
        self.healthy = ok
        self.redis_error = None if ok else err or self.redis_error
        kind = refusal_kind(err) if err is not None else None
        if not ok and (not self._said_down or (kind is not None and kind != self._said_kind)):
            # Said again when Redis comes back refusing (helper-76: restarted with another
            # password, the log kept its "connection refused")
            self._said_down, self._said_kind = True, kind
            log.warning("%s: routing on load, session affinity, this gateway's pending "
                        "claims and where it last sent each prompt, over the last known backends", self.problem())
        elif ok and self._said_down:
            self._said_down = False
            log.info("Redis reachable again: routing on ownership")

    def _with_unlisted(self, model: str, cands: list[Candidate]) -> list[Candidate]:
        """``cands`` plus the snapshot's backends they lack, as load-only candidates
        (depth 0): gone from the registry since the last refresh, or Redis lost its
        data and they have not re-registered yet (module docstring). One that
        really stopped fails fast (connection refused) and its circuit opens."""
        listed = {c.backend_id for c in cands}
        unlisted = [c for c in self.snapshot.get(model, ()) if c.backend_id not in listed]
        if not unlisted:
            return cands
        return cands + [dataclasses.replace(c, depth_blocks=0, saved_blocks=0) for c in unlisted]

    def mismatch(self, model: str, c: Candidate) -> Optional[str]:
        """Why backend ``c`` cannot serve this gateway's ``model`` (None: it can).

        Its URL must be one to send requests to (`schema.url_error`). Its token ids must mean the
        same tokens (`mlxgw.prompt.tokenizer_fingerprint`: the
        gateway forwards ids it computed, so another tokenizer answers nonsense) and its block
        keys must cover the same spans (another block size never matches a prefix). A field
        the backend does not publish (an older backend) is not checked.
        """
        bad_url = schema.url_error(c.url)
        if bad_url:
            return bad_url + " (start it with --url http://<address>:<port>)"
        want = self.expect.get(model)
        if want is None:
            return None
        return schema.incompatibility(want[0], want[1], c.block_size, c.tokenizer)

    def _compatible(self, model: str, cands: list[Candidate]) -> list[Candidate]:
        return [c for c in cands if self.mismatch(model, c) is None]

    def _args(self, k: schema.Keys) -> list[str]:
        return [k.backend_prefix, k.gateways, k.gateway_load_prefix, self.gateway_id]

    def _fallback(self, model: str) -> list[Candidate]:
        # Last known live backends, ownership unknown (depth 0): load-only routing.
        return [dataclasses.replace(c, depth_blocks=0, saved_blocks=0) for c in self.snapshot.get(model, [])]

    def url_of(self, backend_id: str) -> Optional[str]:
        """The URL a live backend registered, from the last snapshot (None: not registered)."""
        return next((c.url for cs in self.snapshot.values() for c in cs if c.backend_id == backend_id), None)

    async def refresh(self) -> None:
        """Re-read every model's live backends (the registry snapshot); notice a Redis
        that lost its data and keep the backends it knew (module docstring)."""
        id_key = schema.redis_id_key(self.namespace)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(id_key, secrets.token_hex(8), nx=True)
        pipe.get(id_key)
        pipe.smembers(schema.models_key(self.namespace))
        self._publish_settings(pipe)
        res = await pipe.execute(raise_on_error=False)
        # A Redis at its maxmemory (noeviction) refuses the writes (OOM) and still answers
        # reads: say that, not "unreachable" (helper-64: the log flipped between unreachable
        # and reachable 26 times while every lookup worked).
        for r in res:
            if isinstance(r, redis.exceptions.OutOfMemoryError):
                self._refused_writes.add()
            elif isinstance(r, Exception):
                raise r
        redis_id, models = res[1:3]
        if redis_id is None and isinstance(res[0], Exception):
            redis_id = self._redis_id  # its id could not be written: no sign of a lost Redis
        lost = self._redis_id is not None and redis_id != self._redis_id
        self._redis_id = redis_id
        snap = {}
        for m in models:
            m = schema.as_str(m)
            k = self.keys(m)
            rows = await self._lookup(keys=[k.backends], args=self._args(k))
            snap[m] = schema.parse_lookup(rows)
        snap = self._leave_out_incompatible(snap)
        self.pulse.alive(asyncio.get_running_loop().time())
        snap = self._keep_known(snap, lost)
        self._log_changes(self.snapshot, snap)
        self.snapshot = snap
        self.snapshot_at = time.time()
        for listener in self.on_snapshot:
            listener(snap)
        self._set_healthy(True)

    async def id_in_use(self, wait: float = 2.5) -> Optional[str]:
        """Why this gateway's id is taken (None: it is not): a live gateway publishes its
        settings under it (helper-76: a second gateway given a live one's --gateway-id ran
        silently, and the two overwrote each other's in-flight load and settings in Redis).
        An entry written within `schema.GATEWAY_SETTINGS_FRESH` s may be this gateway's own
        from before a restart: it is read again after ``wait`` seconds (the refresh writes
        every second) and counts only if rewritten. Call before the first `refresh`."""
        if not self.gateway_id or not self.expect:
            return None
        keys = [self.keys(m).gateway_settings for m in self.expect]

        async def written() -> list[float]:
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.hget(k, self.gateway_id)
            out = []
            for raw in await pipe.execute():
                d = schema.fresh_gateway_settings({self.gateway_id: raw}, time.time()) if raw else {}
                out.append(float(d[self.gateway_id]["at"]) if d else 0.0)
            return out

        first = await written()
        if not any(first):
            return None
        await asyncio.sleep(wait)
        if any(b > a > 0 for a, b in zip(first, await written())):
            return (f"gateway id {self.gateway_id!r} is in use by a live gateway on this Redis (namespace "
                    f"{self.namespace}): give this one another --gateway-id")
        return None

    def _publish_settings(self, pipe) -> None:
        """Queue on ``pipe`` this gateway's entry in each of its models' `Keys.gateway_settings`
        (what a backend must match to be routed to), so a backend can tell its operator it is
        left out and ``mlxgw status`` can show it (neither knows the gateways' flags), and,
        every `schema.GATEWAY_SETTINGS_PRUNE` seconds, delete the entries of gateways gone
        that long (`PRUNE_SETTINGS_LUA`); add its models to the models set (helper-74: a model
        no backend had registered yet was missing from `mlxgw status`)."""
        if not self.gateway_id:
            return
        now = time.time()
        prune = now - self._settings_pruned_at > schema.GATEWAY_SETTINGS_PRUNE
        if self.expect:  # a model served before any backend registers is listed too (status, a
            # backend's --served-name check); the janitor drops it once no gateway serves it
            pipe.sadd(schema.models_key(self.namespace), *self.expect)
        for m, (block_size, fingerprint) in self.expect.items():
            key = self.keys(m).gateway_settings
            live = {c.backend_id for c in self.snapshot.get(m, ())}
            skipped = {b: why for b, why in self.skipped().items() if b in live}
            refused = {b: why for b, why in self.refused().items() if b in live}
            pipe.hset(key, self.gateway_id, schema.gateway_settings_value(block_size, fingerprint, now, skipped,
                                                                          refused))
            if prune:
                pipe.eval(schema.PRUNE_SETTINGS_LUA, 1, key, f"{now - schema.GATEWAY_SETTINGS_PRUNE:.3f}")
        if prune:
            self._settings_pruned_at = now

    def _leave_out_incompatible(self, snap: dict[str, list[Candidate]]) -> dict[str, list[Candidate]]:
        """``snap`` without the live backends this gateway will not route to (`mismatch`; every
        lookup leaves them out too: `_compatible`), recorded in ``incompatible``; the operator
        is told once per backend and reason."""
        now: dict[str, dict[str, str]] = {}
        kept: dict[str, list[Candidate]] = {}
        for m, cs in snap.items():
            kept[m] = []
            for c in cs:
                why = self.mismatch(m, c)
                if why is None:
                    kept[m].append(c)
                    continue
                now.setdefault(m, {})[c.backend_id] = why
                if self.incompatible.get(m, {}).get(c.backend_id) != why:
                    log.warning("backend %s (%s, %s) is not routed to: %s", c.backend_id, m, c.url, why)
        present = {(m, c.backend_id) for m, cs in snap.items() for c in cs}
        for m, bs in self.incompatible.items():
            for b in bs.keys() - now.get(m, {}).keys():
                if (m, b) in present:  # one that left the registry is logged as leaving, not as fixed
                    log.info("backend %s (%s) now matches this gateway's settings and is routed to", b, m)
        self.incompatible = now
        return kept

    def _keep_known(self, snap: dict[str, list[Candidate]], lost: bool) -> dict[str, list[Candidate]]:
        """``snap`` plus the backends kept since Redis lost its data: on a loss, every
        backend of the previous snapshot that has not re-registered, for
        ``keep_after_loss`` seconds or until it does."""
        now = time.monotonic()
        if lost:
            self.data_losses += 1
            log.warning("Redis lost its data (restarted without persistence, or flushed): routing on the "
                        "last known backends until they re-register")
            for m, cs in self.snapshot.items():
                for c in cs:
                    self._kept.setdefault((m, c.backend_id), (c, now + self.keep_after_loss))
        live = {(m, c.backend_id) for m, cs in snap.items() for c in cs}
        self._kept = {mb: v for mb, v in self._kept.items() if mb not in live and v[1] > now}
        for (m, _), (c, _) in self._kept.items():
            snap.setdefault(m, []).append(c)
        return snap

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
                if was.epoch != c.epoch:
                    for listener in self.on_restart:
                        listener(b)
        now = time.monotonic()
        for (m, b) in before.keys() - after.keys():
            log.warning("backend %s (%s) left the registry: stopped, or no heartbeat within its TTL", b, m)
            self.left[(m, b)] = now
        self.left = {mb: t for mb, t in self.left.items() if mb not in after and now - t < LEFT_SHOWN}

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
                    self._set_healthy(False, e)
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
        if self.gateway_id and self.expect and self.healthy:
            # Gone now: backends and status stop counting this gateway at once, not in 10 s.
            try:
                pipe = self.redis.pipeline(transaction=False)
                for m in self.expect:
                    pipe.hdel(self.keys(m).gateway_settings, self.gateway_id)
                await asyncio.wait_for(pipe.execute(), 1.0)
            except (redis.RedisError, OSError, asyncio.TimeoutError):
                pass  # it ages out (schema.GATEWAY_SETTINGS_FRESH)
        await self.redis.aclose()
