"""OpenAI Responses (``POST /v1/responses``, used by Codex CLI), stateless, over chat backends.

`to_chat` turns a Responses request into the internal OpenAI chat request;
`ResponsesTransform` turns the backend's answer into a Response object or
the Responses event stream (``response.created`` ... ``response.completed``).
Shapes follow OpenAI's API reference ("Responses", "Streaming events"):

* ``instructions`` -> a leading system message; ``input`` a string (one user
  message) or items: messages (``input_text`` / ``output_text`` parts),
  ``function_call`` (merged into the preceding assistant message, as chat
  clients send it), ``function_call_output`` -> ``tool`` message,
  ``reasoning`` dropped; ``developer`` messages stay (rendering makes them
  ``system`` ones for templates without that role);
* ``tools``: ``function`` tools kept; ``custom`` (freeform) tools, such as Codex's
  ``apply_patch``, become functions of one string parameter ``input`` (a grammar ``format``
  goes into the description: the model is told it, not held to it), and their calls come
  back as ``custom_tool_call`` items (``custom_tool_call`` / ``_output`` input items go the
  other way); built-in tool types ignored;
* ``previous_response_id`` / ``item_reference`` / ``conversation`` / ``background: true``:
  400, the gateway keeps no state (send the whole conversation, as Codex does with
  ``store: false``);
* ``max_output_tokens`` -> ``max_tokens``; a length stop ends with status
  ``incomplete`` (``response.incomplete``), and so does the output item it cut;
* ``include: ["message.output_text.logprobs"]`` + ``top_logprobs`` -> chat ``logprobs`` /
  ``top_logprobs``; the output text gets its own tokens' entries (`base.text_entries`).
"""

from __future__ import annotations

import json
import time
from typing import Optional

from mlxgw.protocol import REASONING_EFFORTS, UNSUPPORTED_VLLM, RequestError, number_field, optional_field

from .base import (ChatTransform, chat_message, chat_request, function_tools, new_id, sse_event, text_entries, text_of,
                   with_stream)

ROLES = ("user", "assistant", "system", "developer")
#: The ``include`` item that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: ``include`` items OpenAI's API knows (the openai SDK's ``ResponseIncludable``); only the
#: logprobs one yields anything here (no built-in tools, images or encrypted reasoning).
KNOWN_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", LOGPROBS_INCLUDE,
})
#: Fields of the chat request a Responses request may carry too, as vLLM's Responses endpoint
#: takes its sampling extensions: applied (and checked) exactly as on chat (helper-80: seed,
#: top_k, stop, ... were dropped, wrong values and all). The fields chat refuses are refused here.
CHAT_FIELDS = (
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "repetition_context_size", "presence_context_size", "frequency_context_size", "xtc_probability",
    "xtc_threshold", "logit_bias", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
    "include_stop_str_in_output", "allowed_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "guided_json", "guided_choice", "guided_regex", "guided_grammar", "structured_outputs",
    "chat_template_kwargs", "n", "best_of", "echo", *(name for name, _ in UNSUPPORTED_VLLM),
)


