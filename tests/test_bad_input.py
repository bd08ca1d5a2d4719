"""Acceptance: bad input gets an OpenAI-style 4xx and the gateway keeps serving."""

import json

import pytest

from mlxgw.httpget import post
from texts import words


def _err(resp):
    import json

    status, _, body = resp
    return status, json.loads(body)["error"]


CASES = [
    (b"{not json", 400, None, None),
    ({"model": "demo-tiny"}, 400, "messages", None),
    ({"model": "demo-tiny", "messages": []}, 400, "messages", None),
    ({"model": "demo-tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature", None),
    (b"[1, 2]", 400, None, None),
    (b"\xff\xfe", 400, None, None),
    # Text models: an image or a file is refused, not dropped from the prompt unseen.
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]},
     400, "messages[0].content[1].type", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     400, "messages[0].content[0].type", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "refusal", "refusal": 5}]}]}, 400, "messages[1].content[0].refusal", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format.type", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, 400, "response_format.json_schema.schema", None),
    # Refused by the backend's grammar compiler, passed through in OpenAI's shape.
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}}},
     400, "response_format", None),
    # Session 22's SDK trial: each was answered 200 (a string schema forced arguments that were
    # a JSON string) or named another field.
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     400, "tools[0].function.parameters", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     400, "tools[1].function.name", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     400, "max_completion_tokens", None),
    # helper-68: rendered to the template as a function tool
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "bogus", "function": {"name": "f"}}]}, 400, "tools[0].type", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages[0].content[0].text", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}], "tool_choice": {"type": "function"}},
     400, "tool_choice.function.name", None),  # "tool_choice names 'None'" (helper-60)
    # OpenAI's deprecated functions were dropped silently (helper-60).
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}],
      "functions": [{"name": "f", "parameters": {"type": "object"}}]}, 400, "functions", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "function_call": "auto"},
     400, "function_call", None),
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": None, "function_call": {"arguments": "{}"}}]},
     400, "messages[1].function_call", None),
    # helper-66: answered 200, as if the turn were empty
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", None),
    ({"model": "demo-tiny", "messages": [{"role": "system"}, {"role": "user", "content": "x"}]}, 400,
     "messages[0].content", None),
    # helper-66: the compiler's message was cut to "regex parse error:"
    ({"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(("}}}}}]}, 400, "tools", None),
]


@pytest.mark.parametrize("body,status,param,code", CASES)
def test_bad_requests_get_openai_errors(stack1, body, status, param, code):
    got_status, err = _err(post(stack1.gateway.url + "/v1/chat/completions", body))
    assert got_status == status
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    assert err["code"] == code
    if param == "response_format":  # the compiler's reason, not its position and grammar dump
        assert err["message"].endswith("Invalid type: nonsense") and "<[" not in err["message"], err
    if param == "tools" and "pattern" in json.dumps(body):
        assert err["message"] == ("cannot constrain the answer to this tool call: regex parse error: (( error: "
                                  "unclosed group"), err


def test_a_deprecated_function_call_in_the_history_is_rendered_as_a_tool_call(stack1):
    """An assistant message's ``function_call`` and the ``function`` message answering it render
    as the tool call and tool result they stand for; the call was dropped from the prompt."""
    import json

    user = {"role": "user", "content": "weather in Oslo?"}
    old = [user, {"role": "assistant", "content": None, "function_call": {"name": "w", "arguments": '{"c": 1}'}},
           {"role": "function", "name": "w", "content": "sunny"}]
    new = [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    bare = [user, {"role": "assistant", "content": None}, {"role": "function", "name": "w", "content": "sunny"}]
    n = []
    for msgs in (old, new, bare):
        status, _, body = post(stack1.gateway.url + "/v1/chat/completions",
                               {"model": "demo-tiny", "messages": msgs, "max_tokens": 1})
        assert status == 200, body
        n.append(json.loads(body)["usage"]["prompt_tokens"])
    assert n[0] == n[1] > n[2]


@pytest.mark.parametrize("extra,status,param", [
    ({"logprobs": 2}, 200, None),  # the legacy API's count, accepted (a 400 "must be a boolean" before)
    ({"logprobs": 21}, 400, "logprobs"),  # up to 20, as vLLM (OpenAI: 5)
    ({"echo": True}, 400, "echo"),  # these three were ignored (helper-60)
    ({"suffix": "end"}, 400, "suffix"),
    ({"best_of": 3}, 400, "best_of"),
    ({"echo": False, "suffix": None, "best_of": 1}, 200, None),
])
def test_legacy_completion_fields(stack1, extra, status, param):
    import json

    got, _, body = post(stack1.gateway.url + "/v1/completions",
                        {"model": "demo-tiny", "prompt": "once upon", "max_tokens": 1, **extra})
    assert got == status, body
    if status != 200:
        assert json.loads(body)["error"]["param"] == param


def test_prompt_longer_than_context(stack1):
    text = words(9000, seed=3)  # the demo model's context is 8192 tokens
    status, err = _err(post(stack1.gateway.url + "/v1/chat/completions",
                            {"model": "demo-tiny", "messages": [{"role": "user", "content": text}]}))
    assert status == 400 and err["code"] == "context_length_exceeded"
    # In the words agent tools and LiteLLM match a context overflow by (helper-71: ours matched none),
    # OpenAI's here, Anthropic's under /v1/messages
    import re

    n = int(re.fullmatch(r"This model's maximum context length is 8192 tokens\. However, your messages resulted in "
                         r"(\d+) tokens\. Please reduce the length of the messages\.", err["message"])[1])
    assert n > 8192, err
    status, body = post(stack1.gateway.url + "/v1/messages", {"model": "demo-tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": text}]})[::2]
    err = json.loads(body)
    assert (status, len(err.pop("request_id"))) == (400, 32), body
    assert err == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > 8192 maximum"}}, body


