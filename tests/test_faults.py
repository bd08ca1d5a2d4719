"""A backend that dies, hangs or fails a batch: its requests are retried elsewhere or end in a clear error; none is lost."""

import json
import signal
import time
from pathlib import Path

import openai
import pytest

from mlxgw.httpget import get_json, post
from chat import ask as _ask
from texts import words


def _busy(b) -> bool:
    return (get_json(b.url + "/health") or {}).get("active", 0) > 0


def _open_stream(url, path, body):
    """POST a streamed request; return (connection, response) once its headers came."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _sse_events(raw: bytes) -> list:
    """The data events of an SSE body, parsed ("[DONE]" as is), comments left out."""
    out = []
    for ev in raw.decode().split("\n\n"):
        data = "\n".join(ln[5:].lstrip() for ln in ev.split("\n") if ln.startswith("data:"))
        if data:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


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
    assert get_json(s.gateway.url + "/health")["circuit_open"] == [owner]
    # Once its record has expired, the dead backend's circuit goes too (it used to stay
    # open, and probed, for good; a backend back under the same id at another URL was
    # then skipped for good).
    deadline = time.time() + 20
    while get_json(s.gateway.url + "/health")["circuit_open"] and time.time() < deadline:
        time.sleep(0.2)
    health = get_json(s.gateway.url + "/health")
    survivor = b1 if victim is b0 else b0
    assert health["circuit_open"] == [] and health["backends"]["demo-tiny"] == [survivor.name]
    # The operator hears of it once (the gateway said nothing before).
    log = s.gateway.log_path.read_text()
    assert log.count(f"backend {owner} (demo-tiny) left the registry") == 1, log[-2000:]
    # Its per-backend series leaves /metrics (it stayed at 0 for good); the survivor's stays.
    import urllib.request

    metrics = urllib.request.urlopen(s.gateway.url + "/metrics", timeout=5).read().decode()
    running = [ln.split()[0] for ln in metrics.splitlines() if ln.startswith("mlxgw:gateway_num_requests_running{")]
    assert running == [f'mlxgw:gateway_num_requests_running{{backend="{survivor.name}"}}'], running
    # Its `backend_up` stays, at 0, so an alert on `== 0` fires (it vanished with the record).
    up = sorted(ln for ln in metrics.splitlines() if ln.startswith("mlxgw:backend_up{"))
    assert up == sorted([f'mlxgw:backend_up{{backend="{owner}",model_name="demo-tiny"}} 0.0',
                         f'mlxgw:backend_up{{backend="{survivor.name}",model_name="demo-tiny"}} 1.0']), up


def test_dead_only_backend_gives_a_clear_503_and_one_warning(make_stack):
    """While a dead backend is still registered: a 503 the client can act on (Retry-After, the
    backend's id but not its internal address), and one warning in the gateway log, not one per
    request (the circuit is open after the first)."""
    s = make_stack()
    b0 = s.add_backend("b0")
    s.add_gateway()
    s.wait()
    assert _ask(s.gateway.url, "hi")[0] == 200
    b0.kill()
    answers = [_ask(s.gateway.url, f"hi {i}") for i in range(3)]  # its record lives up to 2 s more
    status, h, body = answers[0]
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == "backend_unavailable" and h["Retry-After"] == "1", (status, h, body)
    assert "b0" in err["message"] and str(b0.port) not in err["message"] and "127.0.0.1" not in err["message"]
    assert all(st == 503 for st, _, _ in answers)
    # In words, not aiohttp's class names (helper-66: "b0: ServerDisconnectedError")
    last = json.loads(answers[-1][2])["error"]["message"]
    assert last == ("no backend could take the request: b0: no connection at its registered URL (not listening "
                    "there: stopped, restarting, or a wrong --url)"), last
    assert "Error" not in err["message"], err
    log = s.gateway.log_path.read_text()
    warnings = [ln for ln in log.splitlines() if "unavailable before first byte" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and str(b0.port) in warnings[0], warnings


def test_health_is_not_ok_while_every_listed_backend_is_failing(make_stack):
    """helper-67: a killed backend with a long TTL stayed listed, and the gateway's /health
    answered 200 "ok" while every request got a 503: a load balancer kept sending it traffic."""
    from mlxgw.httpget import get_status

    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--heartbeat-ttl", "60")
    s.add_gateway()
    s.wait()
    assert get_json(s.gateway.url + "/health")["status"] == "ok"
    b0.kill()
    assert _ask(s.gateway.url, "hi")[0] == 503
    h = get_json(s.gateway.url + "/health")
    assert get_status(s.gateway.url + "/health") == 503 and h["status"] == "backends_failing", h
    assert h["backends"] == {"demo-tiny": ["b0"]} and h["circuit_open"] == ["b0"], h
    s.backends.remove(b0)


def test_backend_killed_mid_stream_gives_sse_error(make_stack):
    s = make_stack()
    b0 = s.add_backend("b0")
    s.add_gateway()
    s.wait()
    client = openai.OpenAI(base_url=s.gateway.url + "/v1", api_key="x", max_retries=0)
    errors = get_json(s.gateway.url + "/health")["errors"]
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
    assert n >= 2 and got_error is not None
    assert "backend b0 failed mid-stream: its connection closed before the answer ended" in str(got_error)
    # A 200 whose stream ended in an error is an error in the counts and the log line.
    assert get_json(s.gateway.url + "/health")["errors"] == errors + 1
    deadline = time.time() + 5
    while "outcome=backend_failed" not in s.gateway.log_path.read_text() and time.time() < deadline:
        time.sleep(0.1)
    assert "outcome=backend_failed" in s.gateway.log_path.read_text()


def test_tries_that_reach_no_backend_do_not_use_up_the_retries(make_stack):
    """helper-68: four backends registered at URLs nothing listened on took every try (1 +
    --max-retries), and the first requests got a 503 beside two idle backends. A refused
    connection reached no backend: the next one is tried without counting it."""
    from mlxgw.harness import free_port

    s = make_stack()
    good = s.add_backend("good", None, "--engine", "sim")
    # More free cache: ranked before the good one at equal load (gateway.route's tie-break).
    dead = [s.add_backend(f"dead{i}", None, "--engine", "sim", "--cache-bytes", "1TB",
                          "--url", f"http://127.0.0.1:{free_port()}") for i in range(3)]
    g = s.add_gateway("--max-retries", "1")
    s.wait()
    status, h, body = _ask(g.url, "hi")
    assert status == 200 and h["X-Mlxgw-Backend"] == good.name and h["X-Mlxgw-Route-Reason"] == "retry", body
    assert h["X-Mlxgw-Candidates"].split()[-1].startswith(f"{good.name}:"), h["X-Mlxgw-Candidates"]
    assert sorted(get_json(g.url + "/health")["circuit_open"]) == [d.name for d in dead]
    # With --max-retries 0, every listed backend is still tried when none could be connected to.
    s2 = make_stack()
    for i in range(2):
        s2.add_backend(f"d{i}", None, "--engine", "sim", "--url", f"http://127.0.0.1:{free_port()}")
    g2 = s2.add_gateway("--max-retries", "0")
    s2.wait()
    status, _, body = _ask(g2.url, "hi")
    msg = json.loads(body)["error"]["message"]
    assert status == 503 and msg.count("no connection at its registered URL") == 2, msg


def test_backend_killed_before_first_byte_is_retried(make_stack):
    import threading

    s = make_stack()
    b0, b1 = s.add_backend("b0"), s.add_backend("b1")
    s.add_gateway()
    s.wait()
    out = {}

    def call():  # non-streaming: nothing reaches the client before the answer is complete
        out["r"] = _ask(s.gateway.url, words(3500, seed=52), max_tokens=4)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.time() + 20
    victim = None
    while victim is None and time.time() < deadline:  # the chosen backend is prefilling
        victim = next((b for b in (b0, b1) if _busy(b)), None)
        time.sleep(0.02)
    assert victim is not None
    victim.kill()
    t.join(60)
    status, h, body = out["r"]
    assert status == 200, body
    assert h["X-Mlxgw-Backend"] != victim.name and h["X-Mlxgw-Route-Reason"] == "retry"
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    health = get_json(s.gateway.url + "/health")
    # The claim named the killed first choice: dropped at once, not kept for its 1 s grace.
    assert health["retries"] >= 1 and health["pending_claims"] == 0, health


def test_hung_backend_times_out_then_circuit_breaker(make_stack):
    s = make_stack()
    # Long heartbeat TTL: the stopped backend stays in the registry, so only
    # the gateway's own circuit breaker can keep requests away from it.
    b0 = s.add_backend("b0", None, "--heartbeat-ttl", "60")
    b1 = s.add_backend("b1", None, "--heartbeat-ttl", "60")
    s.add_gateway("--read-timeout", "2")
    s.wait()
    text = words(300, seed=53)
    owner_name = _ask(s.gateway.url, text)[1]["X-Mlxgw-Backend"]
    owner, other = (b0, b1) if owner_name == "b0" else (b1, b0)
    # A second prompt cached on the owner alone (sent to it directly), for the last check.
    only_owner = words(300, seed=56)
    assert _ask(owner.url, only_owner)[0] == 200
    # And a text prompt (no chat template, so no first block shared with the other backend's
    # prompts) for the request that finds the owner's circuit open.
    skipped = {"model": "demo-tiny", "prompt": words(300, seed=58), "max_tokens": 1}
    assert post(owner.url + "/v1/completions", skipped)[0] == 200
    owner.signal(signal.SIGSTOP)
    try:
        t0 = time.time()
        status, h, body = _ask(s.gateway.url, text + " more")  # its prefix lives on the hung backend
        took = time.time() - t0
        assert status == 200 and h["X-Mlxgw-Backend"] == other.name, body
        assert 1.9 < took < 8, took
        assert get_json(s.gateway.url + "/health")["circuit_open"] == [owner.name]
        t0 = time.time()
        status, h, _ = _ask(s.gateway.url, text + " again")  # skipped at once while the circuit is open
        assert status == 200 and h["X-Mlxgw-Backend"] == other.name and time.time() - t0 < 1.9, (status, h, time.time() - t0)
        # The owner's prefix ranked it first, but its circuit is open: the reason given is the
        # chosen backend's own (it said "prefix" beside 0 matched tokens: helper-46).
        status, h, _ = post(s.gateway.url + "/v1/completions", {**skipped, "prompt": skipped["prompt"] + " again"})
        assert status == 200 and h["X-Mlxgw-Backend"] == other.name, (status, h)
        assert (h["X-Mlxgw-Matched-Tokens"], h["X-Mlxgw-Route-Reason"]) == ("0", "load"), h
        other.signal(signal.SIGSTOP)  # every backend hung: a clear 504 within the configured time
        t0 = time.time()
        status, h, body = _ask(s.gateway.url, words(50, seed=54))
        assert status == 504 and json.loads(body)["error"]["code"] == "backend_timeout", (status, body)
        assert time.time() - t0 < 2 * 2 + 3, time.time() - t0
    finally:
        owner.signal(signal.SIGCONT)
        other.signal(signal.SIGCONT)
    deadline = time.time() + 10
    while get_json(s.gateway.url + "/health")["circuit_open"] and time.time() < deadline:
        time.sleep(0.2)
    assert get_json(s.gateway.url + "/health")["circuit_open"] == []
    # Back in service: a prefix only the owner holds goes to it again. (Not `text + " more"`:
    # the other backend answered that one, and the owner holds it too only if it happened to
    # run the request that timed out on it after it resumed, which it may or may not do.)
    _, h, _ = _ask(s.gateway.url, only_owner + " more")
    assert h["X-Mlxgw-Backend"] == owner.name, h


def test_hung_backend_out_of_the_registry_is_given_up(make_stack):
    """A backend that hangs (SIGSTOP: its sockets stay open) leaves the registry within its
    heartbeat TTL; its requests then move on instead of waiting for --read-timeout (300 s):
    a request waiting for its answer goes to the other backend, a stream it began ends with
    the error event. (Both waited the full 300 s before.)"""
    import threading

    s = make_stack()
    b0, b1 = s.add_backend("b0"), s.add_backend("b1")
    s.add_gateway("--gone-after", "1", "--keepalive", "1")
    s.wait()
    text = words(1500, seed=57)  # a long prefix: the next turns go to its owner
    status, h, _ = _ask(s.gateway.url, text)
    owner, other = (b0, b1) if h["X-Mlxgw-Backend"] == "b0" else (b1, b0)
    client = openai.OpenAI(base_url=s.gateway.url + "/v1", api_key="x", max_retries=0)
    out = {}

    def stream():
        n = 0
        try:
            for _ in client.chat.completions.create(model="demo-tiny", max_tokens=4000, stream=True,
                                                    messages=[{"role": "user", "content": text + " on"}]):
                n += 1
                if n == 2:
                    out["stopped"] = time.time()
                    owner.signal(signal.SIGSTOP)
        except openai.APIError as e:
            out["error"], out["error_at"] = e, time.time()
        out["chunks"] = n

    retries = get_json(s.gateway.url + "/health")["retries"]
    t = threading.Thread(target=stream)
    t.start()
    try:
        deadline = time.time() + 30
        while "stopped" not in out and time.time() < deadline:
            time.sleep(0.05)
        assert "stopped" in out, out
        t0 = time.time()
        status, h, body = _ask(s.gateway.url, text + " more")  # routed to the owner, still registered
        took = time.time() - t0
        t.join(30)
    finally:
        owner.signal(signal.SIGCONT)
    assert status == 200 and h["X-Mlxgw-Backend"] == other.name and h["X-Mlxgw-Route-Reason"] == "retry", h
    assert took < 15, took  # heartbeat TTL 5 s + 1 s + registry refresh, not 300 s
    assert get_json(s.gateway.url + "/health")["retries"] == retries + 1
    assert "out of the registry for 1 s" in s.gateway.log_path.read_text()
    assert "error" in out and f"backend {owner.name} failed mid-stream: it stopped heartbeating while silent" in str(
        out["error"]), out
    assert out["error_at"] - out["stopped"] < 15, out
    assert out["chunks"] >= 2


def test_client_disconnect_cancels_upstream_and_saves(make_stack):
    import socket

    s = make_stack()
    b0 = s.add_backend("b0")
    s.add_gateway()
    s.wait()
    msgs = [{"role": "user", "content": words(100, seed=55)}]
    data = json.dumps({"messages": msgs, "max_tokens": 4000, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", s.gateway.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        buf = b""
        while buf.count(b"data:") < 3:
            buf += sock.recv(4096)
    t0 = time.time()
    while _busy(b0) and time.time() - t0 < 5:
        time.sleep(0.02)
    assert not _busy(b0) and time.time() - t0 < 2  # cancelled promptly, not run to 4000 tokens
    h = get_json(b0.url + "/health")
    assert 3 <= h["generated_tokens"] < 1000
    entries = get_json(b0.url + "/internal/cache")["entries"]
    assert len(entries) == 1 and entries[0]["tokens"] > h["prompt_tokens"]  # prompt + what was generated
    status, hh, body = _ask(s.gateway.url, msgs[0]["content"])  # the retry reuses the saved prompt
    assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == h["prompt_tokens"] - 1


def test_a_backend_whose_engine_thread_died_withdraws_and_exits(make_stack):
    """helper-56: a backend whose engine thread died stayed registered, answering every request
    with an error, so each one routed there cost the gateway a retry. It now withdraws from
    Redis and exits (code 5), for `mlxgw serve` to restart it; the gateway routes elsewhere.
    One failed batch step ends only the requests in that batch (helper-75: a request's own
    input took the backend and its prompt cache down); the second in a row ends the engine."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--sim-fail-after", "1")
    s.add_backend("b1", None, "--engine", "sim")
    s.add_gateway()
    s.wait()
    status, _, body = post(b0.url + "/v1/completions", {"prompt": [5, 6, 7] * 30, "max_tokens": 2}, timeout=10)
    assert status == 200, body  # b0's first request is served; every step past it fails (--sim-fail-after)
    status, _, body = post(b0.url + "/v1/completions", {"prompt": [5, 6, 8], "max_tokens": 2}, timeout=10)
    assert status >= 500 and b"Traceback" not in body, body
    assert json.loads(body)["error"]["message"].startswith("the batch this request ran in failed (RuntimeError: "
                                                           "simulated engine failure"), body
    health = get_json(b0.url + "/health")  # still up, its prompt cache kept
    assert b0.proc.poll() is None and (health["batch_failures"], health["cache_entries"]) == (1, 1), health
    assert "a batch step failed (RuntimeError: simulated engine failure" in b0.log_path.read_text()
    status, _, body = post(b0.url + "/v1/completions", {"prompt": [5, 6, 9], "max_tokens": 2}, timeout=10)
    assert status >= 500 and b"Traceback" not in body, body  # a second failed step in a row: the engine
    assert b0.proc.wait(20) == 5
    log = b0.log_path.read_text()
    assert "engine thread died" in log and "withdrawing from Redis and exiting with code 5" in log, log[-2000:]
    deadline = time.time() + 10
    while get_json(s.gateway.url + "/health")["backends"].get("demo-tiny") != ["b1"] and time.time() < deadline:
        time.sleep(0.2)
    assert get_json(s.gateway.url + "/health")["backends"]["demo-tiny"] == ["b1"]
    for i in range(3):
        status, h, body = _ask(s.gateway.url, words(50, seed=70 + i))
        assert status == 200 and h["X-Mlxgw-Backend"] == "b1", body


