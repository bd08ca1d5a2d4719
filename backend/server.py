"""The backend's HTTP server (aiohttp): OpenAI endpoints over one engine.

Accepts plain OpenAI JSON (it then tokenizes itself, exactly as the gateway
would, through `mlxgw.prompt`) or the gateway's msgpack forward, which
carries the token ids in the ``_mlxgw`` field so nothing is tokenized twice.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import msgpack
from aiohttp import web

from mlxgw import prompt as prompt_mod
from mlxgw import schema
from mlxgw.protocol import INTERNAL_FIELD, RequestError, context_exceeded, loads_body, parse_openai

from .engine import Engine, GenEvent, GenParams, GenRequest
from .processors import bad_words_ids
from .render import AnswerBuilder, OpenAIRenderer, Piece
from .report import Reporter
from .toolchoice import constrained_processors

log = logging.getLogger("mlxgw.backend")

# The request this task serves, for `RequestIdFilter`.
REQUEST_ID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("mlxgw_request_id", default=None)


class RequestIdFilter(logging.Filter):
    """Appends ``(request RID)`` to what the root logger records while a request is served.

    mlx-lm's tool-call formatter (run in the request's task) warns "Failed to parse tool
    call" through the root logger without saying which request; the gateway's request id
    (``X-Mlxgw-Request-Id``) finds it. A filter on the root logger sees only records
    logged there, not ours (named ``mlxgw.*`` loggers, which name requests themselves).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        try:
            text = record.getMessage()
        except Exception:  # a bad format is the handler's to report, not the caller's to raise
            return True
        if text.startswith("Failed to parse tool call ("):
            # In our words and under our name (helper-68 read "WARNING root: ... likely truncated
            # mid-generation" on an answer whose model wrote a bad block unasked): the block is
            # the answer's text (`backend.render.AnswerBuilder._parse_call`), not lost.
            why = text[len("Failed to parse tool call ("):].split(")", 1)[0]
            text = f"a tool-call block was not parsed ({why}); the client gets it as text"
            record.name, record.levelno, record.levelname = "mlxgw.backend.render", logging.INFO, "INFO"
        if rid is not None:
            text = f"{text} (request {rid})"
        record.msg, record.args = text, ()
        return True


_REQUEST_ID_FILTER = RequestIdFilter()

MSGPACK = "application/x-msgpack"


@dataclass
class BackendConfig:
    """Settings of one backend process (see ``mlxgw backend --help``)."""

    backend_id: str
    model_name: str
    model_path: str
    max_body_bytes: int = 64 * 1024 * 1024
    request_timeout: float = 600.0
    # Keep-alives stop once the engine thread has not gone round its loop for this long (s), so a
    # gateway's --read-timeout still finds a hung engine (`Engine.loop_silent_for`)
    engine_stall_seconds: float = 30.0
    internal_token: Optional[str] = None
    # What a request that sets none of these samples with (`sampling_defaults`): the model's
    # generation_config.json, and `mlxgw backend --default-temperature` over it; empty: greedy.
    sampling: dict = field(default_factory=dict)


#: generation_config.json keys taken as a request's sampling defaults, with the range each must be in
#: (transformers' names are the request fields' names).
SAMPLING_KEYS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, None), "min_p": (0.0, 1.0),
                 "repetition_penalty": (0.0, 10.0)}


