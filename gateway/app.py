"""The gateway's aiohttp app: the single OpenAI-compatible endpoint.

Per request: validate -> template + tokenize -> block keys -> one Redis
lookup (deadline, fail open) -> rank by cost (`gateway.route`) -> forward the
token ids to the best backend (`gateway.proxy`) -> stream the answer back
with headers naming the backend and the matched prefix.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import msgpack
from aiohttp import web

from mlxgw import schema
from mlxgw.protocol import INTERNAL_FIELD, RequestError, loads_body, parse_openai

from . import auth, limits
from .limits import LimitConfig
from .index import OwnershipIndex
from .proxy import Attempt, BackendUnavailable, Proxy
from .route import RoutingConfig, rank
from .tokenize import ModelInfo, Tokenizers

log = logging.getLogger("mlxgw.gateway")
reqlog = logging.getLogger("mlxgw.requests")


@dataclass
class GatewayConfig:
    """Gateway settings (``mlxgw gateway --help``)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = schema.DEFAULT_NAMESPACE
    block_size: int = schema.DEFAULT_BLOCK_SIZE
    lookup_deadline: float = 0.05
    max_retries: int = 2
    max_body_bytes: int = 32 * 1024 * 1024
    internal_token: Optional[str] = None
    read_timeout: float = 300.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    models: dict[str, str] = field(default_factory=dict)  # served name -> local path
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed (gateway.auth)
    limits: LimitConfig = field(default_factory=LimitConfig)


@dataclass
class GatewayState:
    cfg: GatewayConfig
    tokenizers: Tokenizers
    index: OwnershipIndex
    proxy: Proxy
    counters: dict = field(default_factory=lambda: {"requests": 0, "errors": 0, "routed_prefix": 0, "routed_load": 0})


STATE = web.AppKey("state", GatewayState)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as e:
        request.app[STATE].counters["errors"] += 1
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status >= 400:
            err = RequestError(e.reason or "error", status=e.status)
            if e.status == 404:
                err = RequestError(f"no route for {request.method} {request.path}", status=404, code="not_found")
            elif e.status == 413:
                err = RequestError("request body too large", status=413, code="body_too_large")
            return web.json_response(err.body(), status=e.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled gateway error")
        return web.json_response(
            RequestError("internal gateway error", status=500, type="server_error").body(), status=500
        )


async def _read_json(request: web.Request) -> dict:
    cfg = request.app[STATE].cfg
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise RequestError("request body too large", status=413, code="body_too_large")
    try:
        raw = await asyncio.wait_for(request.read(), cfg.limits.body_timeout)
    except web.HTTPRequestEntityTooLarge:
        raise RequestError("request body too large", status=413, code="body_too_large")
    except asyncio.TimeoutError:
        raise RequestError("request body not received in time", status=408, code="body_timeout")
    # Big bodies decode off the event loop so other requests keep flowing.
    body = loads_body(raw) if len(raw) < 1 << 20 else await asyncio.get_running_loop().run_in_executor(None, loads_body, raw)
    body.pop(INTERNAL_FIELD, None)  # clients cannot inject token ids
    return body


def resolve_model(st: GatewayState, name: Optional[str]) -> ModelInfo:
    """The served model a request names (or the only one, when it names none).

    Raises:
        RequestError: 404 ``model_not_found``.
    """
    models = st.tokenizers.models
    if name is None and len(models) == 1:
        return next(iter(models.values()))
    if name is None:
        raise RequestError("'model' is required", param="model")
    info = models.get(name)
    if info is None:
        raise RequestError(f"the model '{name}' does not exist", status=404, param="model", code="model_not_found")
    return info


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _route(request, "chat", "/v1/chat/completions")


async def handle_text(request: web.Request) -> web.StreamResponse:
    return await _route(request, "text", "/v1/completions")


async def _route(request: web.Request, kind: str, path: str) -> web.StreamResponse:
    st = request.app[STATE]
    st.counters["requests"] += 1
    t0 = time.perf_counter()
    body = await _read_json(request)
    pr = parse_openai(body, kind)
    info = resolve_model(st, pr.model)
    limits.check_request(st.cfg.limits, info, pr)
    if kind == "chat":
        cp = await st.tokenizers.render_chat(info, pr.messages, pr.tools, pr.template_kwargs)
        ids, system_tokens = cp.token_ids, cp.system_tokens
    elif pr.prompt_ids is not None:
        ids, system_tokens = pr.prompt_ids, 0
    else:
        ids, system_tokens = await st.tokenizers.encode(info, pr.prompt), 0
    if len(ids) >= info.context_length:
        raise RequestError(
            f"prompt is {len(ids)} tokens; the model's context is {info.context_length} tokens",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    if pr.max_tokens is not None and len(ids) + pr.max_tokens > info.context_length:
        body["max_tokens"] = info.context_length - len(ids)
        body.pop("max_completion_tokens", None)

    return await route_and_forward(request, st, info, body, ids, system_tokens, path, pr.stream, t0)


async def route_and_forward(request, st: GatewayState, info: ModelInfo, body: dict, ids: list[int],
                            system_tokens: int, path: str, stream: bool, t0: float) -> web.StreamResponse:
    """Look up ownership, rank backends, forward; shared by every dialect."""
    cfg = st.cfg
    blocks = schema.block_keys(info.name, ids, cfg.block_size)
    lk = await st.index.lookup(info.name, blocks)
    decision = rank(
        lk.candidates,
        len(ids),
        cfg.block_size,
        st.proxy.inflight.view(),
        blocks[0] if blocks else "",
        cfg.routing,
    )
    ranked = [s for s in decision.ranked if not st.proxy.recently_failed(s.cand.backend_id)] or decision.ranked
    if not ranked:
        raise RequestError(f"no live backend serves '{info.name}'", status=503, type="server_error", code="no_backend")
    rid = uuid.uuid4().hex
    route_ms = (time.perf_counter() - t0) * 1000
    explain = " ".join(s.explain() for s in ranked)
    if ranked[0].matched > 0:
        st.counters["routed_prefix"] += 1
    else:
        st.counters["routed_load"] += 1
    body[INTERNAL_FIELD] = {"prompt_ids": ids, "system_tokens": system_tokens, "request_id": rid}
    payload = msgpack.packb(body, use_bin_type=True)
    attempts = [
        Attempt(
            s.cand.backend_id,
            s.cand.url,
            s.prefill,
            {
                "X-Mlxgw-Backend": s.cand.backend_id,
                "X-Mlxgw-Matched-Tokens": str(s.matched),
                "X-Mlxgw-Prompt-Tokens": str(len(ids)),
                "X-Mlxgw-Lookup": lk.status,
                "X-Mlxgw-Candidates": explain,
                "X-Mlxgw-Request-Id": rid,
            },
        )
        for s in ranked[: 1 + cfg.max_retries]
    ]
    log.debug("route %s: %s (lookup %s, %.2f ms)", rid, explain, lk.status, route_ms)
    asyncio.ensure_future(
        st.index.record_routed(
            info.name,
            schema.event_fields(
                schema.EVENT_ROUTED,
                ranked[0].cand.backend_id,
                ranked[0].cand.epoch,
                {
                    "request": rid,
                    "matched": ranked[0].matched,
                    "prompt_tokens": len(ids),
                    "lookup": lk.status,
                    "candidates": [[s.cand.backend_id, s.matched, s.queued, s.active] for s in ranked],
                },
            ),
        )
    )
    outcome = "ok"
    try:
        return await st.proxy.forward(request, attempts, path, payload, "application/x-msgpack", stream)
    except BackendUnavailable as e:
        outcome = "unavailable"
        raise RequestError(f"no backend could take the request: {e}", status=503, type="server_error", code="backend_unavailable")
    except asyncio.CancelledError:
        outcome = "client_disconnected"
        raise
    finally:
        reqlog.info(
            "request id=%s model=%s backend=%s prompt_tokens=%d matched=%d lookup=%s duration_ms=%.1f outcome=%s",
            rid, info.name, ranked[0].cand.backend_id, len(ids), ranked[0].matched, lk.status,
            (time.perf_counter() - t0) * 1000, outcome,
        )


async def handle_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    names = set(st.tokenizers.models) | {m for m, c in st.index.snapshot.items() if c}
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "mlxgw"} for n in sorted(names)]
    return web.json_response({"object": "list", "data": data, "models": [{"id": n, "name": n} for n in sorted(names)]})


