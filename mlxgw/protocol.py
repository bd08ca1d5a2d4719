"""OpenAI request parsing and validation, shared by gateway and backend.

`parse_openai` turns a chat or text-completion body into a `ParsedRequest`
(prompt source + `GenParams`-like sampling fields), raising `RequestError`
with the OpenAI error fields for anything malformed. Unknown fields are
ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

# Internal fields the gateway adds when forwarding (the backend then skips
# tokenization). Clients cannot set them: the gateway strips them first.
INTERNAL_FIELD = "_mlxgw"


class RequestError(Exception):
    """A client error, rendered as an OpenAI-style JSON error.

    Attributes: status (HTTP, 4xx), message, param (offending field or None),
    code (machine-readable, e.g. ``"context_length_exceeded"``), type, headers
    (extra response headers, e.g. ``Retry-After``; None for none).
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: str = "invalid_request_error",
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers
        self.tokens: Optional[tuple[int, int]] = None  # (prompt, context) of a `context_exceeded`

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def context_exceeded(prompt_tokens: int, context: int, param: str) -> RequestError:
    """The 400 ``context_length_exceeded`` of a prompt of ``prompt_tokens`` tokens for a model
    whose context is ``context`` tokens, in OpenAI's words ("This model's maximum context length
    is N tokens. However, your messages resulted in M tokens."): agent tools and LiteLLM find
    a context overflow by that sentence, not by the code (helper-71: ours matched none). The
    Anthropic dialect says it in Anthropic's words (`anthropic_context_message`); ``prompt_tokens``
    and ``context`` are kept on the error for that."""
    what = "messages" if param == "messages" else "prompt"
    err = RequestError(f"This model's maximum context length is {context} tokens. However, your {what} resulted "
                       f"in {prompt_tokens} tokens. Please reduce the length of the {what}.",
                       param=param, code="context_length_exceeded")
    err.tokens = (prompt_tokens, context)
    return err


def anthropic_context_message(prompt_tokens: int, context: int) -> str:
    """Anthropic's message for a prompt over the context ("prompt is too long: M tokens > N
    maximum"), which Claude Code and other Anthropic clients match to compact the conversation."""
    return f"prompt is too long: {prompt_tokens} tokens > {context} maximum"


#: Prefix of the tool-call ids the backend gives (OpenAI's form); the Anthropic dialect swaps it for ``toolu_``.
CALL_ID_PREFIX = "call_"


def new_id(prefix: str) -> str:
    """A fresh id such as ``msg_0123...`` or ``call_0123...`` (24 hex digits after the prefix)."""
    return prefix + uuid.uuid4().hex[:24]


def retry_after_headers() -> dict:
    """``Retry-After: 1`` and a ``retry-after-ms`` drawn from 500-1500: the OpenAI and
    Anthropic SDKs wait what ``retry-after-ms`` says (before ``Retry-After``), so clients
    shed together retry spread over a second instead of all at once (a README trial saw
    20 shed streams retry in waves exactly 1.0 s apart)."""
    return {"Retry-After": "1", "retry-after-ms": str(random.randint(500, 1500))}


def overloaded(message: str) -> RequestError:
    """The 503 of a server that is at its limits, not failing: ``server_error`` with code
    ``overloaded`` (Anthropic ``overloaded_error``) and `retry_after_headers`, which the
    OpenAI and Anthropic SDKs retry with backoff."""
    return RequestError(message, status=503, type="server_error", code="overloaded", headers=retry_after_headers())


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # mlx_lm.server's extensions: how many of the latest tokens each penalty looks at (mlx-lm's
    # processors; 20 is its default), and XTC sampling ("exclude top choices").
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # None: no logprobs; else how many alternatives each generated token lists (0 to 20).
    logprobs: Optional[int] = None
    parallel_tool_calls: bool = True  # false: at most one tool call per answer
    template_kwargs: dict = field(default_factory=dict)
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    # What the answer must be (`structured_output`): (kind, value, param), kind "json" (a schema:
    # response_format, guided_json), "choice" (a list of strings) or "regex"; param the client's
    # field. Compiled by backend.toolchoice.
    constraint: Optional[tuple] = None
    ignore_eos: bool = False  # vLLM's extension: generate past end-of-sequence tokens, to max_tokens or a stop string
    # vLLM's stopping extensions (`stopping_fields`): no end-of-sequence, stop token nor stop string
    # before min_tokens; more tokens that end the answer; a stop string kept in the answer.
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # vLLM's: the answer carries the prompt's and its own token ids
    allowed_token_ids: Optional[list[int]] = None  # vLLM's: sample only these tokens
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never generated
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning text out of the answer
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the answer
    n: int = 1  # choices: the backend answers each as its own request on the one prompt (`backend.server`)
    # Completions' batch of two or more prompts, each (text, None) or (None, token ids); the first
    # is also ``prompt`` / ``prompt_ids``. Empty for one prompt.
    batch: list = field(default_factory=list)

    def answer_budget(self) -> int:
        """Tokens the answer may take before the context bounds it: ``max_tokens``, else
        `DEFAULT_MAX_TOKENS`, or ``min_tokens`` when larger (helper-80: ``min_tokens`` 600 got
        the 512 default). The backend generates that many at most; the gateway compares it
        with its ``--max-answer-tokens``."""
        return self.max_tokens if self.max_tokens is not None else max(DEFAULT_MAX_TOKENS, self.min_tokens)

    def prompt_param(self, i: int = 0) -> str:
        """The client's field holding prompt ``i``, for errors: ``messages`` (chat), ``prompt``,
        or ``prompt[i]`` in a completions batch."""
        return "messages" if self.kind == "chat" else f"prompt[{i}]" if self.batch else "prompt"


