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
from functools import partial
from typing import Optional

import msgpack
from aiohttp import web

from mlxgw import schema
from mlxgw.protocol import INTERNAL_FIELD, RequestError, context_exceeded, loads_body, overloaded, parse_openai
from mlxgw.redis_client import is_setting_error

from . import auth, dashboard, dialects, limits
from .limits import LimitConfig
from .index import OwnershipIndex
from .janitor import Janitor
from .load import LoadPublisher
from .metrics import GatewayMetrics, request_done, request_refused
from .pending import PendingClaims, RecentRoutes
from .proxy import Attempt, BackendUnavailable, GatewayStopping, OutOfResources, Proxy
from .route import RoutingConfig, rank
from .stability import DEFAULT_STRIP, DriftDetector, compile_patterns, strip_volatile
from .tokenize import ModelInfo, Tokenizers

log = logging.getLogger("mlxgw.gateway")


@dataclass
class GatewayConfig:
    """Gateway settings (``mlxgw gateway --help``)."""

    redis_url: str = schema.DEFAULT_REDIS_URL
    namespace: str = schema.DEFAULT_NAMESPACE
    block_size: int = schema.DEFAULT_BLOCK_SIZE
    lookup_deadline: float = 0.05  # seconds; `--lookup-deadline-ms` (docs/routing.md "Why 50 ms")
    max_retries: int = 2
    max_body_bytes: int = 32 * 1024 * 1024
    internal_token: Optional[str] = None
    read_timeout: float = 300.0
    gone_after: float = 3.0  # seconds out of the registry before a backend's waiting requests move on (proxy)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    models: dict[str, str] = field(default_factory=dict)  # served name -> local path
    gateway_id: str = "gateway"
    janitor_grace: float = 300.0  # seconds without heartbeat before a backend's leftovers are removed
    load_publish_interval: float = 0.1  # seconds between in-flight publishes (gateway.load)
    strip_lines: tuple = DEFAULT_STRIP  # regexes of volatile system-prompt lines (gateway.stability)
    keepalive: float = 5.0  # seconds of stream silence before an SSE keep-alive
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed (gateway.auth)
    limits: LimitConfig = field(default_factory=LimitConfig)
    token_cache_bytes: int = 64 * 2**20  # per model, gateway.segcache; 0 = plain tokenization


@dataclass
class GatewayState:
    cfg: GatewayConfig
    tokenizers: Tokenizers
    index: OwnershipIndex
    proxy: Proxy
    counters: dict = field(default_factory=lambda: {"requests": 0, "errors": 0, "routed_prefix": 0, "routed_load": 0,
                                                    "routed_fallback": 0, "prefix_drift": 0})
    drift: DriftDetector = field(default_factory=DriftDetector)
    strip: list = field(default_factory=list)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    pending: PendingClaims = field(default_factory=PendingClaims)
    recent: RecentRoutes = field(default_factory=RecentRoutes)  # routed by while Redis cannot answer
    admission: Optional[limits.CallerLimits] = None  # the limits middleware's counts (metrics)


