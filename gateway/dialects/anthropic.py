"""Anthropic Messages (``POST /v1/messages``, used by Claude Code) over OpenAI chat backends.

`to_chat` turns a Messages request into the internal OpenAI chat request;
`MessagesTransform` turns the backend's answer (streamed or not) into a
Messages answer. Shapes follow Anthropic's API reference ("Messages",
"Streaming Messages", "Errors"):

* system: a string or text blocks (joined with ``"\\n"``; empty blocks, e.g.
  a stripped billing-header line, dropped);
* content blocks: ``text``; ``tool_use`` (assistant) -> OpenAI ``tool_calls``;
  ``tool_result`` (user) -> a ``tool`` message; ``thinking`` /
  ``redacted_thinking`` dropped (chat templates drop old reasoning too);
  ``image`` / ``document`` -> 400 (text models);
* tools ``{name, description, input_schema}`` -> OpenAI function tools;
  server tools (a ``type`` other than ``custom``) ignored;
* ``tool_choice`` auto/any/tool/none -> auto/required/named function/none;
* usage: ``input_tokens`` excludes the reused prefix, which is
  ``cache_read_input_tokens``; ``cache_creation_input_tokens`` is 0 (the
  backend caches without being asked).

A text stop sequence ends the answer with ``stop_reason`` ``stop_sequence`` and
names it: the backend's chat choice carries the stop string as ``stop_reason``
(vLLM's extension; `stop_of`).
"""

from __future__ import annotations

import json
from typing import Optional

from mlxgw.protocol import CALL_ID_PREFIX, MAX_STOP, RequestError, number_field, optional_field

from .base import (ChatTransform, chat_message, chat_request, function_tools, new_id, part_text, sse_event,
                   stop_string, text_of, with_stream)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# HTTP status -> Anthropic error type (Anthropic "Errors" page).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``api_error`` for other 5xx)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(message: str, status: int) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _blocks(content, p: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise RequestError(f"'{p}' must be a string or an array of content blocks", param=p)
    for j, b in enumerate(content):  # "block type 'None' is not supported" before (helper-60)
        if not isinstance(b.get("type"), str):
            raise RequestError(f"'{p}[{j}].type' is required (a string)", param=f"{p}[{j}].type")
    return content


def _tool_result_text(content, p: str) -> str:
    if isinstance(content, list):
        for j, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") not in (None, "text"):
                raise RequestError(f"tool_result content of type '{b.get('type')}' is not supported (text models)",
                                   param=f"{p}[{j}].type")
    return text_of(content, p)


def system_messages(system) -> list[dict]:
    """The system prompt as OpenAI system messages (0 or 1)."""
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        texts = []
        for j, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type", "text") != "text":
                raise RequestError(f"'system[{j}]' must be a text block", param=f"system[{j}]")
            texts.append(part_text(b, f"system[{j}]"))
        text = "\n".join(t for t in texts if t.strip())
    else:
        raise RequestError("'system' must be a string or an array of text blocks", param="system")
    return [{"role": "system", "content": text}] if text else []