def test_a_failed_batch_step_ends_its_requests_and_the_real_engine_goes_on(demo_model):
    """The real mlx-lm engine, driven directly (the server no longer passes such a top_k, and
    nothing else known fails a step): a request whose sampler raises inside the batch step
    (mlx-lm refuses a top_k of the vocabulary's size there) is ended with an error, the engine
    starts a new batch and serves the next request from the prompt cache the first one left."""
    import asyncio

    from backend.cache import PromptCache
    from backend.engine import GenParams, GenRequest, MLXEngine

    cache = PromptCache(max_entries=8, max_bytes=2**30, layout="shared", share_min_tokens=16, min_hit_tokens=32)
    eng = MLXEngine(str(demo_model), cache, 2**30)
    eng.start()
    assert eng.wait_ready(120) and eng.load_error is None

    async def ask(rid, prompt, **params):
        req = GenRequest(rid=rid, prompt=prompt, params=GenParams(max_tokens=4, **params),
                         loop=asyncio.get_running_loop(), events=asyncio.Queue())
        eng.submit(req)
        while True:
            ev = await asyncio.wait_for(req.events.get(), 60)
            if ev.kind == "end":
                return ev, req

    async def main():
        first = await ask("a", list(range(100, 180)))
        bad = await ask("b", list(range(200, 280)), temperature=1.0, top_k=10**6)
        again = await ask("c", list(range(100, 180)) + [5])
        return first, bad, again

    try:
        (first, _), (bad, _), (again, req) = asyncio.run(main())
    finally:
        eng.stop()
    assert first.finish_reason == "length"
    assert bad.finish_reason == "error" and bad.error.startswith(
        "the batch this request ran in failed (ValueError: `top_k` has to be an integer"), bad
    assert (again.finish_reason, req.cached) == ("length", 80)
    assert (eng.batch_failures, eng.failed, eng.active, eng.queued_prefill_tokens) == (1, False, 0, 0)


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_stream_whose_backend_dies_before_its_first_token_is_retried(make_stack, dialect):
    """helper-63: a streamed request whose backend died during its prefill ended in an error
    event, though the client had had only headers and keep-alive comments. The next backend now
    answers it on the same stream: the whole answer, no error, one retry, and the request log
    names the backend that answered."""
    s = make_stack()
    slow = ("--engine", "sim", "--sim-prefill-rate", "300")  # a 600-word prompt: ~2-3 s of prefill
    b0, b1 = s.add_backend("b0", None, *slow), s.add_backend("b1", None, *slow)
    s.add_gateway("--keepalive", "0.5")
    s.wait()
    retries = get_json(s.gateway.url + "/health")["retries"]
    text = words(600, seed=91 if dialect == "openai" else 92)
    if dialect == "openai":
        path, body = "/v1/chat/completions", {"model": "demo-tiny", "stream": True, "max_tokens": 5,
                                              "messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/messages", {"model": "demo-tiny", "stream": True, "max_tokens": 5,
                                      "messages": [{"role": "user", "content": text}]}
    conn, resp = _open_stream(s.gateway.url, path, body)
    assert resp.status == 200
    first = resp.getheader("X-Mlxgw-Backend")
    victim, other = (b0, b1) if first == "b0" else (b1, b0)
    victim.kill()  # during its prefill: no data event has gone out
    raw = resp.read()
    conn.close()
    events = _sse_events(raw)
    assert not [e for e in events if isinstance(e, dict) and ("error" in e or e.get("type") == "error")], raw[-600:]
    if dialect == "openai":
        assert events[-1] == "[DONE]", raw[-300:]
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    else:
        kinds = [e["type"] for e in events]
        assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds
        assert "content_block_delta" in kinds, kinds
        stop = next(e for e in events if e["type"] == "message_delta")
        assert stop["delta"]["stop_reason"] == "max_tokens" and stop["usage"]["output_tokens"] == 5, stop
    assert get_json(s.gateway.url + "/health")["retries"] == retries + 1
    deadline = time.time() + 5
    line = ""
    while not line and time.time() < deadline:
        line = next((ln for ln in s.gateway.log_path.read_text().splitlines() if "mlxgw.requests" in ln
                     and "outcome=" in ln and "retries=1" in ln), "")
        time.sleep(0.1)
    assert f"backend={other.name}" in line and "outcome=ok" in line, line
    assert f"after {victim.name} failed before its first token" in s.gateway.log_path.read_text()


def test_stream_whose_only_backend_dies_before_its_first_token_ends_in_an_error_event(make_stack):
    """With no backend left to retry on, the stream whose headers went out ends with the error
    event and [DONE] (not a hang, not a cut connection)."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--sim-prefill-rate", "300")
    s.add_gateway("--keepalive", "0.5")
    s.wait()
    conn, resp = _open_stream(s.gateway.url, "/v1/chat/completions", {
        "model": "demo-tiny", "stream": True, "max_tokens": 5,
        "messages": [{"role": "user", "content": words(600, seed=93)}]})
    assert resp.status == 200 and resp.getheader("X-Mlxgw-Backend") == "b0"
    b0.kill()
    events = _sse_events(resp.read())
    conn.close()
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "backend_failed", events
    assert events[-2]["error"]["message"].startswith("backend b0 failed before its first token: its connection closed")
    assert len(events) == 2, events  # no data event before it


def test_stream_retried_on_a_backend_that_refuses_it_gets_that_refusal_as_its_error_event(make_stack, tmp_path):
    """The retry of a stream whose headers went out can be refused whole (a 4xx JSON answer:
    here the next backend's model has a shorter context): the open stream carries that error
    as its event, then [DONE]."""
    s = make_stack()
    short = tmp_path / "short-context"  # the demo model, its context cut to 300 tokens
    short.mkdir()
    for f in Path(s.model_path).iterdir():
        if f.name != "config.json":
            (short / f.name).symlink_to(f.resolve())
    cfg = json.loads((Path(s.model_path) / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 300}))
    slow = ("--engine", "sim", "--sim-prefill-rate", "300")
    b0 = s.add_backend("b0", None, *slow)
    s.add_gateway("--keepalive", "0.5")
    s.wait()
    text = words(600, seed=94)
    # b0 holds the prompt's first 200 words, so the long prompt goes there first.
    status, _, body = post(b0.url + "/v1/chat/completions", {"model": "demo-tiny", "max_tokens": 1,
                           "messages": [{"role": "user", "content": " ".join(text.split()[:200])}]})
    assert status == 200, body
    b1 = s.add_backend("b1", None, *slow, start=False)
    b1.cmd[b1.cmd.index("--model") + 1] = str(short)
    b1.start(s.env())
    s.wait()
    conn, resp = _open_stream(s.gateway.url, "/v1/chat/completions", {
        "model": "demo-tiny", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": text}]})
    assert resp.status == 200 and resp.getheader("X-Mlxgw-Backend") == "b0", resp.getheaders()
    b0.kill()
    events = _sse_events(resp.read())
    conn.close()
    assert events[-1] == "[DONE]" and len(events) == 2, events
    assert events[0]["error"]["code"] == "context_length_exceeded", events
    assert events[0]["error"]["message"].startswith("This model's maximum context length is 300 tokens. "), events


def test_a_responses_stream_whose_backend_fails_ends_with_response_failed(make_stack):
    """The Responses dialect's stream ended a backend failure with a bare `error` event, on which
    the openai SDK does not raise: a client waiting for the terminal event took a cut answer for
    a finished one (helper-64). It now ends with `response.failed` (status failed, the error)."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--sim-prefill-rate", "300")
    s.add_gateway("--keepalive", "0.5")
    s.wait()
    conn, resp = _open_stream(s.gateway.url, "/v1/responses", {
        "model": "demo-tiny", "stream": True, "max_output_tokens": 5, "input": words(600, seed=95)})
    assert resp.status == 200
    b0.kill()
    events = _sse_events(resp.read())
    conn.close()
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"], kinds
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "backend_failed", failed
    assert failed["error"]["message"].startswith("backend b0 failed before its first token"), failed


def test_a_stopping_gateway_ends_streams_that_outlast_its_drain_with_an_error_event(make_stack):
    """helper-64: Ctrl-C on `mlxgw serve` cut a long stream bare (a payload error in the client,
    no [DONE], no request log line). The gateway now gives answers in flight --drain-seconds,
    then ends the streams still running with an error event naming the stop, and logs them.
    A whole (non-streamed) answer still running gets a 503 `gateway_stopping` at the drain's
    end; it got a closed connection a second later (aiohttp's cancel)."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlsplit

    s = make_stack()
    s.add_backend("b0", None, "--engine", "sim", "--sim-decode-rate", "10")  # 200 tokens: ~20 s
    g = s.add_gateway("--drain-seconds", "1.5")
    s.wait()

    def whole():
        u = urlsplit(g.url)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps({
            "model": "demo-tiny", "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on, whole"}]}), {"Content-Type": "application/json"})
        r = c.getresponse()
        out = (r.status, r.getheader("Retry-After"), json.loads(r.read()), time.time(), r.getheader("X-Mlxgw-Backend"))
        c.close()
        return out

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(whole)
        conn, resp = _open_stream(g.url, "/v1/chat/completions", {
            "model": "demo-tiny", "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on"}]})
        assert resp.status == 200
        head = resp.readline() + resp.readline()  # the first event is here: decoding
        deadline = time.time() + 10
        while get_json(s.backends[0].url + "/health").get("active", 0) < 2 and time.time() < deadline:
            time.sleep(0.05)  # both answers are being generated
        t0 = time.time()
        g.signal(signal.SIGTERM)
        raw = head + resp.read()
        took = time.time() - t0
        conn.close()
        status, retry_after, body, at, backend = pending.result(timeout=30)
    events = _sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "gateway_stopping", events[-3:]
    assert "the gateway is stopping and the answer outlasted its 1.5-s drain" in events[-2]["error"]["message"]
    assert 1.0 < took < 6, took
    assert sum(1 for e in events[:-2] if e["choices"][0]["delta"].get("content")) >= 2  # it kept streaming meanwhile
    # the backend that was computing it is named, as in the message (helper-70: no X-Mlxgw-Backend)
    assert (status, retry_after, body["error"]["code"], backend) == (503, "1", "gateway_stopping", "b0"), (status, body)
    assert body["error"]["message"].startswith(
        "the gateway is stopping and the answer from backend b0 outlasted its 1.5-s drain; send it again"), body
    assert 1.0 < at - t0 < 6, at - t0
    assert g.proc.wait(20) == 0
    assert g.log_path.read_text().count("outcome=gateway_stopping") == 2
    s.gateways.remove(g)


def test_a_stream_whose_retry_fails_too_names_both_failures(make_stack):
    """Both backends gone during a stream's prefill: the error event named only the first
    failure, though the retry's was the last word (helper-64)."""
    s = make_stack()
    slow = ("--engine", "sim", "--sim-prefill-rate", "300")
    b0, b1 = s.add_backend("b0", None, *slow), s.add_backend("b1", None, *slow)
    s.add_gateway("--keepalive", "0.5")
    s.wait()
    conn, resp = _open_stream(s.gateway.url, "/v1/chat/completions", {
        "model": "demo-tiny", "stream": True, "max_tokens": 5,
        "messages": [{"role": "user", "content": words(600, seed=96)}]})
    first = resp.getheader("X-Mlxgw-Backend")
    other = b1 if first == "b0" else b0
    other.kill()
    other.proc.wait(10)
    (b0 if first == "b0" else b1).kill()
    events = _sse_events(resp.read())
    conn.close()
    msg = events[-2]["error"]["message"]
    assert msg.startswith(f"backend {first} failed before its first token: its connection closed") and \
        f"; the retry failed too ({other.name}: " in msg, msg


def test_a_request_two_backends_died_serving_is_not_sent_to_a_third(make_stack):
    """A request that crashes backends (one that runs them out of memory, say) would take every
    one down in turn through the retries (helper-64's concern): after two backends failed while
    serving it, the gateway gives up and says why; the third never sees it."""
    s = make_stack()
    slow = ("--engine", "sim", "--sim-prefill-rate", "300")
    bs = [s.add_backend(f"b{i}", None, *slow) for i in range(3)]
    s.add_gateway("--keepalive", "0.5", "--max-retries", "2")
    s.wait()
    before = {b.name: get_json(b.url + "/health")["requests"] for b in bs}
    conn, resp = _open_stream(s.gateway.url, "/v1/chat/completions", {
        "model": "demo-tiny", "stream": True, "max_tokens": 5,
        "messages": [{"role": "user", "content": words(600, seed=97)}]})
    first = next(b for b in bs if b.name == resp.getheader("X-Mlxgw-Backend"))
    first.kill()
    rest = [b for b in bs if b is not first]
    deadline, second = time.time() + 20, None
    while second is None and time.time() < deadline:  # the retry reaches one of the others
        second = next((b for b in rest if get_json(b.url + "/health")["requests"] > before[b.name]), None)
        time.sleep(0.05)
    assert second is not None
    second.kill()
    events = _sse_events(resp.read())
    conn.close()
    third = next(b for b in rest if b is not second)
    msg = events[-2]["error"]["message"]
    assert "2 backends failed while serving this request, so it was not sent to more" in msg, msg
    assert get_json(third.url + "/health")["requests"] == before[third.name]


def test_a_whole_answer_two_backends_died_computing_is_not_sent_to_a_third(make_stack):
    """The same for a non-streamed request: its backends died in its prefill, with nothing sent
    back yet, and it was retried on every backend (their closed connections could not be told
    from a pooled one of a backend killed while idle). A connection that closes after the
    backend had the request for a second counts (`gateway.proxy.TOOK_IT_AFTER`)."""
    from concurrent.futures import ThreadPoolExecutor

    s = make_stack()
    slow = ("--engine", "sim", "--sim-prefill-rate", "200")  # ~4 s of prefill
    bs = [s.add_backend(f"b{i}", None, *slow) for i in range(3)]
    s.add_gateway("--max-retries", "2")
    s.wait()
    before = {b.name: get_json(b.url + "/health")["requests"] for b in bs}

    def busy(among):  # the backend that took the request, once it has
        deadline = time.time() + 20
        while time.time() < deadline:
            for b in among:
                if get_json(b.url + "/health")["requests"] > before[b.name]:
                    return b
            time.sleep(0.05)
        raise AssertionError("no backend took the request")

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, s.gateway.url + "/v1/chat/completions", {
            "model": "demo-tiny", "max_tokens": 5, "messages": [{"role": "user", "content": words(600, seed=98)}]})
        first = busy(bs)
        time.sleep(1.5)
        first.kill()
        rest = [b for b in bs if b is not first]
        second = busy(rest)
        time.sleep(1.5)
        second.kill()
        status, _, body = pending.result(timeout=60)
    third = next(b for b in rest if b is not second)
    msg = json.loads(body)["error"]["message"]
    assert status == 503 and "2 backends failed while serving this request, so it was not sent to more" in msg, msg
    assert msg.startswith(f"no backend could take the request: {first.name}: its connection closed before it "
                          f"answered (the process stopped or restarted); {second.name}: "), msg
    assert get_json(third.url + "/health")["requests"] == before[third.name]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
