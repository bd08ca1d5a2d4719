"""What every dialect shares: reading the backend's OpenAI answer back.

A dialect (Anthropic Messages, OpenAI Responses) is translated into one
internal OpenAI chat request in the gateway, so routing, tokenization and the
cache see the same tokens whatever the dialect; the backend answers in OpenAI
chat form and a `ChatTransform` subclass turns that answer into the dialect's
own, as the bytes arrive (``gateway.proxy.Proxy.forward(transform=...)``).

The streamed OpenAI chat chunks are reduced to a few events (`on_text`,
`on_reasoning`, `on_tool_start`, `on_tool_args`, `on_finish`, `on_usage`), so
each dialect only says how it renders them.
"""

from __future__ import annotations

import json
from typing import Mapping, Optional

from mlxgw import schema
from mlxgw.protocol import new_id  # noqa: F401 - the dialects' ids (re-exported)


def function_tools(tools, keep, schema_field: str, schema_required: bool = False) -> Optional[list[dict]]:
    """A dialect's tool list -> OpenAI function tools (None when there are none).

    ``keep(t)`` selects the client's own tools (built-in/server tools are
    dropped); each kept tool has ``name``, optional ``description`` and its
    JSON schema in ``schema_field`` (``input_schema``, ``parameters``).
    Keys are written in OpenAI's order (name, description, parameters):
    templates dump tools with ``tojson`` unsorted, and the same tools must give
    the same tokens in every dialect, or the prefix cache misses.

    Raises:
        RequestError: 400 for a malformed list, a tool without a name or with the
            name of an earlier one, a schema that is not an object schema, or no
            schema when ``schema_required`` (Anthropic's ``input_schema``); ``param``
            names the client's field (`mlxgw.protocol.check_tool`).
    """
    from mlxgw.protocol import RequestError, check_tool

    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("'tools' must be an array of objects", param="tools")
    out = []
    seen: set = set()
    for i, t in enumerate(tools):
        if not keep(t):
            continue
        schema = t.get(schema_field)
        if schema is None and schema_required:
            raise RequestError(f"'tools[{i}].{schema_field}' is required", param=f"tools[{i}].{schema_field}")
        check_tool(t.get("name"), schema, seen, f"tools[{i}].name", f"tools[{i}].{schema_field}")
        fn = {"name": t["name"]}
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = schema or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_request(body: dict, messages, tools, convert_tool_choice) -> dict:
    """The common head of an internal chat request: ``model``, ``messages`` and,
    when there are tools, ``tools`` and the dialect's ``tool_choice``.

    ``messages`` and ``tools`` are zero-argument converters of the dialect,
    called in that order after ``model`` is checked (so errors come in the
    order the fields are read).

    Raises:
        RequestError: 400 when ``model`` is missing, or ``tool_choice`` forces a
            call and no function tools are left.
    """
    from mlxgw.protocol import RequestError

    model = body.get("model")
    if model is None:
        raise RequestError("'model' is required", param="model")
    if not isinstance(model, str):  # helper-75: a number or a list read "'model' is required"
        raise RequestError("'model' must be a string", param="model")
    out = {"model": model, "messages": messages()}
    tools = tools()
    tc = convert_tool_choice(body.get("tool_choice"))
    if tools:
        out["tools"] = tools
        if tc is not None:
            out["tool_choice"] = tc
    elif tc is not None and tc not in ("auto", "none"):
        # As the chat endpoint answers: a forced call needs a tool the client runs.
        raise RequestError("'tool_choice' forces a tool call but the request has no function tools",
                           param="tool_choice")
    return out


