"""Small helpers shared by every process."""

from __future__ import annotations

import ipaddress
import re
import sys
import time
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

# ``async with deadline(seconds):`` raises asyncio.TimeoutError when the block
# runs over. A timer on the running task, where asyncio.wait_for wraps the
# awaitable in a new task: one task per request or per streamed chunk is
# measurable gateway CPU.
if sys.version_info >= (3, 11):
    from asyncio import timeout as deadline
else:  # aiohttp depends on async-timeout before 3.11
    from async_timeout import timeout as deadline


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log or print)."""
    try:
        u = urlsplit(url)
        if u.password:
            user = u.username or ""
            # Everything after the last "@" as written: an IPv6 host keeps its brackets (helper-66).
            hostport = u.netloc.rsplit("@", 1)[1]
            return urlunsplit(u._replace(netloc=f"{user}:***@{hostport}"))
    except ValueError:
        return "<unparseable url>"
    return url


def count(n: int, noun: str, plural: str = "") -> str:
    """``"1 request"``, ``"3 requests"``: ``n`` and the noun, plural unless ``n`` is 1
    (``plural`` when it is not the noun and an s: ``count(2, "entry", "entries")``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _int_arg(s: str, lo: int, hi: Optional[int] = None) -> int:
    """``int(s)`` from ``lo`` to ``hi`` for the argparse types below; argparse.ArgumentTypeError otherwise."""
    import argparse

    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be at least {lo}, not {v}")
    if hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"must be from {lo} to {hi}, not {v}")
    return v


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1 (a block size of 0 or less would only fail
    at the first request). Raises argparse.ArgumentTypeError otherwise."""
    return _int_arg(s, 1)


def non_negative_int(s: str) -> int:
    """argparse type: an integer >= 0 (a count where 0 turns a limit off; ``--max-retries -1``
    sent every request nowhere). Raises argparse.ArgumentTypeError otherwise."""
    return _int_arg(s, 0)


def port_arg(s: str) -> int:
    """argparse type: a TCP port, 1-65535 (70000 ended in a traceback from bind()).
    Raises argparse.ArgumentTypeError otherwise."""
    return _int_arg(s, 1, 65535)


def redis_url_arg(s: str) -> str:
    """argparse type: a ``redis://``, ``rediss://`` or ``unix://`` URL (empty passes, for the
    caller's own message). helper-65: ``127.0.0.1:6379`` ended the gateway and ``mlxgw status``
    in redis-py's traceback. The value is not echoed when it may hold a password."""
    import argparse

    if not s:
        return s
    shown = "the value given" if "@" in s else repr(s)
    u = urlsplit(s)
    if u.scheme not in ("redis", "rediss", "unix"):
        raise argparse.ArgumentTypeError(f"must be a redis://, rediss:// or unix:// URL (e.g. "
                                         f"redis://127.0.0.1:6379/0), not {shown}")
    try:
        port = u.port  # ValueError when not a number from 0 to 65535 (helper-66: redis-py's traceback)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the port of {shown} is not a number from 1 to 65535") from None
    if port == 0:
        raise argparse.ArgumentTypeError(f"the port of {shown} is not a number from 1 to 65535")
    if u.scheme != "unix" and u.path not in ("", "/") and not u.path[1:].isdigit():
        raise argparse.ArgumentTypeError(f"the database of {shown} must be a number (e.g. /0), "
                                         f"not {u.path[1:]!r}")
    return s


def non_empty_arg(s: str) -> str:
    """argparse type: any text but the empty string (helper-66: ``--id ''``, ``--url ''`` and
    ``--model ''`` silently meant the default, as if the flag had been left out)."""
    import argparse

    if not s.strip():
        raise argparse.ArgumentTypeError("is empty (leave the flag out for its default)")
    return s


def model_spec_arg(s: str) -> str:
    """argparse type: a gateway ``--model`` value, ``PATH`` or ``NAME=PATH`` with both parts given
    (helper-66: ``--model =PATH`` took the directory's name)."""
    import argparse

    name, eq, path = s.partition("=")
    if not s.strip() or (eq and not (name.strip() and path.strip())):
        raise argparse.ArgumentTypeError(f"must be PATH or NAME=PATH, both non-empty, not {s!r}")
    return s