def sampling_defaults(model_path, mode: str = "model", temperature: Optional[float] = None) -> dict:
    """The sampling a request that sets none gets: with ``mode`` "model", the values of
    `SAMPLING_KEYS` in the model's ``generation_config.json`` (what its authors recommend, and
    what vLLM applies by default, ``--generation-config auto``), none when it says
    ``do_sample: false``; with "none", nothing (greedy, as mlx_lm.server, which reads only the
    end-of-sequence ids there). ``temperature`` (``--default-temperature``), when given, wins.
    A value out of range or of the wrong type is left out with a warning. Returns
    ``{field: value}``; empty means greedy."""
    out = {}
    path = Path(str(model_path)).expanduser() / "generation_config.json"
    if mode == "model" and path.is_file():
        try:
            gc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("%s not read (%s): requests that set no sampling are greedy", path, e)
            gc = {}
        if isinstance(gc, dict) and gc.get("do_sample") is not False:
            for k, (lo, hi) in SAMPLING_KEYS.items():
                v = gc.get(k)
                if v is None:
                    continue
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo and (
                    hi is None or v <= hi) and (k != "top_k" or float(v).is_integer())
                if ok:
                    out[k] = int(v) if k == "top_k" else float(v)
                else:
                    log.warning("%s: %s %r left out (not from %s to %s)", path, k, v, lo, hi if hi is not None else "any")
            if out.get("repetition_penalty") == 1.0:
                del out["repetition_penalty"]  # transformers' "none"; mlx-lm would still run the processor
    if temperature is not None:
        out["temperature"] = temperature
    if out.get("temperature") == 0:  # greedy: the sampler's filters change nothing (a penalty still does)
        out = {k: v for k, v in out.items() if k not in ("top_p", "top_k", "min_p")}
    return out


ENGINE = web.AppKey("engine", Engine)
REPORTER = web.AppKey("reporter", Reporter)
CONFIG = web.AppKey("config", BackendConfig)


def json_error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as e:
        return json_error(e)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            return json_error(RequestError(e.reason, status=e.status, type="invalid_request_error"))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error")
        return json_error(RequestError("internal error", status=500, type="server_error"))


class Refusals:
    """Requests refused for a missing or wrong internal token, logged once per 10 s with their
    count and the last peer: a gateway started with another token is a setup error whose other
    side is on this backend's machine (helper-64: the gateway logged every refusal, the backend
    none). Use from the event loop's thread."""

    def __init__(self):
        from mlxgw.util import Tally

        self.peer = "-"
        self.tally = Tally(lambda n: log.warning(
            "refused %d request(s) with a missing or wrong internal token (last from %s): a gateway "
            "started with another --internal-token / MLXGW_INTERNAL_TOKEN?", n, self.peer))

    def add(self, peer: str) -> None:
        self.peer = peer
        self.tally.add()


REFUSALS = web.AppKey("refusals", Refusals)

@web.middleware
async def auth_middleware(request: web.Request, handler):
    token = request.app[CONFIG].internal_token
    if token and request.path not in ("/health", "/metrics"):  # no prompts in either
        import hmac

        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            request.app[REFUSALS].add(request.remote or "-")
            raise RequestError("missing or invalid internal token", status=401, type="authentication_error")
    return await handler(request)


async def read_body(request: web.Request) -> dict:
    cfg = request.app[CONFIG]
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise RequestError("request body too large", status=413)
    raw = await request.read()
    if request.content_type == MSGPACK:
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:
            raise RequestError("invalid msgpack body")
        if not isinstance(body, dict):
            raise RequestError("request body must be an object")
        return body
    body = loads_body(raw)
    body.pop(INTERNAL_FIELD, None)  # only the gateway's msgpack forward may set it
    return body


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "chat")


async def handle_text(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "text")


def _internal_ids(ids, name: str) -> list[int]:
    # The gateway packs them (schema.token_bytes, the bytes it hashed; cheaper
    # to pack and unpack than a msgpack int array); a list is accepted too
    # (older gateways).
    if isinstance(ids, bytes):
        try:
            ids = schema.tokens_from_bytes(ids)
        except ValueError as e:
            raise RequestError(f"internal {name}: {e}")
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"internal {name} must be a non-empty list")
    return ids


