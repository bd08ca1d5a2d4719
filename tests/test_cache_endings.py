"""Rule 4 of docs/cache-policy.md: the prompt cache is saved on every way a
request ends after its prefill (SwiftLM issue 245 / PR 253), and the next
request of the conversation reuses it.

Real mlx-lm backend on the demo model. The demo model's weights are random,
so generation is steered with ``logit_bias`` (a real OpenAI field, applied by
mlx-lm's logits processors) to make each ending happen on purpose; expected
reuse is computed independently from the rendered token ids.
"""

import json
import socket
import time

import pytest

from mlxgw.httpget import get_json, post
from mlxgw.prompt import render_chat
from texts import words

THE = 269  # " the" in the demo tokenizer (checked below)


@pytest.fixture(scope="module")
def backend(redis_server, demo_model):
    from mlxgw.harness import Stack

    s = Stack(redis_server.url, demo_model)
    try:  # a failed start must not leave its process running
        b = s.add_backend("b0", None, "--request-timeout", "2")
        b.wait_healthy()
        yield b
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tok(demo_model):
    from gateway.tokenize import load_model_info

    t = load_model_info("demo-tiny", demo_model).tokenizer
    assert t.encode(" the", add_special_tokens=False) == [THE]
    return t


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_reuse(entry: list[int], prompt: list[int]) -> int:
    """What a trimmable entry gives a prompt: the common prefix, leaving one token to prefill."""
    return min(lcp(entry, prompt), len(prompt) - 1)


def chat(b, msgs, **kw):
    status, _, body = post(b.url + "/v1/chat/completions", {"messages": msgs, **kw})
    return status, json.loads(body)