def convert_messages(system, messages) -> list[dict]:
    """Anthropic ``system`` + ``messages`` -> OpenAI chat messages.

    Raises:
        RequestError: malformed messages or unsupported block types.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    out = system_messages(system)
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"'{p}.role' must be 'user' or 'assistant'", param=f"{p}.role")
        blocks = _blocks(m.get("content"), f"{p}.content")
        if m["role"] == "assistant":
            text, calls = [], []
            for j, b in enumerate(blocks):
                t, q = b.get("type"), f"{p}.content[{j}]"
                if t == "text":
                    text.append(part_text(b, q))
                elif t in ("tool_use", "server_tool_use"):
                    if not isinstance(b.get("name"), str):
                        raise RequestError(f"'{q}.name' must be a string", param=f"{q}.name")
                    if b.get("input") is not None and not isinstance(b["input"], dict):
                        raise RequestError(f"'{q}.input' must be an object", param=f"{q}.input")
                    calls.append({"id": optional_field(b, "id", (str,), "a string", q), "type": "function",
                                  "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
                elif t in ("thinking", "redacted_thinking"):
                    continue
                else:
                    raise RequestError(f"assistant content block type '{t}' is not supported", param=f"{p}.content")
            msg = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            text = []
            for j, b in enumerate(blocks):
                t, q = b.get("type"), f"{p}.content[{j}]"
                if t == "text":
                    text.append(part_text(b, q))
                elif t == "tool_result":
                    result = _tool_result_text(b.get("content"), f"{q}.content")
                    # Chat templates have no error flag: the model is told in the text (helper-71: it
                    # was dropped, so a failed tool read like a successful one).
                    if optional_field(b, "is_error", (bool,), "a boolean", q) and not result.lower().startswith("error"):
                        result = "Error: " + result
                    out.append({"role": "tool", "tool_call_id": optional_field(b, "tool_use_id", (str,), "a string", q),
                                "content": result})
                else:
                    raise RequestError(f"user content block type '{t}' is not supported (text models)", param=f"{p}.content")
            if text or not any(b.get("type") == "tool_result" for b in blocks):
                out.append({"role": "user", "content": "".join(text)})
    return out


def convert_tools(tools) -> Optional[list[dict]]:
    """Anthropic custom tools -> OpenAI function tools; server tools (web_search,
    bash, ...) are the client's or Anthropic's business and are dropped."""
    return function_tools(tools, lambda t: t.get("type") in (None, "custom"), "input_schema", schema_required=True)


def convert_tool_choice(tc):
    """Anthropic ``tool_choice`` -> OpenAI's."""
    if tc is None:
        return None
    if not isinstance(tc, dict):
        raise RequestError("'tool_choice' must be an object", param="tool_choice")
    kind = tc.get("type")
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise RequestError("'tool_choice.name' must name a tool", param="tool_choice.name")
        return {"type": "function", "function": {"name": tc["name"]}}
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if choice is None:
        raise RequestError("'tool_choice.type' must be auto, any, tool or none", param="tool_choice")
    return choice


def to_chat(body: dict, count_only: bool = False) -> dict:
    """A Messages request -> the internal OpenAI chat request (always ``include_usage``).

    Raises:
        RequestError: 400 with ``param`` naming the field.
    """
    out = chat_request(body, lambda: convert_messages(body.get("system"), body.get("messages")),
                       lambda: convert_tools(body.get("tools")), convert_tool_choice)
    of = optional_field(body, "output_format", (dict,), "an object")
    if of is not None:  # Anthropic's structured outputs: a JSON answer of the schema, as response_format
        if of.get("type") != "json_schema" or not isinstance(of.get("schema"), dict):
            raise RequestError("'output_format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                               param="output_format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": of["schema"]}}
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and optional_field(tc, "disable_parallel_tool_use", (bool,), "a boolean", "tool_choice"):
        out["parallel_tool_calls"] = False  # at most one tool_use block, as Anthropic's API answers
    last = out["messages"][-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        # Anthropic's prefill: the reply continues the final assistant message (helper-60: it
        # was closed as a turn of its own and a new one opened, so the prefill steered nothing).
        out["chat_template_kwargs"] = {**out.get("chat_template_kwargs", {}), "continue_final_message": True}
    if count_only:
        return out
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise RequestError("'max_tokens' is required and must be a positive integer", param="max_tokens")
    out["max_tokens"] = mt
    # Anthropic's ranges (OpenAI's temperature goes to 2); the values pass through as they are.
    for k, lo, hi, integer in (("temperature", 0, 1, False), ("top_p", 0, 1, False), ("top_k", 0, None, True)):
        if number_field(body, k, None, lo=lo, hi=hi, integer=integer) is not None:
            out[k] = body[k]
    for k in ("metadata", "thinking"):  # accepted and not used here, but not any value
        optional_field(body, k, (dict,), "an object")
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(x, str) for x in stops)):
            raise RequestError("'stop_sequences' must be an array of strings", param="stop_sequences")
        if len(stops) > MAX_STOP:  # checked here too, so the error names the client's field (helper-60)
            raise RequestError(f"'stop_sequences' may hold at most {MAX_STOP} sequences", param="stop_sequences")
        out["stop"] = stops
    return with_stream(out, body)