def _tokenize(engine: Engine, pr, internal: dict) -> tuple[list[list[int]], int]:
    """The request's prompts as token ids (one, or a completions batch's every prompt, in
    order) and the first's system-prompt tokens; the gateway's ids when it sent them."""
    if internal.get("prompt_ids") is not None:
        first = _internal_ids(internal["prompt_ids"], "prompt_ids")
        others = internal.get("batch_ids") or []  # a completions batch's prompts after the first
        if not isinstance(others, list) or len(others) != max(len(pr.batch) - 1, 0):
            raise RequestError("internal batch_ids must hold one entry per prompt after the first")
        return [first] + [_internal_ids(b, "batch_ids") for b in others], int(internal.get("system_tokens", 0))
    tok = engine.tokenizer
    if pr.kind == "chat":
        cp = prompt_mod.render_chat(tok, pr.messages, pr.tools, pr.template_kwargs)
        return [cp.token_ids], cp.system_tokens
    return [ids if ids is not None else prompt_mod.encode_text(tok, text)
            for text, ids in pr.batch or [(pr.prompt, pr.prompt_ids)]], 0


async def _complete(request: web.Request, kind: str, body: Optional[dict] = None) -> web.StreamResponse:
    engine = request.app[ENGINE]
    reporter = request.app[REPORTER]
    cfg = request.app[CONFIG]
    if body is None:
        body = await read_body(request)
    internal = body.pop(INTERNAL_FIELD, None) or {}
    for k, v in cfg.sampling.items():
        if body.get(k) is None:
            body[k] = v
    pr = parse_openai(body, kind)
    if engine.failed or reporter.state != "ready":
        raise RequestError(f"backend not ready ({'failed' if engine.failed else reporter.state})",
                           status=503, type="server_error")
    prompts, system_tokens = _tokenize(engine, pr, internal)
    ctx = engine.context_length
    for i, ((_, given), ids) in enumerate(zip(pr.batch or [(None, pr.prompt_ids)], prompts)):
        where = pr.prompt_param(i)
        if given is not None and any(t >= len(engine.tokenizer) for t in ids):
            raise RequestError(f"{where} contains token ids outside the vocabulary", param=where)
        if len(ids) >= ctx:
            raise context_exceeded(len(ids), ctx, where)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if any(t >= len(engine.tokenizer) for t in getattr(pr, name) or ()):
            raise RequestError(f"'{name}' holds token ids outside the vocabulary", param=name)
    max_tokens = min(pr.answer_budget(), ctx - max(map(len, prompts)))
    min_tokens = min(pr.min_tokens, max_tokens)
    # Redis must reflect earlier saves before this request is answered.
    await reporter.settle(answer=False)

    rid = internal.get("request_id") or uuid.uuid4().hex
    REQUEST_ID.set(rid)
    loop = asyncio.get_running_loop()
    params = GenParams(
        max_tokens=max_tokens,
        # top_p 0 keeps only the likeliest token (OpenAI's meaning): greedy. mlx-lm reads 0 as
        # no nucleus at all (helper-80: the widest sampling for the narrowest setting).
        temperature=0.0 if pr.top_p == 0 else pr.temperature,
        top_p=pr.top_p,
        top_k=effective_top_k(pr.top_k, engine),
        min_p=pr.min_p,
        logit_bias=pr.logit_bias,
        repetition_penalty=pr.repetition_penalty,
        presence_penalty=pr.presence_penalty,
        frequency_penalty=pr.frequency_penalty,
        repetition_context_size=pr.repetition_context_size,
        presence_context_size=pr.presence_context_size,
        frequency_context_size=pr.frequency_context_size,
        xtc_probability=pr.xtc_probability,
        xtc_threshold=pr.xtc_threshold,
        logprobs=pr.logprobs,
        seed=pr.seed,
        ignore_eos=pr.ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=tuple(pr.stop_token_ids),
        allowed_token_ids=tuple(pr.allowed_token_ids) if pr.allowed_token_ids else None,
        bad_words=tuple(map(tuple, bad_words_ids(engine.tokenizer, pr.bad_words))),
        # With tools, none skipped (`MLXEngine._skipped_tokens`)
        skip_special_tokens=pr.skip_special_tokens and not pr.tools,
    )
    choices = []
    # OpenAI's order: prompt p's n choices are indexes p * n .. p * n + n - 1.
    for i, (p, j) in enumerate((p, j) for p in range(len(prompts)) for j in range(pr.n)):
        renderer = OpenAIRenderer(kind, pr.model or cfg.model_name, pr.stream, pr.logprobs, engine.tokenizer,
                                  id_names=pr.return_tokens_as_token_ids, reasoning=pr.include_reasoning, index=i,
                                  same_as=choices[0].renderer if choices else None)
        builder = AnswerBuilder(engine.tokenizer, pr.tools, pr.stop, pr.stream,
                                one_call=not pr.parallel_tool_calls, min_tokens=min_tokens,
                                include_stop=pr.include_stop_str_in_output, stop_token_ids=pr.stop_token_ids,
                                raw=kind == "text")
        req = GenRequest(
            # The first choice keeps the gateway's request id (its routed event names it).
            rid=rid if i == 0 else f"{rid}.{i}",
            prompt=list(prompts[p]),
            # vLLM's rule for n > 1: a prompt's choice j samples from seed + j, so a seeded
            # request's choices differ and each is the same on every run.
            params=params if i == 0 else dataclasses.replace(params, seed=None if pr.seed is None else pr.seed + j),
            system_tokens=system_tokens if p == 0 else 0,
            loop=loop,
            events=asyncio.Queue(),
            spare=j > 0,  # saved only into free space: choice 0's entry holds the prompt they share
        )
        # Each its own (a constrained decoder's processors hold their grammar state).
        req.params.processors = constrained_processors(engine.tokenizer, pr.tools, pr.tool_choice, pr.constraint)
        choices.append(Choice(i, req, renderer, builder, prompt=p))
    # Submitted together: the engine computes the shared prompt once, the other choices waiting
    # for that prefill and reusing it (backend.engine, "waits for that prefill").
    for ch in choices:
        engine.submit(ch.req)
    finished = False
    try:
        if pr.stream:
            resp = await _stream(request, choices, pr, reporter, engine, cfg.request_timeout, cfg.engine_stall_seconds)
        else:
            resp = await _collect(request, choices, reporter, engine, cfg.request_timeout, pr.return_token_ids,
                                  cfg.engine_stall_seconds)
        finished = True
        return resp
    finally:
        for ch in choices:
            engine.metrics.on_unparsed_calls(ch.builder.unparsed_calls)
            if not finished:
                # Client went away or the handler failed: stop generating; the
                # engine still saves the prompt cache (into free space).
                engine.cancel(ch.req.rid, abandoned=True)