#: Most choices one request may ask for (``n``): OpenAI's bound.
MAX_N = 128

#: Tokens an answer may take when the request sets no ``max_tokens`` (``mlx_lm.server``'s
#: ``--max-tokens`` default), or its ``min_tokens`` when larger (helper-80).
DEFAULT_MAX_TOKENS = 512

# Deepest JSON nesting accepted. Real requests (tool schemas included) stay
# far below it; deeper bodies could exhaust recursion in the chat template or
# msgpack downstream.
MAX_JSON_DEPTH = 64
# Most ``[`` plus ``{`` bytes in a body (those inside strings count too). Real
# requests hold a few thousand; a 32 MiB body of ``[],[],...`` holds millions
# and takes seconds to decode while holding the GIL.
MAX_JSON_CONTAINERS = 500_000
# Integers must fit msgpack (the gateway's forward format): int64 or uint64.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
# Lone UTF-16 surrogates only arise from \\uD800-\\uDFFF escapes; checked only when one appears.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# OpenAI allows 4 stop sequences; we allow a few more, but not thousands checked per token.
MAX_STOP = 16
# Tokens one logit_bias may name (OpenAI documents no limit; this bounds the per-step work).
MAX_LOGIT_BIAS = 1024
# Tokens one stop_token_ids may name (vLLM documents no limit; each is a stop sequence the
# engine checks per step).
MAX_STOP_TOKEN_IDS = 256
# Words one bad_words may ban (each checked per generated token).
MAX_BAD_WORDS = 256
# vLLM's request fields that change the answer and that no backend here applies: refused, not
# dropped (the answer would silently differ from the one asked for). Each with what it asks.
UNSUPPORTED_VLLM = (
    ("use_beam_search", "beam search is not done here"),
    ("prompt_logprobs", "the prompt's logprobs are not computed here"),
    ("truncate_prompt_tokens", "prompt truncation is not done here"),
    ("logits_processors", "request logits processors are not run here"),
    ("vllm_xargs", "vLLM's custom arguments are not read here"),
    ("prompt_embeds", "prompt embeddings are not taken here: send the prompt"),
    # A request's own template would be run by the gateway's Jinja: as chat_template_kwargs' key.
    ("chat_template", "a request's own chat template is not run here: the model's is"),
    # Isolation asked for and not given is worse than none asked (helper-80: accepted, and the
    # next tenant's request reused the first's prompt).
    ("cache_salt", "per-request cache isolation is not done here: the backends share their prefix "
                   "caches among all requests (docs/security.md)"),
)
# An integer beyond 64 bits needs 19+ digits in a row; the body is scanned for such a run with
# a byte translate plus a substring search (a regex scan costs ~2 ms per 100k tokens of prompt).
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19


def loads_body(raw: bytes) -> dict:
    """Decode a JSON object body.

    Raises:
        RequestError: not UTF-8, not JSON, nested deeper than `MAX_JSON_DEPTH`,
            more than `MAX_JSON_CONTAINERS` brackets,
            an integer outside 64 bits, an unpaired UTF-16 surrogate, or not an object.
    """
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_CONTAINERS:
        raise RequestError(f"request body holds more than {MAX_JSON_CONTAINERS} JSON arrays and objects")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request body is not valid UTF-8 (byte {e.start})")
    try:
        body = json.loads(text)
    except RecursionError:
        raise RequestError(f"request body is nested too deeply (limit {MAX_JSON_DEPTH})")
    except ValueError as e:
        if "integer string conversion" in str(e):  # Python's 4,300-digit guard: not the client's concern
            raise RequestError("request body holds an integer of thousands of digits (integers must fit in 64 bits)")
        raise RequestError(f"invalid JSON in request body: {e}")
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    _check_tree(body, check_ints=_LONG_DIGIT_RUN in raw.translate(_DIGITS_TO_ZERO))
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("request body holds an unpaired UTF-16 surrogate (\\uD800-\\uDFFF) in a string")
    return body