def stop_of(finish_reason: Optional[str], stop: Optional[str], context_capped: bool = False) -> tuple[str, Optional[str]]:
    """Anthropic's (stop_reason, stop_sequence) from the chat finish reason and the stop
    sequence the backend says ended the answer (``stop_sequence`` when one did). A length stop
    of a request whose ``max_tokens`` the gateway lowered to the context left
    (``context_capped``) is Anthropic's ``model_context_window_exceeded``, not ``max_tokens``
    (helper-71: the client read "the limit I asked for" after 20 of its 100 tokens)."""
    if (finish_reason or "stop") == "stop" and stop is not None:
        return "stop_sequence", stop
    if finish_reason == "length" and context_capped:
        return "model_context_window_exceeded", None
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def tool_use_id(call_id: Optional[str]) -> str:
    """The Anthropic id of a tool call: the backend's ``call_<hex>`` becomes ``toolu_<hex>``,
    as Anthropic's API names them; an id the model wrote itself passes unchanged (its chat
    template renders it back next turn); a missing one gets a fresh ``toolu_`` id."""
    if not call_id:
        return new_id("toolu_")
    return "toolu_" + call_id[len(CALL_ID_PREFIX):] if call_id.startswith(CALL_ID_PREFIX) else call_id


def usage_of(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessagesTransform(ChatTransform):
    """The backend's OpenAI chat answer -> an Anthropic Messages answer or event stream."""

    def __init__(self, stream: bool, model: str):
        super().__init__(stream, model)
        self.id = new_id("msg_")
        self.block = -1          # index of the open content block
        self.block_kind = None   # "text" | "thinking" | ("tool", openai index)

    def keepalive(self) -> bytes:
        if self._started:
            return sse_event("ping", {"type": "ping"})
        return b": keepalive\n\n"

    def on_open(self) -> bytes:
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": usage_of(self.prompt_tokens, self.cached_tokens, 0)}
        return sse_event("message_start", {"type": "message_start", "message": msg}) + sse_event("ping", {"type": "ping"})

    def _switch(self, kind, start_block: dict) -> bytes:
        if self.block_kind == kind:
            return b""
        out = self._close()
        self.block += 1
        self.block_kind = kind
        return out + sse_event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                       "content_block": start_block})

    def _close(self) -> bytes:
        if self.block_kind is None:
            return b""
        out = b""
        if self.block_kind == "thinking":
            out = sse_event("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                    "delta": {"type": "signature_delta", "signature": ""}})
        self.block_kind = None
        return out + sse_event("content_block_stop", {"type": "content_block_stop", "index": self.block})

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})

    def on_text(self, text: str) -> bytes:
        return self._switch("text", {"type": "text", "text": ""}) + self._delta({"type": "text_delta", "text": text})

    def on_reasoning(self, text: str) -> bytes:
        out = self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def on_tool_start(self, index: int, call_id: str, name: str) -> bytes:
        return self._switch(("tool", index), {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}})

    def on_tool_args(self, index: int, fragment: str) -> bytes:
        return self._delta({"type": "input_json_delta", "partial_json": fragment})

    def on_done(self) -> bytes:
        reason, seq = stop_of(self.finish_reason, self.stop_string, self.context_capped)
        usage = usage_of(self.prompt_tokens, self.cached_tokens, self.output_tokens)
        return (self._close()
                + sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": usage})
                + sse_event("message_stop", {"type": "message_stop"}))

    def on_error(self, err: dict) -> bytes:
        return sse_event("error", error_body(err.get("message") or "backend error", 500))

    def convert_full(self, completion: dict) -> dict:
        msg, reason, usage = chat_message(completion)
        content = []
        if msg.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = {}
            content.append({"type": "tool_use", "id": tool_use_id(tc.get("id")), "name": fn.get("name"),
                            "input": args})
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        reason, seq = stop_of(reason, stop_string(completion), self.context_capped)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": seq,
                "usage": usage_of(int(usage.get("prompt_tokens", 0)), cached, int(usage.get("completion_tokens", 0)))}

    def convert_error(self, err: dict, status: int) -> dict:
        body = error_body(err.get("message") or "error", status)
        if self.request_id:  # as the gateway's own errors (`error_response`; helper-75: a backend's had none)
            body["request_id"] = self.request_id
        return body