def cached(out) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_idle(b, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if get_json(b.url + "/health")["active"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("backend still busy")


def entry_sizes(b) -> list[int]:
    return sorted(e["tokens"] for e in get_json(b.url + "/internal/cache")["entries"])


def entry_keys(b) -> set[tuple[int, int]]:
    """Each entry as (id, tokens): a save is told by a pair not seen before, not by its size
    (a full run found none: the saved entry's size was that of an older entry)."""
    return {(e["id"], e["tokens"]) for e in get_json(b.url + "/internal/cache")["entries"]}


def new_entry_size(b, before: set[tuple[int, int]], timeout: float = 10.0) -> int:
    """The token count of the one entry saved since ``before`` (`entry_keys`). Polled: the
    request's end and its save are a step or two apart in the engine, so an idle backend
    (`wait_idle`) may not have saved yet (a CI run on a loaded machine found none)."""
    deadline = time.time() + timeout
    while True:
        new = [n for k, n in entry_keys(b) - before]
        if new or time.time() > deadline:
            (saved,) = new
            return saved
        time.sleep(0.05)


def test_end_of_sequence(backend, tok):
    msgs = [{"role": "user", "content": words(60, seed=41)}]
    p1 = render_chat(tok, msgs).token_ids
    st, out = chat(backend, msgs, max_tokens=8, logit_bias={str(tok.eos_token_id): 100})
    assert st == 200 and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["message"]["content"] == ""
    assert len(p1) + 1 in entry_sizes(backend)  # prompt + the end-of-sequence token
    msgs2 = msgs + [{"role": "assistant", "content": ""}, {"role": "user", "content": "go on"}]
    p2 = render_chat(tok, msgs2).token_ids
    st, out = chat(backend, msgs2, max_tokens=2)
    assert cached(out) == expected_reuse(p1 + [tok.eos_token_id], p2) >= len(p1)


def test_max_tokens(backend, tok):
    msgs = [{"role": "user", "content": words(60, seed=42)}]
    p1 = render_chat(tok, msgs).token_ids
    st, out = chat(backend, msgs, max_tokens=4, logit_bias={str(THE): 100})
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    assert len(p1) + 4 in entry_sizes(backend)
    reply = out["choices"][0]["message"]["content"]
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    p2 = render_chat(tok, msgs2).token_ids
    st, out = chat(backend, msgs2, max_tokens=2)
    assert cached(out) == expected_reuse(p1 + [THE] * 4, p2) >= len(p1)


@pytest.mark.parametrize("stream", [False, True])
def test_text_stop_sequence(backend, tok, stream):
    msgs = [{"role": "user", "content": words(60, seed=43 + stream)}]
    p1 = render_chat(tok, msgs).token_ids
    before = entry_keys(backend)
    body = {"messages": msgs, "max_tokens": 50, "logit_bias": {str(THE): 100}, "stop": [" the the"], "stream": stream}
    status, _, raw = post(backend.url + "/v1/chat/completions", body)
    assert status == 200
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        reply = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        out = json.loads(raw)
        reply = out["choices"][0]["message"]["content"]
        assert out["choices"][0]["finish_reason"] == "stop"
    assert " the the" not in reply and reply.strip() == "the"
    wait_idle(backend)
    # The stop text is seen after the third token; the cancel reaches the
    # engine a step or two later, and the KV of every decoded token is kept.
    saved = new_entry_size(backend, before)
    k = saved - len(p1)
    assert 3 <= k <= 10
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    p2 = render_chat(tok, msgs2).token_ids
    st, out = chat(backend, msgs2, max_tokens=2)
    assert cached(out) == expected_reuse(p1 + [THE] * k, p2) >= len(p1)


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": ["src/a.py", "src/b.py"]}},
                   "required": ["path"], "additionalProperties": False}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_only_reply(backend, tok, stream):
    msgs = [{"role": "user", "content": words(60, seed=47 + stream)}]
    cp1 = render_chat(tok, msgs, TOOLS)
    p1 = cp1.token_ids
    before = entry_sizes(backend)
    body = {"messages": msgs, "tools": TOOLS, "max_tokens": 60, "stream": stream,
            "tool_choice": {"type": "function", "function": {"name": "read_file"}}}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, _, raw = post(backend.url + "/v1/chat/completions", body)
    assert status == 200
    if stream:
        events = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
        assert not any((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
        deltas = [tc for e in events if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls") or []]
        call = {"id": deltas[0]["id"], "type": "function",
                "function": {"name": deltas[0]["function"]["name"],
                             "arguments": "".join(d["function"].get("arguments") or "" for d in deltas)}}
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        out = json.loads(raw)
        assert not out["choices"][0]["message"].get("content")
        call = out["choices"][0]["message"]["tool_calls"][0]
        finish = [out["choices"][0]["finish_reason"]]
        usage = out["usage"]
    assert finish == ["tool_calls"] and call["function"]["name"] == "read_file"
    assert json.loads(call["function"]["arguments"])["path"] in ("src/a.py", "src/b.py")
    wait_idle(backend)
    after = entry_sizes(backend)
    assert cp1.system_tokens in after  # the tools block, saved as a system entry (the first time)
    (saved,) = [n for n in after if n not in before and n != cp1.system_tokens]
    assert saved == len(p1) + usage["completion_tokens"]  # the prompt and the whole call were kept
    msgs2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "print('hello')"}]
    p2 = render_chat(tok, msgs2, TOOLS).token_ids
    st, out = chat(backend, msgs2, tools=TOOLS, max_tokens=2)
    assert st == 200 and len(p1) <= cached(out) <= len(p2) - 1  # one token always prefilled (PR 625)


def _raw_stream(b, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", b.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_mid_prefill_finishes_and_saves_the_prompt(backend, tok):
    msgs = [{"role": "user", "content": words(3000, seed=44)}]
    p1 = render_chat(tok, msgs).token_ids
    assert len(p1) > 2000  # several 512-token prefill steps
    sock = _raw_stream(backend, {"messages": msgs, "max_tokens": 500, "stream": True})
    buf = b""
    while b": keepalive" not in buf:  # first prefill step done, prompt not finished
        buf += sock.recv(4096)
    assert b"data:" not in buf
    sock.close()
    wait_idle(backend)
    sizes = entry_sizes(backend)
    # The prefill ran to the end and was saved (at most the first token beyond it), not decoded further.
    assert any(len(p1) <= n <= len(p1) + 1 for n in sizes), (len(p1), sizes)
    st, out = chat(backend, msgs, max_tokens=1)  # the client's retry
    assert out["usage"]["prompt_tokens"] == len(p1) and cached(out) == len(p1) - 1


@pytest.mark.parametrize("stream", [False, True])
def test_server_timeout_saves(backend, tok, stream):
    msgs = [{"role": "user", "content": words(60, seed=45 + stream)}]
    p1 = render_chat(tok, msgs).token_ids
    body = {"messages": msgs, "max_tokens": 7000, "logit_bias": {str(THE): 100}, "stream": stream}
    before = entry_keys(backend)
    t0 = time.time()
    status, _, raw = post(backend.url + "/v1/chat/completions", body, timeout=30)
    elapsed = time.time() - t0
    assert 1.9 < elapsed < 6
    if stream:
        assert status == 200
        lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "timeout" and "timed out" in err["message"]
        reply = "".join(
            json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in lines[:-2]
        )
    else:  # its headers went out after a second (a newline each second since): the error body after them
        assert status == 200 and raw.startswith(b"\n")
        assert json.loads(raw)["error"]["code"] == "timeout"
        reply = None
    wait_idle(backend)
    saved = new_entry_size(backend, before)
    generated = saved - len(p1)
    assert generated > 10  # decoding ran until the timeout and its KV was kept
    if reply is not None:  # the client saw part of the answer and continues from it
        msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
        p2 = render_chat(tok, msgs2).token_ids
        st, out = chat(backend, msgs2, max_tokens=2)
        assert cached(out) == expected_reuse(p1 + [THE] * generated, p2) >= len(p1)
    else:  # the client retries the same request
        st, out = chat(backend, msgs, max_tokens=2)
        assert st == 200 and cached(out) == len(p1) - 1


def test_prefill_accounting(backend):
    """Every request above ran its whole prefill: computed = prompt - reused, exactly."""
    wait_idle(backend)
    h = get_json(backend.url + "/health")
    assert h["requests"] >= 10
    assert h["prefill_tokens"] == h["prompt_tokens"] - h["cached_tokens"] > 0
