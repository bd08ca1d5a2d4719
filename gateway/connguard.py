"""A cap on client connections, below the open-files limit.

`gateway.limits` sheds requests over ``--max-in-flight`` with a 503, but each
connection holds an open file from accept() on, whether its request is
admitted, shed or not yet read. A burst of more clients than the process has
files fails in worse ways (bench/overload.py, 4,500 clients at 4,096 files:
EMFILE on accept, on the upstream connect, on a jinja2 import, on Redis). So
past ``max_connections`` a new connection gets a fixed 503 ``overloaded``
answer (OpenAI-style JSON, ``Retry-After: 1`` and a jittered ``retry-after-ms``,
``Connection: close``) before
anything reads its request, and is closed once the client has read it (a
lingering close: closing with the request unread would send a reset that can
destroy the answer in the client's buffer), or after `LINGER_SECONDS`.

Those answered connections hold files too, as long as their clients take to
close them (in the same bench, 4,080 client sockets at the peak against a cap
of 2,944), so at most `MAX_LINGERING` linger; past that a connection is reset
at once (the SDKs retry a reset connection like a 503). nginx resets at
``worker_connections`` too, without the answer.

Connections a client keeps alive between requests count too, and aiohttp keeps an
idle one for an hour by default: clients that went quiet could hold every slot while
nothing is in flight, and a new client would be refused. So idle connections close
after `KEEPALIVE_SECONDS` (nginx's ``keepalive_timeout``), and at the cap a new
connection takes the place of the one idle longest between requests (nginx reuses
keep-alive connections the same way when ``worker_connections`` run out); only when
none is idle is it refused. A client whose idle connection is closed reconnects, as
HTTP/1.1 clients must (the SDKs retry a connection closed before an answer).

aiohttp answers a request it cannot parse (a bad request line or header, a header past
its size limit, broken chunked framing) itself, before any handler, in text/plain;
`JsonErrors` makes that answer the OpenAI-style JSON error every other one is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from mlxgw.protocol import retry_after_headers
from mlxgw.util import Tally

log = logging.getLogger("mlxgw.gateway")

#: Seconds a refused connection may stay open for its client to read the answer.
LINGER_SECONDS = 2.0
#: Refused connections allowed to linger at once; past it, reset.
MAX_LINGERING = 64
#: Seconds a client connection may stay idle between requests (nginx's keepalive_timeout
#: default; aiohttp's own is 3630).
KEEPALIVE_SECONDS = 75.0
#: Seconds without looking for an idle connection after a look found none (`GuardedRunner._reclaim`).
RESCAN_SECONDS = 0.1
#: Open files kept out of every cap: the refused connections still lingering, Redis
#: (`gateway.index.REDIS_POOL_SIZE`, 64), and logs, model and library files, listeners
#: and the event loop (about 40 when idle).
RESERVED_FILES = 256


def auto_max_connections(open_files: int, max_in_flight: int) -> int:
    """Client connections to hold at most: the open files left once every admitted request
    has its backend socket and `RESERVED_FILES` are kept (0 when ``open_files`` is unknown:
    no cap). Without a request cap (``max_in_flight`` 0) half the files go to backends."""
    if open_files <= 0:
        return 0
    upstream = max_in_flight if max_in_flight > 0 else open_files // 2
    return max(64, open_files - upstream - RESERVED_FILES)


def refusal_body(max_connections: int) -> bytes:
    """The JSON body of the answer to a connection over the cap."""
    return json.dumps({"error": {
        "message": f"the gateway holds its limit of {max_connections} connections; retry shortly",
        "type": "server_error", "param": None, "code": "overloaded"}}).encode()


def refusal(body: bytes) -> bytes:
    """The whole HTTP/1.1 answer sent on a connection over the cap (`retry_after_headers`)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in retry_after_headers().items())
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n{head}"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class JsonErrors(RequestHandler):
    """aiohttp's connection handler, its own error answers (`handle_error`: an unparsable
    request, 400; a handler that failed or timed out, 500 / 504) in OpenAI's JSON error shape
    instead of text/plain, with the status, logging and closing of the connection unchanged.

    aiohttp makes its handlers itself (``web.Server.__call__``) from a class with
    ``__slots__``; this subclass adds none, so a made handler can take it as its class
    (`GuardedRunner.server`).
    """

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; raises if the answer began
        if status < 500:
            text, kind = f"malformed HTTP request: {message or plain.reason}", "invalid_request_error"
        else:
            text, kind = "internal server error", "server_error"
        resp = web.json_response({"error": {"message": text, "type": kind, "param": None, "code": None}},
                                 status=status)
        resp.force_close()
        return resp


