"""Backend and Redis failures degrade service; they never lose a request."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import redis as redis_lib

from mlxgw import schema
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
        # FLUSHALL: the backend notices its record is gone and re-publishes (the gateway's
        # own claim of the last request may match before that: wait for Redis itself).
        from mlxgw import schema

        keys = schema.Keys(s.namespace, s.model_name)
        old = get_json(s.backends[0].url + "/internal/cache")["epoch"]
        r.client().flushall()
        deadline = time.time() + 10
        while time.time() < deadline:
            status, h, _ = _ask(s.gateway.url, text + " again")
            if int(h.get("X-Mlxgw-Matched-Tokens", 0)) >= 150 and r.client().exists(keys.owned("b0", old)):
                break
            time.sleep(0.3)
        assert status == 200 and int(h["X-Mlxgw-Matched-Tokens"]) >= 150
        # The flush took the epoch counter too; the re-publish put it back, so a restart
        # gets a new epoch and the old life's blocks neither route nor stay behind.
        assert int(r.client().get(keys.epoch_counter("b0"))) == old
        s.backends[0].kill()
        b0 = s.add_backend("b0")
        b0.wait_healthy()
        assert get_json(b0.url + "/internal/cache")["epoch"] == old + 1
        status, h, _ = _ask(s.gateway.url, text + " again")
        assert status == 200 and h["X-Mlxgw-Lookup"] == "ok" and h["X-Mlxgw-Matched-Tokens"] == "0"
        deadline = time.time() + 10
        while time.time() < deadline and r.client().exists(keys.owned("b0", old)):
            time.sleep(0.2)
        stale = [k for k in r.client().scan_iter(match=keys.prefix + ":blk:*")
                 if r.client().hget(k, "b0") in (str(old).encode(), f"{old}c".encode())]
        assert stale == [] and not r.client().exists(keys.owned("b0", old))
    finally:
        s.stop()
        r.cleanup()


def test_redis_losing_its_data_keeps_every_backend_routable(demo_model):
    """After FLUSHALL (or a restart without persistence) the registry is empty until each
    backend's next heartbeat. The gateway keeps routing over the backends it knew: no 503
    while they are healthy, and not only the first one back (that one drew every request,
    and through their claims the next turns of their conversations, for seconds)."""
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        slow = ("--heartbeat-interval", "4", "--heartbeat-ttl", "10")  # a long gap before they re-register
        s.add_backend("b0", None, *slow), s.add_backend("b1", None, *slow)
        s.add_gateway()
        s.wait()
        assert _ask(s.gateway.url, words(100, seed=61))[0] == 200
        r.client().flushall()
        answers = [_ask(s.gateway.url, words(100, seed=62 + i)) for i in range(8)]
        assert [st for st, _, _ in answers] == [200] * 8, answers[0]
        for _, h, _ in answers:
            assert sorted(c.split(":")[0] for c in h["X-Mlxgw-Candidates"].split()) == ["b0", "b1"], h
        deadline = time.time() + 5
        while time.time() < deadline and "Redis lost its data" not in s.gateway.log_path.read_text():
            time.sleep(0.1)
        assert "Redis lost its data" in s.gateway.log_path.read_text()
        assert get_json(s.gateway.url + "/health")["redis_data_losses"] == 1
    finally:
        s.stop()
        r.cleanup()


def test_an_older_snapshot_s_earlier_epochs_are_cleaned_after_the_re_publish(demo_model):
    """Redis restored from an older snapshot (RDB, AOF) holds a live backend's earlier epochs
    again: their owned set and fields stayed until its next restart (helper-81: 1,188 stale
    fields); the re-publish that follows the loss cleans them up too."""
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        b = s.add_backend("b0")
        s.wait()
        c = r.client()
        k = schema.Keys(s.namespace, s.model_name)
        epoch = int(c.hget(k.backend("b0"), "epoch"))
        c.flushall()
        # What the snapshot held: an earlier epoch's ownership of two blocks, and a block the
        # backend does not own now under the same epoch.
        old, stale = epoch + 7, [k.block(f"{i:016x}") for i in range(3)]
        c.incr(k.epoch_counter("b0"), old + 1)  # the snapshot's counter was past both epochs
        for key in stale[:2]:
            c.hset(key, "b0", schema.block_value(old, True))
        c.sadd(k.owned("b0", old), *stale[:2])
        deadline = time.time() + 15
        while time.time() < deadline and (c.exists(k.owned("b0", old)) or c.hget(stale[0], "b0") is not None
                                          or c.hget(k.backend("b0"), "epoch") is None):
            time.sleep(0.1)
        assert not c.exists(k.owned("b0", old)) and [c.hget(x, "b0") for x in stale] == [None] * 3
        assert c.hget(k.backend("b0"), "epoch") == str(epoch)  # the live epoch, re-registered
        assert b.proc.poll() is None
    finally:
        s.stop()
        r.cleanup()


@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_busy_backend_re_registers_after_redis_lost_its_data_without_waiting_for_its_heartbeat(demo_model, loss):
    """After FLUSHALL a backend's writes succeed, and after a restart the first one fails and
    the re-publish wrote ownership without the registry record; either way only its heartbeat
    used to put the record back, and until then gateways routed without its ownership
    (bench/redis_restart.py: up to a second of near-zero hits). Each flush now looks for the
    record, and a re-publish re-registers first: the next request it serves does both."""
    from mlxgw import schema

    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        b0 = s.add_backend("b0", None, "--heartbeat-interval", "30", "--heartbeat-ttl", "90")
        b0.wait_healthy()
        keys = schema.Keys(s.namespace, s.model_name)
        assert _ask(b0.url, words(300, seed=63))[0] == 200
        before = set(get_json(b0.url + "/internal/cache")["owned"])
        assert len(before) >= 10
        if loss == "flushall":
            r.client().flushall()
        else:
            r.stop()
            r.proc = None
            r.start()  # same port, empty
        c = r.client()
        t0 = time.time()
        assert _ask(b0.url, words(300, seed=64))[0] == 200
        owned = set(get_json(b0.url + "/internal/cache")["owned"])
        assert owned > before
        deadline = time.time() + 5
        named = set()
        while time.time() < deadline:
            named = {k.split(":blk:")[1] for k in c.scan_iter(match=keys.prefix + ":blk:*") if c.hexists(k, "b0")}
            if c.exists(keys.backend("b0")) and named == owned:
                break
            time.sleep(0.05)
        assert c.exists(keys.backend("b0")), "not registered again before the heartbeat (30 s)"
        assert named == owned
        assert time.time() - t0 < 10
        assert "registry record was gone" in b0.log_path.read_text()
    finally:
        s.stop()
        r.cleanup()


def test_evictions_during_an_outage_leave_no_ownership_behind(demo_model):
    """Redis comes back with its data (a restart with persistence; a dropped connection is
    the same) after the backend evicted a prompt it could not report. The re-publish removes
    the fields those lost deletions left: they kept the live epoch and sat in no owned set,
    so nothing ever removed them, and gateways routed the prompt to a backend that no longer
    held it (helper repro: matched 4,544 tokens, cached 11)."""
    from mlxgw import schema

    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        b0 = s.add_backend("b0", None, "--cache-entries", "2")
        b0.wait_healthy()
        c = r.client()
        keys = schema.Keys(s.namespace, s.model_name)
        assert _ask(b0.url, words(600, seed=59))[0] == 200
        (entry,) = get_json(b0.url + "/internal/cache")["entries"]
        gone = entry["blocks"]
        assert len(gone) >= 10 and all(c.hexists(keys.block(x), "b0") for x in gone)
        c.save()  # what Redis comes back with
        r.stop()
        for i in range(3):  # two entries at most: the first prompt's goes while Redis is away
            assert _ask(b0.url, words(300, seed=60 + i))[0] == 200
        owned = set(get_json(b0.url + "/internal/cache")["owned"])
        gone = [x for x in gone if x not in owned]
        assert len(gone) >= 9
        r.proc = None
        r.start()  # same port, loads the dump: the evicted prompt's blocks name b0 again
        deadline = time.time() + 15
        named = None
        while time.time() < deadline:
            named = {k.split(":blk:")[1] for k in c.scan_iter(match=keys.prefix + ":blk:*") if c.hexists(k, "b0")}
            if named == owned and c.exists(keys.backend("b0")):
                break
            time.sleep(0.2)
        assert named == owned, (len(named - owned), len(owned - named))
        assert not any(c.hexists(keys.block(x), "b0") for x in gone)
        assert c.smembers(keys.owned("b0", get_json(b0.url + "/internal/cache")["epoch"])) == set(keys.blocks(owned))
    finally:
        s.stop()
        r.cleanup()


def _busy(b) -> bool:
    return (get_json(b.url + "/health") or {}).get("active", 0) > 0


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


def test_janitor_removes_a_dead_backends_claims(make_stack, redis_server):
    from mlxgw import schema

    s = make_stack()
    b0 = s.add_backend("b0")
    s.add_backend("b1")
    s.add_gateway("--janitor-grace", "2")
    s.wait()
    r = redis_server.client()
    k = schema.Keys(s.namespace, s.model_name)
    for i in range(2):
        _ask(b0.url, words(200, seed=56 + i))
    epoch = get_json(b0.url + "/internal/cache")["epoch"]
    assert r.scard(k.owned("b0", epoch)) > 10
    b0.kill()  # dies and never comes back
    deadline = time.time() + 15
    while r.zscore(k.backends, "b0") is not None and time.time() < deadline:
        time.sleep(0.2)
    assert r.zscore(k.backends, "b0") is None and r.zscore(k.backends, "b1") is not None
    assert not r.exists(k.owned("b0", epoch))
    leftovers = [key for key in r.scan_iter(match=k.prefix + ":blk:*") if r.hget(key, "b0") is not None]
    assert leftovers == []


def test_janitor_forgets_a_model_no_backend_serves_and_a_backend_brings_it_back(make_stack, redis_server):
    """A model whose backends all died and that no gateway serves (here a backend's mistaken
    --served-name) leaves the models set once nothing happened for the grace (it stayed
    listed, and looked up by every gateway refresh, forever); its next backend lists it again.
    A model a live gateway serves stays listed without backends, so status still shows it."""
    from mlxgw import schema

    s = make_stack()
    b1 = s.add_backend("b1")
    s.add_gateway("--janitor-grace", "2")
    s.wait()
    b0 = s.add_backend("b0", None, "--served-name", "retired")
    b0.wait_healthy()
    r = redis_server.client()
    models = schema.models_key(s.namespace)
    status, _, body = post(b0.url + "/v1/chat/completions", {"model": "retired", "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": words(50, seed=57)}]})
    assert status == 200, body
    assert r.smembers(models) == {"retired", s.model_name}
    b0.kill()
    b1.kill()
    t0 = time.time()
    while r.sismember(models, "retired") and time.time() < t0 + 20:
        time.sleep(0.2)
    assert not r.sismember(models, "retired") and time.time() - t0 >= 2  # not before the grace
    while "janitor: model retired left the models set" not in s.gateway.log_path.read_text() and time.time() < t0 + 25:
        time.sleep(0.1)  # logged just after the removal
    assert "janitor: model retired left the models set" in s.gateway.log_path.read_text()
    time.sleep(3)  # sweeps every second: the gateway's own model stays, its backend dead too
    assert r.sismember(models, s.model_name) and r.zcard(schema.Keys(s.namespace, s.model_name).backends) == 0
    b0.start(s.env())
    b0.wait_healthy()
    assert r.sismember(models, "retired")


def test_redis_client_policy_retries_a_closed_connection_but_not_a_timeout():
    """`mlxgw.redis_client`: a pooled connection that a restarted Redis closed is retried once on
    a new one (not an outage), and a Redis that does not answer fails after one socket timeout
    (redis-py 6+'s default retried ten times with backoff, ~11 timeouts per command)."""
    import redis as redis_py

    from mlxgw.redis_client import connect

    r = RedisServer().start()
    try:
        c = connect(r.url, 0.3)
        assert c.ping() is True
        r.stop()
        r.proc = None
        r.start()  # same port: the pooled connection is now closed
        assert c.ping() is True
        r.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.time()
            with pytest.raises(redis_py.exceptions.TimeoutError):
                c.ping()
            assert time.time() - t0 < 1.0
        finally:
            r.proc.send_signal(signal.SIGCONT)
    finally:
        r.cleanup()


def test_frozen_redis_does_not_hold_answers_and_the_gateway_says_so(demo_model):
    """A Redis that stops answering (SIGSTOP here; a partition, swapping) held every backend
    answer for its flush: seconds each (ops trial: median 4.4 s). Answers now wait at most
    `SETTLE_TIMEOUT` once, then not at all until Redis is back; the backend re-publishes then.
    The gateway, whose lookups notice an outage before its refresh loop, used to log nothing
    about it under traffic; it now says when Redis stops answering and when it is back."""
    from mlxgw import schema

    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        b0 = s.add_backend("b0")
        s.add_gateway("--lookup-deadline-ms", "50")
        s.wait()
        assert _ask(s.gateway.url, words(200, seed=65))[0] == 200
        r.proc.send_signal(signal.SIGSTOP)
        try:
            times = []
            for i in range(4):
                t0 = time.time()
                assert _ask(b0.url, words(200, seed=66 + i))[0] == 200
                times.append(time.time() - t0)
            assert sum(times) < 6.0, times  # each waited >= the 2 s socket timeout before (28 s in all)
        finally:
            r.proc.send_signal(signal.SIGCONT)
        r.stop()  # now refusing connections: the gateway's lookups fail at once
        status, h, _ = _ask(s.gateway.url, words(200, seed=70))
        assert status == 200 and h["X-Mlxgw-Lookup"] == "error"
        r.proc = None
        r.start()  # empty, same port
        keys = schema.Keys(s.namespace, s.model_name)
        c = r.client()
        owned = set(get_json(b0.url + "/internal/cache")["owned"])
        deadline = time.time() + 10
        named = set()
        while time.time() < deadline:
            named = {k.split(":blk:")[1] for k in c.scan_iter(match=keys.prefix + ":blk:*") if c.hexists(k, "b0")}
            if named == owned and "Redis reachable again" in s.gateway.log_path.read_text():
                break
            time.sleep(0.1)
        assert named == owned and len(owned) >= 10
        # Each outage told once, and its end once (the refresh may have seen the frozen spell too).
        down = ": routing on load, session affinity"
        said = ["down" if down in ln else "up" for ln in s.gateway.log_path.read_text().splitlines()
                if down in ln or "Redis reachable again" in ln]
        assert said and said == ["down", "up"] * (len(said) // 2), said
    finally:
        s.stop()
        r.cleanup()


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


def test_a_second_gateway_under_a_live_ones_id_is_refused(make_stack):
    """helper-76: a gateway given a live gateway's --gateway-id ran silently, the two overwriting
    each other's in-flight load and settings in Redis. It exits 2 naming the id; a gateway
    restarted under its own id after a kill (its entry still fresh, but no longer written) starts."""
    s = make_stack()
    s.add_backend("b0", None, "--engine", "sim")
    first = s.add_gateway("--gateway-id", "edge-1")
    s.wait()
    twin = s.add_gateway("--gateway-id", "edge-1")
    assert twin.proc.wait(60) == 2, twin.tail(10)
    assert (f"gateway id 'edge-1' is in use by a live gateway on this Redis (namespace {s.namespace}): give this "
            "one another --gateway-id") in twin.tail(5), twin.tail(10)
    s.gateways.remove(twin)
    assert get_json(first.url + "/health")["status"] == "ok"
    first.kill()
    again = s.add_gateway("--gateway-id", "edge-1", port=first.port)
    again.wait_healthy()
    assert "in use" not in again.log_path.read_text().rsplit("starting on", 1)[1]  # (the log file twin had)


def test_a_second_backend_under_a_live_ones_id_is_refused(make_stack):
    """A backend started with the --id of a live backend at another URL exits 2 naming it; it took
    the first one's place in the registry without a word, and the first kept running with no
    traffic (helper-63)."""
    s = make_stack()
    b0 = s.add_backend("b0")
    s.add_gateway()
    s.wait()
    twin = s.add_backend("b0")  # same id, another port
    rc = twin.proc.wait(120)
    assert rc == 2, (rc, twin.tail(30))
    assert f"backend id 'b0' is in use by a live backend at {b0.url}" in twin.tail(20)
    s.backends.remove(twin)
    from mlxgw.httpget import get_json

    assert get_json(b0.url + "/health")["status"] == "ok"


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


def test_advertised_url_is_one_other_machines_can_reach():
    """helper-64: a backend on another Mac listening on 0.0.0.0 without --url registered
    http://127.0.0.1:PORT, with no warning; with the default ports a gateway's own backend then
    answered there."""
    from backend.main import advertised_url
    from mlxgw.util import is_loopback
    from urllib.parse import urlsplit

    assert advertised_url("0.0.0.0", 8100, "redis://127.0.0.1:6379/0") == ("http://127.0.0.1:8100", "")
    assert advertised_url("0.0.0.0", 8100, "redis://x", "http://mac2.local:8100") == ("http://mac2.local:8100", "")
    url, why = advertised_url("0.0.0.0", 8100, "redis://:pw@192.0.2.7:6379/0")  # Redis on another machine
    assert not is_loopback(urlsplit(url).hostname) and urlsplit(url).port == 8100 and why == "", (url, why)
    for host, given in (("127.0.0.1", None), ("0.0.0.0", "http://127.0.0.1:8100")):
        url, why = advertised_url(host, 8100, "redis://192.0.2.7:6379/0", given)
        assert url == "http://127.0.0.1:8100" and "Redis is on another machine (192.0.2.7)" in why, why
    # helper-67: "::" listens on IPv6 only, and registered 127.0.0.1
    assert advertised_url("::", 8100, "redis://[::1]:6379/0") == ("http://[::1]:8100", "")
    # ... and URLs no gateway can use are refused: a wildcard address (taken until session 39),
    # a password in one is not echoed
    from mlxgw.schema import url_error

    assert url_error("http://0.0.0.0:8100").startswith("its URL 'http://0.0.0.0:8100' names a wildcard address")
    assert url_error("http://[::]:8100").startswith("its URL 'http://[::]:8100' names a wildcard address")
    assert "pw" not in url_error("http://u:pw@127.0.0.1:8100") and url_error("http://127.0.0.1:8100") is None


def test_a_backend_registered_at_another_backends_url_is_skipped(make_stack):
    """A backend registered at a URL another backend answers at (here b0's) used to get requests
    that b0 answered, credited to the wrong backend; the gateway now sees the answering backend's
    id, skips the misaddressed one, and says so once."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    b0.wait_healthy()
    twin = s.add_backend("mac2-0", None, "--engine", "sim", "--url", b0.url)
    g = s.add_gateway()
    s.wait()
    text = words(300, seed=65)
    # mac2-0 caches the prompt (asked at its real port), so the gateway tries it first.
    status, _, body = post(twin.url + "/v1/chat/completions", {"model": "demo-tiny", "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": text}]})
    assert status == 200, body
    time.sleep(1.0)
    answers = [_ask(g.url, text + f" turn {i}") for i in range(4)]
    assert [(st, h["X-Mlxgw-Backend"]) for st, h, _ in answers] == [(200, "b0")] * 4, [a[:2] for a in answers]
    assert [h["X-Mlxgw-Route-Reason"] for _, h, _ in answers] == ["retry", "prefix", "prefix", "prefix"]
    assert "X-Mlxgw-Served-By" not in answers[0][1]
    health = get_json(g.url + "/health")
    assert health["misaddressed"] == {"mac2-0": b0.url}, health
    # The routing decision is the first choice's (a prefix on mac2-0), in /health and /metrics alike
    # (helper-70: /metrics classed the retry's answer from b0 as `load`).
    assert (health["routed_prefix"], health["routed_load"]) == (4, 0), health
    metrics = urllib.request.urlopen(g.url + "/metrics", timeout=5).read().decode()
    assert 'mlxgw:routing_decisions_total{model_name="demo-tiny",outcome="prefix"} 4.0' in metrics, [
        ln for ln in metrics.splitlines() if "routing_decisions" in ln]
    assert 'outcome="load"} 1.0' not in metrics
    assert g.log_path.read_text().count(f"backend mac2-0 registered the URL {b0.url}, where backend b0 answers") == 1
    out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url,
                          "--namespace", s.namespace], capture_output=True, text=True, timeout=60).stdout
    assert f"backends b0, mac2-0 registered the same URL {b0.url}: only one of them answers there" in out, out
    deadline = time.time() + 10  # the gateway publishes why it skips mac2-0; its own /health says so
    while not get_json(twin.url + "/health").get("left_out_by") and time.time() < deadline:
        time.sleep(0.2)
    assert list(get_json(twin.url + "/health")["left_out_by"].values()) == [
        f"its registered URL {b0.url} does not answer as it (start it with --url http://<address>:<port>, an "
        "address the gateways reach it at)"]


def test_a_backend_replaced_under_its_id_while_hung_steps_aside(make_stack, redis_server):
    """helper-64: a stopped (hung) backend left the registry, the operator started another under
    its id, and the first, resumed, overwrote the second's record every second (the registry
    flipped between their URLs). The later epoch wins: the resumed one exits 2, leaving the
    replacement's record alone."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    s.add_gateway()
    s.wait()
    r = redis_server.client()
    key = f"{s.namespace}:{{{s.model_name}}}:backend:b0"
    b0.signal(signal.SIGSTOP)
    try:
        deadline = time.time() + 15
        while r.exists(key) and time.time() < deadline:  # its record expires (TTL 2 s)
            time.sleep(0.2)
        assert not r.exists(key)
        twin = s.add_backend("b0", None, "--engine", "sim")
        twin.wait_healthy()
    finally:
        b0.signal(signal.SIGCONT)
    assert b0.proc.wait(20) == 2, b0.tail(20)
    assert f"backend id 'b0' was registered by a backend at {twin.url}" in b0.log_path.read_text()
    urls = set()
    for _ in range(10):
        urls.add(r.hget(key, "url"))
        time.sleep(0.2)
    assert urls == {twin.url}, urls
    assert get_json(twin.url + "/health")["status"] == "ok"
    s.backends.remove(b0)


def test_a_backend_started_by_serve_waits_for_redis(make_stack):
    """Under `mlxgw serve` (its pid in the environment), a backend whose Redis does not answer at
    start waits for it instead of exiting 4 on every restart (helper-64: with an outside Redis
    down, serve's growing restart delay brought it back 28 s after Redis). By hand it still
    exits 4 at once."""
    import os

    r = RedisServer().start()
    url = r.url
    r.stop()  # the port stays ours to start it again on
    try:
        s = Stack(url, make_stack().model_path, env_extra={"MLXGW_INTERNAL_PARENT_PID": str(os.getpid())})
        b0 = s.add_backend("b0", None, "--engine", "sim")
        deadline = time.time() + 60
        while "registering when it answers" not in b0.log_path.read_text() and time.time() < deadline:
            assert b0.proc.poll() is None, b0.tail(20)
            time.sleep(0.2)
        assert "registering when it answers" in b0.log_path.read_text(), b0.tail(20)
        r.start()
        b0.wait_healthy(30)
        assert get_json(b0.url + "/health")["status"] == "ok"
        s.stop()
        alone = Stack(url.rsplit(":", 1)[0] + ":1/0", s.model_path)  # by hand, nothing listening
        b1 = alone.add_backend("b1", None, "--engine", "sim")
        assert b1.proc.wait(60) == 4 and "Redis unreachable" in b1.tail(5)
        alone.stop()
    finally:
        r.cleanup()


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


def test_a_redis_at_its_maxmemory_is_said_to_refuse_writes_not_to_be_unreachable(demo_model):
    """helper-64: with Redis at its maxmemory (noeviction) the gateway's log flipped between
    "Redis unreachable" and "reachable again" every few seconds while every lookup worked."""
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        s.add_backend("b0", None, "--engine", "sim")
        g = s.add_gateway()
        s.wait()
        r.client().config_set("maxmemory", "1")  # every write is refused from now on (OOM)
        for i in range(5):
            assert _ask(g.url, f"hello {i}")[0] == 200
            time.sleep(0.5)
        h = get_json(g.url + "/health")
        log = g.log_path.read_text()
        assert "Redis refuses writes: its used memory is over its maxmemory" in log, log[-2000:]
        assert "Redis unreachable" not in log and h["degraded"] is False, (h, log[-2000:])
    finally:
        s.stop()
        r.cleanup()


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


def test_an_https_url_at_a_plain_http_backend_is_said_to_be_a_tls_failure(make_stack):
    """helper-67: a backend registered as ``https://`` (it serves plain http) was explained as
    "not listening there" in the 503 and the gateway's log; its own URL check said nothing answered."""
    from mlxgw.harness import free_port

    s = make_stack()
    port = free_port()
    b = s.add_backend("tls", port, "--engine", "sim", "--url", f"https://127.0.0.1:{port}")
    g = s.add_gateway()
    s.wait()
    status, _, body = _ask(g.url, "hi")
    msg = json.loads(body)["error"]["message"]
    assert status == 503 and ("tls: no TLS connection at its registered URL (an https:// URL where it "
                              "serves plain http, or a certificate this machine does not trust)") in msg, msg
    deadline = time.time() + 30
    while "gateways cannot reach it there" not in b.log_path.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert (f"backend tls registered the URL https://127.0.0.1:{port}, but no TLS connection can be made there "
            "(it serves plain http: an https:// URL needs a TLS proxy in front") in b.log_path.read_text(), b.tail(5)


def test_a_backend_url_gateways_cannot_use_is_refused_and_left_out(make_stack):
    """helper-65: a backend joined with `--url 127.0.0.1:PORT` (no scheme) registered, and every
    request routed to it was a 500 with a traceback in the gateway, never retried elsewhere. The
    backend refuses such a URL (exit 2); a record with one (an older backend) is left out."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    g = s.add_gateway()
    s.wait()
    bad = s.add_backend("hand", None, "--engine", "sim", "--url", "127.0.0.1:1234")
    assert bad.proc.wait(60) == 2 and "--url: its URL '127.0.0.1:1234' is not an http(s)://host:port URL" in \
        bad.tail(5), bad.tail(10)
    s.backends.remove(bad)
    # helper-66: a URL with a path registered, and every request routed there was a 404
    bad = s.add_backend("hand", None, "--engine", "sim", "--url", "http://127.0.0.1:1234/v1")
    assert bad.proc.wait(60) == 2 and ("--url: its URL 'http://127.0.0.1:1234/v1' has more than a scheme, host "
                                       "and port") in bad.tail(5), bad.tail(10)
    s.backends.remove(bad)
    # helper-66: the wrong port in --url registered without a word from the backend
    from mlxgw.harness import free_port

    nowhere = f"http://127.0.0.1:{free_port()}"
    lost = s.add_backend("lost", None, "--engine", "sim", "--url", nowhere)
    deadline = time.time() + 30
    while "gateways cannot reach it there" not in lost.log_path.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert (f"backend lost registered the URL {nowhere}, but nothing answers there from this machine "
            "(ClientConnectorError") in lost.log_path.read_text(), lost.tail(10)
    assert "registered the URL" not in b0.log_path.read_text()  # a backend at its own URL says nothing
    # A gateway's URL: the gateway is named (helper-76: "something that is not an mlxgw backend")
    at_gw = s.add_backend("at-gw", None, "--engine", "sim", "--url", s.gateway.url)
    deadline = time.time() + 30
    while "gateways cannot reach it there" not in at_gw.log_path.read_text() and time.time() < deadline:
        time.sleep(0.2)
    gid = f"{socket.gethostname()}:{s.gateway.port}"
    assert (f"backend at-gw registered the URL {s.gateway.url}, but mlxgw gateway {gid} (not a backend) answers "
            "there: gateways cannot reach it there") in at_gw.log_path.read_text(), at_gw.tail(10)
    at_gw.stop()
    s.backends.remove(at_gw)
    # ... and `mlxgw status`, where it showed `ready` like the others, says it too
    deadline, out = time.time() + 10, ""
    while "gateways cannot reach it there" not in out and time.time() < deadline:
        out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url, "--namespace",
                              s.namespace], capture_output=True, text=True, timeout=60).stdout
    assert f"backend lost registered the URL {nowhere}, but nothing answers there from this machine" in \
        " ".join(out.split()), out
    # ... and its row says so, out of the live count (helper-68: `ready`, counted live)
    cells = {c[0]: c[1] for c in ([x.strip() for x in ln.split("│")[1:3]] for ln in out.splitlines() if "│" in ln)}
    assert (cells["lost"], cells["b0"], cells["total"]) == ("url problem", "ready", "1 live, 1 url problem"), out
    lost.stop()
    s.backends.remove(lost)
    # A record with such a URL (written by hand here, as an older backend would have) is left out.
    from mlxgw.schema import Keys

    r, k = redis_lib.Redis.from_url(s.redis_url), Keys(s.namespace, s.model_name)
    rec = {a.decode(): v.decode() for a, v in r.hgetall(k.backend("b0")).items()}
    deadline = time.time() + 10
    while "old" not in (get_json(g.url + "/health").get("incompatible") or {}).get("demo-tiny", {}) \
            and time.time() < deadline:
        r.hset(k.backend("old"), mapping={**rec, "id": "old", "url": "notaurl", "last_heartbeat": f"{time.time():.3f}"})
        r.expire(k.backend("old"), 30)
        r.zadd(k.backends, {"old": time.time()})
        time.sleep(0.2)
    assert get_json(g.url + "/health")["incompatible"]["demo-tiny"]["old"].startswith(
        "its URL 'notaurl' is not an http(s)://host:port URL")
    answers = [_ask(g.url, f"hi {i}") for i in range(4)]
    assert [(st, h["X-Mlxgw-Backend"]) for st, h, _ in answers] == [(200, "b0")] * 4
    assert "Traceback" not in g.log_path.read_text()
    # One whose URL answers but not as a backend (here the gateway's own: every request routed
    # there was its 400, never retried, helper-66) is skipped like a misaddressed one.
    r.delete(k.backend("old"))
    r.zrem(k.backends, "old")
    deadline = time.time() + 10
    while "elsewhere" not in (get_json(g.url + "/health").get("backends") or {}).get("demo-tiny", []) \
            and time.time() < deadline:
        r.hset(k.backend("elsewhere"), mapping={**rec, "id": "elsewhere", "url": g.url, "active": "0",
                                                "queued_tokens": "0", "last_heartbeat": f"{time.time():.3f}",
                                                "cache_bytes": "0", "cache_budget_bytes": str(2**40)})  # most room: first
        r.expire(k.backend("elsewhere"), 60)
        r.zadd(k.backends, {"elsewhere": time.time()})
        time.sleep(0.2)
    # Prompts that share no block with what b0 holds: they go where there is most room first.
    errors = get_json(g.url + "/health")["errors"]
    answers = [post(g.url + "/v1/chat/completions", {"model": "demo-tiny", "max_tokens": 1, "messages": [
        {"role": "system", "content": f"{i} " * 40}, {"role": "user", "content": "hello"}]}) for i in range(3)]
    assert [(st, h["X-Mlxgw-Backend"]) for st, h, _ in answers] == [(200, "b0")] * 3, [a[:2] for a in answers]
    assert [h["X-Mlxgw-Route-Reason"] for _, h, _ in answers] == ["retry", "load", "load"], [a[1] for a in answers]
    assert get_json(g.url + "/health")["misaddressed"] == {"elsewhere": g.url}
    # It says it is a gateway, and its refusal of its own forwarded request is no error of its
    # own (helper-67: counted in `errors`)
    gid = f"{socket.gethostname()}:{g.port}"  # the default --gateway-id
    assert (f"backend elsewhere registered the URL {g.url}, where mlxgw gateway {gid} (not a backend) "
            "answers") in g.log_path.read_text()
    assert get_json(g.url + "/health")["errors"] == errors
    assert b0.proc.poll() is None


def test_a_wrong_or_missing_redis_password_is_said_so(demo_model):
    """helper-66: a wrong Redis password read "Redis unreachable", a missing one Redis's raw
    HELLO message, and a gateway started with a wrong one answered 503 "no live backend serves"
    with no word of Redis."""
    from mlxgw.redis_embed import EmbeddedRedis

    red = EmbeddedRedis().start()
    wrong = red.url.replace(red.password, "not-the-password")
    none = red.url.replace(f":{red.password}@", "")
    s = Stack(red.url, demo_model)
    try:
        cases = (("w", wrong, "refused the password in the URL"),
                 ("n", none, "requires a password, and the URL has none"),
                 ("d", red.url.rsplit("/", 1)[0] + "/99", "has no such database"))
        started = [s.add_backend(name, None, "--engine", "sim", "--redis-url", url) for name, url, _ in cases]
        for (name, url, says), b in zip(cases, started):  # started together: each exits at its first Redis call
            assert b.proc.wait(60) == 4, b.tail(10)
            shown = url.replace("not-the-password", "***").replace(red.password, "***")
            assert f"Redis at {shown} {says}" in b.tail(5), b.tail(10)
            s.backends.remove(b)
        s.add_backend("b0", None, "--engine", "sim")
        # A gateway exits 4 as a backend does (helper-68: it stayed up, every request a 503).
        g = s.add_gateway("--redis-url", wrong)
        assert g.proc.wait(60) == 4, g.tail(10)
        assert "Redis at redis://:***@127.0.0.1:" in g.tail(5) and "refused the password in the URL" in g.tail(5)
        assert "not-the-password" not in g.log_path.read_text() and "Traceback" not in g.log_path.read_text()
        s.gateways.remove(g)
        # status --json calls it a refusal, not an outage (helper-77: "redis_unreachable")
        st = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--json", "--redis-url", wrong],
                            capture_output=True, text=True, timeout=60)
        err = json.loads(st.stdout)["error"]
        assert st.returncode == 4 and (err["type"], err["hint"]) == ("redis_refused", None), st.stdout
        assert "refused the password in the URL" in err["message"] and "not-the-password" not in st.stdout
        # Unreachable is another matter (waiting mends it): the gateway stays up, and its 503
        # says Redis is why (helper-66: "no live backend serves" with no word of Redis).
        from mlxgw.harness import free_port

        g = s.add_gateway("--redis-url", f"redis://127.0.0.1:{free_port()}/0")
        deadline = time.time() + 60
        while get_json(g.url + "/health") is None and time.time() < deadline:
            time.sleep(0.2)
        status, _, body = _ask(g.url, "hi")
        msg = json.loads(body)["error"]["message"]
        assert status == 503 and msg.startswith("no live backend serves 'demo-tiny' (this gateway learns of backends "
                                                "from Redis: Redis unreachable (no connection: ConnectionError))"), msg
        assert "127.0.0.1" not in msg, msg  # Redis's address is not the API client's business (helper-67)
        assert "at start: Redis unreachable at redis://127.0.0.1:" in g.log_path.read_text()
    finally:
        s.stop()
        red.stop()


def test_a_redis_cluster_node_is_named_as_one(demo_model, tmp_path):
    """helper-76: pointed at a Redis Cluster node, a backend exited "Redis unreachable ...
    MovedError" and a gateway ran degraded with the same words, while the docs said Cluster
    worked. Both say it is a Cluster node, which mlxgw does not speak to, and exit 4."""
    import shutil

    from mlxgw.harness import free_port
    from mlxgw.redis_client import redis_problem

    moved = redis_problem("redis://h:7001/0", __import__("redis").exceptions.MovedError("3999 10.0.0.2:7002"))
    assert moved == ("Redis at redis://h:7001/0 is a Redis Cluster node (MovedError: 3999 10.0.0.2:7002); mlxgw "
                     "speaks to one Redis, not to a Cluster (docs/redis-schema.md)"), moved
    # A cluster node also listens on its port + 10000 (the cluster bus): both must be free and
    # below 65536 (CI picked 56787 once: the node could not start)
    port = next(p for p in iter(free_port, None) if p < 55000)
    node = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                             "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"),
                             "--dir", str(tmp_path), "--save", ""], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    s = Stack(url, demo_model)
    try:
        deadline = time.time() + 30
        while True:
            try:
                __import__("redis").Redis(port=port).ping()
                break
            except Exception:
                assert node.poll() is None and time.time() < deadline, "the cluster node did not start"
                time.sleep(0.1)
        b = s.add_backend("b0", None, "--engine", "sim")
        g = s.add_gateway()
        says = f"Redis at {url} is a Redis Cluster node (ClusterDownError: Hash slot not served); mlxgw speaks to one"
        for p in (b, g):
            assert p.proc.wait(60) == 4, p.tail(10)
            assert says in p.tail(5), p.tail(10)
        s.backends.clear()
        s.gateways.clear()
        # serve checks it before starting anything (helper-77: it waited for its backends forever)
        serve = subprocess.run([sys.executable, "-m", "mlxgw", "serve", "--redis-url", url, "--port", str(free_port()),
                                "--backend-port", str(free_port()), "--backends", "1"],
                               capture_output=True, text=True, timeout=120)
        assert serve.returncode == 4 and says in serve.stderr, serve.stderr[-2000:]
    finally:
        s.stop()
        node.kill()
        node.wait(10)


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


def test_a_redis_back_with_another_password_is_said_so(demo_model, tmp_path):
    """helper-76: Redis restarted with another password, and the gateway's and backends' logs
    kept their last line, "connection refused", with no word of the password; the refusal is
    told as soon as it comes, once."""
    import shutil

    from mlxgw.harness import free_port

    port = free_port()

    def redis_with(password):
        return subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                                 "--requirepass", password, "--save", "", "--dir", str(tmp_path)],
                                stdout=subprocess.DEVNULL)

    node = redis_with("first")
    url = f"redis://:first@127.0.0.1:{port}/0"
    s = Stack(url, demo_model)
    try:
        b = s.add_backend("b0", None, "--engine", "sim")
        g = s.add_gateway()
        s.wait()
        node.kill()
        node.wait(10)
        time.sleep(3)  # both notice it is gone (heartbeat 1 s here, refresh 1 s)
        node = redis_with("second")
        says = f"Redis at redis://:***@127.0.0.1:{port}/0 refused the password in the URL"
        deadline = time.time() + 20
        while time.time() < deadline and not all(says in p.log_path.read_text() for p in (b, g)):
            time.sleep(0.3)
        for p in (b, g):
            assert p.log_path.read_text().count(says) == 1, p.tail(10)
        health = get_json(b.url + "/health")  # the backend's /health says why too (helper-77: only "redis": false)
        assert health["redis"] is False and health["redis_problem"].startswith(
            "Redis refused the password in the URL (invalid username-password pair"), health
    finally:
        s.stop()
        node.kill()
        node.wait(10)


def _events(r, k, kind, backend):
    from mlxgw import schema

    return [e for e in (schema.decode_event(f) for _, f in r.xrange(k.events))
            if e["type"] == kind and e["backend"] == backend]


def test_the_event_feed_shows_a_killed_backend_lost_and_its_next_start(make_stack, redis_server):
    """Starts and crashes are in the event stream (helper-85: the feed showed saves, evictions
    and routing only, so joins, restarts and crashes were invisible there): a backend's first
    registration writes `started` (with how the run before ended), and a gateway's janitor a
    `lost` event, once, for a listed backend whose record expired without its withdrawal."""
    from mlxgw import schema

    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    b1 = s.add_backend("b1", None, "--engine", "sim")
    s.add_gateway("--janitor-grace", "6")  # sweeps every 3 s
    s.wait()
    import redis

    r = redis.Redis.from_url(redis_server.url)  # bytes: the events' data field is msgpack
    k = schema.Keys(s.namespace, s.model_name)
    (first,) = _events(r, k, "started", "b0")
    assert (first["epoch"], first["data"]) == ("1", {"url": b0.url})  # an id's first run
    b0.kill()
    deadline = time.time() + 20
    while not _events(r, k, "lost", "b0") and time.time() < deadline:
        time.sleep(0.2)
    (lost,) = _events(r, k, "lost", "b0")
    assert lost["epoch"] == "1" and lost["data"]["silent_s"] >= 1.5, lost  # the record's TTL is 2 s
    while r.zscore(k.backends, "b0") is not None and time.time() < deadline + 10:
        time.sleep(0.2)  # more sweeps, and the janitor unlists it: still one event for that run
    assert len(_events(r, k, "lost", "b0")) == 1 and r.zscore(k.backends, "b0") is None
    assert _events(r, k, "lost", "b1") == []
    b0.start(s.env())
    b0.wait_healthy()
    assert [(e["epoch"], e["data"].get("previous")) for e in _events(r, k, "started", "b0")] == [
        ("1", None), ("2", "stopped")]  # unlisted by the janitor: as after a clean stop
    # A backend killed and started again while still listed (within the 6 s grace): its next run says so.
    b1.kill()
    b1.start(s.env())
    b1.wait_healthy()
    assert [(e["epoch"], e["data"].get("previous")) for e in _events(r, k, "started", "b1")][-1] == ("2", "vanished")
    # `mlxgw status` shows them in its recent events.
    out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url,
                          "--namespace", s.namespace], capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"lost\s+b0\s+silent_s=", out) and re.search(r"started\s+b1\s+url=\S+ previous=vanished", out), out
