"""A bare aiohttp pass-through proxy: the floor of any aiohttp gateway's extra hop.

It reads the client's body, POSTs the same bytes to one upstream over a
pooled ``aiohttp.ClientSession`` (the connector settings of
`gateway.proxy.Proxy`) and returns the upstream's status, content type and
body. No parsing, tokenization, routing or Redis: what `bench/overhead.py`
measures on this path is the cost of the hop alone (an aiohttp server
request, an aiohttp client request, the copies), which our gateway pays on
top of its own work.

    python bench/bare_hop.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import argparse
import sys

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    """The proxy app; ``upstream`` is a base URL such as ``http://127.0.0.1:8100``."""

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app[SESSION].post(upstream + request.path, data=body,
                                             headers={"Content-Type": request.content_type}) as up:
            data = await up.read()
            return web.Response(status=up.status, body=data, content_type=up.content_type)

    async def session(app: web.Application):
        # auto_decompress off: the bytes pass through as the upstream sent them.
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                             auto_decompress=False)
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/{path:.*}", forward)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    return app


def start(upstream: str, env: dict, timeout: float = 30.0):
    """Run this proxy in front of ``upstream`` as a harness `Proc` on a free port, once it answers.

    Raises:
        RuntimeError: it did not answer ``/health`` within ``timeout`` seconds.
    """
    from mlxgw.harness import LOG_DIR, Proc, free_port

    port = free_port()
    hop = Proc("bare-hop", [sys.executable, __file__, str(port), upstream], port,
               LOG_DIR / f"bare-hop-{port}.log").start(env)
    hop.wait_healthy(timeout)
    return hop


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("port", type=int, help="port to listen on (127.0.0.1)")
    p.add_argument("upstream", help="base URL requests are passed to, e.g. http://127.0.0.1:8100")
    a = p.parse_args()
    web.run_app(make_app(a.upstream), host="127.0.0.1", port=a.port, access_log=None, print=None)