async def handle_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = request.match_info["name"]
    names = set(st.tokenizers.models) | {m for m, c in st.index.snapshot.items() if c}
    if name not in names:
        raise RequestError(f"the model '{name}' does not exist", status=404, param="model", code="model_not_found")
    return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "mlxgw"})


async def handle_health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    live = {m: [c.backend_id for c in cs] for m, cs in st.index.snapshot.items()}
    ok = any(live.values())
    body = {
        "status": "ok" if ok else "no_backends",
        "redis": st.index.healthy,
        "degraded": not st.index.healthy,
        "backends": live,
        "lookups": st.index.lookups,
        "retries": st.proxy.retries,
        **st.counters,
    }
    return web.json_response(body, status=200 if ok else 503)


def make_app(cfg: GatewayConfig) -> web.Application:
    """Build the gateway app; tokenizers load and Redis connects in its cleanup context.

    Raises (at startup): FileNotFoundError for a configured model path that is
    not a model directory.
    """
    app = web.Application(middlewares=[error_middleware, auth.auth_middleware(cfg.api_keys),
                                       limits.limits_middleware(cfg.limits)], client_max_size=cfg.max_body_bytes)

    async def lifecycle(app: web.Application):
        toks = Tokenizers()
        for name, path in cfg.models.items():
            toks.add(name, path)
        index = OwnershipIndex(cfg.redis_url, cfg.namespace, cfg.lookup_deadline)
        try:
            await index.refresh()
        except Exception as e:
            log.warning("Redis not reachable at start (%s); routing on load until it is", type(e).__name__)
        index.start()
        proxy = Proxy(cfg.internal_token, read_timeout=cfg.read_timeout, write_timeout=cfg.limits.write_timeout)
        await proxy.start()
        app[STATE] = GatewayState(cfg, toks, index, proxy)
        yield
        await proxy.close()
        await index.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_text)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{name:.+}", handle_model)
    app.router.add_get("/health", handle_health)
    return app
