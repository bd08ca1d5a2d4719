"""Forwarding to backends: connection pool, retries before the first byte,
pass-through streaming, and cancellation on client disconnect.

A response can be rewritten on its way (``transform``: the Anthropic and
Responses dialects turn the backend's OpenAI answer into their own), and a
streamed answer that falls silent for ``keepalive`` seconds (a long prefill,
a queue) gets an SSE comment so clients with idle timeouts keep waiting.

A request is retried on the next-best backend only while no answer has
reached the client (connection refused or reset, a 5xx before any body, a
whole JSON answer cut off before it was complete: those are read in full,
then sent in one write; or a stream whose backend failed before its first
token, when the client has had only its headers and SSE comments: the
retry's events continue that stream, whose headers still name the first
backend), so retries are idempotent. Once a data event went out, a backend
failure becomes a well-formed SSE error event and end of stream.

A backend that hangs without closing its sockets (stopped, swapping, a
wedged GPU) stops heartbeating and leaves the Redis registry within its
heartbeat TTL. Its requests are not left waiting for ``read_timeout``: once
it has been out of the registry for ``gone_after`` seconds, a request still
waiting for its answer goes to the next backend, and a stream it had begun
ends with the error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from mlxgw import schema
from mlxgw.rlimit import out_of_resources
from mlxgw.util import Tally, cancel_and_wait, deadline

log = logging.getLogger("mlxgw.gateway.proxy")

# Hop-by-hop and length headers are not passed through.
_SKIP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server",
         "x-mlxgw-served-by"}


class InFlight:
    """This gateway's in-flight work per backend.

    ``view()`` gives (running decodes, prefill tokens): a request counts as
    many decodes as it has choices (``n``); prefill tokens count the requests
    not yet answering that were sent within the last ``fresh`` seconds. A
    streamed request stops counting at its first token, and counts down by
    its backend's progress comments before it (`progress`; session 54); a
    non-streamed one sends its first byte only at the end, so the window
    bounds how long its prefill is assumed to be waiting. The window cuts
    streamed requests too: counting them until their first token (a prefill
    queued past a second stays in the figure, as the backend still has it to
    do: helper-84) lost hits and p99 TTFT in all four rounds of a side-by-side
    replay, the load weight having been measured with the window (session 45,
    ``bench/results/session45/queued-window-ab/``; docs/routing.md). Session
    54 counted a stream that had reported progress past the window, until its
    first token: level on the traces (``bench/results/session54/progress-hold-*``).
    """

    def __init__(self, fresh: float = 1.0):
        self.fresh = fresh
        self._live: dict[str, dict[int, tuple[float, int, int]]] = {}  # handle -> (sent at, prefill, decodes)
        self._n = 0

    def begin(self, backend: str, prefill_tokens: int, decodes: int = 1) -> int:
        self._n += 1
        self._live.setdefault(backend, {})[self._n] = (time.monotonic(), prefill_tokens, decodes)
        return self._n

    def started(self, backend: str, handle: int) -> None:
        """The backend began answering: its prefill is done."""
        d = self._live.get(backend, {})
        if handle in d:
            d[handle] = (d[handle][0], 0, d[handle][2])

    def progress(self, backend: str, handle: int, left: int) -> None:
        """The backend reports ``left`` prompt tokens still to prefill for this request: its
        figure drops to that (never rises: ours may have counted a cache hit it did not find)."""
        d = self._live.get(backend, {})
        if handle in d and d[handle][1] > left:
            d[handle] = (d[handle][0], left, d[handle][2])

    def end(self, backend: str, handle: int) -> None:
        self._live.get(backend, {}).pop(handle, None)

    def backends(self) -> set[str]:
        """Backends with at least one request in flight from this gateway."""
        return {b for b, d in self._live.items() if d}

    def view(self) -> dict[str, tuple[int, int]]:
        now = time.monotonic()
        return {
            b: (sum(n for _, _, n in d.values()), sum(tok for t, tok, _ in d.values() if now - t < self.fresh))
            for b, d in self._live.items()
        }


@dataclass
class Attempt:
    backend_id: str
    url: str
    prefill_tokens: int
    headers: dict
    decodes: int = 1  # the request's choices (``n``): decodes it runs there
    first_byte_at: float = 0.0  # perf_counter() of the first answer byte (SSE: first data event)
    failed: bool = False  # the backend failed mid-stream (the client got an error event)
    tried: bool = False  # the request was sent to this backend
    gone: bool = False  # given up: the backend left the registry while this request waited on it
    client_gone: bool = False  # the client left during the answer (a write to it failed)
    stopped: bool = False  # its stream outlasted the gateway's drain at stop (`Proxy.begin_drain`)
    answered: bool = False  # the client got this backend's answer (a stream retried elsewhere: False)
    # The request reached no backend: no connection (not listening, TLS refused) or another
    # server answered at its URL. Such a try is not one of ``max_tries`` (helper-68: four
    # registered URLs nothing listened on took every try, a 503 beside two idle backends).
    free: bool = False
    # The backend's answer headers once they came (its X-Mlxgw-Cached-Tokens: the metrics count a
    # stream the client then left, when no response to the client is left to read them from).
    answer_headers: Optional[Mapping[str, str]] = None
    # Why the backend cut this stream, from its `schema.failed_comment`: (fatal, reason)
    cut_why: Optional[tuple] = None


def _set_cached(a: Attempt, cached: int) -> None:
    """Record the cache hit (prompt tokens) a backend sent after its headers as if it had been one
    of them: the metrics, the access log and the client's headers read it there."""
    headers = CIMultiDict(a.answer_headers or {})
    headers[schema.CACHED_TOKENS] = str(cached)
    a.answer_headers = headers