def _append_call(out: list[dict], call_id: str, name: str, arguments: str) -> None:
    """One tool call (an input item) into ``out``: merged into the preceding assistant message,
    as a chat client sends its calls, else as an assistant message of its own."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    prev = out[-1] if out else None
    if prev is not None and prev["role"] == "assistant":
        prev.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def convert_input(instructions, items) -> list[dict]:
    """``instructions`` + ``input`` -> OpenAI chat messages.

    Raises:
        RequestError: malformed items, or stateful references.
    """
    out: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        if instructions:
            out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty array of items", param="input")
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(it, dict):
            raise RequestError(f"'{p}' must be an object", param=p)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ROLES:
                raise RequestError(f"'{p}.role' must be one of {', '.join(ROLES)}", param=f"{p}.role")
            content = it.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text", "text", "refusal"):
                        raise RequestError(f"content part type '{part.get('type')}' is not supported (text models)",
                                           param=f"{p}.content")
            # Codex sends its instructions as developer messages: rendering makes them
            # system ones unless the template knows the role (mlxgw.prompt.template_roles).
            out.append({"role": role, "content": text_of(content, f"{p}.content", ("input_text", "output_text", "text"))})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not it["name"]:
                raise RequestError(f"'{p}.name' must be a non-empty string", param=f"{p}.name")
            for key in ("arguments", "call_id"):  # both required, as in OpenAI's API
                if not isinstance(it.get(key), str):
                    raise RequestError(f"'{p}.{key}' must be a string", param=f"{p}.{key}")
            _append_call(out, it["call_id"], it["name"], it["arguments"] or "{}")
        elif kind == "custom_tool_call":
            if not isinstance(it.get("name"), str) or not it["name"]:
                raise RequestError(f"'{p}.name' must be a non-empty string", param=f"{p}.name")
            for key in ("input", "call_id"):
                if not isinstance(it.get(key), str):
                    raise RequestError(f"'{p}.{key}' must be a string", param=f"{p}.{key}")
            _append_call(out, it["call_id"], it["name"], json.dumps({CUSTOM_INPUT: it["input"]}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(it.get("call_id"), str):
                raise RequestError(f"'{p}.call_id' must be a string", param=f"{p}.call_id")
            if it.get("output") is None:
                raise RequestError(f"'{p}.output' is required", param=f"{p}.output")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": text_of(it["output"], f"{p}.output")})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise RequestError("item references need stored responses; this gateway is stateless: send the items",
                               param=p, code="unsupported_parameter")
        else:
            raise RequestError(f"input item type '{kind}' is not supported", param=f"{p}.type")
    return out


#: The one parameter of the function a custom (freeform) tool is given to the model as.
CUSTOM_INPUT = "input"


def custom_tool_names(tools) -> set:
    """Names of the ``custom`` (freeform) tools of a Responses request's ``tools``."""
    return {t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "custom"
            and isinstance(t.get("name"), str)} if isinstance(tools, list) else set()


def _custom_as_function(t: dict, i: int) -> dict:
    """A ``custom`` tool as a flat Responses function tool of one string parameter (helper-71:
    Codex's ``apply_patch`` was dropped, so the model never heard of it). Its grammar, if any,
    is told in the description; the answer is not held to it."""
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise RequestError(f"'tools[{i}].description' must be a string", param=f"tools[{i}].description")
    fmt = t.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise RequestError(f"'tools[{i}].format' must be an object", param=f"tools[{i}].format")
    desc = desc or ""
    if fmt and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        desc += f"\n\nThe input follows this {fmt.get('syntax') or ''} grammar:\n{fmt['definition']}"
    return {"type": "function", "name": t.get("name"), "description": desc.strip(),
            "parameters": {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                           "required": [CUSTOM_INPUT], "additionalProperties": False}}


def custom_input(arguments) -> str:
    """A custom tool's ``input`` from its function call's ``arguments`` (JSON text or an
    object): the ``input`` string, or the arguments as given when they hold none."""
    args = arguments
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return arguments
    if isinstance(args, dict) and isinstance(args.get(CUSTOM_INPUT), str):
        return args[CUSTOM_INPUT]
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def convert_tools(tools) -> Optional[list[dict]]:
    """Responses function tools -> chat tools; ``custom`` tools as functions of one string
    (`_custom_as_function`); built-in tools (web_search, ...) ignored.

    Raises:
        RequestError: as `function_tools`; a chat-shaped tool (``{"type": "function",
            "function": {...}}``) is told the Responses shape is flat (helper-68: it read only
            "'tools[0].name' must be a non-empty string").
    """
    if isinstance(tools, list):
        for i, t in enumerate(tools):
            if isinstance(t, dict) and t.get("type") == "function" and "name" not in t and isinstance(
                    t.get("function"), dict):
                raise RequestError(f"'tools[{i}]' is a chat completions tool: the Responses API's are flat, "
                                   f"{{\"type\": \"function\", \"name\": ..., \"parameters\": ...}}",
                                   param=f"tools[{i}]")
        tools = [_custom_as_function(t, i) if isinstance(t, dict) and t.get("type") == "custom" else t
                 for i, t in enumerate(tools)]
    return function_tools(tools, lambda t: t.get("type") == "function", "parameters")


