"""Backend and Redis failures degrade service; they never lose a request."""

import json
import signal
import time

import openai

from mlxgw.harness import RedisServer, Stack
from mlxgw.httpget import get_json, post
from texts import words


def _ask(url, text, **kw):
    return post(url + "/v1/chat/completions",
                {"model": "demo-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **kw})


def test_killed_idle_backend_no_client_error(make_stack):
    s = make_stack()
    b0, b1 = s.add_backend("b0"), s.add_backend("b1")
    s.add_gateway()
    s.wait()
    text = words(200, seed=31)
    status, h, _ = _ask(s.gateway.url, text)
    owner = h["X-Mlxgw-Backend"]
    victim = b0 if owner == "b0" else b1
    victim.kill()  # SIGKILL while idle; its registry record is still live for up to 2 s
    for i in range(4):
        status, h, body = _ask(s.gateway.url, text + f" {i}")
        assert status == 200, body
        assert h["X-Mlxgw-Backend"] != owner


def test_backend_killed_mid_stream_gives_sse_error(make_stack):
    s = make_stack()
    b0 = s.add_backend("b0")
    s.add_gateway()
    s.wait()
    client = openai.OpenAI(base_url=s.gateway.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "go"}],
                                            max_tokens=4000, stream=True)
    got_error = None
    n = 0
    try:
        for chunk in stream:
            n += 1
            if n == 2:
                b0.kill()
    except openai.APIError as e:  # the SDK raises on an SSE error event
        got_error = e
    assert n >= 2 and got_error is not None and "backend failed" in str(got_error)


def test_redis_outage_and_flush_recovery(demo_model):
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        s.add_backend("b0")
        s.add_gateway()
        s.wait()
        text = words(200, seed=41)
        assert _ask(s.gateway.url, text)[0] == 200
        r.stop()
        status, h, _ = _ask(s.gateway.url, text + " more")
        assert status == 200 and h["X-Mlxgw-Lookup"] == "error"
        assert get_json(s.gateway.url + "/health")["degraded"] is True
        r.proc = None
        r.start()  # same port, empty: like a restart without persistence
        deadline = time.time() + 10
        h = {}
        while time.time() < deadline:
            status, h, _ = _ask(s.gateway.url, text + " again")
            if h.get("X-Mlxgw-Lookup") == "ok" and int(h["X-Mlxgw-Matched-Tokens"]) > 0:
                break
            time.sleep(0.3)
        assert h["X-Mlxgw-Lookup"] == "ok" and int(h["X-Mlxgw-Matched-Tokens"]) >= 150
        # FLUSHALL: the backend notices its record is gone and re-publishes.
        r.client().flushall()
        deadline = time.time() + 10
        while time.time() < deadline:
            status, h, _ = _ask(s.gateway.url, text + " again")
            if int(h.get("X-Mlxgw-Matched-Tokens", 0)) >= 150:
                break
            time.sleep(0.3)
        assert int(h["X-Mlxgw-Matched-Tokens"]) >= 150
    finally:
        s.stop()
        r.cleanup()
