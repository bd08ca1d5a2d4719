"""The gateway's non-OpenAI dialects: Anthropic Messages and OpenAI Responses.

Each dialect request becomes one internal OpenAI chat request and goes
through the same route as ``/v1/chat/completions`` (``gateway.app._route``),
so the same conversation gives the same token ids, backend and cached prefix
in every dialect; the answer is rewritten on its way back by the dialect's
transform. Errors are rendered in the endpoint's dialect (`error_response`).
See docs/api.md.
"""

from __future__ import annotations

import uuid
from typing import Awaitable, Callable

from aiohttp import web

from mlxgw.protocol import RequestError, anthropic_context_message

from . import anthropic, responses

def error_response(request: web.Request, err: RequestError) -> web.Response:
    """``err`` as a JSON error in the dialect of ``request``'s endpoint, with its headers.

    Anthropic's shape (``{"type": "error", "error": {"type", "message"}, "request_id"}``, the
    type from the status) under ``/v1/messages``, unknown sub-paths included (an Anthropic
    SDK parses it); OpenAI's ``{"error": {"message", "type", "param", "code"}}`` elsewhere.
    Every error carries a request id in ``x-request-id`` and ``request-id`` (the SDKs'
    ``request_id``; helper-71: None), the routed request's own when it was routed.
    """
    headers = dict(err.headers or {})
    rid = headers.get("request-id") or uuid.uuid4().hex
    headers.setdefault("x-request-id", rid)
    headers.setdefault("request-id", rid)
    if request.path.startswith("/v1/messages"):
        # a context overflow in Anthropic's words (`mlxgw.protocol.context_exceeded`)
        body = anthropic.error_body(anthropic_context_message(*err.tokens) if err.tokens else err.message, err.status)
        body["request_id"] = rid  # as Anthropic's API puts it in the body too
    else:
        body = err.body()
        if request.path.startswith("/v1/responses"):
            body["error"]["param"] = responses.client_param(body["error"].get("param"))
    return web.json_response(body, status=err.status, headers=headers)


Route = Callable[..., Awaitable[web.StreamResponse]]


def register(app: web.Application, route: Route, read_json, count_tokens) -> None:
    """Add the dialect endpoints to the gateway app.

    Args:
        route: ``gateway.app._route`` (``(request, kind, path, body=, transform=)``).
        read_json: reads and size-checks a request's JSON body.
        count_tokens: ``(request, chat_body) -> int`` renders and tokenizes an
            internal chat request exactly as ``route`` would.
    """

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        chat = anthropic.to_chat(body)
        t = anthropic.MessagesTransform(chat["stream"], chat["model"])
        return await route(request, "chat", "/v1/chat/completions", body=chat, transform=t)

    async def count(request: web.Request) -> web.Response:
        body = await read_json(request)
        n = await count_tokens(request, anthropic.to_chat(body, count_only=True))
        return web.json_response({"input_tokens": n})

    async def respond(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        chat = responses.to_chat(body)
        t = responses.ResponsesTransform(chat["stream"], chat["model"], body)
        return await route(request, "chat", "/v1/chat/completions", body=chat, transform=t)

    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count)
    app.router.add_post("/v1/responses", respond)


__all__ = ["register", "error_response", "anthropic", "responses"]