@dataclass
class Choice:
    """One choice of an answer (a request's ``n``): its engine request, its renderer and answer
    builder (each holds its own answer's state), and its stream's progress (`_stream`)."""

    index: int
    req: GenRequest
    renderer: OpenAIRenderer
    builder: AnswerBuilder
    prompt: int = 0  # which of a completions batch's prompts it answers
    # Tokens of the answer. Not ``req.generated``: the engine may make a token or two after a stop
    # string or the one tool call allowed ended it, before the cancel reaches it (helper-78:
    # completion_tokens 10 or 11 for the same request, 10 tokens of answer).
    kept: int = 0
    ended: bool = False
    first: bool = True  # no chunk of it sent yet
    reason: Optional[str] = None
    # Its token events not sent yet, each with where its text ends in the decoded stream (``fed``
    # characters so far): a token goes out with the chunk that carries the last of its text, so a
    # stop string's held-back text holds its tokens' entries too (helper-79).
    unsent: list = field(default_factory=list)
    fed: int = 0


def _usage(choices: list[Choice]) -> dict:
    """The request's usage: each prompt counted once (OpenAI's for ``n`` > 1), every choice's
    answer tokens, and as cached, per prompt, the fewest prompt tokens any of its choices read
    from the cache (the prompt's first computing; the others reuse it)."""
    by_prompt: dict[int, list[Choice]] = {}
    for ch in choices:
        by_prompt.setdefault(ch.prompt, []).append(ch)
    return OpenAIRenderer.usage(sum(len(g[0].req.prompt) for g in by_prompt.values()),
                                sum(ch.kept for ch in choices),
                                sum(min(ch.req.cached for ch in g) for g in by_prompt.values()))


