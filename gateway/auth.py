"""Gateway API keys: who may call the gateway.

Keys come from a file (``--api-key-file``, one key a line, ``#`` comments) and
from the ``MLXGW_API_KEYS`` environment variable (comma-separated); never from
the command line, where ``ps`` would show them. A client presents one as
``Authorization: Bearer KEY`` (OpenAI SDKs) or ``x-api-key: KEY`` (Anthropic
SDKs). Keys are compared as SHA-256 digests with ``hmac.compare_digest``
against every configured key, so the time taken depends neither on how much of
a key matched nor on which key matched.

Inside the gateway a caller is known by a key id (``key-`` + 8 hex digits of
the key's SHA-256), never by the key itself, so limits and logs can name the
caller without holding the secret. Without keys (loopback default) the caller
is its remote address (``ip:ADDR``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Iterable, Optional

from aiohttp import web

from mlxgw.protocol import RequestError
from mlxgw.util import is_loopback

ENV_KEYS = "MLXGW_API_KEYS"
# Paths that never need a key: liveness probes from load balancers and the launcher.
OPEN_PATHS = frozenset({"/health", "/favicon.ico"})
# The request attribute holding the caller's id (set by the auth middleware);
# a typed key where aiohttp has them (3.13+).
CALLER = web.RequestKey("mlxgw_caller", str) if hasattr(web, "RequestKey") else "mlxgw_caller"

class AuthConfigError(ValueError):
    """The gateway must not start with these settings (message says why and how to fix)."""


def read_keys(key_file: Optional[str] = None, env: Optional[dict] = None) -> list[str]:
    """The configured API keys: lines of ``key_file`` plus ``MLXGW_API_KEYS`` (comma-separated).

    Blank lines and lines starting with ``#`` are skipped; surrounding
    whitespace is stripped. Duplicates are kept once.

    Raises:
        AuthConfigError: the file cannot be read, or it was given but holds no key.
    """
    env = os.environ if env is None else env
    keys: list[str] = []
    if key_file:
        try:
            text = Path(key_file).expanduser().read_text()
        except OSError as e:
            raise AuthConfigError(f"cannot read the API key file {key_file}: {e.strerror or e}") from None
        file_keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if not file_keys:
            raise AuthConfigError(f"the API key file {key_file} holds no key")
        keys += file_keys
    keys += [k.strip() for k in env.get(ENV_KEYS, "").split(",") if k.strip()]
    return list(dict.fromkeys(keys))


def check_exposure(host: str, keys: list[str], allow_unauthenticated: bool) -> None:
    """Refuse to serve a non-loopback address without API keys unless explicitly waived.

    Raises:
        AuthConfigError: with the message to print.
    """
    if keys or allow_unauthenticated or is_loopback(host):
        return
    raise AuthConfigError(
        f"refusing to listen on {host!r} without API keys: anyone who can reach that address could use the "
        f"models. Give keys with --api-key-file FILE or {ENV_KEYS}=key1,key2, or pass --allow-unauthenticated "
        "if something in front of the gateway already authenticates (see docs/security.md)"
    )


def key_id(key: str) -> str:
    """A stable, non-secret name for ``key`` (safe in logs, metrics and Redis)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


class KeyCheck:
    """Constant-time lookup of a presented key among the configured ones."""

    def __init__(self, keys: Iterable[str]):
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in keys]
        if not self._digests:
            raise ValueError("KeyCheck needs at least one key")

    def match(self, presented: str) -> Optional[str]:
        """The key id of ``presented``, or None. Compares against every key (no early exit)."""
        d = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for digest, kid in self._digests:
            if hmac.compare_digest(d, digest):
                found = kid
        return found


def presented_key(request: web.Request) -> Optional[str]:
    """The key a request carries: ``Authorization: Bearer K`` first, then ``x-api-key``."""
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    k = request.headers.get("x-api-key", "").strip()
    return k or None


def auth_middleware(keys: list[str]):
    """An aiohttp middleware: 401 unless the request carries a configured key.

    With no keys every caller is let through and named by its address. Sets
    ``request[CALLER]`` for the limits middleware.
    """
    check = KeyCheck(keys) if keys else None

    @web.middleware
    async def mw(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        if check is None:
            request[CALLER] = f"ip:{request.remote or 'unknown'}"
            return await handler(request)
        k = presented_key(request)
        kid = check.match(k) if k else None
        if kid is None:
            msg = "invalid API key" if k else "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            # Raised, so the error middleware answers in the endpoint's dialect and logs it as refused.
            # OpenAI's own 401 has type invalid_request_error (helper-71); Anthropic's dialect types by status.
            raise RequestError(msg, status=401, code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        request[CALLER] = kid
        return await handler(request)

    return mw
