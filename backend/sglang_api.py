"""The SGLang-native endpoints sglang-router needs from a worker.

sglang-router (PyPI ``sglang-router`` 0.3.2) probes a worker at registration
with ``GET /health``, ``GET /server_info`` and ``GET /model_info`` (observed on
the wire; older releases use ``/get_server_info`` and ``/get_model_info``),
health-checks ``/health``, and routes token-id prompts only through
``POST /generate`` with ``input_ids`` (its ``/v1/completions`` accepts a string
prompt only). Its cache-aware tree then matches on the ids joined by spaces.

``/generate`` here takes SGLang's request shape (``input_ids`` or ``text``,
``sampling_params.max_new_tokens`` / ``temperature``, ``stream``) and answers
through the backend's own completions path, in the OpenAI completions format
(not SGLang's ``meta_info`` format): that is what the benchmarks read.
"""

from __future__ import annotations

from aiohttp import web

from mlxgw.protocol import RequestError

from . import server


def to_openai(body: dict) -> dict:
    """SGLang ``/generate`` body -> OpenAI completions body.

    Raises:
        RequestError: neither or both of ``text`` and ``input_ids``, or a
            batch (lists of prompts) which this backend does not serve.
    """
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of 'text' and 'input_ids'", param="input_ids")
    prompt = ids if ids is not None else text
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        raise RequestError("batched /generate is not supported", param="input_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise RequestError("'sampling_params' must be an object", param="sampling_params")
    out = {"prompt": prompt, "stream": bool(body.get("stream", False))}
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    for src, dst in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("stop", "stop"), ("seed", "seed")):
        if sp.get(src) is not None:
            out[dst] = sp[src]
    return out


async def handle_generate(request: web.Request) -> web.StreamResponse:
    body = await server.read_body(request)
    return await server._complete(request, "text", to_openai(body))


async def handle_server_info(request: web.Request) -> web.Response:
    cfg = request.app[server.CONFIG]
    engine = request.app[server.ENGINE]
    return web.json_response({
        "model_path": cfg.model_path, "served_model_name": cfg.model_name, "tokenizer_path": cfg.model_path,
        "context_length": engine.context_length, "dp_size": 1, "tp_size": 1, "backend": cfg.backend_id,
    })


async def handle_model_info(request: web.Request) -> web.Response:
    cfg = request.app[server.CONFIG]
    return web.json_response({"model_path": cfg.model_path, "tokenizer_path": cfg.model_path,
                              "served_model_name": cfg.model_name, "is_generation": True})


def register(app: web.Application) -> None:
    """Add the SGLang-native routes to a backend app."""
    app.router.add_post("/generate", handle_generate)
    app.router.add_get("/health_generate", server.handle_health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, handle_server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, handle_model_info)