def _check_tree(body: dict, check_ints: bool) -> None:
    """Depth limit (and 64-bit integers when ``check_ints``), iteratively: no recursion to exhaust."""
    stack = [(body, 1, None)]
    while stack:
        node, depth, trail = stack.pop()
        if depth > MAX_JSON_DEPTH:
            p = _trail_path(trail)
            raise RequestError(f"request body is nested too deeply (limit {MAX_JSON_DEPTH}) at '{p}'",
                               param=_top_field(p))
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, (trail, k)))
            elif check_ints and isinstance(v, int) and not isinstance(v, bool) and not _INT_MIN <= v <= _INT_MAX:
                p = _trail_path((trail, k))
                raise RequestError(f"'{p}' is an integer outside 64 bits", param=_top_field(p))


def _trail_path(trail) -> str:
    """``((None, "messages"), 0)`` -> ``"messages[0]"``."""
    keys = []
    while trail is not None:
        trail, k = trail
        keys.append(k)
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _top_field(path: str) -> str:
    return path.split(".")[0].split("[")[0]


def number_field(body: dict, name: str, default, lo=None, hi=None, integer=False):
    """``body[name]`` checked as a finite number (an integer when ``integer``) in ``[lo, hi]``;
    ``default`` when absent or null.

    Raises:
        RequestError: 400 naming ``name`` (the client's own field name).
    """
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