class _Refused(asyncio.Protocol):
    """Answers `refusal`, half-closes, discards the request, closes when the client does.
    ``lingering`` (a one-element list shared with the runner) counts the open ones."""

    def __init__(self, body: bytes, lingering: list):
        self._body = body
        self._lingering = lingering
        self._timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport):
        self._lingering[0] += 1
        transport.write(refusal(self._body))
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.abort)

    def data_received(self, data):  # the request: never read
        pass

    def eof_received(self):
        return False  # the client is done: close

    def connection_lost(self, exc):
        self._lingering[0] -= 1
        if self._timer is not None:
            self._timer.cancel()


class _Reset(asyncio.Protocol):
    """Resets the connection at once (frees its file now)."""

    def connection_made(self, transport):
        transport.abort()


def reclaim_idle(handlers) -> bool:
    """Close the client connection idle longest between requests, to make room for a new one;
    True if one was closed. Idle: it has answered at least one request and has none in
    progress or queued (a connection still to send its first request is not idle: that is
    a slow client, and a new one would be no more deserving). Reads aiohttp's
    ``RequestHandler`` state (3.10+); without it, nothing is closed."""
    best, best_t = None, None
    for h in handlers:
        if (getattr(h, "_request_count", 0) < 1 or getattr(h, "_request_in_progress", True)
                or getattr(h, "_messages", None) or getattr(h, "_close", True) or getattr(h, "_force_close", True)):
            continue
        t = getattr(h, "_next_keepalive_close_time", 0.0)  # the end of its keep-alive: earliest = idle longest
        if best is None or t < best_t:
            best, best_t = h, t
    if best is None:
        return False
    best.force_close()  # no request in progress or queued (close() would wait for the next one)
    return True


class GuardedRunner(web.AppRunner):
    """An `aiohttp.web.AppRunner` whose sites hand a connection to the app only while fewer
    than ``max_connections`` are open (0: no cap); the rest get `refusal`, or a reset while
    `MAX_LINGERING` refused ones are still open.

    ``counts["connections"]`` counts those connections (the admission counts of
    `gateway.limits.CallerLimits`, exported as ``gateway_requests_rejected_total``). Sites
    build their listener from the runner's ``server`` property; this one returns a guarded
    protocol factory around the real server.
    """

    def __init__(self, app: web.Application, max_connections: int, counts: Optional[dict] = None, **kwargs):
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_SECONDS)
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.counts = counts if counts is not None else {}
        self._body = refusal_body(max_connections)
        self._lingering = [0]
        self._refusals = Tally(lambda n: log.warning(  # one log line per 10 s, not one per connection
            "at the limit of %d client connections: refused %d connection(s) (503, or a reset while %d refused "
            "ones were open)", max_connections, n, MAX_LINGERING))
        self.reclaimed = 0  # idle keep-alive connections closed to admit new ones (`reclaim_idle`)
        self._rescan_at = 0.0
        self._reclaims = Tally(lambda n: log.info(
            "at the limit of %d client connections: closed %d idle keep-alive connection(s) to admit new ones",
            max_connections, n))

    @property
    def server(self):
        inner = super().server
        if inner is None:
            return inner

        def handler():
            h = inner()
            h.__class__ = JsonErrors  # its error answers in JSON (`JsonErrors`)
            return h

        if self.max_connections <= 0:
            return handler
        # aiohttp keeps its connections in a dict; `connections` copies it into a list.
        conns = getattr(inner, "_connections", None)

        def factory():
            n = len(conns) if conns is not None else len(inner.connections)
            if n < self.max_connections or self._reclaim(conns if conns is not None else inner.connections):
                if n >= self.max_connections:
                    self.reclaimed += 1
                    self._reclaims.add()
                return handler()
            self._refuse()
            if self._lingering[0] >= MAX_LINGERING:
                return _Reset()
            return _Refused(self._body, self._lingering)

        return factory

    def _reclaim(self, handlers) -> bool:
        """`reclaim_idle`, but after a scan that found nothing idle, no scan for
        `RESCAN_SECONDS`: a flood of new connections at the cap would otherwise walk every
        open connection once per accept."""
        now = time.monotonic()
        if now < self._rescan_at:
            return False
        if reclaim_idle(handlers):
            return True
        self._rescan_at = now + RESCAN_SECONDS
        return False

    def _refuse(self) -> None:
        self.counts["connections"] = self.counts.get("connections", 0) + 1
        self._refusals.add()