def _late_answer(up: aiohttp.ClientResponse, data: bytes) -> Optional[tuple]:
    """For a whole JSON answer whose headers the backend sent before it was done (no
    `schema.CACHED_TOKENS`; it sent newlines while it worked, `backend.server._collect`):
    ``(body, cached, failure, code)``: the body without the newlines, its usage's cached tokens
    (None: none given), its error message and code (None, None: no error; the 200 went out
    before it failed). None for an answer sent whole."""
    if up.status != 200 or schema.CACHED_TOKENS in up.headers:
        return None
    data = data.lstrip()
    try:
        obj = json.loads(data)
    except ValueError:
        return data, None, None, None  # not ours to judge: passed on as it came
    if not isinstance(obj, dict):
        return data, None, None, None
    if "error" in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {}
        return data, None, str(err.get("message") or obj["error"]), err.get("code")
    details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return data, int(cached) if isinstance(cached, int) else None, None, None


class Transform(Protocol):
    """Rewrites one backend answer into another dialect (see ``gateway.dialects``).

    ``begin`` gets the backend's status and headers and the routing headers,
    and returns the headers to set (e.g. ``Content-Type``); ``feed`` gets raw
    body bytes and returns bytes to send; ``end`` flushes at end of body;
    ``fail`` renders a mid-stream backend failure; ``keepalive`` is what a
    silent stream gets.
    """

    def begin(self, status: int, headers: Mapping[str, str], route: Mapping[str, str]) -> dict: ...
    def feed(self, data: bytes) -> bytes: ...
    def end(self) -> bytes: ...
    def fail(self, message: str, code: str = "backend_failed") -> bytes: ...
    def keepalive(self) -> bytes: ...


KEEPALIVE = b": keepalive\n\n"
ERROR_EVENT = b'\ndata: {"error"'  # a backend's error event, at a line's start (`backend.server._sse`)

#: The backend id a backend puts on every answer (``backend.server``): the gateway checks that the
#: backend it meant answered, not another one at the same URL.
SERVED_BY = schema.SERVED_BY
FORWARDED_BY, GATEWAY_ID = schema.FORWARDED_BY, schema.GATEWAY_ID


#: Backends a request may see fail after taking it before it is sent to no more (`Proxy.forward`).
MAX_DEATHS = 2
# Seconds a backend must have had a whole (non-streamed) request before its connection closing
# counts towards MAX_DEATHS: a pooled connection of a backend that died idle fails at once.
TOOK_IT_AFTER = 1.0


def _died_with_it(e: BaseException) -> bool:
    """True when a backend that had taken the request (its stream's headers came) failed: its
    connection closed or reset (a crash, an out-of-memory kill); not a timeout or a hang."""
    return (isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))
            and not isinstance(e, aiohttp.ClientConnectorError))


def _before_answer(e: BaseException) -> str:
    """A backend's failure before its answer, in the client's terms (helper-66: the 503 said
    ``ServerDisconnectedError``); the gateway's log adds the exception itself."""
    if isinstance(e, aiohttp.ClientSSLError):  # helper-67: was "not listening there"
        return ("no TLS connection at its registered URL (an https:// URL where it serves plain http, "
                "or a certificate this machine does not trust)")
    if isinstance(e, aiohttp.ClientConnectorError):
        return "no connection at its registered URL (not listening there: stopped, restarting, or a wrong --url)"
    if isinstance(e, aiohttp.InvalidURL):
        return "its registered URL cannot be used"
    if "answer cut off" in str(e):
        return "its connection closed in the middle of the answer (the process stopped or restarted)"
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        return "its connection closed before it answered (the process stopped or restarted)"
    return f"the request to it failed ({type(e).__name__})"


TOKEN_REJECTED = ("rejected this gateway's internal token (start gateways and backends with the same "
                  "--internal-token / MLXGW_INTERNAL_TOKEN)")


# A gateway with no token at all (helper-69: joined to a `mlxgw serve` stack without it, it was
# told the backends "rejected this gateway's internal token", though it sent none).
_GIVE_TOKEN = ("start it with --internal-token / MLXGW_INTERNAL_TOKEN set to the backends' token; `mlxgw serve` "
               "leaves its token in the serve-internal-token file its summary names")
TOKEN_MISSING = f"refused a request without an internal token, and {schema.NO_TOKEN_MARK} ({_GIVE_TOKEN})"


# The registry says a backend needs a token this gateway lacks (`Proxy.note_registry`).
TOKEN_NEEDED = f"requires an internal token, and {schema.NO_TOKEN_MARK} ({_GIVE_TOKEN})"


def unavailable_message(errs: list[str]) -> str:
    """The 503's reason from each failed attempt's, in order: backends that refused the
    internal token named together, the rest joined by ``; `` (helper-65: only the last
    backend was named, though the gateway had tried them all)."""
    out = list(errs)
    for why in (TOKEN_MISSING, TOKEN_REJECTED):
        refused = [e.split(" ", 2)[1] for e in out if e.startswith("backend ") and e.endswith(" " + why)]
        out = [e for e in out if not (e.startswith("backend ") and e.endswith(" " + why))]
        if refused:
            out.insert(0, f"backend{'s' if len(refused) > 1 else ''} {', '.join(refused)} {why}")
    return "; ".join(out) or "no backend"