# Content part types a text model can take (OpenAI chat: text, and an assistant's
# refusal; the Responses names too). Images, audio and files are refused.
TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


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
            raise RequestError(f"'{p}.role' must be one of system, developer, user, assistant, tool (or the deprecated "
                               "function)", param=f"{p}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"'{p}.content' must be a string or an array of parts", param=f"{p}.content")
        if content is None and role in ("system", "developer", "user"):
            # Only an assistant turn (with tool calls) or a tool result may leave it out, as in
            # OpenAI's API (helper-66: a user message with null content was answered 200).
            raise RequestError(f"'{p}.content' is required for a {role} message (a string or an array of parts)",
                               param=f"{p}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                q = f"{p}.content[{j}]"
                if not isinstance(part, dict):
                    raise RequestError(f"'{q}' must be an object", param=q)
                kind = part.get("type", "text")
                if not isinstance(kind, str):
                    raise RequestError(f"'{q}.type' must be a string", param=f"{q}.type")
                if kind not in TEXT_PARTS:
                    # Answering as if an image or file had not been sent would be silent data loss.
                    raise RequestError(f"content part type '{kind}' is not supported (text models)",
                                       param=f"{q}.type")
                field = "refusal" if kind == "refusal" else "text"
                if not isinstance(part.get(field), str):  # missing too: OpenAI's API requires it
                    raise RequestError(f"'{q}.{field}' must be a string", param=f"{q}.{field}")
        for name in ("name", "tool_call_id"):
            optional_field(m, name, (str,), "a string", p)
        fc = m.get("function_call")  # the deprecated form of one tool call (normalize_messages)
        if fc is not None and not (isinstance(fc, dict) and isinstance(fc.get("name"), str)):
            raise RequestError(f"'{p}.function_call' must be an object with a 'name'", param=f"{p}.function_call")
        if fc is not None and fc.get("arguments") is not None and not isinstance(fc["arguments"], (str, dict)):
            raise RequestError(f"'{p}.function_call.arguments' must be a JSON string",
                               param=f"{p}.function_call.arguments")
        tcs = m.get("tool_calls")
        if tcs is not None and not isinstance(tcs, list):
            raise RequestError(f"'{p}.tool_calls' must be an array", param=f"{p}.tool_calls")
        for j, tc in enumerate(tcs or []):
            q = f"{p}.tool_calls[{j}]"
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict):
                raise RequestError(f"'{q}.function' must be an object", param=f"{q}.function")
            if not isinstance(fn.get("name"), str):
                raise RequestError(f"'{q}.function.name' must be a string", param=f"{q}.function.name")
            if fn.get("arguments") is None:
                # as OpenAI's API; the chat template failed on it, naming jinja's Undefined (helper-71)
                raise RequestError(f"'{q}.function.arguments' is required (a JSON string)",
                                   param=f"{q}.function.arguments")
            if not isinstance(fn["arguments"], (str, dict)):
                raise RequestError(f"'{q}.function.arguments' must be a JSON string",
                                   param=f"{q}.function.arguments")
    return messages


def check_tool(name, schema, seen: set, param: str, schema_param: str) -> None:
    """One function tool: a non-empty name not used by an earlier tool (``seen``, updated)
    and a JSON schema (or none) that describes an object, the call's arguments, as the
    OpenAI and Anthropic APIs require: a forced call on a string schema produced arguments
    that were a JSON string, which no client can read (session 22's SDK trial).

    Raises:
        RequestError: 400 naming ``param`` (the name) or ``schema_param``.
    """
    if not isinstance(name, str) or not name:
        raise RequestError(f"'{param}' must be a non-empty string", param=param)
    if name in seen:
        raise RequestError(f"'{param}': two tools are named '{name}'", param=param)
    seen.add(name)
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise RequestError(f"'{schema_param}' must be an object", param=schema_param)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise RequestError(f"'{schema_param}' must be a JSON Schema of type 'object' (the call's arguments), "
                           f"not {kind!r}", param=schema_param)


def _validate_tools(tools) -> Optional[list]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be an array of objects", param="tools")
    seen: set = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise RequestError(f"'{p}' must be an object", param=p)
        if t.get("type", "function") != "function":  # helper-68: `"type": "bogus"` was rendered as a function
            raise RequestError(f"'{p}.type' must be 'function' (the only chat tool type served), not "
                               f"{json.dumps(t.get('type'))}", param=f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"'{p}.function' must be an object", param=f"{p}.function")
        check_tool(fn.get("name"), fn.get("parameters"), seen, f"{p}.function.name", f"{p}.function.parameters")
    return tools or None


def forced_tool_names(tools: Optional[list], tool_choice) -> Optional[list[str]]:
    """The names of the function tools ``tool_choice`` forces a call to, in ``tools``' order, or
    None when no call is forced.

    Forms (OpenAI's Chat Completions): ``"none"`` / ``"auto"`` / None (not forced),
    ``"required"`` (any tool), ``{"type": "function", "function": {"name"}}`` (that one), and
    ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools": [{"type": "function",
    "function": {"name"}}, ...]}}``: mode ``required`` forces a call to one of those, so a
    client keeps one ``tools`` list (and its cached prefix) while it narrows the choice; mode
    ``auto`` is not forced, and the model may then call any of ``tools`` (no grammar here allows
    "text, or a call to one of these").

    Raises:
        RequestError: 400 for another form (``custom``: chat serves function tools only), a
            name not in ``tools``, or a forced call with no tools.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    names = [(t.get("function") or {}).get("name") for t in tools or [] if t.get("type", "function") == "function"]
    if tool_choice == "required":
        if not names:
            raise RequestError("tool_choice 'required' needs 'tools'", param="tool_choice")
        return names
    if not isinstance(tool_choice, dict):
        raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or an object", param="tool_choice")
    kind = tool_choice.get("type", "function")
    if kind == "allowed_tools":
        allowed = tool_choice.get("allowed_tools")
        if not isinstance(allowed, dict):  # helper-93: the Responses API's flat form, sent to chat
            raise RequestError("'tool_choice.allowed_tools' must be an object, {\"mode\": ..., \"tools\": [...]} "
                               "(the flat form is the Responses API's)", param="tool_choice.allowed_tools")
        mode = allowed.get("mode")
        if mode not in ("auto", "required"):
            raise RequestError("'tool_choice.allowed_tools.mode' must be 'auto' or 'required'",
                               param="tool_choice.allowed_tools.mode")
        listed = allowed.get("tools")
        if not isinstance(listed, list) or not listed:
            raise RequestError("'tool_choice.allowed_tools.tools' must be a non-empty array of tools",
                               param="tool_choice.allowed_tools.tools")
        chosen = []
        for i, t in enumerate(listed):
            p = f"tool_choice.allowed_tools.tools[{i}]"
            fn = t.get("function") if isinstance(t, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or t.get("type", "function") != "function":
                raise RequestError(f"'{p}' must be a function tool, {{\"type\": \"function\", \"function\": "
                                   f"{{\"name\": ...}}}}", param=p)
            if name not in names:
                raise RequestError(f"'{p}' names '{name}', which is not in 'tools'", param=p)
            chosen.append(name)
        return [n for n in names if n in chosen] if mode == "required" else None
    if kind != "function":
        raise RequestError(f"'tool_choice.type' must be 'function' or 'allowed_tools' (chat serves function "
                           f"tools only), not {json.dumps(kind)}", param="tool_choice.type")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):  # it said "names 'None'" (helper-60)
        raise RequestError("'tool_choice.function.name' must name a function in 'tools'",
                           param="tool_choice.function.name")
    if name not in names:
        raise RequestError(f"tool_choice names '{name}', which is not in 'tools'", param="tool_choice")
    return [name]


def _response_format(body: dict) -> Optional[dict]:
    """The JSON schema ``response_format`` asks for: None for ``text`` (or none),
    ``{"type": "object"}`` for ``json_object``, ``json_schema.schema`` for ``json_schema``.

    Raises:
        RequestError: 400 for another type or a ``json_schema`` without a schema object.
    """
    rf = optional_field(body, "response_format", (dict,), "an object")
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("'response_format.json_schema.schema' must be an object",
                               param="response_format.json_schema.schema")
        return schema
    raise RequestError("'response_format.type' must be text, json_object or json_schema", param="response_format.type")


# vLLM's structured-output fields: its older top-level names, and (vLLM 0.10 on) the keys of its
# ``structured_outputs`` object. Grammars are refused: vLLM's are EBNF/GBNF, not llguidance's lark.
_GUIDED = {"guided_json": "json", "guided_choice": "choice", "guided_regex": "regex"}
_GUIDED_REFUSED = ("guided_grammar", "structural_tag")
# vLLM's tuning options beside the constraint: accepted, no effect here (llguidance's defaults).
_SO_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def structured_output(body: dict) -> Optional[tuple]:
    """The answer's constraint, from ``response_format`` (`_response_format`) or vLLM's
    structured-output fields: None, or ``(kind, value, param)`` with kind ``"json"`` (a JSON
    schema), ``"choice"`` (the answer is one of the strings) or ``"regex"`` (it matches the
    pattern), ``param`` the client's field.

    Clients written for vLLM send ``guided_json`` / ``guided_choice`` / ``guided_regex`` (or
    vLLM 0.10's ``structured_outputs: {"json"|"choice"|"regex": ...}``); ignored, as before,
    the answer came out unconstrained.

    Raises:
        RequestError: 400 for more than one constraint, a grammar (``guided_grammar``,
            ``structured_outputs.grammar``: another grammar language than ours), or a value of
            the wrong type.
    """
    schema = _response_format(body)
    found = [] if schema is None else [("json", schema, "response_format")]
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((kind, body[name], name))
    so = optional_field(body, "structured_outputs", (dict,), "an object")
    for key, v in (so or {}).items():
        if v is None or key in _SO_OPTIONS:
            continue
        if key in ("json", "choice", "regex"):
            found.append((key, v, f"structured_outputs.{key}"))
        elif key == "json_object":
            if optional_field(so, key, (bool,), "a boolean", "structured_outputs"):
                found.append(("json", {"type": "object"}, "structured_outputs.json_object"))
        elif key in ("grammar", "structural_tag"):
            raise RequestError(f"'structured_outputs.{key}' is not supported: send a JSON schema, a choice or a "
                               "regex", param=f"structured_outputs.{key}", code="unsupported_parameter")
        else:  # a typo'd key constrained nothing, silently (helper-79)
            raise RequestError(f"'structured_outputs.{key}' is not a structured-output field (json, choice, regex, "
                               "json_object)", param=f"structured_outputs.{key}")
    for name in _GUIDED_REFUSED:
        if body.get(name) is not None:
            raise RequestError(f"'{name}' is not supported: send a JSON schema (response_format), guided_choice or "
                               "guided_regex", param=name, code="unsupported_parameter")
    if not found:
        return None
    if len(found) > 1:
        names = [p for _, _, p in found]
        if schema is not None:  # response_format, when given, named last (the error's param)
            names = names[1:] + names[:1]
        raise RequestError(f"only one constraint on the answer may be given, not {', '.join(names)}", param=names[-1])
    kind, v, param = found[0]
    if param == "response_format":
        return found[0]
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                v = None
        if not isinstance(v, dict):
            raise RequestError(f"'{param}' must be a JSON schema (an object, or a string of one)", param=param)
        return kind, v, param
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise RequestError(f"'{param}' must be a non-empty array of non-empty strings", param=param)
    elif not (isinstance(v, str) and v):
        raise RequestError(f"'{param}' must be a non-empty string (a regular expression)", param=param)
    return kind, v, param


def optional_field(body: dict, name: str, types, what: str, where: str = ""):
    """``body[name]`` when absent/None or of ``types``; else a 400 naming the field
    (``where.name`` when ``where``, the path of ``body`` in the request, is given)."""
    v = body.get(name)
    if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
        path = f"{where}.{name}" if where else name
        raise RequestError(f"'{path}' must be {what}", param=path)
    return v


TURN_FLAGS = ("add_generation_prompt", "continue_final_message")
# Arguments of transformers' ``apply_chat_template`` itself, not template variables: a client's
# ``chat_template`` would run its own Jinja (a loop in it held the gateway's event loop for a minute
# and took 11 GB, helper-62; vLLM takes one only with --trust-request-chat-template), and the rest
# are the server's to set (the messages, the tools, tokenization and its output).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens",
})


#: OpenAI's ``reasoning_effort`` values (chat; the Responses API's ``reasoning.effort``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(body: dict) -> dict:
    """The request's extra chat-template arguments: ``chat_template_kwargs``, plus the
    top-level ``add_generation_prompt`` / ``continue_final_message`` (vLLM's extensions of the
    chat request; either spelling is honoured, the top-level one wins) and ``reasoning_effort``
    as the template variable of that name (unless ``chat_template_kwargs`` sets it).

    Raises:
        RequestError: 400 when ``chat_template_kwargs`` is not an object, names an argument of
            the template call itself (`RESERVED_TEMPLATE_KWARGS`: ``chat_template``, ``tools``,
            ``tokenize``...), a turn flag is not a boolean, or both turn flags are true (as vLLM:
            continuing the last message and opening a new assistant turn contradict each other), or
            ``reasoning_effort`` is not one of OpenAI's values.
    """
    tk = dict(optional_field(body, "chat_template_kwargs", (dict,), "an object") or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(tk))
    if reserved:
        name = reserved[0]
        where = f"chat_template_kwargs.{name}"
        raise RequestError(f"'{where}' cannot be set by a request: "
                           + ("the server renders with the model's own chat template" if name == "chat_template"
                              else "it is an argument of the template call, not a template variable"
                              + (" (send tools at the top level)" if name == "tools" else "")), param=where)
    for name in TURN_FLAGS:
        optional_field(tk, name, (bool,), "a boolean", where="chat_template_kwargs")
        if optional_field(body, name, (bool,), "a boolean") is not None:
            tk[name] = body[name]
    if tk.get("add_generation_prompt") and tk.get("continue_final_message"):
        raise RequestError("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                           param="continue_final_message")
    effort = optional_field(body, "reasoning_effort", (str,), "a string")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise RequestError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                               param="reasoning_effort")
        # The template variable of that name (gpt-oss's template reads it, as vLLM renders it);
        # chat_template_kwargs' own wins. Other templates ignore it (helper-82: dropped unsaid).
        tk.setdefault("reasoning_effort", effort)
    return tk


def normalize_messages(messages: list) -> list:
    """Flatten text content parts into strings, decode tool-call argument JSON, and make an
    assistant message's deprecated ``function_call`` its one tool call.

    Templates expect ``content`` as a string and (Qwen-style) tool-call
    ``arguments`` as an object; OpenAI clients send parts and JSON strings.
    """
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = "".join(
                p.get("refusal" if p.get("type") == "refusal" else "text", "") for p in c if isinstance(p, dict)
            )
        elif c is None:
            m["content"] = ""
        fc = m.pop("function_call", None)
        if fc is not None and not m.get("tool_calls"):
            # The deprecated single call is one tool call (its result comes as a `function` message,
            # rendered as `tool`: `prompt.template_roles`); it was dropped from the prompt (helper-60).
            m["tool_calls"] = [{"id": f"call_{len(out)}", "type": "function",
                                "function": {"name": fc["name"], "arguments": fc.get("arguments") or "{}"}}]
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


def string_list(body: dict, name: str, most: int) -> list[str]:
    """``body[name]`` as a list of at most ``most`` strings ([] when absent or null).

    Raises:
        RequestError: 400 naming the field: not an array of strings, or too long.
    """
    v = body.get(name)
    if v is None:
        return []
    if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
        raise RequestError(f"'{name}' must be an array of strings", param=name)
    if len(v) > most:
        raise RequestError(f"'{name}' may hold at most {most} strings", param=name)
    return [x for x in v if x.strip()]


def token_id_list(body: dict, name: str) -> Optional[list[int]]:
    """``body[name]`` as a list of token ids (None when absent or null; the backend checks them
    against its vocabulary).

    Raises:
        RequestError: 400 naming the field when it is not an array of integers from 0 to 2**32 - 1.
    """
    ids = body.get(name)
    if ids is None:
        return None
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                          for t in ids)):
        raise RequestError(f"'{name}' must be an array of token ids", param=name)
    return ids


def refuse_unsupported(body: dict) -> None:
    """Refuse the request fields of `UNSUPPORTED_VLLM` that are set (not absent, null, false or
    empty; ``prompt_logprobs: 0`` asks too).

    Raises:
        RequestError: 400 ``unsupported_parameter`` naming the first such field.
    """
    for name, what in UNSUPPORTED_VLLM:
        v = body.get(name)
        if v is not None and v is not False and v != [] and v != {}:
            raise RequestError(f"'{name}' is not supported: {what}", param=name, code="unsupported_parameter")


def stopping_fields(body: dict, max_tokens: Optional[int], mt_field: str) -> tuple[int, list[int], bool]:
    """vLLM's stopping fields of a request: ``(min_tokens, stop_token_ids, include_stop_str_in_output)``.

    ``min_tokens`` (tokens, >= 0, at most ``max_tokens``): no end-of-sequence token, stop token
    nor stop string ends the answer before it has that many tokens; ``stop_token_ids`` (token
    ids, at most `MAX_STOP_TOKEN_IDS`): generating one ends the answer (``finish_reason``
    "stop", ``stop_reason`` the id); ``include_stop_str_in_output``: the stop string that
    ended the answer stays in it. Meanings from vLLM's ``SamplingParams``.

    Raises:
        RequestError: 400 naming the field: a wrong type or range, ``min_tokens`` above
            ``max_tokens``.
    """
    min_tokens = number_field(body, "min_tokens", 0, lo=0, integer=True)
    if max_tokens is not None and min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({min_tokens}) must be at most '{mt_field}' ({max_tokens})",
                           param="min_tokens")
    ids = token_id_list(body, "stop_token_ids") or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
    include = bool(optional_field(body, "include_stop_str_in_output", (bool,), "a boolean"))
    return min_tokens, sorted(set(ids)), include


def parse_openai(body: dict, kind: str) -> ParsedRequest:
    """Validate an OpenAI ``/v1/chat/completions`` (kind "chat") or ``/v1/completions`` ("text") body.

    Raises:
        RequestError: with ``param`` naming the offending field.
    """
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    so = optional_field(body, "stream_options", (dict,), "an object") or {}
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    continuous = optional_field(so, "continuous_usage_stats", (bool,), "a boolean", "stream_options")
    n = number_field(body, "n", 1, lo=1, hi=MAX_N, integer=True)
    for name, what in (("adapters", "LoRA adapters per request"), ("draft_model", "a draft model per request")):
        if body.get(name) is not None:  # mlx_lm.server's extensions: ignoring them would answer from another model
            raise RequestError(f"'{name}' is not supported: {what} (a backend serves the one model it loaded)",
                               param=name, code="unsupported_parameter")
    refuse_unsupported(body)
    # Both endpoints (vLLM takes them on chat too; helper-80: ignored there, refused here).
    if optional_field(body, "echo", (bool,), "a boolean"):
        raise RequestError("'echo' is not supported: the answer never repeats the prompt", param="echo",
                           code="unsupported_parameter")
    if number_field(body, "best_of", 1, lo=1, integer=True) != 1:
        raise RequestError("'best_of' must be 1: one completion per request is supported", param="best_of")
    # -1: mlx_lm.server's "none" (its default, which clients written for it send)
    top = number_field(body, "top_logprobs", None, lo=-1, hi=20, integer=True)
    top = None if top == -1 else top
    if kind == "text":  # the legacy API's logprobs is a count; suffix is not done here
        if isinstance(body.get("logprobs"), bool):  # mlx_lm.server's form, with top_logprobs as the count
            logprobs = (top or 0) if body["logprobs"] else None
        else:
            # up to 20 as vLLM takes (OpenAI's legacy API: 5)
            logprobs = number_field(body, "logprobs", None, lo=0, hi=20, integer=True)
        if top and logprobs is None:  # as on chat (helper-79: silently no logprobs)
            raise RequestError("'top_logprobs' needs 'logprobs' (a count, or true)", param="top_logprobs")
        if optional_field(body, "suffix", (str,), "a string"):
            raise RequestError("'suffix' (insertion) is not supported", param="suffix", code="unsupported_parameter")
    else:
        if optional_field(body, "logprobs", (bool,), "a boolean"):
            logprobs = top or 0
        elif top:  # OpenAI's and vLLM's rule: the alternatives come with the tokens' own logprobs
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        else:
            logprobs = None
    parallel = optional_field(body, "parallel_tool_calls", (bool,), "a boolean")
    constraint = structured_output(body)
    tc = body.get("tool_choice")
    if tc is not None and not (isinstance(tc, dict) or tc in ("none", "auto", "required")):
        raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or an object", param="tool_choice")
    # The newer name wins when both are sent; an error names the field the client sent.
    mt_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number_field(body, mt_field, None, lo=1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("'stop' must be a string or an array of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"'stop' may hold at most {MAX_STOP} sequences", param="stop")
    stop = [s for s in stop if s]
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise RequestError("'logit_bias' must be an object", param="logit_bias")
        if len(lb) > MAX_LOGIT_BIAS:
            raise RequestError(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        try:
            lb = {int(k): float(v) for k, v in lb.items() if not isinstance(v, (bool, str))}
        except (TypeError, ValueError, OverflowError):
            lb = None
        if lb is None or len(lb) != len(body["logit_bias"]) or not all(
            0 <= k < 2**32 and -100 <= v <= 100 for k, v in lb.items()
        ):
            raise RequestError("'logit_bias' must map token ids to numbers from -100 to 100", param="logit_bias")
    tk = template_kwargs(body)
    min_tokens, stop_token_ids, include_stop = stopping_fields(body, max_tokens, mt_field)
    allowed = token_id_list(body, "allowed_token_ids")
    if allowed == []:  # nothing could be sampled
        raise RequestError("'allowed_token_ids' must name at least one token", param="allowed_token_ids")
    seed = number_field(body, "seed", None, integer=True)
    user = optional_field(body, "user", (str,), "a string")
    pck = optional_field(body, "prompt_cache_key", (str,), "a string")
    ignore_eos = bool(optional_field(body, "ignore_eos", (bool,), "a boolean"))
    req = ParsedRequest(
        kind=kind,
        model=model,
        stream=stream,
        n=n,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=float(number_field(body, "temperature", 0.0, lo=0, hi=2)),  # OpenAI's range
        top_p=float(number_field(body, "top_p", 1.0, lo=0, hi=1)),
        # -1 is vLLM's "no top-k", which clients written for it send (helper-77: a 400)
        top_k=max(0, int(number_field(body, "top_k", 0, lo=-1, integer=True))),
        min_p=float(number_field(body, "min_p", 0.0, lo=0, hi=1)),
        repetition_penalty=float(number_field(body, "repetition_penalty", 0.0, lo=0, hi=10)),
        presence_penalty=float(number_field(body, "presence_penalty", 0.0, lo=-2, hi=2)),  # OpenAI's range
        frequency_penalty=float(number_field(body, "frequency_penalty", 0.0, lo=-2, hi=2)),
        # At least 1: mlx-lm's processors take the last n tokens as ``tokens[-n:]``, all of them for 0.
        repetition_context_size=number_field(body, "repetition_context_size", 20, lo=1, integer=True),
        presence_context_size=number_field(body, "presence_context_size", 20, lo=1, integer=True),
        frequency_context_size=number_field(body, "frequency_context_size", 20, lo=1, integer=True),
        xtc_probability=float(number_field(body, "xtc_probability", 0.0, lo=0, hi=1)),
        xtc_threshold=float(number_field(body, "xtc_threshold", 0.1, lo=0, hi=0.5)),
        logprobs=logprobs,
        parallel_tool_calls=parallel is not False,
        stop=stop,
        seed=seed,
        logit_bias=lb,
        template_kwargs=tk,
        user=user,
        prompt_cache_key=pck,
        constraint=constraint,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=include_stop,
        return_tokens_as_token_ids=bool(optional_field(body, "return_tokens_as_token_ids", (bool,), "a boolean")),
        return_token_ids=bool(optional_field(body, "return_token_ids", (bool,), "a boolean")),
        allowed_token_ids=allowed,
        bad_words=string_list(body, "bad_words", MAX_BAD_WORDS),
        continuous_usage=bool(continuous) and include_usage,  # vLLM: with include_usage only
        include_reasoning=optional_field(body, "include_reasoning", (bool,), "a boolean") is not False,
        skip_special_tokens=optional_field(body, "skip_special_tokens", (bool,), "a boolean") is not False,
    )
    optional_field(body, "spaces_between_special_tokens", (bool,), "a boolean")  # read by no detokenizer here
    if kind == "chat":
        for k in ("functions", "function_call"):
            if body.get(k) is not None:  # silently ignored before (helper-60): the model saw no functions
                raise RequestError(f"'{k}' is OpenAI's deprecated form of 'tools' and 'tool_choice' and is not "
                                   "supported: send 'tools'", param=k)
        req.messages = normalize_messages(_validate_messages(body.get("messages")))
        req.tools = _validate_tools(body.get("tools"))
        req.tool_choice = body.get("tool_choice")
        forced_tool_names(req.tools, req.tool_choice)  # a 400 here, before any backend is chosen
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) >= 1 and all(isinstance(p, (str, list)) for p in prompt):
            # OpenAI's batch: several prompts (strings or token arrays), each answered with n choices
            batch = [_one_prompt(p, f"prompt[{i}]" if len(prompt) > 1 else "prompt") for i, p in enumerate(prompt)]
        else:
            batch = [_one_prompt(prompt, "prompt")]
        if len(batch) * n > MAX_N:
            raise RequestError(f"{len(batch)} prompts x n={n} is {len(batch) * n} choices; at most {MAX_N} per request",
                               param="prompt")
        req.prompt, req.prompt_ids = batch[0]
        req.batch = batch if len(batch) > 1 else []
    if allowed and (req.constraint is not None or req.tool_choice not in (None, "auto", "none")):
        # Two masks that may leave nothing in common: the answer then breaks the grammar it was
        # promised (helper-83: guided_choice yes/no with two other ids allowed wrote "!!!!!!!!!!").
        raise RequestError("'allowed_token_ids' cannot be combined with structured outputs or a forced tool call: "
                           "the grammar already says which tokens may come", param="allowed_token_ids")
    return req


def _one_prompt(prompt, param: str) -> tuple[Optional[str], Optional[list[int]]]:
    """One completions prompt: (text, None) or (None, token ids).

    Raises:
        RequestError: 400 naming ``param`` (``prompt``, or ``prompt[i]`` in a batch).
    """
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"'{param}' must not be empty", param=param)
        return prompt, None
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt
    ):
        return None, list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # helper-68: "must be an array of token ids" for an array of ids, one of them negative
        bad = next(t for t in prompt if not 0 <= t < 2**32)
        # helper-69: not "from 0 to 4294967295": the model's vocabulary ends far sooner (gateway.limits names it)
        raise RequestError(f"'{param}' holds token id {bad}, outside the vocabulary", param=param)
    raise RequestError(f"'{param}' must be a non-empty string or array of token ids", param=param)