STATE = web.AppKey("state", GatewayState)
# The limits middleware's counts, also fed by the connection guard (gateway.connguard).
ADMISSION = web.AppKey("admission", limits.CallerLimits)
# Request key, set once a request is handed to a backend (a web.RequestKey where aiohttp has them).
FORWARDED = web.RequestKey("mlxgw_forwarded", bool) if hasattr(web, "RequestKey") else "mlxgw_forwarded"


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error becomes a JSON error in the request's dialect, and every answer with an
    error status, ours or a backend's passed through, counts in ``errors``."""
    if schema.FORWARDED_BY in request.headers:
        # A gateway (this one or another) took this gateway for a backend: a backend registered
        # its URL. That gateway hears so and retries elsewhere; it is no failure of this
        # gateway's (helper-67: its refusals were counted in `errors` here).
        gid = request.app[STATE].cfg.gateway_id
        return dialects.error_response(request, RequestError(
            f"this is mlxgw gateway {gid}, not a backend (a backend registered this gateway's URL)",
            status=421, code="misaddressed", headers={schema.GATEWAY_ID: gid}))
    try:
        resp = await handler(request)
    except RequestError as e:
        resp = _refuse(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = RequestError(e.reason or "error", status=e.status)
        if e.status == 404:
            err = RequestError(f"no route for {request.method} {request.path}", status=404, code="not_found")
        elif e.status == 413:
            err = limits.body_too_large()
        resp = _refuse(request, err)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled gateway error")
        resp = _refuse(request, RequestError("internal gateway error", status=500, type="server_error"))
    if resp.status >= 400 and request.path != "/health":  # /health's 503 reports the stack, not a failed request
        request.app[STATE].counters["errors"] += 1
    return resp


# Routing headers that name an answering backend, left off when none answered.
UNANSWERED_DROP = ("X-Mlxgw-Backend", "X-Mlxgw-Matched-Tokens")


def _refuse(request: web.Request, err: RequestError) -> web.Response:
    """The error answer for ``err``, logged as refused unless a backend already had the request.

    Called inside the ``except`` clause: keeping a raised error past it would tie its traceback
    (and the request body its frames hold) into a reference cycle with the middleware's frame.
    """
    if not request.get(FORWARDED):  # a forwarded request has its own log line (request_done)
        request_refused(request, err)
    return dialects.error_response(request, err)


async def _read_json(request: web.Request) -> dict:
    cfg = request.app[STATE].cfg
    raw = await limits.receive_body(request, cfg.max_body_bytes, cfg.limits.body_timeout)  # read already, when capped
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


async def _render_chat(st: GatewayState, info: ModelInfo, pr) -> tuple[list[int], int]:
    pr.messages = strip_volatile(pr.messages, st.strip)
    cp = await st.tokenizers.render_chat(info, pr.messages, pr.tools, pr.template_kwargs)
    return cp.token_ids, cp.system_tokens


async def count_chat_tokens(request: web.Request, body: dict) -> int:
    """Prompt tokens of an internal chat request, rendered exactly as `_route` renders it."""
    st = request.app[STATE]
    pr = parse_openai(body, "chat")
    ids, _ = await _render_chat(st, resolve_model(st, pr.model), pr)
    return len(ids)


async def _route(request: web.Request, kind: str, path: str, body: Optional[dict] = None,
                 transform=None) -> web.StreamResponse:
    """Validate, tokenize and forward one OpenAI request; dialects pass their translated ``body``."""
    st = request.app[STATE]
    t0 = time.perf_counter()
    body = await _read_json(request) if body is None else body
    pr = parse_openai(body, kind)
    info = resolve_model(st, pr.model)
    limits.check_request(st.cfg.limits, info, pr)
    if kind == "chat":
        ids, system_tokens = await _render_chat(st, info, pr)
        if st.drift.observe(info.name, pr.messages, ids):
            st.counters["prefix_drift"] += 1
    elif pr.prompt_ids is not None:
        ids, system_tokens = pr.prompt_ids, 0
    else:
        ids, system_tokens = await st.tokenizers.encode(info, pr.prompt), 0
    # A completions batch: every prompt tokenized here too; the first routes the request.
    batch = [ids] + [p if p is not None else await st.tokenizers.encode(info, text) for text, p in pr.batch[1:]]
    for i, b in enumerate(batch):
        if len(b) >= info.context_length:
            raise context_exceeded(len(b), info.context_length, pr.prompt_param(i))
    longest = max(map(len, batch))
    room = info.context_length - longest
    cap = st.cfg.limits.max_answer_tokens
    answer = pr.max_tokens  # None: the backend's default; the seeding rule reads it as unbounded
    if 0 < cap < min(pr.answer_budget(), room + 1):  # the operator's bound (--max-answer-tokens), under the context's
        answer = _lower_max_tokens(body, pr, cap)
    elif pr.max_tokens is not None and pr.max_tokens > room:
        answer = _lower_max_tokens(body, pr, room)
        if transform is not None:  # a length stop is then the context's (the Anthropic dialect says so)
            transform.context_capped = True
    return await route_and_forward(request, st, info, body, ids, system_tokens, path, pr.stream, t0, transform,
                                   batch=batch if pr.batch else None, answer_tokens=answer)


def _lower_max_tokens(body: dict, pr, n: int) -> int:
    """Set the forwarded request's ``max_tokens`` to ``n`` (and its ``min_tokens`` to at most
    that: the backend refuses more); returns ``n``."""
    body["max_tokens"] = n
    body.pop("max_completion_tokens", None)
    if pr.min_tokens > n:
        body["min_tokens"] = n
    return n


def session_key(request: web.Request, body: dict) -> Optional[str]:
    """The client's session key for affinity: header ``X-Session-Id``, else the
    body's ``prompt_cache_key`` (OpenAI) or ``user``; None when absent."""
    for v in (request.headers.get("X-Session-Id"), body.get("prompt_cache_key"), body.get("user")):
        if isinstance(v, str) and v:
            return v[:256]
    return None


async def route_and_forward(request, st: GatewayState, info: ModelInfo, body: dict, ids: list[int],
                            system_tokens: int, path: str, stream: bool, t0: float,
                            transform=None, batch: Optional[list[list[int]]] = None,
                            answer_tokens: Optional[int] = None) -> web.StreamResponse:
    """Look up ownership, rank backends, forward; shared by every dialect.

    ``batch``: a completions request's prompts (token ids, ``ids`` first), answered on one
    backend, the one the first prompt routes to (a batch of few-shot prompts shares its prefix).
    ``answer_tokens``: the request's ``max_tokens`` as forwarded (capped to the context; None:
    unbounded), for the seeding rule (`gateway.route.seed_wait`)."""
    cfg = st.cfg
    st.counters["requests"] += 1  # reached routing (docs: errors is not a part of requests)
    packed = schema.token_bytes(ids)  # once, for the block hashes and the forward
    blocks = schema.block_keys(info.name, packed, cfg.block_size)
    lk = await st.index.lookup(info.name, blocks)
    pending = st.pending.depths(blocks)
    if lk.status != "ok":  # Redis did not answer: where this gateway last sent these prefixes
        for b, d in st.recent.depths(blocks).items():
            pending[b] = max(pending.get(b, 0), d)
    decision = rank(
        lk.candidates,
        len(ids),
        cfg.block_size,
        st.proxy.inflight.view(),
        blocks[0] if blocks else "",
        cfg.routing,
        session_key(request, body),
        pending,
        answer_tokens,
    )
    ranked = [s for s in decision.ranked if not st.proxy.recently_failed(s.cand.backend_id)] or decision.ranked
    if not ranked:
        # Retry-After: backends (re-)register within a heartbeat, e.g. after Redis restarted empty.
        bad = st.index.incompatible.get(info.name)
        why = (f"; left out: {'; '.join(f'{b}: {w}' for b, w in sorted(bad.items()))}" if bad else "")
        if not st.index.healthy and st.index.redis_error is not None:  # helper-66: a wrong password read as no backend
            why += f" (this gateway learns of backends from Redis: {st.index.problem(for_clients=True)})"
        # Retry-After only when waiting can help (a backend registering); a setting to fix cannot.
        raise RequestError(f"no live backend serves '{info.name}'{why}", status=503, type="server_error",
                           code="no_backend", headers={} if bad else {"Retry-After": "1"})
    reason = decision.reason
    if ranked[0] is not decision.best:  # the choice failed just now: say what the one taken offers
        reason = "prefix" if ranked[0].matched > 0 else "load"
    rid = uuid.uuid4().hex
    route_ms = (time.perf_counter() - t0) * 1000
    explain = " ".join(s.explain() for s in ranked)
    # The metrics' classes (gateway.metrics.request_done): a failed lookup is a fallback,
    # whatever this gateway's own pending claims matched.
    st.counters["routed_fallback" if lk.status != "ok" else
                ("routed_prefix" if ranked[0].matched > 0 else "routed_load")] += 1
    body[INTERNAL_FIELD] = {"prompt_ids": packed, "system_tokens": system_tokens, "request_id": rid}
    others = 0  # prefill tokens of the batch's other prompts, counted as the first one's are
    if batch:
        body[INTERNAL_FIELD]["batch_ids"] = [schema.token_bytes(b) for b in batch[1:]]  # the first is prompt_ids
        others = sum(map(len, batch[1:]))
    payload = msgpack.packb(body, use_bin_type=True)
    attempts = [
        Attempt(
            s.cand.backend_id,
            s.cand.url,
            s.prefill + others,
            {
                "X-Mlxgw-Backend": s.cand.backend_id,
                "X-Mlxgw-Matched-Tokens": str(s.matched),
                "X-Mlxgw-Prompt-Tokens": str(len(ids)),
                "X-Mlxgw-Lookup": lk.status,
                "X-Mlxgw-Candidates": explain,
                # The next-ranked backends answer only when those before failed.
                "X-Mlxgw-Route-Reason": reason if i == 0 else "retry",
                "X-Mlxgw-Request-Id": rid,
                # The ids the SDKs show (`_request_id`): openai reads x-request-id, anthropic request-id
                # (helper-71: None in both).
                "x-request-id": rid,
                "request-id": rid,
            },
            decodes=(body.get("n") or 1) * (len(batch) if batch else 1),
        )
        for i, s in enumerate(ranked)  # forward tries 1 + max_retries of them (`Attempt.free` aside)
    ]
    log.debug("route %s: %s (reason %s, lookup %s, %.2f ms)", rid, explain, reason, lk.status, route_ms)
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
                "reason": reason,
                "gateway": cfg.gateway_id,  # several gateways write one stream
                "candidates": [[s.cand.backend_id, s.matched, s.queued, s.active] for s in ranked],
            },
        ),
    )
    outcome, resp = "ok", None
    claim = st.pending.add(ranked[0].cand.backend_id, blocks)
    request[FORWARDED] = True
    try:
        resp = await st.proxy.forward(request, attempts, path, payload, "application/x-msgpack", stream, transform,
                                      max_tries=1 + cfg.max_retries)
        if any(a.failed for a in attempts):
            # A 200 whose stream ended in an error event: an error all the same.
            outcome = "gateway_stopping" if any(a.stopped for a in attempts) else "backend_failed"
            st.counters["errors"] += 1
        elif any(a.client_gone for a in attempts):
            outcome = "client_disconnected"  # left mid-answer (before it: CancelledError below)
        return resp
    except BackendUnavailable as e:
        outcome = "unavailable"
        # Routed but unanswered: the routing headers still tell the client what was tried.
        route = {k: v for k, v in attempts[0].headers.items() if k not in UNANSWERED_DROP}
        if e.timed_out:
            raise RequestError(f"backend timed out: {e}", status=504, type="server_error", code="backend_timeout",
                               headers=route)
        # Retry-After: a restarting backend re-registers, or leaves the registry, within seconds.
        raise RequestError(f"no backend could take the request: {e}", status=503, type="server_error",
                           code="backend_unavailable", headers={**route, "Retry-After": "1"})
    except GatewayStopping as e:
        outcome = "gateway_stopping"
        # A backend was computing it (the message names it): its headers, X-Mlxgw-Backend included
        # (helper-70: left off as for a request no backend took).
        route = dict(next((a for a in reversed(attempts) if a.tried), attempts[0]).headers)
        raise RequestError(f"{e}; send it again (another gateway, or this one once restarted, takes it)",
                           status=503, type="server_error", code="gateway_stopping",
                           headers={**route, "Retry-After": "1"})
    except OutOfResources as e:
        outcome = "overloaded"
        if st.admission is not None:
            st.admission.rejected["out_of_files"] += 1
        raise overloaded(f"the gateway is out of open files or memory ({e}); retry shortly") from None
    except asyncio.CancelledError:
        outcome = "client_disconnected"
        raise
    finally:
        ended_well = outcome == "ok" and resp is not None and resp.status < 400
        tried = [a for a in attempts if a.tried]
        # The claim names the first choice: kept for its grace only if that backend answered (a
        # retry elsewhere left it crediting the failed one: helper-53 saw the next turn go there).
        st.pending.release(claim, ended_well and bool(tried) and tried[-1].backend_id == ranked[0].cand.backend_id)
        if ended_well and tried:  # the backend that answered (after a retry, not the first choice)
            st.recent.add(tried[-1].backend_id, blocks)
        # Metrics and the request log line (a blocking write to stderr, ~0.25 ms) run once
        # aiohttp has written the answer (same task step), off the client's latency.
        asyncio.get_running_loop().call_soon(partial(
            request_done, st.metrics, rid=rid, model=info.name, prompt_tokens=len(ids), lookup=lk, t0=t0,
            route_s=route_ms / 1000, attempts=attempts, resp=resp, outcome=outcome))