def test_still_serving_after_bad_input(stack1):
    for body, *_ in CASES:
        post(stack1.gateway.url + "/v1/chat/completions", body)
    status, _, _ = post(stack1.gateway.url + "/v1/chat/completions",
                        {"model": "demo-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    assert status == 200
    status, _, body = post(stack1.gateway.url + "/v1/nothing", {"a": 1})
    assert status == 404 and b"error" in body


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])
def test_any_content_type_is_read_as_json(stack1, ctype):
    """A lenience on purpose (docs/api.md), as mlx_lm.server: curl's `-d` alone sends a form type."""
    import json

    url = stack1.gateway.url + "/v1/chat/completions"
    ok = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    status, _, body = post(url, json.dumps(ok).encode(), headers={"Content-Type": ctype})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    status, err = _err(post(url, b"model=demo-tiny&max_tokens=2", headers={"Content-Type": ctype}))
    assert status == 400 and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_its_content_encoding_does_not_match_is_a_400(stack1, path):
    """A plain body sent with ``Content-Encoding: gzip`` (or deflate) got a 500 and a traceback in
    the log (helper-60): aiohttp fails to decompress it as the handler reads it. Now a 400 in the
    endpoint's own error shape; a body that is gzip is read. br and zstd bodies were refused in
    aiohttp's text/plain 400 before any handler (its decoders were not installed); they are read
    now, and a body that does not match them is the same JSON 400."""
    import gzip
    import json
    import sys

    import brotli

    if sys.version_info >= (3, 14):
        from compression import zstd
    else:
        from backports import zstd

    url = stack1.gateway.url + path
    ok = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for enc, pack in (("br", brotli.compress), ("zstd", zstd.compress)):
        status, _, body = post(url, pack(json.dumps(ok).encode()), headers={"Content-Encoding": enc})
        assert status == 200, body
    # Codings applied in turn, listed in that order: gzip first, then br over it (RFC 9110 8.4).
    status, _, body = post(url, brotli.compress(gzip.compress(json.dumps(ok).encode())),
                           headers={"Content-Encoding": "gzip, br"})
    assert status == 200, body
    for enc in ("gzip", "deflate", "br", "zstd"):
        status, _, body = post(url, json.dumps(ok).encode(), headers={"Content-Encoding": enc})
        err = json.loads(body)["error"]
        assert status == 400 and err["type"] == "invalid_request_error", body
        assert err["message"].startswith(f"the request body could not be read (Can not decode content-encoding: {enc}")
        if path == "/v1/messages":
            assert json.loads(body)["type"] == "error"
        else:
            assert err["code"] == "invalid_body"
    status, _, body = post(url, gzip.compress(json.dumps(ok).encode()), headers={"Content-Encoding": "gzip"})
    assert status == 200, body
    # A coding we do not know: 415 (RFC 9110), where the body was read as if it had none.
    status, _, body = post(url, json.dumps(ok).encode(), headers={"Content-Encoding": "xyz"})
    assert status == 415 and "Content-Encoding 'xyz' is not supported" in body.decode(), body
    # After a body that does not decode, the connection goes on (helper-79: the next request on it
    # was reset, and the gateway logged a traceback).
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("POST", u.path, body=b"not gzip at all", headers={"Content-Encoding": "gzip",
                                                                       "Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 400 and json.loads(r.read())
        conn.request("POST", u.path, body=json.dumps(ok).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
    finally:
        conn.close()
    log = stack1.gateway.log_path.read_text()
    assert "Unhandled exception" not in log and "Traceback" not in log


def test_integers_beyond_64_bits_are_refused_by_name():
    from mlxgw.protocol import RequestError, loads_body

    with pytest.raises(RequestError) as e:
        loads_body(b'{"model": "m", "max_tokens": 100000000000000000000}')
    assert e.value.param == "max_tokens" and "outside 64 bits" in str(e.value)
    with pytest.raises(RequestError, match=r"^request body holds an integer of thousands of digits \(integers must "
                                           r"fit in 64 bits\)$"):  # Python's own message named sys.set_int_max_str_digits
        loads_body(b'{"max_tokens": ' + b"9" * 5000 + b"}")
    with pytest.raises(RequestError, match=r"'prompt\[2\]' is an integer outside 64 bits"):
        loads_body(b'{"prompt": [1, 2, -99999999999999999999]}')
    # 19 digits inside a string, and the largest unsigned 64-bit integer, are fine.
    body = loads_body(b'{"messages": [{"role": "user", "content": "call 1234567890123456789"}], "seed": 18446744073709551615}')
    assert body["seed"] == 2**64 - 1


def test_a_token_id_out_of_range_is_named():
    """helper-68: `{"prompt": [-1, 5]}` was told the prompt must be an array of token ids."""
    from mlxgw.protocol import RequestError, parse_openai

    with pytest.raises(RequestError, match=r"^'prompt' holds token id -1, outside the vocabulary$"):
        parse_openai({"prompt": [5, -1, 2**40]}, "text")
    with pytest.raises(RequestError, match=r"^'prompt' must be a non-empty string or array of token ids$"):
        parse_openai({"prompt": [5, "x"]}, "text")


def test_backend_takes_packed_ids_and_refuses_torn_ones(stack1):
    """The gateway's forward (msgpack, ids packed by schema.token_bytes) straight to a backend."""
    import json

    import msgpack

    from mlxgw import schema
    from mlxgw.protocol import INTERNAL_FIELD

    url = stack1.backends[0].url + "/v1/completions"
    ids = list(range(100, 300))
    mp = {"Content-Type": "application/x-msgpack"}

    def send(packed):
        body = {"model": "demo-tiny", "prompt": "x", "max_tokens": 1, INTERNAL_FIELD: {"prompt_ids": packed}}
        return post(url, msgpack.packb(body, use_bin_type=True), mp)

    status, _, raw = send(schema.token_bytes(ids))
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == len(ids)
    status, _, raw = send(schema.token_bytes(ids)[:-1])
    assert status == 400 and "multiple of 4 bytes" in json.loads(raw)["error"]["message"]


def test_a_top_k_over_the_vocabulary_samples_from_all_and_the_backend_lives(stack1):
    """helper-75: top_k at or above the vocabulary size (3072 here) with temperature > 0 raised
    inside mlx-lm's sampler, in the batch step: the engine thread died, the backend exited and
    the gateway's retry killed the next one. It means no top-k now, as in the real APIs."""
    from mlxgw.httpget import get_json

    before = get_json(stack1.backends[0].url + "/health")
    chat = {"model": "demo-tiny", "max_tokens": 3, "temperature": 1, "messages": [{"role": "user", "content": "hi"}]}
    for path, extra in (("/v1/chat/completions", {"top_k": 3072}), ("/v1/chat/completions", {"top_k": 10**6}),
                        ("/v1/chat/completions", {"top_k": -1}),  # vLLM's "no top-k" (helper-77: a 400)
                        ("/v1/completions", {"top_k": 3072, "prompt": "hi"}),
                        ("/v1/messages", {"top_k": 5000})):
        body = {**chat, **extra}
        if path == "/v1/completions":
            body.pop("messages")
        status, _, raw = post(stack1.gateway.url + path, body)
        assert status == 200, (path, raw)
        usage = json.loads(raw)["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) == 3, raw
    after = get_json(stack1.backends[0].url + "/health")
    assert after["status"] == "ok" and after["pid"] == before["pid"], after
    assert stack1.backends[0].proc.poll() is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("model", [5, ["demo-tiny"]])
def test_a_model_that_is_not_a_string_is_named_so(stack1, path, model):
    """helper-75: on /v1/messages (and /v1/responses) a number or a list read "'model' is
    required"; chat said "must be a string", which every dialect says now."""
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    status, _, raw = post(stack1.gateway.url + path, body)
    err = json.loads(raw)["error"]
    assert (status, err["message"]) == (400, "'model' must be a string"), raw


def test_an_anthropic_error_from_the_backend_carries_the_request_id(stack1):
    """helper-75: an Anthropic-shaped error the backend raised (a tool schema it cannot compile)
    had no request_id in its body, where the gateway's own errors have one, as Anthropic's do."""
    body = {"model": "demo-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "any"},
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}]}
    status, headers, raw = post(stack1.gateway.url + "/v1/messages", body)
    got = json.loads(raw)
    assert status == 400 and got["type"] == "error" and "cannot constrain" in got["error"]["message"], raw
    assert got["request_id"] == headers["request-id"] and len(got["request_id"]) == 32, (got, headers)


@pytest.mark.parametrize("raw", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nNot a header\r\n\r\n",  # a header line without a colon
    b"FOO BAR BAZ QUX\r\n\r\n",  # no request line
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",  # past aiohttp's 8190
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
])
def test_a_request_aiohttp_cannot_parse_gets_a_json_400(stack1, raw):
    """Requests aiohttp refuses before any handler got its text/plain 400 ("Bad Request\\n\\n...");
    now the OpenAI-style JSON error every other answer is, the connection closed as before."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(stack1.gateway.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(raw)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", got
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("malformed HTTP request: "), err
    status, _, _ = post(stack1.gateway.url + "/v1/chat/completions",
                        {"model": "demo-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    assert status == 200