def test_an_engine_failure_mid_stream_ends_the_clients_stream_as_a_failure(make_stack, path):
    """helper-75: a backend whose engine failed mid-stream (the batch step raised) wrote an error
    event and ended its stream cleanly, so the gateway's Anthropic stream went on to `end_turn`
    and `message_stop`, the Responses one to `response.completed` after `response.failed`, and
    the request was logged and counted `ok`. The stream is cut as a killed backend's is now:
    the client's stream ends at the gateway's backend_failed event, logged so. The backend
    itself goes on (one failed batch step)."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--sim-fail-after", "1")
    s.add_gateway()
    s.wait()
    msgs = [{"role": "user", "content": words(50, seed=96)}]
    body = {"/v1/messages": {"messages": msgs, "max_tokens": 4000},
            "/v1/responses": {"input": msgs, "max_output_tokens": 4000},
            "/v1/chat/completions": {"messages": msgs, "max_tokens": 4000}}[path]
    conn, resp = _open_stream(s.gateway.url, path, {"model": "demo-tiny", "stream": True, **body})
    assert resp.status == 200
    head = b""
    while not any(k in head for k in (b"content_block_delta", b"output_text.delta", b'"content": "')):
        line = resp.readline()  # chunk-aware
        assert line, head
        head += line
    status, _, raw = post(b0.url + "/v1/completions", {"prompt": [5, 6, 8], "max_tokens": 2}, timeout=10)
    assert status >= 500 and b"Traceback" not in raw, raw
    rest = resp.read()
    events = _sse_events(head + rest)
    conn.close()
    assert b"mlxgw-failed" not in head + rest  # the backend's reason for the gateway, not the client
    if path == "/v1/messages":
        kinds = [e["type"] for e in events]
        assert kinds[-1] == "error" and "message_delta" not in kinds and "message_stop" not in kinds, kinds
        err = events[-1]["error"]
    elif path == "/v1/responses":
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds, kinds
        err = events[-1]["response"]["error"]
        assert err["code"] == "backend_failed", err
    else:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "backend_failed", events[-3:]
        assert not any(isinstance(e, dict) and (e.get("choices") or [{}])[0].get("finish_reason") for e in events)
        err = events[-2]["error"]
    # The reason the backend gave as it cut the stream (not "its connection closed"), and no circuit
    # opened: the backend goes on
    assert err["message"].startswith("backend b0 failed mid-stream: the batch this request ran in failed "
                                      "(RuntimeError: simulated engine failure after 1 requests"), err
    assert "b0" not in get_json(s.gateway.url + "/health")["circuit_open"]
    deadline = time.time() + 10
    while "outcome=backend_failed" not in s.gateway.log_path.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert "outcome=backend_failed" in s.gateway.log_path.read_text()
    assert b0.proc.poll() is None and get_json(b0.url + "/health")["batch_failures"] == 1


def _cached_total(gateway_url: str) -> float:
    """The gateway's ``mlxgw:gateway_cached_tokens_total`` over every model."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(gateway_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "mlxgw:gateway_cached_tokens_total")