def _model_entry(info, anthropic: bool) -> dict:
    """One model of ``/v1/models`` with its context length (tokens, prompt and answer together),
    which agent tools need to compact a conversation in time (helper-71: never published):
    OpenAI's shape plus vLLM's ``max_model_len``, or, for an Anthropic client (an
    ``anthropic-version`` header), Anthropic's ``{"type": "model", "id", "display_name",
    "created_at", "max_input_tokens", "max_tokens"}``."""
    if anthropic:
        return {"type": "model", "id": info.name, "display_name": info.name, "created_at": "1970-01-01T00:00:00Z",
                "max_input_tokens": info.context_length - 1, "max_tokens": info.context_length - 1}
    return {"id": info.name, "object": "model", "created": 0, "owned_by": "mlxgw", "max_model_len": info.context_length}


async def handle_models(request: web.Request) -> web.Response:
    """This gateway's models (the ones it can tokenize for and route); a model only other
    gateways serve is not listed: asked for here, it is a 404 (``/health`` ``not_served``).
    An Anthropic client (``anthropic-version`` header) gets Anthropic's list shape."""
    st = request.app[STATE]
    infos = [st.tokenizers.models[n] for n in sorted(st.tokenizers.models)]
    if "anthropic-version" in request.headers:
        data = [_model_entry(i, True) for i in infos]
        return web.json_response({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})
    return web.json_response({"object": "list", "data": [_model_entry(i, False) for i in infos],
                              "models": [{"id": i.name, "name": i.name} for i in infos]})


