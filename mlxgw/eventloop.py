"""Which asyncio event loop a process runs on: uvloop when installed, else the standard one.

uvloop (libuv under the asyncio API, what uvicorn and SGLang's and vLLM's Python servers run
on) cut the gateway's added latency at ~100-token prompts by about 0.3 ms of ~2 ms in session
55's side-by-side runs (docs/benchmarks.md, "Session 55"): the socket and callback work of an
aiohttp hop runs in C. It is a dependency on macOS and Linux (pyproject); on Windows, or with
``--event-loop asyncio``, the standard loop runs and nothing else changes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str = "auto") -> tuple[Optional[Callable[[], asyncio.AbstractEventLoop]], str]:
    """``(factory, name)`` for ``choice`` (one of `EVENT_LOOPS`): ``auto`` is uvloop when it
    imports, else asyncio's default (factory None).

    Raises:
        RuntimeError: ``uvloop`` asked for and not installed.
    """
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop {choice!r}: one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return None, "asyncio"
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def run(main: Callable[[], Awaitable[Any]], factory: Optional[Callable[[], asyncio.AbstractEventLoop]]) -> Any:
    """``asyncio.run(main())`` on a loop from ``factory`` (None: asyncio's default)."""
    if factory is None:
        return asyncio.run(main())
    if hasattr(asyncio, "Runner"):  # Python >= 3.11
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main())
    loop = factory()  # 3.10: what asyncio.run does, on this loop
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main())
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