def test_requests_waiting_for_a_decode_slot_outlast_a_short_read_timeout(make_stack):
    """A request waiting at its backend for a decode slot, streamed or not, gets its answer from
    that backend however long the wait, with the gateway's ``--read-timeout`` shorter: the backend
    sends its headers and a keep-alive each second (`schema.KEEPALIVE_SECONDS`), then its cache
    hit, which the usage, the metrics, Anthropic's message_start and a whole answer's
    ``X-Mlxgw-Cached-Tokens`` all give (helper-90: at ``--read-timeout 5`` a request that
    waited 11.7 s was retried elsewhere and the full, healthy backend's circuit opened)."""
    import threading

    import anthropic

    s = make_stack()
    # One sequence at a time (the sim raises the decode slots to the prefill concurrency)
    b0 = s.add_backend("b0", None, "--engine", "sim", "--decode-concurrency", "1", "--prefill-concurrency", "1",
                       "--sim-decode-rate", "20")
    g = s.add_gateway("--read-timeout", "2.5")
    s.wait()
    text = words(300, seed=91)
    assert _ask(g.url, text)[0] == 200  # b0 holds it
    # b0's only decode slot taken for ~6 s (120 tokens at 20 per second)
    busy_conn, busy = _open_stream(g.url, "/v1/chat/completions", {
        "model": "demo-tiny", "messages": [{"role": "user", "content": words(30, seed=92)}],
        "max_tokens": 120, "stream": True})
    assert busy.status == 200
    deadline = time.time() + 20
    while not _busy(b0) and time.time() < deadline:
        time.sleep(0.05)
    before = _cached_total(g.url)
    out = {}

    def streamed():
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="demo-tiny", messages=[{"role": "user", "content": text}], max_tokens=2, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
        out["openai"] = (raw.headers.get("X-Mlxgw-Backend"), raw.headers.get("X-Mlxgw-Route-Reason"),
                         chunks[-1].usage.prompt_tokens_details.cached_tokens)

    def whole():
        status, h, body = _ask(g.url, text, max_tokens=2)
        out["whole"] = (status, h.get("X-Mlxgw-Backend"), h.get("X-Mlxgw-Cached-Tokens"),
                        json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"])

    def claude():
        client = anthropic.Anthropic(base_url=g.url, api_key="x", max_retries=0)
        with client.messages.stream(model="demo-tiny", max_tokens=2,
                                    messages=[{"role": "user", "content": text}]) as st:
            events = list(st)
        start = next(e for e in events if e.type == "message_start")
        out["anthropic"] = (start.message.usage.cache_read_input_tokens,
                            st.get_final_message().usage.cache_read_input_tokens)

    t0 = time.time()
    threads = [threading.Thread(target=f) for f in (streamed, whole, claude)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    took = time.time() - t0
    busy_conn.close()
    assert took > 2.5 + 1, took  # they waited longer than the read timeout
    # The reference: the same prompt's cache hit when nothing waits (headers with the count)
    status, h, body = _ask(g.url, text, max_tokens=2)
    hit = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and int(h["X-Mlxgw-Cached-Tokens"]) == hit > 250, (h, body)
    assert out["openai"] == ("b0", "prefix", hit), out
    assert out["whole"] == (200, "b0", str(hit), hit), out
    assert out["anthropic"] == (hit, hit), out
    # These four and the request that held the slot (over before they began)
    assert _cached_total(g.url) - before == 4 * hit + int(busy.getheader("X-Mlxgw-Cached-Tokens"))
    health = get_json(g.url + "/health")
    assert (health["retries"], health["circuit_open"]) == (0, []), health


def test_a_backends_request_timeout_is_the_clients_answer_not_retried_and_counted_an_error(make_stack):
    """A backend's ``--request-timeout`` ends a request: a whole answer's headers went out after a
    second (200, newlines since), so the error body follows them, which a gateway answers as the
    504 it is, without sending the request to another backend, where it would take as long again
    (helper-91: it was retried there, a stream was not); a stream's error event is logged and
    counted a failure (it was ``ok``), and an Anthropic stream ends at its ``error`` event (it
    went on with ``end_turn`` and ``message_stop``)."""
    s = make_stack()
    slow = ("--engine", "sim", "--sim-decode-rate", "5", "--request-timeout", "2")  # 100 tokens: 20 s
    b0, b1 = s.add_backend("b0", None, *slow), s.add_backend("b1", None, *slow)
    g = s.add_gateway()
    s.wait()
    body = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100}
    status, h, raw = post(b0.url + "/v1/chat/completions", body)
    assert status == 200 and raw.startswith(b"\n") and "X-Mlxgw-Cached-Tokens" not in h, (status, h, raw)
    assert json.loads(raw)["error"]["code"] == "timeout", raw
    before = {b.name: get_json(b.url + "/health")["requests"] for b in (b0, b1)}
    t0 = time.time()
    status, h, raw = post(g.url + "/v1/chat/completions", body)
    took = time.time() - t0
    err = json.loads(raw)["error"]
    assert status == 504 and err["code"] == "timeout", (status, raw)
    assert "generation timed out after 2 s" in err["message"] and 1.9 < took < 4, (err, took)
    served = [b.name for b in (b0, b1) if get_json(b.url + "/health")["requests"] > before[b.name]]
    assert served == [h["X-Mlxgw-Backend"]], (served, h)  # one backend ran it
    health = get_json(g.url + "/health")
    assert (health["retries"], health["errors"]) == (0, 1), health
    # A stream: the backend's error event, counted as a failure
    status, h, raw = post(g.url + "/v1/chat/completions", {**body, "stream": True})
    events = _sse_events(raw)
    assert status == 200 and events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]", raw
    health = get_json(g.url + "/health")
    assert (health["retries"], health["errors"]) == (0, 2), health
    # An Anthropic stream ends at its error event
    status, h, raw = post(g.url + "/v1/messages", {"model": "demo-tiny", "max_tokens": 100, "stream": True,
                                                     "messages": [{"role": "user", "content": "hello"}]})
    kinds = [ln[7:] for ln in raw.decode().splitlines() if ln.startswith("event: ")]
    assert status == 200 and kinds[0] == "message_start" and kinds[-1] == "error", kinds
    assert "message_stop" not in kinds and "message_delta" not in kinds, kinds