async def handle_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = request.match_info["name"]
    if name not in st.tokenizers.models:
        raise RequestError(f"the model '{name}' does not exist", status=404, param="model", code="model_not_found")
    return web.json_response(_model_entry(st.tokenizers.models[name], "anthropic-version" in request.headers))


async def handle_health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    # This gateway's models, each with its live backends; models with live backends that this
    # gateway cannot route (no tokenizer for them: a backend started without --served-name, or
    # another gateway's model) apart, so that they make no gateway look healthy.
    live = {m: [c.backend_id for c in st.index.snapshot.get(m, [])] for m in st.tokenizers.models}
    other = {m: [c.backend_id for c in cs] for m, cs in st.index.snapshot.items()
             if cs and m not in st.tokenizers.models}
    ids = {b for bs in live.values() for b in bs}
    # Every live backend refused this gateway's internal token: it cannot serve anything, so a
    # load balancer must take it out (a 200 kept it in, answering 503 to every request).
    rejected = bool(ids) and ids <= st.proxy.token_rejected.keys()
    # Every live backend skipped (open circuit, refused token, misaddressed): still listed in
    # Redis (a killed one until its record expires) but serving nothing, so not "ok" either
    # (helper-67: a 200 "ok" while every request got a 503).
    failing = bool(ids) and not rejected and all(st.proxy.recently_failed(b) for b in ids)
    ok = bool(ids) and not rejected and not failing
    body = {
        "status": "ok" if ok else ("token_rejected" if rejected else "backends_failing" if failing else "no_backends"),
        "redis": st.index.healthy,
        "degraded": not st.index.healthy,
        "backends": live,
        # Of those, the ones still loading (registered, not ready): not routed to yet.
        "starting": {m: [c.backend_id for c in st.index.snapshot.get(m, []) if c.state == "starting"]
                     for m in st.tokenizers.models},
        "not_served": other,
        "lookups": st.index.lookups,
        "lookups_stretched": st.index.lookups_stretched,
        "events_dropped": st.index.events_dropped,
        "redis_data_losses": st.index.data_losses,  # Redis found empty (restart, flush): gateway.index
        "retries": st.proxy.retries,
        "pending_claims": st.pending.live(),  # routed prefixes in flight or in their grace (gateway.pending)
        "circuit_open": sorted(st.proxy.open),
        "token_rejected": sorted(st.proxy.token_rejected),
        # backends whose registered URL another backend answers at -> that URL (gateway.proxy)
        "misaddressed": dict(sorted(st.proxy.misaddressed.items())),
        # live backends left out: another block size or tokenizer (gateway.index.mismatch)
        "incompatible": st.index.incompatible,
        **st.counters,
    }
    return web.json_response(body, status=200 if ok else 503)


