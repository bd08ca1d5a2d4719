"""When a gateway or backend process stops: a signal, or the `mlxgw serve` that started it gone.

`mlxgw serve` supervises its children and stops them on SIGINT, SIGTERM and SIGHUP. When serve
itself dies without that chance (SIGKILL, a crash, the OOM killer), its children used to live
on, re-parented, holding their ports: the next `mlxgw serve` then failed with "port in use"
(helper-46's trial). So serve tells each child its pid (`PARENT_ENV`), and a child whose parent
changes stops as on SIGTERM. Polling ``os.getppid()`` works on macOS and Linux alike (Linux's
``PR_SET_PDEATHSIG`` has no macOS twin). A process started by hand has no such variable and is
never stopped this way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Callable, Optional

log = logging.getLogger("mlxgw")

#: Set by `mlxgw serve` in its children's environment: its own pid.
PARENT_ENV = "MLXGW_INTERNAL_PARENT_PID"
#: Set by `mlxgw serve` in the gateway's environment when Redis is its private embedded one,
#: which the gateway then shuts down if serve is gone (nobody else would).
EMBEDDED_REDIS_ENV = "MLXGW_INTERNAL_EMBEDDED_REDIS"
#: SIGHUP: a closed terminal or SSH session stops the process as Ctrl-C would (unless it was
#: started ignoring SIGHUP, as ``nohup`` does: `stop_signals`).
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
#: Seconds between two looks at the parent pid.
PARENT_POLL_SECONDS = 1.0
#: Seconds an orphaned process's graceful shutdown may take before it exits regardless.
ORPHAN_EXIT_SECONDS = 20.0


def stop_signals() -> tuple:
    """`STOP_SIGNALS`, less SIGHUP when this process was started ignoring it: ``nohup mlxgw
    backend &`` must outlive the SSH session it was started from (helper-47), as it did before
    SIGHUP stopped it. SIGINT and SIGTERM always stop it (a shell starts background jobs
    ignoring SIGINT; an explicit ``kill -INT`` must still stop them)."""
    hup = getattr(signal, "SIGHUP", None)
    return tuple(s for s in STOP_SIGNALS if not (s == hup and signal.getsignal(s) is signal.SIG_IGN))


def _exit_now(name: str) -> None:
    log.error("%s: shutdown still not done %.0f s after its mlxgw serve went; exiting now", name,
              ORPHAN_EXIT_SECONDS)
    logging.shutdown()
    os._exit(1)


class Stopper:
    """An `asyncio.Event` (``stop``) set by `STOP_SIGNALS` or, when `PARENT_ENV` names a pid,
    once this process's parent is no longer that pid (``orphaned`` is then True). A stop signal
    after that calls ``on_again`` (if set: the operator wants it stopped now, a second Ctrl-C).
    Create it inside the running loop; `close` ends the parent watch."""

    def __init__(self, name: str):
        self.name = name
        self.stop = asyncio.Event()
        self.orphaned = False
        self.on_again: Optional[Callable[[], None]] = None
        loop = asyncio.get_running_loop()
        for sig in stop_signals():
            try:
                loop.add_signal_handler(sig, self._signalled)
            except (NotImplementedError, RuntimeError):  # pragma: no cover (Windows)
                pass
        parent = os.environ.get(PARENT_ENV, "")
        self._task = loop.create_task(self._watch(int(parent))) if parent.isdigit() else None

    def _signalled(self) -> None:
        if self.stop.is_set() and self.on_again is not None:
            self.on_again()
        self.stop.set()

    async def _watch(self, parent: int) -> None:
        while not self.stop.is_set():
            if os.getppid() != parent:
                log.warning("%s: the mlxgw serve that started it (pid %d) is gone; stopping", self.name, parent)
                self.orphaned = True
                self.stop.set()
                # Nobody supervises this process any more: if its shutdown hangs, end it anyway.
                t = threading.Timer(ORPHAN_EXIT_SECONDS, _exit_now, (self.name,))
                t.daemon = True
                t.start()
                return
            await asyncio.sleep(PARENT_POLL_SECONDS)

    async def wait(self) -> None:
        """Until a stop signal arrived or the parent is gone."""
        await self.stop.wait()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def shut_down_embedded_redis(redis_url: str) -> None:
    """``SHUTDOWN NOSAVE`` the serve's private Redis at ``redis_url`` (the gateway does it when
    serve is gone: `EMBEDDED_REDIS_ENV`); never raises (it may be gone already)."""
    from .redis_client import connect
    from .util import redact_url

    try:
        connect(redis_url, 2.0).shutdown(nosave=True)  # returns once the server closed the connection
    except Exception as e:
        log.warning("could not stop the embedded Redis at %s: %s", redact_url(redis_url), e)
    else:
        log.warning("stopped the embedded Redis at %s (its mlxgw serve is gone)", redact_url(redis_url))