def with_stream(out: dict, body: dict) -> dict:
    """Copy the dialect's boolean ``stream`` into ``out``; a streamed internal
    request always asks for the final usage chunk (the dialects report usage).

    Raises:
        RequestError: 400 when ``stream`` is not a boolean.
    """
    from mlxgw.protocol import RequestError

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def sse_event(event: str, data: dict) -> bytes:
    """One named SSE event (``event:`` + ``data:`` lines), as Anthropic and Responses send them."""
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class ChatTransform:
    """Base of the dialect transforms (implements ``gateway.proxy.Transform``).

    Args:
        stream: the client asked for a stream (the backend then answers SSE).
        model: the model name to echo back.

    Non-streamed and error answers are buffered and converted whole at
    `end` (`convert_full`, `convert_error`); streamed ones go chunk by chunk.
    """

    def __init__(self, stream: bool, model: str):
        self.stream = stream
        self.model = model
        self.status = 200
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.stop_string: Optional[str] = None
        self.buffered = not stream
        self._buf = b""
        self._body = bytearray()
        self._tools: dict[int, dict] = {}
        self.finish_reason: Optional[str] = None
        self.usage: Optional[dict] = None
        self.done = False
        # Set by the gateway when it lowered the request's max_tokens to the context left
        # (`gateway.app._route`): the Anthropic dialect's length stop is then the context's.
        self.context_capped = False
        self.request_id = ""
        # The chat logprobs entries of the text `on_text` is given (`text_entries`); None when
        # the request asked for none.
        self.text_logprobs: Optional[list] = None

    # -- gateway.proxy.Transform -------------------------------------------
    def begin(self, status: int, headers: Mapping[str, str], route: Mapping[str, str]) -> dict:
        self.status = status
        self.request_id = route.get("request-id", "")  # the routed request's (Anthropic error bodies)
        self.prompt_tokens = int(route.get("X-Mlxgw-Prompt-Tokens", "0") or 0)
        self.cached_tokens = int(headers.get(schema.CACHED_TOKENS, "0") or 0)
        if status >= 400 or not headers.get("Content-Type", "").startswith("text/event-stream"):
            self.buffered = True
            return {"Content-Type": "application/json"}
        return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    def feed(self, data: bytes) -> bytes:
        if self.buffered:
            self._body += data
            return b""
        out = []
        if not self._started:
            self._started = True
            out.append(self.on_open())
        self._buf += data
        while b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            out.append(self._event(raw.decode("utf-8", errors="replace")))
        return b"".join(out)

    def end(self) -> bytes:
        if self.buffered:
            try:
                obj = json.loads(bytes(self._body) or b"{}")
            except ValueError:
                obj = {"error": {"message": "backend answered with invalid JSON", "type": "server_error"}}
            if self.status >= 400 or "error" in obj:
                body = self.convert_error(obj.get("error") or {}, self.status)
            else:
                body = self.convert_full(obj)
            return json.dumps(body, ensure_ascii=False).encode()
        if not self._started:
            return self.feed(b"") + self.on_done()
        return b"" if self.done else self.on_done()

    def fail(self, message: str, code: str = "backend_failed") -> bytes:
        if self.buffered:
            return json.dumps(self.convert_error({"message": message, "type": "server_error"}, 502)).encode()
        return self.on_error({"message": message, "type": "server_error", "code": code})

    def keepalive(self) -> bytes:
        return b": keepalive\n\n"

    # -- OpenAI SSE -> events ---------------------------------------------------
    _started = False

    def _event(self, raw: str) -> bytes:
        data = [ln[5:].lstrip() for ln in raw.split("\n") if ln.startswith("data:")]
        if not data:
            # The backend's prefill progress (`: keepalive done/total`): SSE clients skip comments,
            # so it passes as it came, in every dialect.
            return raw.encode() + b"\n\n" if raw.startswith(":") else b""
        payload = "\n".join(data)
        if self.done:  # after an error event, which ended the answer: not a finish too (helper-91)
            return b""
        if payload == "[DONE]":
            self.done = True
            return self.on_done()
        try:
            obj = json.loads(payload)
        except ValueError:
            return b""
        if "error" in obj:
            self.done = True
            return self.on_error(obj["error"] or {})
        out = []
        if obj.get("usage"):
            self.usage = obj["usage"]
            details = self.usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens", self.cached_tokens))
        for ch in obj.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("reasoning_content"):
                out.append(self.on_reasoning(delta["reasoning_content"]))
            if delta.get("content"):
                self.text_logprobs = text_entries((ch.get("logprobs") or {}).get("content"), delta["content"],
                                                  delta.get("reasoning_content") or "", bool(delta.get("tool_calls")))
                out.append(self.on_text(delta["content"]))
            for tc in delta.get("tool_calls") or []:
                idx = tc.get("index", 0)
                fn = tc.get("function") or {}
                if idx not in self._tools:
                    self._tools[idx] = {"id": tc.get("id") or new_id("call_"), "name": fn.get("name", ""), "arguments": ""}
                    out.append(self.on_tool_start(idx, self._tools[idx]["id"], self._tools[idx]["name"]))
                if fn.get("arguments"):
                    self._tools[idx]["arguments"] += fn["arguments"]
                    out.append(self.on_tool_args(idx, fn["arguments"]))
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
            if isinstance(ch.get("stop_reason"), str):
                self.stop_string = ch["stop_reason"]  # the backend's: which stop sequence ended it
        return b"".join(out)

    @property
    def output_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens", 0))

    # -- what a dialect implements ----------------------------------------------
    def on_open(self) -> bytes:
        return b""

    def on_text(self, text: str) -> bytes:
        raise NotImplementedError

    def on_reasoning(self, text: str) -> bytes:
        raise NotImplementedError

    def on_tool_start(self, index: int, call_id: str, name: str) -> bytes:
        raise NotImplementedError

    def on_tool_args(self, index: int, fragment: str) -> bytes:
        raise NotImplementedError

    def on_done(self) -> bytes:
        raise NotImplementedError

    def on_error(self, err: dict) -> bytes:
        raise NotImplementedError

    def convert_full(self, completion: dict) -> dict:
        raise NotImplementedError

    def convert_error(self, err: dict, status: int) -> dict:
        raise NotImplementedError


