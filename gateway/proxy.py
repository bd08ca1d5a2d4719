"""Forwarding to backends: connection pool, retries before the first byte,
pass-through streaming, and cancellation on client disconnect.

A request is retried on the next-best backend only while nothing has been
sent to the client (connection refused or reset, or a 5xx before any body),
so retries are idempotent. Once streaming, a backend failure becomes a
well-formed SSE error event and end of stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

import aiohttp
from aiohttp import web

log = logging.getLogger("mlxgw.gateway.proxy")

# Hop-by-hop and length headers are not passed through.
_SKIP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}


class InFlight:
    """This gateway's in-flight work per backend.

    ``view()`` gives (requests, prefill tokens); prefill tokens count only
    requests sent within the last ``fresh`` seconds and not yet answering:
    older ones already show in the backend's own heartbeat figure, and
    counting them twice would push traffic off the backends that own the
    prefixes.
    """

    def __init__(self, fresh: float = 1.0):
        self.fresh = fresh
        self._live: dict[str, dict[int, tuple[float, int]]] = {}
        self._n = 0

    def begin(self, backend: str, prefill_tokens: int) -> int:
        self._n += 1
        self._live.setdefault(backend, {})[self._n] = (time.monotonic(), prefill_tokens)
        return self._n

    def started(self, backend: str, handle: int) -> None:
        """The backend began answering: its prefill is done."""
        d = self._live.get(backend, {})
        if handle in d:
            d[handle] = (d[handle][0], 0)

    def end(self, backend: str, handle: int) -> None:
        self._live.get(backend, {}).pop(handle, None)

    def view(self) -> dict[str, tuple[int, int]]:
        now = time.monotonic()
        return {
            b: (len(d), sum(tok for t, tok in d.values() if now - t < self.fresh))
            for b, d in self._live.items()
        }


@dataclass
class Attempt:
    backend_id: str
    url: str
    prefill_tokens: int
    headers: dict


class BackendUnavailable(Exception):
    """Every candidate failed before the first byte."""


class Proxy:
    """Forwards requests to backends over one pooled ``aiohttp.ClientSession``.

    Args:
        internal_token: bearer token the backends require (None: none).
        connect_timeout: seconds to open a connection.
        read_timeout: seconds without a byte from the backend before giving up
            (a hung backend; covers long prefills since backends send
            keep-alives while streaming).
        write_timeout: seconds a client may leave a chunk unread before the
            answer is dropped (a client that stopped reading a stream).
    """

    def __init__(self, internal_token: Optional[str] = None, connect_timeout: float = 2.0, read_timeout: float = 300.0,
                 write_timeout: float = 60.0):
        self.internal_token = internal_token
        self.write_timeout = write_timeout
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.session: Optional[aiohttp.ClientSession] = None
        self.inflight = InFlight()
        self.retries = 0
        self.failures: dict[str, float] = {}  # backend -> time of last connect failure

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    def recently_failed(self, backend_id: str, window: float = 2.0) -> bool:
        t = self.failures.get(backend_id)
        return t is not None and time.monotonic() - t < window

    async def forward(
        self,
        request: web.Request,
        attempts: list[Attempt],
        path: str,
        payload: bytes,
        content_type: str,
        stream: bool,
    ) -> web.StreamResponse:
        """Send ``payload`` to the first attempt that answers; stream its answer back.

        Raises:
            BackendUnavailable: every attempt failed before the first byte.
        """
        headers = {"Content-Type": content_type}
        if self.internal_token:
            headers["Authorization"] = f"Bearer {self.internal_token}"
        last_err = None
        for i, a in enumerate(attempts):
            if i > 0:
                self.retries += 1
            handle = self.inflight.begin(a.backend_id, a.prefill_tokens)
            prefill_open = True
            try:
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout)
                async with self.session.post(a.url + path, data=payload, headers=headers, timeout=timeout) as up:
                    if up.status >= 500:
                        last_err = f"backend {a.backend_id} answered {up.status}"
                        await up.read()
                        continue
                    out = web.StreamResponse(status=up.status)
                    for k, v in up.headers.items():
                        if k.lower() not in _SKIP:
                            out.headers[k] = v
                    out.headers.update(a.headers)
                    await out.prepare(request)
                    is_sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
                    try:
                        async for chunk in up.content.iter_any():
                            if prefill_open and (not is_sse or b"data:" in chunk):
                                self.inflight.started(a.backend_id, handle)
                                prefill_open = False
                            try:
                                await asyncio.wait_for(out.write(chunk), self.write_timeout)
                            except asyncio.TimeoutError:
                                # The client stopped reading: drop it; leaving the
                                # upstream block closes the backend connection, which
                                # cancels the generation there.
                                log.info("client stopped reading for %.0fs; dropping the answer", self.write_timeout)
                                if request.transport is not None:
                                    request.transport.abort()
                                return out
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        log.warning("backend %s failed mid-answer: %s", a.backend_id, e)
                        self.failures[a.backend_id] = time.monotonic()
                        if is_sse:
                            err = {"error": {"message": f"backend failed mid-stream: {type(e).__name__}", "type": "server_error", "param": None, "code": "backend_failed"}}
                            await out.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
                    await out.write_eof()
                    return out
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                # Nothing reached the client yet: try the next backend.
                last_err = f"{a.backend_id}: {type(e).__name__}: {e}"
                self.failures[a.backend_id] = time.monotonic()
                log.warning("backend %s unavailable before first byte: %s", a.backend_id, e)
                continue
            finally:
                self.inflight.end(a.backend_id, handle)
        raise BackendUnavailable(last_err or "no backend")