async def handle_favicon(request: web.Request) -> web.Response:
    """No icon (204): a browser opening /health or /metrics asks for one, and its 404 counted
    as a gateway error (helper-47)."""
    return web.Response(status=204)


async def handle_metrics(request: web.Request) -> web.Response:
    return await request.app[STATE].metrics.handler(request)


class GatewayIdInUse(Exception):
    """A live gateway publishes under this gateway's ``--gateway-id`` (`OwnershipIndex.id_in_use`);
    `gateway.main` exits 2 with it, as a backend does for a live backend's ``--id``."""


class RedisRefused(Exception):
    """Redis refused this gateway at start for a reason only another ``--redis-url`` mends
    (`mlxgw.redis_client.is_setting_error`); `gateway.main` exits 4 with it, as a backend does.
    Unreachable at start is not this: the gateway routes on load until Redis answers."""


def make_app(cfg: GatewayConfig) -> web.Application:
    """Build the gateway app; tokenizers load and Redis connects in its cleanup context.

    Raises (at startup): FileNotFoundError for a configured model path that is
    not a model directory.
    """
    admission = limits.limits_middleware(cfg.limits, cfg.max_body_bytes)
    app = web.Application(middlewares=[error_middleware, auth.auth_middleware(cfg.api_keys), admission],
                          client_max_size=cfg.max_body_bytes)
    app[ADMISSION] = admission.limits

    async def lifecycle(app: web.Application):
        toks = Tokenizers(cfg.token_cache_bytes)
        for name, path in cfg.models.items():
            toks.add(name, path)
        index = OwnershipIndex(cfg.redis_url, cfg.namespace, cfg.lookup_deadline, cfg.gateway_id)
        index.expect = {name: (cfg.block_size, info.fingerprint) for name, info in toks.models.items()}
        try:
            taken = await index.id_in_use()
        except Exception:  # Redis unreachable: the refresh below says so
            taken = None
        if taken:
            await index.close()
            raise GatewayIdInUse(taken)
        try:
            await index.refresh()
        except Exception as e:
            index.redis_error = e
            if is_setting_error(e):  # a wrong password or database: waiting never mends it (helper-68)
                await index.close()
                raise RedisRefused(index.problem()) from None
            log.warning("at start: %s; routing on load until it answers", index.problem())
        index.start()
        proxy = Proxy(cfg.internal_token, read_timeout=cfg.read_timeout, keepalive=cfg.keepalive,
                      write_timeout=cfg.limits.write_timeout, url_of=index.url_of, gone_after=cfg.gone_after)
        proxy.gateway_id = cfg.gateway_id
        proxy.prefill_progress = cfg.routing.prefill_progress
        await proxy.start()
        index.skipped = proxy.skipped
        index.refused = proxy.refused
        index.on_snapshot.append(proxy.note_registry)
        proxy.note_registry(index.snapshot)  # the snapshot read at start
        app[STATE] = GatewayState(cfg, toks, index, proxy, strip=compile_patterns(cfg.strip_lines),
                                  pending=PendingClaims(cfg.routing.pending_grace), admission=app[ADMISSION])
        app[STATE].metrics.bind(app[STATE])
        index.on_restart.append(app[STATE].recent.forget)
        for name in cfg.models:
            app[STATE].metrics.prime(name)
        publisher = LoadPublisher(index, proxy.inflight.view, cfg.load_publish_interval)
        publisher.start()
        janitor = Janitor(index, grace=cfg.janitor_grace, interval=min(10.0, max(1.0, cfg.janitor_grace / 2)))
        janitor.start()
        yield
        # Side by side: a task stuck in a redis-py call while cancelled costs its close up to
        # `CANCEL_WAIT_SECONDS`, once in all rather than once per task (the janitor's and the
        # publisher's, one after the other, took a stop past 15 s on a loaded machine).
        await asyncio.gather(janitor.close(), publisher.close())
        await proxy.close()
        await index.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_text)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{name:.+}", handle_model)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/favicon.ico", handle_favicon)
    dashboard.install(app, cfg.redis_url, cfg.namespace)
    dialects.register(app, _route, _read_json, count_chat_tokens)
    return app
