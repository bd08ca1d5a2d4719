"""Small helpers shared by every process."""

from __future__ import annotations

import logging
import sys
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
            host = u.hostname or ""
            port = f":{u.port}" if u.port else ""
            return urlunsplit(u._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:
        return "<unparseable url>"
    return url


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1 (a block size of 0 or less would only fail
    at the first request). Raises argparse.ArgumentTypeError otherwise."""
    import argparse

    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {v}")
    return v


def parse_bytes(s: str | int) -> int:
    """``'512MB'``, ``'8GB'``, ``'1.5GiB'``, ``'1000000'`` -> bytes.

    Raises:
        ValueError: unparseable size.
    """
    if isinstance(s, int):
        return s
    t = s.strip().upper().replace("IB", "B")
    for unit, mult in (("KB", 1 << 10), ("MB", 1 << 20), ("GB", 1 << 30), ("TB", 1 << 40), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(float(t))


def serve_url_file():
    """Where ``mlxgw serve`` leaves its Redis URL (mode 0600) for ``mlxgw status``."""
    import os
    from pathlib import Path

    return Path(os.environ.get("MLXGW_CACHE_DIR", Path.home() / ".cache" / "mlxgw")) / "serve-redis-url"


async def cancel_and_wait(task) -> None:
    """Cancel a background ``asyncio.Task`` (or None) and wait for it to end; its
    errors are swallowed (it is being shut down)."""
    import asyncio

    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


#: Open files a gateway or backend asks for: two sockets per proxied request, plus Redis,
#: logs and model files. macOS starts processes at a soft limit of 256 (Linux often 1024),
#: and importing mlx-lm sets (2048, 4096) (mlx_lm/utils.py), so the hard limit, 4096, is
#: what this reaches in practice. Past the soft limit accept() fails, and asyncio before
#: Python 3.12 logs that failure in a tight loop (a 109 MB log in a session-23 soak).
OPEN_FILES_WANTED = 65536


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE toward ``wanted`` (never above the hard limit,
    never down); what servers such as SGLang do at start (``set_ulimit``). Logs a raise.

    macOS refuses a soft limit above ``OPEN_MAX`` (10240) even under an unlimited hard
    limit, so that is tried next. Returns the (before, after) soft limits; never raises
    (no ``resource`` module, e.g. on Windows: (0, 0)).
    """
    try:
        import resource
    except ImportError:
        return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (wanted, 10240):
        if hard != resource.RLIM_INFINITY:
            target = min(target, hard)
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        logging.getLogger("mlxgw").info("open files limit raised from %d to %d", soft, target)
        return soft, target
    return soft, soft
