"""The one way every mlxgw process opens a Redis client (redis-py).

Timeouts are explicit, and so is the retry policy, since redis-py's default
moved under us: 5.x retries nothing, 6.x and later retry every command ten
times, with backoff, after a connection error *or a timeout*. Against a
frozen Redis (SIGSTOP, swapping, a partition) that made each command take
up to ~11 socket timeouts, and a backend held its answers that long (ops
trial, session 23). Here: one immediate retry on a new connection after a
connection error (a pooled connection that a restarted Redis closed fails
once, and should not count as an outage), none after a timeout (a Redis that
does not answer in time is treated as down at once; callers degrade).
"""

from __future__ import annotations

from typing import Optional

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry


def connect(url: str, timeout: float, **kw) -> redis.Redis:
    """A blocking client for ``url``: ``timeout`` seconds to connect and per reply.

    Extra keyword arguments go to `redis.Redis.from_url` (e.g. ``decode_responses``).
    Connecting is lazy: an unreachable Redis raises ``redis.exceptions.ConnectionError``
    at the first command.
    """
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
                                **kw)


def connect_async(url: str, timeout: float, max_connections: int = 0, **kw) -> aioredis.Redis:
    """The asyncio client of `connect` (same timeouts and retry policy).

    ``max_connections`` > 0 bounds its pool (redis-py's default has no bound: every
    command in flight opens a connection, 101 for a gateway under a 3,000-client burst in
    ``bench/overload.py``, each an open file); a command past it waits up to ``timeout``
    seconds for a free connection, then raises ``redis.exceptions.ConnectionError``.
    """
    retry = AsyncRetry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    if max_connections <= 0:
        return aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry, **kw)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout,
                                                    socket_timeout=timeout, socket_connect_timeout=timeout, **kw)
    client = aioredis.Redis(connection_pool=pool, retry=retry)
    client.auto_close_connection_pool = True  # aclose() closes the pool it was given (redis-py >= 5.0)
    return client


def refusal_kind(e: BaseException) -> Optional[str]:
    """What Redis refused in ``e``, when only another URL mends it: ``no_password`` (it needs
    one), ``wrong_password``, ``no_database``, ``cluster`` (a Redis Cluster node: it answered
    MOVED or CLUSTERDOWN); None otherwise (unreachable, slow, ...)."""
    low = str(e).lower()
    if isinstance(e, getattr(redis.exceptions, "AuthenticationRequiredError", ())) or "noauth" in low \
            or "must be called with the client already authenticated" in low or "authentication required" in low:
        return "no_password"
    if isinstance(e, redis.exceptions.AuthenticationError) or "wrongpass" in low or "invalid password" in low \
            or "invalid username-password" in low:
        return "wrong_password"
    if "db index is out of range" in low:
        return "no_database"
    if isinstance(e, (redis.exceptions.AskError, redis.exceptions.ClusterError)):  # MOVED, CLUSTERDOWN
        return "cluster"
    return None


def is_setting_error(e: BaseException) -> bool:
    """Whether Redis refused for a reason only another URL mends (a refused or missing
    password, no such database: `refusal_kind`), not one waiting can (unreachable, slow):
    `redis_problem` words both."""
    return refusal_kind(e) is not None


def redis_problem(url: Optional[str], e: BaseException) -> str:
    """One line on why Redis at ``url`` did not serve a client (``e``: the exception redis-py
    raised), for logs and errors: a refused or missing password is not "unreachable"
    (helper-66: a wrong password read "Redis unreachable", a missing one Redis's raw
    ``HELLO must be called with the client already authenticated``), nor is a database it does
    not have, a TLS mismatch or a port where something else answers (helper-67). The URL is
    redacted; with ``url`` None the line names no address (for API clients)."""
    from .util import redact_url

    text = str(e)
    where = f"Redis at {redact_url(url)}" if url else "Redis"
    low = text.lower()
    refusal = refusal_kind(e)
    if refusal == "no_password":
        return f"{where} requires a password, and the URL has none (redis://:PASSWORD@host:port/0)"
    if refusal == "wrong_password":
        return f"{where} refused the password in the URL ({text})"
    if refusal == "no_database":
        return f"{where} has no such database (the /N at the end of the URL; {text})"
    if refusal == "cluster":  # helper-76: it read "Redis unreachable ... MovedError"
        return (f"{where} is a Redis Cluster node ({type(e).__name__}: {text}); mlxgw speaks to one Redis, "
                "not to a Cluster (docs/redis-schema.md)")
    # redis-py's text of the failures below names the address ("Error 111 connecting to
    # host:port"): kept for logs, left out for API clients (url None).
    said = f": {text}" if url and text else ""
    if "protocol error" in low or isinstance(e, redis.exceptions.InvalidResponse):
        return f"{where}: what answers there does not speak Redis's protocol (another server's port?){said}"
    if "ssl" in low or "wrong version number" in low:
        return f"{where}: TLS failed (rediss:// to a Redis without TLS, or the other way round?){said}"
    if isinstance(e, redis.exceptions.TimeoutError):
        return (f"{where} did not answer in time (overloaded, stopped, or a rediss:// URL for a Redis "
                f"without TLS?){said if url else ''}{': timeout' if url and not text else ''}")
    unreachable = f"Redis unreachable at {redact_url(url)}" if url else "Redis unreachable"
    if isinstance(e, redis.exceptions.ConnectionError) and ("refused" in low or "connecting to" in low):
        return f"{unreachable}{said}" if url else f"{unreachable} (no connection: {type(e).__name__})"
    return f"{unreachable}: {type(e).__name__}{said}"
