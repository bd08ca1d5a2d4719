"""The backend registry under faults: the janitor, ids and URLs taken twice or unusable, and the event feed of starts and losses."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import redis as redis_lib

from mlxgw.httpget import get_json, post
from chat import ask as _ask
from texts import words


def _events(r, k, kind, backend):
    from mlxgw import schema

    return [e for e in (schema.decode_event(f) for _, f in r.xrange(k.events))
            if e["type"] == kind and e["backend"] == backend]


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


def test_the_event_feed_shows_a_killed_backend_lost_and_its_next_start(make_stack, redis_server):
    """Starts and crashes are in the event stream (helper-85: the feed showed saves, evictions
    and routing only, so joins, restarts and crashes were invisible there): a backend's first
    registration writes `started` (with how the run before ended), and a gateway's janitor a
    `lost` event, once, for a listed backend whose record expired without its withdrawal."""
    from mlxgw import schema

    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    b1 = s.add_backend("b1", None, "--engine", "sim")
    s.add_gateway("--janitor-grace", "10")  # sweeps every 5 s: a restart under load (CI at a385587: over 6 s) stays listed
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
    # A backend killed and started again while still listed (within the 10 s grace): its next run says so.
    b1.kill()
    b1.start(s.env())
    b1.wait_healthy()
    assert [(e["epoch"], e["data"].get("previous")) for e in _events(r, k, "started", "b1")][-1] == ("2", "vanished")
    # `mlxgw status` shows them in its recent events.
    out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url,
                          "--namespace", s.namespace], capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"lost\s+b0\s+silent_s=", out) and re.search(r"started\s+b1\s+url=\S+ previous=vanished", out), out


def test_a_backend_still_loading_is_listed_as_starting_and_not_routed_to(make_stack):
    """A backend registers as `starting` while it loads its model and turns `ready` after: the
    gateway's /health lists it among the live backends and under `starting` meanwhile, and
    routes nothing there (the test harness waits for that list to empty: a refresh from
    before a backend was ready made a test's first scrape read backend_up 0, CI at 1071335)."""
    from mlxgw.schema import Keys

    s = make_stack()
    s.add_backend("b0", None, "--engine", "sim")
    g = s.add_gateway()
    s.wait()
    assert get_json(g.url + "/health")["starting"] == {"demo-tiny": []}
    r, k = redis_lib.Redis.from_url(s.redis_url), Keys(s.namespace, s.model_name)
    rec = {a.decode(): v.decode() for a, v in r.hgetall(k.backend("b0")).items()}
    deadline = time.time() + 10
    while "loading" not in get_json(g.url + "/health")["starting"]["demo-tiny"] and time.time() < deadline:
        r.hset(k.backend("loading"), mapping={**rec, "id": "loading", "state": "starting", "active": "0",
                                              "cache_bytes": "0", "cache_budget_bytes": str(2**40),
                                              "last_heartbeat": f"{time.time():.3f}"})
        r.expire(k.backend("loading"), 30)
        r.zadd(k.backends, {"loading": time.time()})
        time.sleep(0.2)
    h = get_json(g.url + "/health")
    assert sorted(h["backends"]["demo-tiny"]) == ["b0", "loading"] and h["starting"] == {"demo-tiny": ["loading"]}
    # The most free cache would take a cold prompt first: it is not a candidate while starting.
    answers = [_ask(g.url, f"cold {i} " * 30) for i in range(3)]
    assert [(st, hd["X-Mlxgw-Backend"]) for st, hd, _ in answers] == [(200, "b0")] * 3
    assert all("loading" not in hd["X-Mlxgw-Candidates"] for _, hd, _ in answers)