class BackendUnavailable(Exception):
    """Every candidate failed before the first byte.

    ``timed_out`` is True when the last failure was a read timeout (a hung
    backend) rather than a refused or reset connection.
    """

    def __init__(self, msg: str, timed_out: bool = False):
        super().__init__(msg)
        self.timed_out = timed_out


class OutOfResources(Exception):
    """This gateway ran out of open files (or buffers, memory) connecting to a backend: its
    own overload, not the backend's failure, so no circuit trip and no next backend (it
    would fail the same way)."""


class BackendGone(Exception):
    """The backend stopped heartbeating (left the registry) while a stream from it was silent."""


def _expire(timer) -> None:
    """End a `Proxy._waiting_on` block now (TimeoutError inside it)."""
    # asyncio.Timeout.reschedule; async_timeout (Python 3.10) before 4.0.3 has update
    move = getattr(timer, "reschedule", None) or timer.update
    move(asyncio.get_running_loop().time())


class GatewayStopping(Exception):
    """The gateway is stopping and an answer outlasted its drain (`Proxy.begin_drain`): a stream
    ends with an error event; `Proxy.forward` raises it for an answer not yet being sent."""


class Proxy:
    """Forwards requests to backends over one pooled ``aiohttp.ClientSession``.

    Args:
        internal_token: bearer token the backends require (None: none).
        connect_timeout: seconds to open a connection.
        read_timeout: seconds without a byte from the backend before giving up
            (a hung backend; covers long prefills since backends send
            keep-alives while streaming). 0: no limit (a hung backend is then
            found only by its heartbeat ending).
        keepalive: seconds of silence on a streamed answer before the
            gateway sends an SSE keep-alive itself (0: never). Clients abort
            idle streams after 30-300 s; 10 s or less keeps them all waiting.
        write_timeout: seconds a client may leave a chunk unread before the
            answer is dropped (a client that stopped reading a stream).
        url_of: the registry's current URL of a backend id, None when it is not
            registered (the gateway's registry snapshot). An open circuit is probed
            at that URL, so a backend that came back elsewhere is seen, and dropped
            once the backend has left the registry. None: probe the URL that failed,
            and never give up on a backend for leaving the registry.
        gone_after: seconds a backend with requests in flight may be missing from
            the registry before they are given up (retried elsewhere while nothing
            reached the client, else ended with an error event); 0: never. A
            registry emptied by a Redis restart fills again within a heartbeat
            (1 s), well inside the default; a snapshot kept while Redis is down
            still lists every backend, so an outage gives nothing up.
    """

    def __init__(self, internal_token: Optional[str] = None, connect_timeout: float = 2.0, read_timeout: float = 300.0,
                 keepalive: float = 5.0, write_timeout: float = 60.0,
                 url_of: Optional[Callable[[str], Optional[str]]] = None, gone_after: float = 3.0):
        self.internal_token = internal_token
        self.keepalive = keepalive
        self.write_timeout = write_timeout
        self.connect_timeout = connect_timeout
        self.gateway_id = "gateway"  # sent in `FORWARDED_BY`; `gateway.app` sets this gateway's id
        self.read_timeout = read_timeout
        self.session: Optional[aiohttp.ClientSession] = None
        self.inflight = InFlight()
        # Count a stream's queued prefill down by its backend's progress comments
        # (`RoutingConfig.prefill_progress`; `gateway.app` sets it).
        self.prefill_progress = True
        self.retries = 0
        # Circuit breaker: a backend that failed (refused, reset, hung) is
        # skipped until its /health answers again (probed every second).
        self.open: dict[str, str] = {}  # backend id -> url, while its circuit is open
        # Backends whose last answer refused this gateway's internal token (a setup error that
        # no retry mends; /health says so) -> the URL it came from: skipped like an open circuit
        # (helper-64: such a backend took the first try of most requests, for good), until a
        # probe with the token is accepted or an answer from it comes anyway.
        self.token_rejected: dict[str, str] = {}
        # Backends whose registered URL is answered by another backend -> that URL: skipped
        # until it answers as them (probed every second) or they leave the registry.
        self.misaddressed: dict[str, str] = {}
        self.url_of = url_of
        self.gone_after = gone_after
        self._prober: Optional[asyncio.Task] = None
        self._watcher: Optional[asyncio.Task] = None
        self._waiting: dict[object, tuple[Attempt, object]] = {}  # requests awaiting an answer -> their timer
        self._absent: dict[str, float] = {}  # backend id -> monotonic time first seen out of the registry
        self.stop_at: Optional[float] = None  # monotonic time streams still running end (begin_drain)
        self._drain = 0.0
        self._hurried = False  # `end_drain`: a second stop signal ended the drain
        self._resource_error = ""  # the last EMFILE connect, for the log line
        self._resource_failures = Tally(lambda n: log.warning(  # one log line per 10 s, not one per request
            "out of open files or memory connecting to backends: %d request(s) answered 503 (last: %s)",
            n, self._resource_error))

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
        )
        self._prober = asyncio.create_task(self._probe_loop(), name="circuit-prober")
        if self.url_of is not None and self.gone_after > 0:
            self._watcher = asyncio.create_task(self._watch_loop(), name="gone-backend-watch")

    async def close(self) -> None:
        await cancel_and_wait(self._prober)
        await cancel_and_wait(self._watcher)
        if self.session:
            await self.session.close()

    def skipped(self) -> dict[str, str]:
        """Backend id -> why this gateway skips it though it is live and compatible, for a reason
        of the backend's (its URL answers as another), published with the gateway's settings:
        the backend's log and ``mlxgw status`` show it."""
        return {b: (f"its registered URL {url} does not answer as it (start it with --url "
                    "http://<address>:<port>, an address the gateways reach it at)")
                for b, url in self.misaddressed.items()}

    def refused(self) -> dict[str, str]:
        """Backend id -> why it refuses this gateway's requests (the internal token), published
        with the gateway's settings apart from `skipped`: the wrong side may be the gateway's."""
        why = ("it refuses the gateway's internal token (start it with the same --internal-token / "
               "MLXGW_INTERNAL_TOKEN)" if self.internal_token else
               "it requires an internal token and the gateway has none (start the gateway with the backends' "
               "--internal-token / MLXGW_INTERNAL_TOKEN)")
        return {b: why for b in self.token_rejected}

    def note_registry(self, snapshot: dict) -> None:
        """Skip, from the registry snapshot on (model -> `schema.Candidate` list), every backend
        that publishes ``auth: token`` while this gateway has no internal token, and say so once
        per backend: its requests would be refused (helper-69: a gateway joined to a `mlxgw
        serve` stack without the token heard nothing at start, then lost a try per backend).
        The probe loop clears one that comes back taking requests without a token."""
        if self.internal_token:
            return
        for cs in snapshot.values():
            for c in cs:
                if c.auth == "token" and c.backend_id not in self.token_rejected:
                    log.error("backend %s %s; skipped until it accepts requests without one (probed every "
                              "second)", c.backend_id, TOKEN_NEEDED)
                    self.token_rejected[c.backend_id] = c.url

    def begin_drain(self, seconds: float) -> None:
        """The gateway is stopping: streams still running in ``seconds`` end with an error event
        naming the stop (helper-64: `mlxgw serve`'s Ctrl-C cut them bare, with no log line)."""
        self._drain = seconds
        self.stop_at = time.monotonic() + seconds
        n = sum(reqs for reqs, _ in self.inflight.view().values())
        log.info("stopping: %d answer(s) in flight get up to %g s to finish (--drain-seconds)", n, seconds)
        asyncio.get_running_loop().call_later(seconds, self._stop_waiting)

    def end_drain(self) -> None:
        """A second stop signal during the drain: the answers still in flight end now, as at the
        drain's end (streams with an error event naming the stop, the rest a 503)."""
        if self.stop_at is None or time.monotonic() >= self.stop_at:
            return
        n = sum(reqs for reqs, _ in self.inflight.view().values())
        log.warning("stopping now (a second stop signal): %d answer(s) in flight end without their drain", n)
        self.stop_at = time.monotonic()
        self._hurried = True
        self._stop_waiting()

    def _cut(self) -> str:
        """Why an answer ended at the gateway's stop, after \"the answer\" or \"it\"."""
        return ("was cut short by a second stop signal" if self._hurried
                else f"outlasted its {self._drain:g}-s drain")

    def _stop_waiting(self) -> None:
        # Answers not yet being sent at the drain's end (a whole one being computed or read, a
        # stream's retry before its headers): forward ends them (GatewayStopping, a 503 or the
        # stream's error event) instead of the closed connection aiohttp's cancel a second
        # later leaves. Leaving the block closes the backend connection, which cancels its work.
        for a, timer in list(self._waiting.values()):
            a.stopped = True
            _expire(timer)

    def recently_failed(self, backend_id: str) -> bool:
        """True while the backend's circuit is open (failed, not yet healthy again), it
        refuses this gateway's internal token, or another backend answers at its URL."""
        return backend_id in self.open or backend_id in self.token_rejected or backend_id in self.misaddressed

    def _misaddressed(self, a: Attempt, who: str) -> None:
        """Skip ``a``'s backend: its registered URL answers as ``who`` (another backend, or not one)."""
        if a.backend_id not in self.misaddressed:
            log.error("backend %s registered the URL %s, where %s answers: this gateway cannot reach %s there "
                      "(start it with --url http://<address>:<port>, an address this machine reaches it at); "
                      "skipped until that URL answers as %s", a.backend_id, a.url, who, a.backend_id, a.backend_id)
        self.misaddressed[a.backend_id] = a.url

    def _trip(self, backend_id: str, url: str) -> None:
        if backend_id not in self.open:
            log.warning("circuit open for backend %s", backend_id)
        self.open[backend_id] = url

    async def _probe_loop(self, interval: float = 1.0) -> None:
        """Every second, ask each skipped backend again at the URL the registry has for it now
        (dropping one that has left it): an open circuit closes on a 200 from ``/health``; a
        refused token clears once ``/v1/models``, which needs the token (``/health`` does not),
        answers 200; a misaddressed backend once ``/health`` answers as it."""
        token = {"Authorization": f"Bearer {self.internal_token}"} if self.internal_token else {}

        async def healthy(r, bid) -> bool:
            return r.status == 200

        async def is_itself(r, bid) -> bool:
            return (await r.json(content_type=None) or {}).get("backend") == bid

        while True:
            await asyncio.sleep(interval)
            for bid, url in list(self.open.items()):
                await self._probe(self.open, bid, url, "/health", {}, healthy,
                                  "circuit closed for backend {bid} (healthy again)",
                                  "circuit dropped for backend {bid} (no longer registered)")
            for bid, url in list(self.token_rejected.items()):
                await self._probe(self.token_rejected, bid, url, "/v1/models", token, healthy,
                                  "backend {bid} accepts this gateway's internal token now")
            for bid, url in list(self.misaddressed.items()):
                await self._probe(self.misaddressed, bid, url, "/health", {}, is_itself,
                                  "backend {bid} answers at its registered URL {url} now")

    async def _probe(self, skips: dict, bid: str, url: str, path: str, headers: dict, cleared,
                     cleared_msg: str, gone_msg: Optional[str] = None) -> None:
        """One probe of a backend in ``skips`` (backend id -> URL): removed when ``await
        cleared(response, bid)`` is true (logged with ``cleared_msg``, a format string of ``bid``
        and ``url``), or when the backend has left the registry (``gone_msg``, if any); an
        unanswered probe changes nothing."""
        if self.url_of is not None:
            url = self.url_of(bid)
            if url is None:  # gone from the registry: nothing routes to it any more
                skips.pop(bid, None)
                if gone_msg:
                    log.info(gone_msg.format(bid=bid))
                return
        try:
            async with self.session.get(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                ok = await cleared(r, bid)
        except Exception:
            return
        if ok:
            skips.pop(bid, None)
            log.info(cleared_msg.format(bid=bid, url=url))

    def gone(self, backend_id: str) -> bool:
        """True once the backend has been out of the registry for ``gone_after`` seconds."""
        t = self._absent.get(backend_id)
        return t is not None and time.monotonic() - t >= self.gone_after

    async def _watch_loop(self, interval: float = 0.5) -> None:
        """Track which backends with requests in flight left the registry; give up on theirs."""
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            # Busy backends out of the registry, with the time each was first seen so.
            self._absent = {b: self._absent.get(b, now) for b in self.inflight.backends() if self.url_of(b) is None}
            for a, timer in list(self._waiting.values()):
                if not a.gone and self.gone(a.backend_id):
                    a.gone = True
                    _expire(timer)  # raises TimeoutError in forward

    @contextlib.asynccontextmanager
    async def _waiting_on(self, a: Attempt):
        """The block waits for ``a``'s answer; `_watch_loop` ends it (TimeoutError) if the backend is gone."""
        async with deadline(None) as timer:
            key = object()
            self._waiting[key] = (a, timer)
            try:
                yield
            finally:
                del self._waiting[key]

    async def forward(
        self,
        request: web.Request,
        attempts: list[Attempt],
        path: str,
        payload: bytes,
        content_type: str,
        stream: bool,
        transform: Optional[Transform] = None,
        max_tries: Optional[int] = None,
    ) -> web.StreamResponse:
        """Send ``payload`` to the first attempt that answers; stream its answer back.

        At most ``max_tries`` attempts (None: all) are tried, not counting those the request
        never reached a backend on (`Attempt.free`): a failed one costs nothing there.

        ``transform`` (optional) rewrites the answer; without it the bytes
        pass through untouched. The attempt whose answer the client got is
        marked ``answered``; one whose stream failed is marked ``failed`` when the
        client got the error event.

        Raises:
            BackendUnavailable: every attempt failed before the first byte (no
                connection, no answer in time, a 5xx, or a 401: the backend refused
                this gateway's internal token).
            OutOfResources: connecting failed for want of open files (EMFILE) or memory.
            GatewayStopping: the gateway's drain ended before the answer started (a whole,
                non-streamed one included: it is sent only once read whole).
        """
        headers = {"Content-Type": content_type, FORWARDED_BY: self.gateway_id}
        if self.internal_token:
            headers["Authorization"] = f"Bearer {self.internal_token}"
        last_err = None
        timed_out = False
        t_feed = transform.feed if transform else (lambda b: b)
        out: Optional[web.StreamResponse] = None  # the client's stream, once its headers went out
        failed: Optional[tuple[Attempt, str]] = None  # a stream's backend that failed before its first token
        died = 0  # backends that failed after taking this request (not refused, not hung)
        errs: list[str] = []  # each failed attempt's reason, in order (the 503 names them all)
        for i, a in enumerate(attempts):
            if max_tries is not None and sum(b.tried and not b.free for b in attempts[:i]) >= max_tries:
                break
            if died >= MAX_DEATHS:
                # Not on more: a request that crashes backends (one that runs them out of memory,
                # say) would take every one down in turn (helper-64's concern).
                last_err = (f"{last_err}; {died} backends failed while serving this request, so it was not "
                            "sent to more")
                errs.append(f"{died} backends failed while serving this request, so it was not sent to more")
                break
            if i > 0:
                self.retries += 1
            a.tried = True
            sent_at = time.monotonic()
            handle = self.inflight.begin(a.backend_id, a.prefill_tokens, a.decodes)
            try:
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout or None)
                async with contextlib.AsyncExitStack() as upstream:
                    async with self._waiting_on(a):  # until the answer is ours to send
                        up = await upstream.enter_async_context(
                            self.session.post(a.url + path, data=payload, headers=headers, timeout=timeout))
                        served_by = up.headers.get(SERVED_BY)
                        if served_by != a.backend_id:
                            # Another backend answers at this one's registered URL (a backend on another
                            # Mac that registered 127.0.0.1, helper-64), or no backend does (a URL with a
                            # path, or another server's port: every answer was its 404 or 400, never
                            # retried, helper-66): not its answer to give. Leaving the block closes the
                            # connection, which cancels any work there.
                            gateway = up.headers.get(GATEWAY_ID)
                            who = (f"backend {served_by}" if served_by is not None
                                   else f"mlxgw gateway {gateway} (not a backend)" if gateway is not None
                                   else f"something that is not an mlxgw backend (HTTP {up.status})")
                            last_err = f"backend {a.backend_id}: its registered URL answers as {who}"
                            errs.append(last_err)
                            self._misaddressed(a, who)
                            timed_out = False
                            a.free = True
                            continue
                        # A 504 is the backend's --request-timeout: the client's answer, not tried
                        # elsewhere, where it would take as long again (helper-91); as on a stream
                        if (up.status >= 500 and up.status != 504) or up.status == 401:
                            if up.status == 401:
                                # The backend refuses this gateway's internal token: a setup
                                # error between the two, not the client's credentials.
                                last_err = f"backend {a.backend_id} {TOKEN_REJECTED if self.internal_token else TOKEN_MISSING}"
                                if a.backend_id not in self.token_rejected:  # once, until it takes the token
                                    log.error("%s; skipped until it accepts it (probed every second)", last_err)
                                self.token_rejected[a.backend_id] = a.url
                            else:
                                last_err = f"backend {a.backend_id} answered {up.status}"
                            errs.append(last_err)
                            timed_out = False
                            await up.read()
                            continue
                        self.token_rejected.pop(a.backend_id, None)
                        a.answer_headers = up.headers
                        status = up.status
                        is_sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
                        if not is_sse:
                            # A whole JSON answer: read it, then send headers and body in
                            # one write. Nothing reached the client yet, so a backend that
                            # fails mid-body is retried like one that failed before it.
                            try:
                                data = await up.read()
                            except aiohttp.ClientPayloadError as e:
                                if schema.CACHED_TOKENS not in up.headers:
                                    # Only its keep-alive newlines came (it writes its body whole)
                                    raise aiohttp.ServerDisconnectedError(f"closed after its headers: {e}") from e
                                raise aiohttp.ClientConnectionError(f"answer cut off: {e}") from e
                            late = _late_answer(up, data)
                            if late is not None:  # headers sent before the answer was done
                                data, cached, failure, code = late
                                if code == "timeout":  # its --request-timeout: what its 504 would have been
                                    status = 504
                                elif failure is not None:  # what a 5xx would have said
                                    last_err = f"backend {a.backend_id} failed: {failure}"
                                    errs.append(last_err)
                                    timed_out = False
                                    continue
                                if cached is not None:
                                    _set_cached(a, cached)
                    a.answered = True
                    if not is_sse:
                        self.inflight.started(a.backend_id, handle)
                        a.first_byte_at = time.perf_counter()
                        if out is not None:
                            # The retry of a stream answered whole (a 4xx error): the open
                            # stream carries it as its error event.
                            await self._stream_json(request, out, data, transform, t_feed)
                            return out
                        out = web.Response(status=status)
                        self._copy_headers(out, up, a, transform, status)  # transform.begin before any feed
                        out.body = t_feed(b"") + t_feed(data) + (transform.end() if transform else b"")
                        return out
                    try:
                        if out is None:
                            out = web.StreamResponse(status=up.status)
                            self._copy_headers(out, up, a, transform)
                            await out.prepare(request)
                            # A backend that sent its headers while the request waited for a decode
                            # slot sends its cache hit later (`schema.cached_comment`): a dialect's
                            # opening event (Anthropic's message_start has the usage) waits for it.
                            first = t_feed(b"") if schema.CACHED_TOKENS in up.headers else b""
                            if first:
                                await self._write(request, out, first)
                        else:
                            log.info("request %s: retried on backend %s after %s failed before its first token",
                                     a.headers.get("X-Mlxgw-Request-Id", "-"), a.backend_id, failed[0].backend_id)
                        err = await self._stream_body(request, out, up, a, handle, transform, t_feed)
                        if (err is not None and not a.first_byte_at and i + 1 < len(attempts)
                                and not isinstance(err, GatewayStopping)):
                            # Only SSE comments reached the client: the next backend can
                            # still give the whole answer on the same stream.
                            a.answered = False
                            died += _died_with_it(err)
                            if failed is None:
                                failed = (a, self._why(err, a))
                            last_err = f"{a.backend_id}: {self._why(err, a)}"
                            errs.append(last_err)
                            continue
                        if err is not None:
                            await self._fail_stream(request, out, a, self._why(err, a), transform)
                        elif transform is not None:
                            await self._write(request, out, transform.end())
                        await out.write_eof()
                    except ConnectionResetError:
                        # The client went away (aiohttp's ClientConnectionResetError
                        # is one): not the backend's fault, so no circuit trip and no
                        # retry. Leaving the upstream context cancels the backend's work.
                        a.client_gone = True
                        log.info("client disconnected during the answer from %s", a.backend_id)
                    return out
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # an invalid URL too (helper-65)
                if a.stopped and isinstance(e, asyncio.TimeoutError):  # `_stop_waiting`: the drain is over
                    if out is None:
                        raise GatewayStopping(f"the gateway is stopping and the answer from backend "
                                              f"{a.backend_id} {self._cut()}") from None
                    # A stream's retry: its headers went out, so the stop is its error event.
                    try:
                        await self._fail_stream(request, out, a, self._why(GatewayStopping()), transform)
                        await out.write_eof()
                    except ConnectionResetError:
                        a.client_gone = True
                    return out
                if out_of_resources(e):
                    self._resource_error = f"{a.backend_id}: {e}"
                    self._resource_failures.add()
                    if out is None:
                        raise OutOfResources(str(e)) from None
                    break  # a stream retried: it ends with its first failure's error event
                # Nothing reached the client yet: try the next backend.
                timed_out = isinstance(e, asyncio.TimeoutError)
                if a.gone:
                    what = f"out of the registry for {self.gone_after:g} s (no heartbeat) while this request waited"
                else:
                    what = f"no answer within {self.read_timeout:g} s" if timed_out else _before_answer(e)
                # An answer cut off mid-body counts, and a connection closed before the answer once
                # the backend had the request for `TOOK_IT_AFTER` s (its prefill, say); one closed
                # sooner may be a pooled connection the backend closed while idle (killed
                # earlier), not this request's doing.
                died += "answer cut off" in str(e) or (
                    isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
                    and not isinstance(e, aiohttp.ClientConnectorError)
                    and time.monotonic() - sent_at >= TOOK_IT_AFTER)
                a.free = isinstance(e, aiohttp.ClientConnectorError)  # never connected
                # The client hears the backend's id, not its address; the log has both.
                last_err = f"{a.backend_id}: {what}"
                errs.append(last_err)
                detail = what if timed_out or a.gone else f"{what}: {e}"
                if a.backend_id in self.open:  # tried again with its circuit open: said already
                    log.debug("backend %s unavailable before first byte: %s", a.backend_id, detail)
                else:
                    log.warning("backend %s unavailable before first byte: %s", a.backend_id, detail)
                self._trip(a.backend_id, a.url)
                continue
            finally:
                self.inflight.end(a.backend_id, handle)
        if out is not None:
            # A stream whose backend failed before its first token, and no retry answered:
            # its headers went out, so the error is an event (the first failure's, as without retries).
            why = failed[1]
            if last_err and not last_err.startswith(f"{failed[0].backend_id}:"):
                why += f"; the retry failed too ({last_err})"  # helper-64: only the first was named
            try:
                await self._fail_stream(request, out, failed[0], why, transform)
                await out.write_eof()
            except ConnectionResetError:
                failed[0].client_gone = True
            return out
        raise BackendUnavailable(unavailable_message(errs), timed_out)

    @staticmethod
    def _copy_headers(out: web.StreamResponse, up: aiohttp.ClientResponse, a: Attempt, transform,
                      status: Optional[int] = None) -> None:
        """The backend's headers (``a.answer_headers``: with a cache hit it sent later) and the
        routing ones onto ``out``; ``status``: the answer's (a late failure's 504), default ``up``'s."""
        status = up.status if status is None else status
        headers = a.answer_headers if a.answer_headers is not None else up.headers
        for k, v in headers.items():
            if k.lower() not in _SKIP:
                out.headers[k] = v
        out.headers.update(a.headers)
        if transform is not None:
            out.headers.update(transform.begin(status, headers, a.headers))

    async def _stream_body(self, request, out, up, a: Attempt, handle: int, transform, t_feed) -> Optional[BaseException]:
        """Copy (or transform) the backend's event stream to the client.

        Returns None when the backend's stream ended, or the failure reading it
        (its circuit is then open; ``a.first_byte_at`` is 0 when no data event had
        come, only comments). A stream that failed mid-event is closed at an event
        boundary, so a retry's events are not glued to its remains. A failure
        writing to the client raises ConnectionResetError to the caller.
        """
        prefill_open = True
        upstream_err = None
        tail = b"\n\n"  # the last two bytes from the backend (an event boundary at the start)
        while True:
            try:
                chunk = await self._read(up)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                upstream_err = e
                break
            if chunk == b"":  # the backend's answer ended
                break
            if chunk and schema.FAILED_MARK in chunk:  # the backend is about to cut the stream: why
                chunk, why = schema.parse_failed_comment(chunk, at_line_start=tail[-1:] == b"\n")
                a.cut_why = why or a.cut_why
            if chunk and (schema.QUEUED_COMMENT in chunk or schema.CACHED_MARK in chunk):
                # The request waits for a decode slot there, then its cache hit (`schema.KEEPALIVE_SECONDS`)
                chunk, queued, cached = schema.parse_queue_comments(chunk, at_line_start=tail[-1:] == b"\n")
                if cached is not None:
                    _set_cached(a, cached)
                    if transform is not None:
                        transform.cached_tokens = cached
                if queued and tail == b"\n\n":
                    await self._write(request, out, transform.keepalive() if transform else KEEPALIVE)
            if chunk and ERROR_EVENT in (b"\n" if tail[-1:] == b"\n" else b"") + chunk:
                # The backend ended the answer with an error event (its --request-timeout): a
                # failure, logged and counted so, though the stream's end is clean (helper-91)
                a.failed = True
            if chunk:
                tail = (tail + chunk)[-2:]
                if prefill_open and self.prefill_progress and schema.PROGRESS_MARK in chunk:
                    left = schema.parse_progress(chunk)
                    if left is not None:
                        self.inflight.progress(a.backend_id, handle, left)
                if prefill_open and b"data:" in chunk:
                    self.inflight.started(a.backend_id, handle)
                    a.first_byte_at = time.perf_counter()
                    prefill_open = False
                data = t_feed(chunk)
                if data:
                    await self._write(request, out, data)
            if self.stop_at is not None and time.monotonic() >= self.stop_at:
                upstream_err = GatewayStopping()
                break
            if chunk is None:
                if self.gone(a.backend_id):  # silent, and out of the registry: hung, not thinking
                    upstream_err = BackendGone(f"backend {a.backend_id} left the registry mid-answer")
                    a.gone = True
                    break
                if tail == b"\n\n":  # never inside a half-sent event
                    await self._write(request, out, transform.keepalive() if transform else KEEPALIVE)
        if upstream_err is None:
            return None
        if isinstance(upstream_err, GatewayStopping):
            a.stopped = True
            log.warning("answer from %s cut: the gateway is stopping and it %s", a.backend_id, self._cut())
        elif a.cut_why is not None and not a.cut_why[0]:
            # A failed batch step: the backend goes on, so its circuit stays closed
            log.warning("backend %s cut the answer: %s", a.backend_id, a.cut_why[1])
        else:
            log.warning("backend %s failed %s: %s", a.backend_id,
                        "mid-answer" if a.first_byte_at else "before its first token",
                        a.cut_why[1] if a.cut_why else upstream_err)
            self._trip(a.backend_id, a.url)
        if tail != b"\n\n":
            # Ends the half-sent event (a transform drops an unfinished data event; raw bytes sent are sent).
            data = t_feed(b"\n\n")
            if data:
                await self._write(request, out, data)
        return upstream_err

    async def _fail_stream(self, request, out, a: Attempt, why: str, transform) -> None:
        """End the client's stream with the error event for ``a``'s failure (``why``)."""
        a.failed = True
        when = "mid-stream" if a.first_byte_at else "before its first token"  # helper-65: "mid-stream" in a prefill
        msg = f"backend {a.backend_id} failed {when}: {why}; the answer is incomplete"
        code = "backend_failed"
        if a.stopped:
            msg, code = f"{why} (answer from backend {a.backend_id}); the answer is incomplete", "gateway_stopping"
        if transform is not None:
            await self._write(request, out, transform.fail(msg, code))
        else:
            err = {"error": {"message": msg, "type": "server_error", "param": None, "code": code}}
            await self._write(request, out, b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")

    async def _stream_json(self, request, out, data: bytes, transform, t_feed) -> None:
        """Send a whole JSON answer (a backend's 4xx error) on an open stream, as its data event."""
        await self._write(request, out, t_feed(b"data: " + data.strip() + b"\n\n"))
        await self._write(request, out, transform.end() if transform is not None else b"data: [DONE]\n\n")
        await out.write_eof()

    def _why(self, e: BaseException, a: Optional[Attempt] = None) -> str:
        """A stream's backend failure in the client's terms (not an aiohttp class name); the
        reason the backend gave before it cut the stream (``a.cut_why``) when it gave one."""
        if a is not None and a.cut_why is not None and not isinstance(e, GatewayStopping):
            fatal, why = a.cut_why
            return f"{why}" + ("; its engine failed and it is restarting" if fatal else "")
        if isinstance(e, BackendGone):
            return "it stopped heartbeating while silent (hung or stopped)"
        if isinstance(e, GatewayStopping):
            return f"the gateway is stopping and the answer {self._cut()}"
        if isinstance(e, asyncio.TimeoutError):  # aiohttp's ServerTimeoutError is one too
            return f"it sent nothing for {self.read_timeout:g} s"
        return "its connection closed before the answer ended (the process stopped or restarted)"

    async def _write(self, request, out, data: bytes) -> None:
        try:
            async with deadline(self.write_timeout):
                await out.write(data)
        except asyncio.TimeoutError:
            # The client stopped reading: drop it. Leaving the upstream block
            # closes the backend connection, which cancels the generation there.
            log.info("client stopped reading for %.0fs; dropping the answer", self.write_timeout)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("client stopped reading") from None

    async def _read(self, up: aiohttp.ClientResponse) -> Optional[bytes]:
        """The next body bytes (b"" at end), or None after ``keepalive`` s of silence on a stream.

        Cancelling ``readany`` while it waits loses no data (it only waits
        for the buffer to fill), so the timeout is safe.
        """
        wait = self.keepalive if self.keepalive > 0 else None
        if self.stop_at is not None:  # draining: back at the drain's end, not a keep-alive later
            left = max(0.0, self.stop_at - time.monotonic())
            wait = left if wait is None else min(wait, left)
        if wait is None:
            return await up.content.readany()
        try:
            async with deadline(wait):
                return await up.content.readany()
        except aiohttp.ClientError:  # aiohttp's own read timeout: a hung backend
            raise
        except asyncio.TimeoutError:
            return None