class GenerationTimeout(RequestError):
    """The request ran past the backend's ``--request-timeout`` (504)."""

    def __init__(self, seconds: float):
        super().__init__(f"generation timed out after {seconds:g} s (backend --request-timeout)",
                         status=504, type="server_error", code="timeout")


async def _next_event(events: asyncio.Queue, submitted_at: float, timeout: float, tick: float = 0.0):
    """The next item of ``events`` (a request's engine events), or GenerationTimeout once
    ``timeout`` seconds have passed since ``submitted_at`` (a server-side cancel: the
    caller's ``finally`` cancels generation and the engine saves the cache). A ``timeout``
    of 0 is no limit (it timed every request out at once). ``tick`` > 0: None once ``tick``
    seconds pass first with no event (the caller sends a keep-alive)."""
    limit = submitted_at + timeout - time.monotonic() if timeout > 0 else None
    wait = limit if tick <= 0 else tick if limit is None else min(limit, tick)
    if wait is None:
        return await events.get()
    try:
        return await asyncio.wait_for(events.get(), max(wait, 0.0))
    except asyncio.TimeoutError:
        if limit is not None and limit <= wait:
            raise GenerationTimeout(timeout) from None
        return None


async def _collect_choice(ch: Choice, engine, timeout: float, token_ids: bool) -> dict:
    """Run one choice to its end; its whole answer as a response body (one choice, no usage yet)."""
    req, builder = ch.req, ch.builder
    content, reasoning, calls, lps, ids = [], [], [], [], []
    while True:
        ev = await _next_event(req.events, req.submitted_at, timeout)
        if ev.kind == "token" or ev.kind == "end":
            if ev.kind == "token" and not builder.ended:
                ch.kept += 1
                ids.append(ev.token)
            if ev.logprob is not None and not builder.ended:
                lps.append(ev)
            piece = builder.feed(ev.text, ev.finish_reason if ev.kind == "end" else None,
                                 ev.token if ev.kind == "token" else None)
            content.append(piece.content)
            reasoning.append(piece.reasoning)
            calls.extend(piece.tool_calls)
            if builder.ended and ch.reason is None:
                ch.reason = "stop"
                engine.cancel(req.rid)
            if ev.kind == "end":
                if ev.finish_reason == "error":
                    raise RequestError(ev.error or "generation failed", status=500, type="server_error")
                ch.reason = builder.finish_reason(ev.finish_reason)
                ch.ended = True
                break
    body = ch.renderer.full("".join(content), "".join(reasoning), calls, ch.reason, None, builder.stop_reason, lps)
    if token_ids:
        ch.renderer.add_token_ids(body, ids, req.ids)
    return body


async def _collect(request, choices: list[Choice], reporter, engine, timeout: float,
                   token_ids: bool, stall: float) -> web.StreamResponse:
    """The whole answer as one JSON body. One that takes over `schema.KEEPALIVE_SECONDS` sends
    its headers (200, no `schema.CACHED_TOKENS`: its usage has the count) and a newline each
    `schema.KEEPALIVE_SECONDS` until the body, so a gateway's read timeout measures silence, not
    the answer's length (until session 50 every non-streamed answer longer than ``--read-timeout``
    was retried on another backend, found beside helper-90's queued stream). A failure after the
    headers is the error body with that 200."""
    work = asyncio.ensure_future(asyncio.gather(*(_collect_choice(ch, engine, timeout, token_ids) for ch in choices)))
    resp = None
    try:
        while not (await asyncio.wait({work}, timeout=schema.KEEPALIVE_SECONDS))[0]:
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                await resp.prepare(request)
            if _engine_moves(engine, stall):
                await resp.write(b"\n")
        bodies = work.result()
    except RequestError as e:
        if resp is None:
            raise
        for ch in choices:  # as the caller does for an error it sees: stop generating, save the cache
            engine.cancel(ch.req.rid, abandoned=True)
        await resp.write(json.dumps(e.body()).encode())
        await resp.write_eof()
        return resp
    finally:
        if not work.done():  # the client left (this handler cancelled): the caller cancels the generation
            work.cancel()
            # Read its CancelledError, or asyncio logs "exception was never retrieved" (helper-91)
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
    await reporter.settle()
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    body["usage"] = _usage(choices)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    if resp is None:
        return web.json_response(body, headers={schema.CACHED_TOKENS: str(cached)})
    await resp.write(json.dumps(body).encode())
    await resp.write_eof()
    return resp