def convert_tool_choice(tc):
    if tc is None or tc in ("auto", "none", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") in ("function", "custom"):
        if not isinstance(tc.get("name"), str):
            raise RequestError(f"'tool_choice.name' must name a {tc['type']} tool", param="tool_choice.name")
        return {"type": "function", "function": {"name": tc["name"]}}  # a custom tool is a function here
    if isinstance(tc, dict) and tc.get("type") == "allowed_tools":
        # The Responses form, flat: {"type": "allowed_tools", "mode", "tools": [{"type", "name"}]}
        if tc.get("mode") not in ("auto", "required"):
            raise RequestError("'tool_choice.mode' must be 'auto' or 'required'", param="tool_choice.mode")
        listed = tc.get("tools")
        if not isinstance(listed, list):
            raise RequestError("'tool_choice.tools' must be an array of tools", param="tool_choice.tools")
        fns = [{"type": "function", "function": {"name": t.get("name")}} for t in listed
               if isinstance(t, dict) and t.get("type") in ("function", "custom")]  # built-in ones are not served
        if not fns:
            if tc.get("mode") == "required":
                raise RequestError("'tool_choice' requires a call to one of 'tool_choice.tools' but none is a "
                                   "function or custom tool", param="tool_choice.tools")
            return "auto"
        return {"type": "allowed_tools", "allowed_tools": {"mode": tc.get("mode"), "tools": fns}}
    if isinstance(tc, dict) and isinstance(tc.get("type"), str) and tc["type"]:
        return "auto"  # a built-in tool: not ours to force
    raise RequestError("'tool_choice' must be auto, none, required or a function", param="tool_choice")


def _check_tool_choice(body: dict) -> None:
    """The tool_choice against the request's own tools, in the client's (flat) fields: a named
    function or custom tool, or each one ``allowed_tools`` lists, must be in ``tools`` with that
    type, and a built-in type must be one of the tools (helper-93: a typo such as ``fucntion``
    was taken for a built-in tool and answered unforced; a function named as ``custom`` was
    forced). Raises RequestError (400)."""
    tc = body.get("tool_choice")
    if not isinstance(tc, dict):
        return
    tools = [t for t in body.get("tools") or () if isinstance(t, dict)]
    kinds = {t.get("name"): t.get("type") for t in tools if t.get("type") in ("function", "custom")}

    def named(t: dict, param: str) -> None:
        if t.get("name") not in kinds:
            raise RequestError(f"'{param}' names {json.dumps(t.get('name'))}, which is not in 'tools'", param=param)
        if kinds[t["name"]] != t.get("type"):
            raise RequestError(f"'{param}' names the {kinds[t['name']]} tool {json.dumps(t['name'])} as a "
                               f"{t.get('type')} tool", param=f"{param}.type")

    if tc.get("type") in ("function", "custom"):
        named(tc, "tool_choice")
    elif tc.get("type") == "allowed_tools":
        for i, t in enumerate(tc["tools"]):
            if isinstance(t, dict) and t.get("type") in ("function", "custom"):
                named(t, f"tool_choice.tools[{i}]")
    elif tc.get("type") not in {t.get("type") for t in tools}:
        raise RequestError(f"'tool_choice.type' {json.dumps(tc.get('type'))} is none of the request's tools' types "
                           "(function, custom, or a built-in tool in 'tools')", param="tool_choice.type")


def to_chat(body: dict) -> dict:
    """A Responses request -> the internal OpenAI chat request.

    Raises:
        RequestError: 400 (``previous_response_id`` included: stateless).
    """
    if body.get("previous_response_id") is not None:
        raise RequestError("'previous_response_id' is not supported: this gateway is stateless; "
                           "send the whole conversation in 'input' (store: false)", param="previous_response_id",
                           code="unsupported_parameter")
    # Stateful features, refused like previous_response_id (helper-71: `conversation` was ignored
    # with a 200, and `background: true` answered at once, its later retrieve a 404).
    if body.get("conversation") is not None:
        raise RequestError("'conversation' is not supported: this gateway is stateless; send the whole "
                           "conversation in 'input' (store: false)", param="conversation", code="unsupported_parameter")
    if body.get("background") not in (None, False):
        raise RequestError("'background' responses are not supported: this gateway keeps no responses to poll; "
                           "leave it out and wait for the answer (or stream it)", param="background",
                           code="unsupported_parameter")
    if body.get("n") not in (None, 1):  # a response is one answer (chat takes several since session 45)
        raise RequestError("'n' is not supported: a response has one output; send one request per answer",
                           param="n", code="unsupported_parameter")
    out = chat_request(body, lambda: convert_input(body.get("instructions"), body.get("input")),
                       lambda: convert_tools(body.get("tools")), convert_tool_choice)
    _check_tool_choice(body)
    if body.get("max_output_tokens") is not None:  # checked here so the error names the client's field
        out["max_tokens"] = number_field(body, "max_output_tokens", None, lo=1, integer=True)
    for k in ("temperature", "top_p"):
        if body.get(k) is not None:
            out[k] = body[k]
    if optional_field(body, "parallel_tool_calls", (bool,), "a boolean") is False:
        out["parallel_tool_calls"] = False
    optional_field(body, "store", (bool,), "a boolean")  # accepted and not used (stateless), but not any value
    include = optional_field(body, "include", (list,), "an array of strings")
    if include is not None and not all(isinstance(x, str) for x in include):
        raise RequestError("'include' must be an array of strings", param="include")
    for i, x in enumerate(include or ()):
        if x not in KNOWN_INCLUDES:  # as OpenAI answers (helper-80: a 200)
            raise RequestError(f"'include[{i}]' must be one of {', '.join(sorted(KNOWN_INCLUDES))}",
                               param=f"include[{i}]")
    for k in CHAT_FIELDS:
        if k in body:
            out[k] = body[k]
    top = number_field(body, "top_logprobs", None, lo=0, hi=20, integer=True)
    # As OpenAI's API: the output text's logprobs come only when `include` asks for them,
    # top_logprobs (alone: none) says how many alternatives each token lists.
    if include and LOGPROBS_INCLUDE in include:
        out["logprobs"], out["top_logprobs"] = True, top or 0
    for k in ("reasoning", "metadata"):
        optional_field(body, k, (dict,), "an object")
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:  # chat's reasoning_effort (a template variable), checked there
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            raise RequestError(f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}",
                               param="reasoning.effort")
        out["reasoning_effort"] = effort
    fmt = response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return with_stream(out, body)


