"""OpenAI request parsing and validation, shared by gateway and backend.

`parse_openai` turns a chat or text-completion body into a `ParsedRequest`
(prompt source + `GenParams`-like sampling fields), raising `RequestError`
with the OpenAI error fields for anything malformed. Unknown fields are
ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

# Internal fields the gateway adds when forwarding (the backend then skips
# tokenization). Clients cannot set them: the gateway strips them first.
INTERNAL_FIELD = "_mlxgw"


class RequestError(Exception):
    """A client error, rendered as an OpenAI-style JSON error.

    Attributes: status (HTTP, 4xx), message, param (offending field or None),
    code (machine-readable, e.g. ``"context_length_exceeded"``), type.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class ParsedRequest:
    """A validated OpenAI chat or completions request.

    ``kind`` is ``"chat"`` or ``"text"``. For chat, ``messages``/``tools``;
    for text, ``prompt`` (str) or ``prompt_ids`` (token array).
    """

    kind: str
    model: Optional[str]
    stream: bool = False
    include_usage: bool = False
    messages: list = field(default_factory=list)
    tools: Optional[list] = None
    tool_choice: Any = None
    prompt: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    repetition_penalty: float = 0.0
    template_kwargs: dict = field(default_factory=dict)
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None


def loads_body(raw: bytes) -> dict:
    """Decode a JSON object body.

    Raises:
        RequestError: not UTF-8, not JSON, nesting too deep, or not an object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("request body is not valid UTF-8")
    try:
        body = json.loads(text)
    except RecursionError:
        raise RequestError("request body is nested too deeply")
    except ValueError as e:
        raise RequestError(f"invalid JSON in request body: {e}")
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _num(body: dict, name: str, default, lo=None, hi=None, integer=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind}", param=name)
    if isinstance(v, float) and not math.isfinite(v):
        raise RequestError(f"'{name}' must be finite", param=name)
    if lo is not None and v < lo:
        raise RequestError(f"'{name}' must be >= {lo}", param=name)
    if hi is not None and v > hi:
        raise RequestError(f"'{name}' must be <= {hi}", param=name)
    return v


def _validate_messages(messages) -> list:
    if messages is None:
        raise RequestError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{p}' must be an object", param=p)
        role = m.get("role")
        if not isinstance(role, str) or role not in (
            "system", "developer", "user", "assistant", "tool", "function"
        ):
            raise RequestError(f"'{p}.role' must be one of system, developer, user, assistant, tool", param=f"{p}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"'{p}.content' must be a string or an array of parts", param=f"{p}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise RequestError(f"'{p}.content[{j}]' must be an object", param=f"{p}.content")
        tcs = m.get("tool_calls")
        if tcs is not None and not isinstance(tcs, list):
            raise RequestError(f"'{p}.tool_calls' must be an array", param=f"{p}.tool_calls")
    return messages


def normalize_messages(messages: list) -> list:
    """Flatten text content parts into strings and decode tool-call argument JSON.

    Templates expect ``content`` as a string and (Qwen-style) tool-call
    ``arguments`` as an object; OpenAI clients send parts and JSON strings.
    """
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = "".join(
                p.get("text", "") for p in c if isinstance(p, dict) and p.get("type", "text") in ("text", "input_text", "output_text")
            )
        elif c is None:
            m["content"] = ""
        if m.get("tool_calls"):
            tcs = []
            for tc in m["tool_calls"]:
                tc = dict(tc) if isinstance(tc, dict) else {}
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass
                tc["function"] = fn
                tcs.append(tc)
            m["tool_calls"] = tcs
        out.append(m)
    return out


def parse_openai(body: dict, kind: str) -> ParsedRequest:
    """Validate an OpenAI ``/v1/chat/completions`` (kind "chat") or ``/v1/completions`` ("text") body.

    Raises:
        RequestError: with ``param`` naming the offending field.
    """
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    include_usage = bool((so or {}).get("include_usage", False))
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        max_tokens = _num({"max_tokens": max_tokens}, "max_tokens", None, lo=1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("'stop' must be a string or an array of strings", param="stop")
    stop = [s for s in stop if s]
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise RequestError("'logit_bias' must be an object", param="logit_bias")
        try:
            lb = {int(k): float(v) for k, v in lb.items()}
        except (TypeError, ValueError):
            raise RequestError("'logit_bias' must map token ids to numbers", param="logit_bias")
    tk = body.get("chat_template_kwargs") or {}
    if not isinstance(tk, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("'seed' must be an integer", param="seed")
    user = body.get("user")
    pck = body.get("prompt_cache_key")
    req = ParsedRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=float(_num(body, "temperature", 0.0, lo=0, hi=100)),
        top_p=float(_num(body, "top_p", 1.0, lo=0, hi=1)),
        top_k=int(_num(body, "top_k", 0, lo=0, integer=True)),
        min_p=float(_num(body, "min_p", 0.0, lo=0, hi=1)),
        repetition_penalty=float(_num(body, "repetition_penalty", 0.0, lo=0, hi=10)),
        stop=stop,
        seed=seed,
        logit_bias=lb,
        template_kwargs=tk,
        user=user if isinstance(user, str) else None,
        prompt_cache_key=pck if isinstance(pck, str) else None,
    )
    if kind == "chat":
        req.messages = normalize_messages(_validate_messages(body.get("messages")))
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise RequestError("'tools' must be an array of objects", param="tools")
            req.tools = tools or None
        req.tool_choice = body.get("tool_choice")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' must not be empty", param="prompt")
            req.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt
        ):
            req.prompt_ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a non-empty string or array of token ids", param="prompt")
    return req