def effective_top_k(top_k: int, engine) -> int:
    """``top_k`` as the sampler takes it: 0 (no top-k) when it covers the whole vocabulary.
    mlx-lm's sampler raises for a top_k of its logits' size or more (`apply_top_k`), inside
    the batch step, which killed the engine thread and so the backend, and the gateway's retry
    the next one (helper-75: one request with top_k 3072 took down both demo backends); the
    real APIs take any value, and sampling from the top k of n <= k tokens is sampling from all."""
    vocab = len(engine.tokenizer)
    if engine.logits_size:
        vocab = min(vocab, engine.logits_size)
    return top_k if 0 < top_k < vocab else 0


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _engine_moves(engine, stall: float) -> bool:
    """Whether a keep-alive may go out: the engine thread went round its loop within ``stall``
    seconds. A hung engine's requests then fall silent, and a gateway's --read-timeout tries
    another backend, as before keep-alives covered the wait for a decode slot."""
    return engine.loop_silent_for() < stall


async def _stream(request, choices: list[Choice], pr, reporter, engine, timeout: float,
                  stall: float) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            schema.CACHED_TOKENS: "0",
        }
    )
    submitted_at = choices[0].req.submitted_at
    if len(choices) == 1:
        events = choices[0].req.events
        one = choices[0]
    else:
        # n > 1: one queue of (choice, event) in the order the engine made them.
        events, one = asyncio.Queue(), None
        pumps = [asyncio.create_task(_pump(ch, events)) for ch in choices]
    try:
        started = False  # headers sent
        begun = False  # an engine event came (the first: its prefill started, with its cache hit)
        while True:
            try:
                item = await _next_event(events, submitted_at, timeout, 0.0 if begun else schema.KEEPALIVE_SECONDS)
            except GenerationTimeout as e:
                if not started:
                    raise  # nothing sent yet: a plain 504
                for ch in choices:
                    engine.cancel(ch.req.rid, abandoned=True)
                await resp.write(_sse(e.body()))
                break
            if item is None:
                # Waiting for a decode slot: headers now, without the cache hit it does not know
                # yet, and a comment each tick (`schema.QUEUED_COMMENT`)
                if not started:
                    del resp.headers[schema.CACHED_TOKENS]
                    await resp.prepare(request)
                    started = True
                if _engine_moves(engine, stall):
                    await resp.write(schema.QUEUED_COMMENT)
                continue
            ch, ev = (one, item) if one is not None else item
            if not begun:
                begun = True
                if ev.kind == "start" and started:
                    await resp.write(schema.cached_comment(ev.cached))
                elif ev.kind == "start":  # the first choice to start: the one computing the prompt
                    resp.headers[schema.CACHED_TOKENS] = str(ev.cached)
            if not started:
                await resp.prepare(request)
                started = True
            if ev.kind == "start":
                continue
            failed = ev.kind == "end" and ev.finish_reason == "error"
            if one is None and ev.kind != "progress" and not failed and choices[0].first:
                # With the first token: every choice's first chunk (the role), in index order,
                # before any text. The engine may start the choices in another order, and the
                # openai SDK's stream helper builds its choices list in the order first chunks
                # come (helper-83: IndexError). Not sooner: a gateway reads the first data event
                # as the prefill's end (TTFT, queued prefill tokens), and retries a stream that
                # failed before it on another backend.
                for c in choices:
                    for obj in _chunks(c, None, pr, engine, choices):
                        await resp.write(_sse(obj))
            if ev.kind == "progress":
                await resp.write(schema.progress_comment(ev.done, ev.total))
                continue
            if failed:
                # The batch it ran in failed, or the engine thread died and this backend is exiting
                # (code 5): the stream ends as a killed process's would, cut, so a gateway ends its
                # client's stream with its backend_failed event and counts it so (helper-75: an
                # error event and a clean end read as a finished answer: Anthropic end_turn,
                # Responses completed).
                ch.ended = True
                why = ev.error or "generation failed"
                log.warning("request %s: stream cut: %s", ch.req.rid, why)
                try:  # the reason, for a gateway (`schema.FAILED_MARK`)
                    await resp.write(schema.failed_comment(why, fatal=engine.failed))
                except ConnectionResetError:
                    pass
                for c in choices:  # the request's other choices: nobody reads them now (helper-83)
                    if not c.ended:
                        engine.cancel(c.req.rid, abandoned=True)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            if ev.kind == "end":
                await reporter.settle()  # Redis reflects its saves before the client reads its end
            for obj in _chunks(ch, ev, pr, engine, choices):
                await resp.write(_sse(obj))
            if all(c.ended for c in choices):
                if pr.include_usage:
                    await resp.write(_sse(choices[0].renderer.usage_chunk(_usage(choices))))
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        # The client went away mid-answer, a normal ending: stop generating (the
        # engine still saves the prompt cache) without logging a traceback.
        for ch in choices:
            if not ch.ended:
                engine.cancel(ch.req.rid, abandoned=True)
    finally:
        if one is None:
            for t in pumps:
                t.cancel()
    return resp