def namespace_arg(s: str) -> str:
    """argparse type: a Redis key namespace (`mlxgw.schema.namespace_error`). helper-65: an
    empty one was taken, giving keys that start with ``:``."""
    import argparse

    from .schema import namespace_error

    why = namespace_error(s)
    if why:
        raise argparse.ArgumentTypeError(why)
    return s


def _number_arg(s: str) -> float:
    """``float(s)`` for the argparse types below; argparse.ArgumentTypeError when it is not one."""
    import argparse

    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None


def share_arg(s: str) -> float:
    """argparse type: a fraction in (0, 1]. Raises argparse.ArgumentTypeError otherwise."""
    import argparse

    v = _number_arg(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, not {s}")
    return v


def non_negative_float(s: str) -> float:
    """argparse type: a finite number at least 0 (seconds, weights, rates). Raises
    argparse.ArgumentTypeError otherwise: ``float()`` alone takes "nan" and "inf", and NaN passes
    every later check, since every comparison with it is false (helper-62)."""
    import argparse
    import math

    v = _number_arg(s)
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, at least 0, not {s}")
    return v


def seconds_arg(lo: float, hi: float):
    """An argparse type: a finite number of seconds from ``lo`` to ``hi``, said in those
    words when it is not one (helper-68: `--heartbeat-interval nan` said "at least 0" where
    the least is 0.1, and 0.05 was an error line two seconds into the start)."""
    import argparse
    import math

    def parse(s: str) -> float:
        v = _number_arg(s)
        if not (math.isfinite(v) and lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds from {lo:g} to {hi:g}, not {s}")
        return v

    return parse


def positive_float(s: str) -> float:
    """argparse type: a finite number above 0. Raises argparse.ArgumentTypeError otherwise."""
    import argparse
    import math

    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {s}")
    return v


def share_or_off_arg(s: str) -> float:
    """argparse type: a fraction in [0, 1], 0 meaning off (so a flag can turn off what a config
    file set). Raises argparse.ArgumentTypeError otherwise (NaN included)."""
    import argparse

    v = _number_arg(s)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 (off) to 1, not {s}")
    return v


def temperature_arg(s: str) -> float:
    """argparse type: a sampling temperature, a finite number from 0 to 2 (OpenAI's range).
    Raises argparse.ArgumentTypeError otherwise (NaN included)."""
    import argparse

    v = _number_arg(s)
    if not 0 <= v <= 2:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2, not {s}")
    return v


_SIZE = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:E[+-]?\d+)?)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)
_UNIT = {None: 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(s: str | int) -> int:
    """A size -> bytes, binary units: ``'512MB'``, ``'512M'``, ``'512MiB'``, ``'1.5G'``,
    ``'4k'``, ``'1000000'``, ``'100B'`` (case does not matter; ``1G = 2**30``).

    Raises:
        ValueError: unparseable size, or a fraction of a byte (``'1.5'`` meant 1.5 of some
            unit: it read as 1 byte, helper-57); the sign is kept: see ``positive_bytes``.
    """
    if isinstance(s, int) and not isinstance(s, bool):
        return s
    if isinstance(s, float) and s == s:  # a config's number: 1.5 bytes is the same mistake as '1.5'
        s = repr(s)
    m = _SIZE.fullmatch(s) if isinstance(s, str) else None
    if not m:
        raise ValueError(f"{s!r} is not a size")
    unit = _UNIT[m.group(2) and m.group(2).upper()]
    n = float(m.group(1)) * unit
    if unit == 1 and n != int(n):
        raise ValueError(f"{s!r} is a fraction of a byte (a unit is missing)")
    return int(n)


def positive_bytes(s: str | int) -> int:
    """``parse_bytes``, and more than 0 (a cache that holds nothing, or a body limit
    nothing fits under, is a mistake, not a setting).

    Raises:
        ValueError: ``"'x' is not a size (e.g. 2GB, 512MB)"`` or ``"'-1GB' must be more
            than 0 bytes (e.g. 2GB, 512MB)"``.
    """
    try:
        n = parse_bytes(s)
    except ValueError as e:
        raise ValueError(f"{e} (e.g. 2GB, 512MB)" if "fraction" in str(e) else
                         f"{s!r} is not a size (e.g. 2GB, 512MB)") from None
    if n <= 0:
        raise ValueError(f"{s!r} must be more than 0 bytes (e.g. 2GB, 512MB)")
    return n


def size_text(n: int) -> str:
    """Bytes as a short size for people, binary units: ``'512 B'``, ``'64.0 MiB'``, ``'1.5 GiB'``
    (a 64 MB budget read "0.1 GiB" and 1.5 MB "0.0 GiB" in the disk tier's log, helper-54)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def size_arg(s: str) -> str:
    """argparse type for a size flag: ``s`` unchanged once ``positive_bytes`` accepts it
    (the flag's text is passed on to child processes as given).

    Raises:
        argparse.ArgumentTypeError: as ``positive_bytes``.
    """
    import argparse

    try:
        positive_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def serve_url_file():
    """Where ``mlxgw serve`` leaves its Redis URL (mode 0600) for ``mlxgw status``."""
    import os
    from pathlib import Path

    return Path(os.environ.get("MLXGW_CACHE_DIR", Path.home() / ".cache" / "mlxgw")) / "serve-redis-url"


def serve_token_file():
    """Where ``mlxgw serve`` leaves its backends' internal token (mode 0600), for a gateway
    or backend joining the stack by hand (``MLXGW_INTERNAL_TOKEN=$(cat FILE)``)."""
    return serve_url_file().with_name("serve-internal-token")


#: Seconds a cancelled background task may take to end before a shutdown goes on without it.
CANCEL_WAIT_SECONDS = 5.0


async def cancel_and_wait(*tasks, timeout: float = CANCEL_WAIT_SECONDS) -> None:
    """Cancel background ``asyncio.Task`` objects (None is skipped) and wait for them to end,
    at most ``timeout`` seconds; their errors are swallowed (they are being shut down).

    Bounded because a task inside a redis-py command can swallow its cancellation while the
    server goes away (redis/redis-py issues 2028, 2551): a backend whose parent `mlxgw serve`
    was killed, its Redis gone, never exited that way (seen while testing the fix for
    helper-46's finding that such a serve left its children running). A task
    still running after ``timeout`` is logged and left behind.
    """
    import asyncio
    import logging

    tasks = [t for t in tasks if t is not None]
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in done:
        if not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" at exit
    for t in pending:
        logging.getLogger("mlxgw").warning("task %s did not end within %.0f s of its cancel; going on without it",
                                           t.get_name(), timeout)


class Tally:
    """Counts events that would each log a line and reports them through ``report(n)`` at
    most once per ``every`` seconds: the first at once, the rest of a burst ``every``
    seconds later (a flood of one failure becomes a line per 10 s with its count, and
    the tail of a burst is still reported). Use it from the event loop's thread.
    """

    def __init__(self, report, every: float = 10.0):
        self.report = report
        self.every = every
        self.count = 0
        self._last = float("-inf")
        self._timer = None

    def add(self) -> None:
        """Count one event; report now, or schedule the report of what is held back."""
        self.count += 1
        if self._timer is not None:
            return
        wait = self._last + self.every - time.monotonic()
        if wait <= 0:
            self._flush()
        else:
            import asyncio

            self._timer = asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        self._timer = None
        n, self.count = self.count, 0
        if n:
            self._last = time.monotonic()
            self.report(n)


#: Wildcard listen address -> the loopback address of its family: ``::`` listens on IPv6 only
#: (asyncio sets IPV6_V6ONLY), so 127.0.0.1 does not reach it (helper-67, helper-69).
WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets (``[::]:8000``, not ``:::8000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_base(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 address in brackets."""
    return "http://" + host_port(host, port)


def local_base_url(host: str, port: int) -> str:
    """``http://ADDRESS:PORT`` at which this machine reaches a server listening on ``host``: the
    loopback of its family for a wildcard (helper-69: serve probed a gateway on ``::``, which
    listens IPv6 only, at 127.0.0.1 and never saw it ready), else the host itself."""
    return http_base(WILDCARD_LOOPBACK.get(host, host), port)


def is_loopback(host: str) -> bool:
    """True when listening on ``host`` is reachable from this machine only.

    ``localhost`` and loopback addresses (127.0.0.0/8, ::1) are; wildcard
    addresses (``0.0.0.0``, ``::``, empty) and every other name are not.
    """
    h = (host or "").strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