def response_format(text) -> Optional[dict]:
    """``text.format`` (Responses) -> the chat ``response_format`` (None: plain text).

    Raises:
        RequestError: 400 naming the Responses field: ``text`` or ``text.format`` not an
            object, another format type, a ``json_schema`` format without a schema object.
    """
    if text is None:
        return None
    if not isinstance(text, dict):  # helper-68: `"text": "x"` was said to be text.format's fault
        raise RequestError("'text' must be an object (e.g. {\"format\": {\"type\": \"text\"}})", param="text")
    fmt = text.get("format")
    if not isinstance(fmt, (dict, type(None))):
        raise RequestError("'text.format' must be an object", param="text.format")
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise RequestError("'text.format.type' must be text, json_object or json_schema", param="text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise RequestError("'text.format.schema' must be an object", param="text.format.schema")
    # Flat in Responses, nested in chat.
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def usage_of(prompt: int, cached: int, output: int) -> dict:
    # cache_write_tokens: required by the openai SDK's ResponseUsage (3.60 at least); the prefix
    # cache writes implicitly, so 0 (as Anthropic's cache_creation_input_tokens).
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


def client_param(param: Optional[str]) -> Optional[str]:
    """An internal chat error's ``param`` as the Responses client named it: the whole prompt
    (``messages``, e.g. context_length_exceeded) is its ``input``; ``response_format`` (and
    its ``json_schema`` object, which Responses flattens) is its ``text.format`` (helper-71: a
    backend's schema error named ``response_format``)."""
    if param == "messages":
        return "input"
    if param and param.split(".", 1)[0] == "response_format":
        rest = param[len("response_format"):]
        return "text.format" + (rest[len(".json_schema"):] if rest.startswith(".json_schema") else rest)
    return param


class ResponsesTransform(ChatTransform):
    """The backend's OpenAI chat answer -> a Response object or Responses events."""

    def __init__(self, stream: bool, model: str, request: dict):
        super().__init__(stream, model)
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.request = request
        self.seq = 0
        self.items: list[dict] = []  # output items so far
        self.open: Optional[dict] = None  # the output item being streamed
        self.custom = custom_tool_names(request.get("tools"))  # their calls are custom_tool_call items
        self._custom_args = ""  # the open custom call's arguments (JSON) so far

    def _response(self, status: str, usage: Optional[dict] = None) -> dict:
        r = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
             "output": self.items, "parallel_tool_calls": self.request.get("parallel_tool_calls") is not False, "tool_choice": self.request.get("tool_choice", "auto"),
             "tools": self.request.get("tools") or [], "temperature": self.request.get("temperature"),
             "top_p": self.request.get("top_p"), "max_output_tokens": self.request.get("max_output_tokens"),
             "previous_response_id": None, "instructions": self.request.get("instructions"),
             "error": None, "incomplete_details": None, "metadata": self.request.get("metadata") or {},
             "text": {"format": (self.request.get("text") or {}).get("format") or {"type": "text"}},
             "truncation": "disabled", "store": False, "top_logprobs": self.request.get("top_logprobs"),
             "usage": usage}
        if status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    def _ev(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def on_open(self) -> bytes:
        return (self._ev("response.created", response=self._response("in_progress"))
                + self._ev("response.in_progress", response=self._response("in_progress")))

    def _close(self, status: str = "completed") -> bytes:
        """End the open output item with ``status`` (``incomplete``: the item the length stop cut)."""
        it, self.open = self.open, None
        if it is None:
            return b""
        idx = len(self.items)
        self.items.append(it)
        it["status"] = status
        if it["type"] == "message":
            part = it["content"][0]
            return (self._ev("response.output_text.done", item_id=it["id"], output_index=idx, content_index=0,
                             text=part["text"], logprobs=part["logprobs"])
                    + self._ev("response.content_part.done", item_id=it["id"], output_index=idx, content_index=0,
                               part=part)
                    + self._ev("response.output_item.done", output_index=idx, item=it))
        if it["type"] == "custom_tool_call":
            # Its input is a string inside the call's JSON arguments: told whole once they are complete.
            it["input"] = custom_input(self._custom_args)
            return (self._ev("response.custom_tool_call_input.delta", item_id=it["id"], output_index=idx,
                             delta=it["input"])
                    + self._ev("response.custom_tool_call_input.done", item_id=it["id"], output_index=idx,
                               input=it["input"])
                    + self._ev("response.output_item.done", output_index=idx, item=it))
        return (self._ev("response.function_call_arguments.done", item_id=it["id"], output_index=idx,
                         name=it["name"], arguments=it["arguments"])
                + self._ev("response.output_item.done", output_index=idx, item=it))

    def on_text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != "message":
            out = self._close()
            self.open = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
            idx = len(self.items)
            out += self._ev("response.output_item.added", output_index=idx, item={**self.open, "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._ev("response.content_part.added", item_id=self.open["id"], output_index=idx,
                            content_index=0, part=dict(part))
            self.open["content"].append(part)
        part = self.open["content"][0]
        part["text"] += text
        lps = self.text_logprobs or []
        part["logprobs"] += lps
        return out + self._ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items),
                              content_index=0, delta=text, logprobs=lps)

    def on_reasoning(self, text: str) -> bytes:
        return b""  # reasoning is not surfaced in this dialect (counted in output tokens)

    def on_tool_start(self, index: int, call_id: str, name: str) -> bytes:
        out = self._close()
        if name in self.custom:
            self._custom_args = ""
            self.open = {"id": new_id("ctc_"), "type": "custom_tool_call", "status": "in_progress",
                         "call_id": call_id, "name": name, "input": ""}
        else:
            self.open = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                         "name": name, "arguments": ""}
        return out + self._ev("response.output_item.added", output_index=len(self.items), item=dict(self.open))

    def on_tool_args(self, index: int, fragment: str) -> bytes:
        if self.open["type"] == "custom_tool_call":
            self._custom_args += fragment
            return b""
        self.open["arguments"] += fragment
        return self._ev("response.function_call_arguments.delta", item_id=self.open["id"],
                        output_index=len(self.items), delta=fragment)

    def on_done(self) -> bytes:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        out = self._close(status)  # as OpenAI does, the item cut by max_output_tokens is incomplete too
        usage = usage_of(self.prompt_tokens, self.cached_tokens, self.output_tokens)
        return out + self._ev(f"response.{status}", response=self._response(status, usage))

    def on_error(self, err: dict) -> bytes:
        """The ``error`` event, then ``response.failed`` (its terminal event, as OpenAI sends): the
        openai SDK raises on neither, so a client that waits for the terminal event saw a cut
        answer end like a finished one (helper-64). The item the failure cut is incomplete."""
        code, message = err.get("code") or "server_error", err.get("message") or "error"
        r = self._response("failed", usage_of(self.prompt_tokens, self.cached_tokens, self.output_tokens))
        r["error"] = {"code": code, "message": message}
        return (self._close("incomplete") + self._ev("error", code=code, message=message, param=None)
                + self._ev("response.failed", response=r))

    def convert_full(self, completion: dict) -> dict:
        msg, reason, usage = chat_message(completion)
        if msg.get("content"):
            lps = text_entries(((completion.get("choices") or [{}])[0].get("logprobs") or {}).get("content"),
                               msg["content"], msg.get("reasoning_content") or "", bool(msg.get("tool_calls")))
            self.items.append({"id": new_id("msg_"), "type": "message", "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": msg["content"], "annotations": [],
                                            "logprobs": lps or []}]})
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if fn.get("name") in self.custom:
                self.items.append({"id": new_id("ctc_"), "type": "custom_tool_call", "status": "completed",
                                   "call_id": tc.get("id"), "name": fn.get("name"),
                                   "input": custom_input(fn.get("arguments", "{}"))})
                continue
            self.items.append({"id": new_id("fc_"), "type": "function_call", "status": "completed",
                               "call_id": tc.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments", "{}")})
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        status = "incomplete" if reason == "length" else "completed"
        if status == "incomplete" and self.items:
            self.items[-1]["status"] = "incomplete"  # the last item is the one the length stop cut
        return self._response(status, usage_of(int(usage.get("prompt_tokens", 0)), cached,
                                               int(usage.get("completion_tokens", 0))))

    def convert_error(self, err: dict, status: int) -> dict:
        return {"error": {"message": err.get("message") or "error", "type": err.get("type") or "invalid_request_error",
                          "param": client_param(err.get("param")), "code": err.get("code")}}