async def _pump(ch: Choice, out: asyncio.Queue) -> None:
    """Move choice ``ch``'s engine events to the request's one queue, to its end event."""
    while True:
        ev = await ch.req.events.get()
        out.put_nowait((ch, ev))
        if ev.kind == "end":
            return


def _chunks(ch: Choice, ev: Optional[GenEvent], pr, engine, choices: list[Choice]) -> list[dict]:
    """The stream chunks choice ``ch``'s token or end event ``ev`` makes (none while text is held
    back); its end makes its last chunk, with its ``finish_reason``. ``ev`` None: its first chunk
    alone (the role), before any token."""
    renderer, builder = ch.renderer, ch.builder
    out = []
    ended = ev is not None and ev.kind == "end"
    if ev is None:
        piece = Piece()
    else:
        if ev.kind == "token" and not builder.ended:
            ch.kept += 1
            ch.unsent.append((ch.fed + len(ev.text), ev))
        ch.fed += len(ev.text)
        piece = builder.feed(ev.text, ev.finish_reason if ended else None, ev.token if ev.kind == "token" else None)
    if builder.ended and ch.reason is None:
        ch.reason = "stop"
        engine.cancel(ch.req.rid)
    if piece.content or piece.reasoning or piece.tool_calls or ch.first:
        sent = ch.fed - builder.held  # characters of the stream sent (or dropped: markers, a stop's tail)
        ready = [e for end, e in ch.unsent if end <= sent or builder.ended]
        ch.unsent = [(end, e) for end, e in ch.unsent if not (end <= sent or builder.ended)]
        lps = [e for e in ready if e.logprob is not None]
        for i, obj in enumerate(renderer.stream_chunks(piece, first=ch.first, lps=lps)):
            if pr.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far on each chunk
                obj["usage"] = _usage(choices)
            if pr.return_token_ids:  # as the logprobs: with the chunk carrying their text
                renderer.add_token_ids(obj, [e.token for e in ready] if i == 0 else [],
                                       ch.req.ids if ch.first and i == 0 else None)
            out.append(obj)
        ch.first = False
    if ended:
        ch.ended = True
        ch.reason = builder.finish_reason(ev.finish_reason)
        rest = [e for _, e in ch.unsent]
        last = renderer.chunk(Piece(), ch.reason, stop_reason=builder.stop_reason,
                              lps=[e for e in rest if e.logprob is not None])
        if pr.return_token_ids:
            renderer.add_token_ids(last, [e.token for e in rest], None)
        if pr.continuous_usage:
            last["usage"] = _usage(choices)
        out.append(last)
    return out


async def handle_models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    item = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "mlxgw"}
    return web.json_response({"object": "list", "data": [item]})


