"""``GET /dashboard``: one self-contained HTML page, fed by ``GET /dashboard/data``.

The data comes from Redis alone, gathered exactly as ``mlxgw status`` /
``mlxgw top`` do (`mlxgw.status.collect`, `backend_view`, `History`), so any
gateway of a cluster shows the same backends. A background task samples
Redis every ``interval`` seconds (in a worker thread: the sync client of
``mlxgw status``) and keeps ``maxlen`` points of rates, so a page opened
late still sees the recent past. The page (``gateway/static/dashboard.html``)
has no external resources: inline CSS, JS and SVG charts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Optional

from aiohttp import web

from mlxgw.redis_client import connect
from mlxgw.util import cancel_and_wait

from mlxgw.status import History, backend_view, collect, problem_lines

log = logging.getLogger("mlxgw.gateway.dashboard")

PAGE = Path(__file__).parent / "static" / "dashboard.html"


class Dashboard:
    """Samples Redis for the dashboard.

    Args:
        redis_url / namespace: where the cluster lives.
        interval: seconds between samples.
        maxlen: points kept per series (``maxlen * interval`` seconds of history).
        events: recent events kept per model.
    """

    def __init__(self, redis_url: str, namespace: str, interval: float = 1.0, maxlen: int = 300, events: int = 20):
        self.namespace = namespace
        self.interval = interval
        self.events = events
        self.redis = connect(redis_url, 1.0)
        self.history = History(maxlen=maxlen)
        self.latest: dict = {}
        self.sampled_at = 0.0
        self.error: Optional[str] = None
        self._task: Optional[asyncio.Task] = None

    async def sample(self) -> None:
        """Read one snapshot (never raises: a Redis failure is kept in ``error``)."""
        loop = asyncio.get_running_loop()
        try:
            data = await loop.run_in_executor(None, collect, self.redis, self.namespace, self.events)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            return
        self.error = None
        self.sampled_at = time.time()
        self.history.add(data, self.sampled_at)
        self.latest = data

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval)

    def payload(self) -> dict:
        """The JSON of ``/dashboard/data``.

        While Redis does not answer, the backends are shown as of ``sampled_at`` (their ages not
        growing), each state suffixed ``(N s ago; Redis unreachable)``.

        ``{"namespace", "sampled_at" (unix s), "interval", "redis": "ok" | error,
        "models": [{"name", "totals", "backends": [backend_view + "series"], "problems": [`problem_lines`],
        "series": [History point]}], "events": [event + "model", newest first]}``
        """
        # Redis unreachable: the backends as of the last sample, not aged since (helper-70: every
        # backend read `silent 5s` while it served; the silence was Redis's).
        now = time.time() if self.error is None else self.sampled_at
        models, events = [], []
        for m, d in self.latest.items():
            views = sorted((backend_view(r, now) for r in d["backends"]), key=lambda v: v["load"], reverse=True)
            ready = sum(v["state"] == "ready" for v in views)
            for v in views:
                v["series"] = self.history.backend_series(m, v["id"])[-60:]
                if self.error is not None:
                    v["state"] += f" ({time.time() - self.sampled_at:.0f} s ago; Redis unreachable)"
            prompt = sum(float(r.get("prompt_tokens", 0) or 0) for r in d["backends"])
            cached = sum(float(r.get("cached_tokens", 0) or 0) for r in d["backends"])
            models.append({
                "name": m,
                "totals": {
                    "backends": len(views),
                    "ready": ready,
                    "active": sum(v["active"] for v in views),
                    "requests": sum(v["requests"] for v in views),
                    "hits": sum(v["hits"] for v in views),
                    "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
                    "cache_mb": round(sum(v["cache_mb"] for v in views), 2),
                },
                "backends": views,
                # status's warning lines (a gateway every backend refuses, a URL problem, ...):
                # the page showed none of them
                "problems": problem_lines(d, self.namespace),
                "series": self.history.model_series(m),
            })
            events += [{**e, "model": m} for e in d["recent_events"]]
        events.sort(key=lambda e: float(e.get("ts", 0) or 0), reverse=True)
        return {"namespace": self.namespace, "sampled_at": self.sampled_at, "interval": self.interval,
                "redis": self.error or "ok", "models": models, "events": events[: self.events]}

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dashboard-sampler")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self.redis.close()


DASHBOARD = web.AppKey("dashboard", Dashboard)


async def handle_page(request: web.Request) -> web.Response:
    return web.Response(body=PAGE.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def handle_data(request: web.Request) -> web.Response:
    return web.json_response(request.app[DASHBOARD].payload(), headers={"Cache-Control": "no-store"})


def install(app: web.Application, redis_url: str, namespace: str, interval: float = 1.0) -> None:
    """Add ``/dashboard`` and ``/dashboard/data`` to ``app`` and run the sampler with it."""

    async def lifecycle(app: web.Application):
        d = Dashboard(redis_url, namespace, interval)
        app[DASHBOARD] = d
        d.start()
        yield
        await d.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/dashboard", handle_page)
    app.router.add_get("/dashboard/data", handle_data)