def test_a_request_on_a_hung_engine_falls_silent_and_is_tried_elsewhere(make_stack):
    """Keep-alives cover a wait for a decode slot, not a hung engine: once the engine thread has
    not gone round its loop for ``--engine-stall-seconds``, a waiting request's keep-alives stop,
    so the gateway's ``--read-timeout`` tries the next backend, streamed or not, as it did before
    keep-alives (the request would otherwise hold on until the backend's ``--request-timeout``),
    and the backend's ``/health`` says ``stalled`` (503), so the circuit stays open."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--sim-hang-after", "1", "--engine-stall-seconds", "2",
                       "--request-timeout", "60")
    b1 = s.add_backend("b1", None, "--engine", "sim")
    gateways = {False: s.add_gateway("--read-timeout", "3"), True: s.add_gateway("--read-timeout", "3")}
    s.wait()
    text = words(300, seed=95)
    assert post(b0.url + "/v1/chat/completions", {"model": "demo-tiny", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": text}]})[0] == 200
    for stream, g in gateways.items():  # b0 owns the prompt; its engine hangs on its second request
        t0 = time.time()
        status, h, raw = _ask(g.url, text + (" streamed" if stream else " whole"), max_tokens=2, stream=stream)
        took = time.time() - t0
        assert status == 200 and 4 < took < 20, (status, took)  # ~2 s of keep-alives, 3 s of silence, then b1
        if stream:  # its headers went out from b0 (the first choice); b1's events follow on the same stream
            events = _sse_events(raw)
            assert h["X-Mlxgw-Backend"] == "b0" and events[-1] == "[DONE]" and "error" not in events[-2], (h, raw)
        else:
            assert (h["X-Mlxgw-Backend"], h["X-Mlxgw-Route-Reason"]) == ("b1", "retry"), h
            assert json.loads(raw)["usage"]["completion_tokens"] == 2, raw
        assert get_json(b0.url + "/health")["status"] == "stalled"
        health = get_json(g.url + "/health")
        assert (health["retries"], health["circuit_open"]) == (1, ["b0"]), health
        time.sleep(1.5)  # a probe of b0's /health: still 503, so its circuit stays open
        t0 = time.time()
        assert _ask(g.url, text + " again")[1]["X-Mlxgw-Backend"] == "b1" and time.time() - t0 < 2
    assert get_json(b1.url + "/health")["requests"] == 4