HEALTH_SETTINGS = ("cache_budget_bytes", "cache_layout", "min_hit_tokens", "max_inflight_share", "pin_by_reference")


async def handle_health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    reporter = request.app[REPORTER]
    # A hung engine thread (no loop for --engine-stall-seconds) is not healthy, though the HTTP side
    # answers: a gateway's circuit for it stays open instead of closing on the next probe
    stalled = not _engine_moves(engine, request.app[CONFIG].engine_stall_seconds)
    ok = not engine.failed and reporter.state == "ready" and not stalled
    body = {
        "status": "ok" if ok else ("failed" if engine.failed else "stalled" if stalled else reporter.state),
        "backend": request.app[CONFIG].backend_id,
        "epoch": reporter.epoch,
        "pid": os.getpid(),
        "redis": reporter.redis_ok,
        "redis_problem": reporter.redis_problem,  # why it last failed; null while it answers
        "reports_late": reporter.reports_late,
        # What it serves: `mlxgw status` names backends of one model whose files differ.
        "model_path": reporter.extra.get("model_path"),
        "model_files": reporter.extra.get("model_files"),
        **engine.stats(),
        # The cache settings of the registry record (`backend.main`), so an operator sees what is on.
        **{k: reporter.extra[k] for k in HEALTH_SETTINGS if k in reporter.extra},
        # Gateways of this model that do not route here, and why (Reporter._check_gateways).
        "left_out_by": reporter.left_out_by,
        "sampling_defaults": request.app[CONFIG].sampling,  # what a request setting none samples with
    }
    return web.json_response(body, status=200 if ok else 503)


async def handle_cache(request: web.Request) -> web.Response:
    """The live cache entries and the blocks they cover (for tests and debugging)."""
    from .report import servable_blocks

    engine = request.app[ENGINE]
    reporter = request.app[REPORTER]
    entries = []
    for e in engine.cache.entries():
        entries.append({
            "id": e.id, "tokens": len(e), "cache_type": e.cache_type, "nbytes": e.nbytes,
            "trimmable": e.trimmable, "used_at": round(e.used_at, 3),
            "blocks": servable_blocks(e, reporter.model, reporter.block_size),
        })
    # The disk tier's entries (cache rule 8), each with its chain of parts: [start, end) tokens per file.
    disk = engine.cache.disk
    tier = [{"id": e.id, "tokens": len(e), "cache_type": e.cache_type, "nbytes": e.nbytes,
             "parts": [[a, b, name] for a, b, name in disk.parts(e)]} for e in disk.entries()] if disk is not None else []
    # ``nbytes``: what the cache holds; with the shared layout (cache rule 7) less than the
    # entries' own ``nbytes`` summed, since each counts its whole chain.
    return web.json_response({"entries": entries, "owned": sorted(reporter.owned_blocks()), "epoch": reporter.epoch,
                              "nbytes": engine.cache.nbytes, "layout": engine.cache.layout, "disk": tier,
                              "disk_nbytes": disk.nbytes if disk is not None else 0})


def make_app(engine: Engine, reporter: Reporter, cfg: BackendConfig) -> web.Application:
    """Build the backend aiohttp app around a started engine and reporter."""
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=cfg.max_body_bytes)
    app[ENGINE] = engine
    app[REPORTER] = reporter
    app[CONFIG] = cfg
    app[REFUSALS] = Refusals()

    async def served_by(request: web.Request, response: web.StreamResponse) -> None:
        # Every answer names this backend: a gateway that reached another backend at a URL
        # registered by mistake (two backends, one address) can tell (mlxgw.schema.SERVED_BY).
        response.headers[schema.SERVED_BY] = cfg.backend_id

    app.on_response_prepare.append(served_by)
    logging.getLogger().addFilter(_REQUEST_ID_FILTER)  # once: the same instance is not added twice
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_text)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/internal/cache", handle_cache)
    if getattr(engine, "metrics", None) is not None:
        app.router.add_get("/metrics", engine.metrics.handler)
    from . import sglang_api

    sglang_api.register(app)
    return app
