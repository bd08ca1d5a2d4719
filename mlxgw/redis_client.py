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
