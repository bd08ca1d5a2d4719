"""Admission: a global cap on requests in flight, per-caller limits (concurrency,
token-bucket rate) and per-request size limits.

A caller is an API key (by its id) or, without keys, a remote address (see
`gateway.auth`). Every path but ``/health`` counts. Over a per-caller limit the
answer is 429 with ``Retry-After`` (whole seconds, RFC 9110 10.2.3) in the
dialect of the endpoint; at the global cap it is 503 ``overloaded`` (Anthropic's
``overloaded_error``) with ``Retry-After: 1``, which the OpenAI and Anthropic
SDKs retry with backoff. Nothing is queued, so a flood costs the gateway one
cheap answer per request and never delays the requests already admitted.

The global cap exists because every request in flight holds two open files (the
client's socket and the backend's): past the process's open-files limit accept()
and the upstream connect fail with EMFILE for everyone (a session-23 soak: 1,883
failed requests). Its default, `auto_max_in_flight`, is a quarter of that limit.
``/metrics`` and the dashboard stay outside the cap, so operators can see an
overload while it lasts.

`check_request` holds the checks that need the parsed request and the model
(message count, token ids within the vocabulary); the gateway calls it before
routing.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from mlxgw.protocol import RequestError, overloaded
from mlxgw.util import count, deadline

from .auth import CALLER, OPEN_PATHS


@dataclass
class LimitConfig:
    """Limits; 0 turns a limit off.

    Attributes:
        max_connections: client connections held at once (`gateway.connguard`); over it
            a new connection gets a fixed 503 before its request is read.
        max_in_flight: requests the gateway holds at once, all callers together
            (from when the whole body has arrived; a stream counts until its last
            byte); over it, 503 ``overloaded``.
        max_concurrent_per_key: requests one caller may have in flight (a
            stream counts until its last byte).
        rate_per_minute: sustained requests per minute per caller.
        rate_burst: bucket size, requests a caller may send at once after a
            quiet period (0: ``max(1, rate_per_minute / 6)``, ten seconds' worth).
        max_messages: most messages in one chat request.
        body_timeout: seconds to receive a whole request body (a half-sent
            body is answered 408 after this).
        write_timeout: seconds a client may leave an answer chunk unread
            before the gateway drops the connection.
        max_answer_tokens: most tokens one answer (each choice) may take; a larger
            ``max_tokens`` (or the backend's default without one) is lowered to it, as one
            past the context is (`gateway.app._route`). 0: only the context bounds it.
    """

    max_connections: int = 0
    max_in_flight: int = 0
    max_concurrent_per_key: int = 0
    rate_per_minute: float = 0.0
    rate_burst: int = 0
    max_messages: int = 10_000
    body_timeout: float = 60.0
    write_timeout: float = 60.0
    max_answer_tokens: int = 0

    def burst(self) -> float:
        return float(self.rate_burst) if self.rate_burst > 0 else max(1.0, self.rate_per_minute / 6)


#: Paths outside the global cap (they hold no backend connection): operators watch
#: an overload through them.
UNCAPPED_PATHS = ("/metrics", "/dashboard")

#: Floor of the automatic cap (a tiny open-files limit still admits this many).
MIN_AUTO_IN_FLIGHT = 64


def auto_max_in_flight(open_files: int) -> int:
    """The default global cap for a process allowed ``open_files`` descriptors (0 when
    unknown or unlimited: no cap): a quarter of them, at least `MIN_AUTO_IN_FLIGHT`.

    Each admitted request holds two (client and backend sockets); the other half is
    for idle keep-alive client connections, refused clients, Redis, logs and model
    files. 4096 files (mlx-lm's usual hard limit) -> 1024 requests; macOS's 10240 -> 2560.
    """
    return max(MIN_AUTO_IN_FLIGHT, open_files // 4) if open_files > 0 else 0


class TokenBucket:
    """``capacity`` tokens refilled at ``rate`` tokens per second; one request takes one.

    ``take(now)`` returns 0.0 when a token was taken, else the seconds until
    one will be available (nothing taken).
    """

    __slots__ = ("capacity", "rate", "tokens", "t")

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity = capacity
        self.rate = rate
        self.tokens = capacity
        self.t = now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate)
        self.t = now

    def take(self, now: float) -> float:
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.capacity


class CallerLimits:
    """The count of requests admitted, and concurrency counts and rate buckets per caller.

    Idle callers (no request in flight, bucket full) are forgotten once more
    than ``prune_above`` are tracked, so addresses that come and go cannot
    grow memory without bound.
    """

    def __init__(self, cfg: LimitConfig, prune_above: int = 10_000):
        self.cfg = cfg
        self.inflight: dict[str, int] = {}
        self.buckets: dict[str, TokenBucket] = {}
        self.admitted = 0  # requests holding a slot of the global cap
        # overloaded: at the cap; out_of_files: admitted, then connecting upstream failed
        # with EMFILE (counted by the gateway app); connections: refused before any request
        # was read (gateway.connguard); rate, concurrency: per caller.
        self.rejected = {"overloaded": 0, "out_of_files": 0, "connections": 0, "rate": 0, "concurrency": 0}
        self.prune_above = prune_above

    def admit(self, caller: str, now: Optional[float] = None, capped: bool = True) -> Optional[tuple[str, int]]:
        """Take ``caller``'s slot: None when admitted (call `take_slot` next when
        ``capped``, and `release` with the same ``capped`` after), else
        ``(reason, retry_after_seconds)`` with reason ``"overloaded"`` (the global cap;
        checked first, so a shed request spends none of its caller's rate), ``"rate"``
        or ``"concurrency"``. ``capped``: the request counts against the global cap,
        whose slot `take_slot` takes once the body has arrived."""
        now = time.monotonic() if now is None else now
        cfg = self.cfg
        if capped and self.full():
            self.rejected["overloaded"] += 1
            return "overloaded", 1
        if cfg.max_concurrent_per_key > 0 and self.inflight.get(caller, 0) >= cfg.max_concurrent_per_key:
            self.rejected["concurrency"] += 1
            return "concurrency", 1
        if cfg.rate_per_minute > 0:
            b = self.buckets.get(caller)
            if b is None:
                if len(self.buckets) >= self.prune_above:
                    self._prune(now)
                b = self.buckets[caller] = TokenBucket(cfg.burst(), cfg.rate_per_minute / 60.0, now)
            wait = b.take(now)
            if wait > 0:
                self.rejected["rate"] += 1
                return "rate", max(1, math.ceil(wait))
        self.inflight[caller] = self.inflight.get(caller, 0) + 1
        return None

    def full(self) -> bool:
        """Whether the global cap is reached."""
        return self.cfg.max_in_flight > 0 and self.admitted >= self.cfg.max_in_flight

    def take_slot(self, caller: str) -> bool:
        """Take a slot of the global cap for a request `admit` let in; False when the cap
        filled up meanwhile: the request is shed (counted as overloaded), its caller's slot
        released and its rate token given back."""
        if self.full():
            self.rejected["overloaded"] += 1
            self.release(caller, capped=False)
            b = self.buckets.get(caller)
            if b is not None:
                b.tokens = min(b.capacity, b.tokens + 1.0)
            return False
        self.admitted += 1
        return True

    def release(self, caller: str, capped: bool = True) -> None:
        """Give back what `admit` (and, when ``capped``, `take_slot`) took."""
        if capped:
            self.admitted -= 1
        n = self.inflight.get(caller, 0) - 1
        if n > 0:
            self.inflight[caller] = n
        else:
            self.inflight.pop(caller, None)

    def _prune(self, now: float) -> None:
        for c in [c for c, b in self.buckets.items() if c not in self.inflight and b.full(now)]:
            del self.buckets[c]


def body_too_large(max_bytes: Optional[int] = None) -> RequestError:
    """The 413 ``body_too_large`` answer, naming the limit (bytes) when known and the setting."""
    limit = f" of {max_bytes / 2**20:g} MiB ({max_bytes} bytes)" if max_bytes else ""
    return RequestError(f"request body over the gateway's limit{limit}; the operator sets it with --max-body-bytes "
                        "(or [gateway] max_body_bytes)", status=413, code="body_too_large")


#: The request body as `receive_body` read and decoded it.
BODY = web.RequestKey("mlxgw_body", bytes) if hasattr(web, "RequestKey") else "mlxgw_body"

#: Set on an app whose server runs with aiohttp's ``auto_decompress`` off (gateway.main): its
#: handlers get bodies still coded, which `receive_body` decodes.
DECODE_BODIES = web.AppKey("mlxgw_decode_bodies", bool)

#: Content codings a request body may come in (RFC 9110 8.4.1; x-gzip is gzip's old name).
CONTENT_CODINGS = ("gzip", "x-gzip", "deflate", "br", "zstd")


def _decompressor(coding: str, data: bytes):
    """aiohttp's own decompressor for one content coding (the gateway's server runs with
    ``auto_decompress`` off: `decode_body`)."""
    from aiohttp import compression_utils as cu

    if coding in ("gzip", "x-gzip"):
        return cu.ZLibDecompressor(encoding="gzip")
    if coding == "deflate":  # as aiohttp reads it: a raw deflate stream (no zlib header) too
        return cu.ZLibDecompressor(encoding="deflate", suppress_deflate_header=bool(data) and data[0] & 0xF != 8)
    if coding == "br":
        return cu.BrotliDecompressor()
    return cu.ZSTDDecompressor()


def decode_body(raw: bytes, content_encoding: Optional[str], max_bytes: int) -> bytes:
    """``raw`` with its ``Content-Encoding`` codings undone, last applied first.

    The gateway decodes bodies itself, after reading them whole, where aiohttp decoded them as
    they arrived: a body its coding does not match then failed inside aiohttp's reader, and
    after the 400 the connection was reset under the client (its next request on it failed)
    with a traceback in the log (helper-79).

    Raises:
        RequestError: 415 ``unsupported_encoding`` for a coding not in `CONTENT_CODINGS`
            (RFC 9110: an unknown coding was read as if there were none); 400 ``invalid_body``
            when the body does not decode; 413 ``body_too_large`` when it decodes to more
            than ``max_bytes``.
    """
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for c in codings:
        if c not in CONTENT_CODINGS:
            raise RequestError(f"Content-Encoding {c!r} is not supported (gzip, deflate, br, zstd)", status=415,
                               code="unsupported_encoding")
    body = raw
    for c in reversed(codings):
        try:
            body = _decompressor(c, body).decompress_sync(body, max_length=max_bytes + 1)
        except Exception as e:  # noqa: BLE001 - zlib.error, brotli.error, ZstdError: the body is not that coding
            raise RequestError(f"the request body could not be read (Can not decode content-encoding: {c}: "
                               f"{type(e).__name__}); check its Content-Encoding header",
                               status=400, code="invalid_body") from None
        if len(body) > max_bytes:
            raise body_too_large(max_bytes)
    return body


async def receive_body(request: web.Request, max_bytes: int, timeout: float) -> bytes:
    """The whole request body, its content codings undone (`decode_body`); kept on the
    request (``request[BODY]``), so a second call returns it.

    Raises:
        RequestError: 413 ``body_too_large`` over ``max_bytes`` (sent or decoded); 408
            ``body_timeout`` when it has not all arrived within ``timeout`` seconds; 400
            ``invalid_body`` when it does not decode as its ``Content-Encoding`` says (it
            was a 500, helper-60); 415 for a coding we do not know.
    """
    if BODY in request:
        return request[BODY]
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        async with deadline(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes)
    except asyncio.TimeoutError:
        raise RequestError("request body not received in time", status=408, code="body_timeout")
    except web.RequestPayloadError as e:
        why = str(getattr(e.__cause__, "message", None) or getattr(e, "message", None) or e).strip()
        raise RequestError(f"the request body could not be read ({why})", status=400, code="invalid_body")
    body = raw
    if request.app.get(DECODE_BODIES):
        body = decode_body(raw, request.headers.get("Content-Encoding"), max_bytes)
    request[BODY] = body
    return body


def limits_middleware(cfg: LimitConfig, max_body_bytes: int):
    """An aiohttp middleware enforcing `CallerLimits` (after the auth middleware named the caller);
    its ``limits`` attribute is that object (for metrics and tests).

    A capped request takes its slot of the global cap only once its body has arrived
    (`receive_body`, up to ``max_body_bytes``): a client sending slowly holds its own
    caller's concurrency slot and a connection, never a slot other callers need.
    """
    limits = CallerLimits(cfg)

    def at_cap() -> RequestError:  # shed on arrival, or once the body arrived and the cap had filled
        return overloaded(f"the gateway is at its limit of {count(cfg.max_in_flight, 'request')} in flight; "
                          "retry shortly")

    @web.middleware
    async def mw(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        caller = request.get(CALLER, "unknown")
        capped = not request.path.startswith(UNCAPPED_PATHS)
        denied = limits.admit(caller, capped=capped)
        if denied is not None:
            reason, retry = denied
            headers = {"Retry-After": str(retry)}
            if reason == "overloaded":
                raise at_cap()
            # Without API keys the limits are per client address (`auth_middleware`; helper-82:
            # "for this API key" on a gateway that has none).
            who = "this client address" if caller.startswith("ip:") else "this API key"
            msg = (f"too many requests in flight for {who} (limit {cfg.max_concurrent_per_key})"
                   if reason == "concurrency" else
                   f"rate limit exceeded for {who} ({cfg.rate_per_minute:g} requests per minute)")
            raise RequestError(msg, status=429, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)
        if capped:
            try:
                if request.can_read_body:
                    await receive_body(request, max_body_bytes, cfg.body_timeout)
            except BaseException:
                limits.release(caller, capped=False)
                raise
            if not limits.take_slot(caller):
                raise at_cap()
        try:
            return await handler(request)
        finally:
            limits.release(caller, capped)

    mw.limits = limits  # for metrics, the connection guard and tests
    return mw


def check_request(cfg: LimitConfig, info, pr) -> None:
    """Limits that need the parsed request (`mlxgw.protocol.ParsedRequest`) and
    the model (`gateway.tokenize.ModelInfo`): message count, and token ids
    (``prompt`` arrays, ``logit_bias`` keys) inside the model's vocabulary.

    Raises:
        RequestError: 400 naming the field.
    """
    if cfg.max_messages > 0 and len(pr.messages) > cfg.max_messages:
        raise RequestError(f"'messages' has {len(pr.messages)} entries; at most {cfg.max_messages} are allowed",
                           param="messages", code="too_many_messages")
    vocab = vocab_size(info)
    for i, (_, ids) in enumerate(pr.batch or [(None, pr.prompt_ids)]):
        if ids is not None and max(ids) >= vocab:
            where = pr.prompt_param(i)
            raise RequestError(f"'{where}' holds token ids outside the vocabulary (0..{vocab - 1})", param=where)
    if pr.logit_bias and max(pr.logit_bias) >= vocab:
        raise RequestError(f"'logit_bias' names token ids outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")


def vocab_size(info) -> int:
    """Token ids the model's tokenizer knows (``len(tokenizer)``, added tokens included)."""
    n = getattr(info, "_vocab", None)
    if n is None:
        n = len(info.tokenizer)
        try:
            info._vocab = n
        except AttributeError:
            pass
    return n
