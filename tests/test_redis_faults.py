"""Redis failures (outage, lost data, a freeze, a full memory, wrong passwords, a cluster node) degrade service; they never lose a request or corrupt the index."""

import json
import signal
import subprocess
import sys
import time

import pytest

from mlxgw import schema
from mlxgw.harness import RedisServer, Stack
from mlxgw.httpget import get_json
from chat import ask as _ask
from texts import words


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
        assert get_json(b0.url + "/health")["reports_late"] == 0  # its save was in Redis before its answer
        r.proc.send_signal(signal.SIGSTOP)
        try:
            times = []
            for i in range(4):
                t0 = time.time()
                assert _ask(b0.url, words(200, seed=66 + i))[0] == 200
                times.append(time.time() - t0)
            assert sum(times) < 6.0, times  # each waited >= the 2 s socket timeout before (28 s in all)
            assert get_json(b0.url + "/health")["reports_late"] == 4  # each answered before its save was in Redis
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