def chat_message(completion: dict) -> tuple[dict, Optional[str], dict]:
    """(message, finish_reason, usage) of a non-streamed OpenAI chat completion."""
    ch = (completion.get("choices") or [{}])[0]
    return ch.get("message") or {}, ch.get("finish_reason"), completion.get("usage") or {}


def text_entries(entries, text: str, reasoning: str = "", calls: bool = False) -> Optional[list]:
    """The chat logprobs entries (``{token, logprob, bytes, top_logprobs}``) of the tokens that
    wrote ``text``, an answer's (or a chunk's) content, out of ``entries``, those of every token
    of it: the reasoning's and tool calls' tokens are left out (OpenAI's Responses API gives
    ``output_text`` the logprobs of its own text). None when ``entries`` is None.

    Content that came alone has all the entries. Beside reasoning or tool calls, its tokens are
    found by their bytes: the content's UTF-8 bytes after the reasoning's (the reasoning comes
    first, tool calls after); the entries whose bytes overlap that span are kept. Content the
    bytes do not show (the detokenizer's trimmed leading space, say) keeps them all.
    """
    if entries is None:
        return None
    if not (reasoning or calls):
        return list(entries)
    spans, at = [], 0
    for e in entries:
        n = len(e.get("bytes") or ())
        spans.append((at, at + n))
        at += n
    joined = b"".join(bytes(e.get("bytes") or ()) for e in entries)
    want, before = text.encode(), reasoning.encode()
    at = joined.find(before) if before else -1
    begin = joined.find(want, at + len(before) if at >= 0 else 0)
    if begin < 0:
        return list(entries)
    end = begin + len(want)
    return [e for e, (a, b) in zip(entries, spans) if a < end and b > begin]


def stop_string(completion: dict) -> Optional[str]:
    """The stop sequence that ended a non-streamed answer (the backend's vLLM-style
    ``choices[0].stop_reason``), or None."""
    s = (completion.get("choices") or [{}])[0].get("stop_reason")
    return s if isinstance(s, str) else None


def text_of(content, param: str, types=("text", "input_text", "output_text")) -> str:
    """Concatenated text of a string or an array of text parts/blocks (parts of
    other types are skipped: each dialect refuses the ones it cannot serve first).

    Args:
        content: None, a string, or a list of objects with ``type`` and ``text``.
        param: the client's name of the field, for the error.

    Raises:
        RequestError: 400 when ``content`` is another type, an item is not an
            object, or a text part's ``text`` is not a string.
    """
    from mlxgw.protocol import RequestError

    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}' must be a string or an array of text parts", param=param)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(f"'{param}[{j}]' must be an object", param=f"{param}[{j}]")
        if part.get("type", "text") in types:
            out.append(part_text(part, f"{param}[{j}]"))
    return "".join(out)


def part_text(part: dict, param: str) -> str:
    """A text part's ``text`` (required, as the OpenAI and Anthropic APIs do).

    Raises:
        RequestError: 400 when it is missing or not a string.
    """
    from mlxgw.protocol import RequestError

    text = part.get("text")
    if not isinstance(text, str):
        raise RequestError(f"'{param}.text' must be a string", param=f"{param}.text")
    return text
