"""`mlxgw serve`: the whole stack from one command, and its clear start-up errors."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from mlxgw.httpget import get_json
from mlxgw.launcher import Child, _spawn, watch
from mlxgw.harness import free_port, free_port_run
from mlxgw.util import serve_token_file, serve_url_file

MLXGW = [sys.executable, "-m", "mlxgw"]


def _run(args, timeout=60):
    return subprocess.run(MLXGW + args, capture_output=True, text=True, timeout=timeout)


def test_serve_embedded_redis_two_backends_and_clean_stop(demo_model, tmp_path):
    port = free_port()
    bport = free_port_run(2, avoid=(port,))
    rport = next(p for p in iter(free_port, None) if p not in (port, bport, bport + 1))
    log = open(tmp_path / "serve.log", "wb")
    # The shipped offline config (2 backends of the demo model); flags override its ports.
    demo_toml = Path(__file__).parent.parent / "configs" / "demo.toml"
    kv = tmp_path / "kv"
    p = subprocess.Popen(MLXGW + ["serve", "--config", str(demo_toml), "--port", str(port), "--backend-port", str(bport),
                                  "--cache-dir", str(kv), "--redis-port", str(rport)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        h = None
        while time.time() < deadline:
            h = get_json(f"http://127.0.0.1:{port}/health")
            if h and len(h.get("backends", {}).get("demo-tiny", [])) == 2:
                break
            assert p.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.3)
        assert sorted(h["backends"]["demo-tiny"]) == ["demo-tiny-0", "demo-tiny-1"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
        # Backends demand the launcher's internal token: nobody skips the gateway.
        assert get_json(f"http://127.0.0.1:{bport}/v1/models")["error"]["type"] == "authentication_error"
        # A crashed backend is restarted by the launcher and registers a new epoch.
        before = get_json(f"http://127.0.0.1:{bport}/health")
        os.kill(before["pid"], signal.SIGKILL)
        deadline = time.time() + 60
        after = None
        while time.time() < deadline:
            after = get_json(f"http://127.0.0.1:{bport}/health")
            if after and after.get("status") == "ok" and after["pid"] != before["pid"]:
                break
            time.sleep(0.3)
        assert after["pid"] != before["pid"] and after["epoch"] == before["epoch"] + 1
        deadline = time.time() + 10
        while time.time() < deadline:
            if sorted(get_json(f"http://127.0.0.1:{port}/health")["backends"]["demo-tiny"]) == ["demo-tiny-0", "demo-tiny-1"]:
                break
            time.sleep(0.2)
        r = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
        deadline = time.time() + 10
        while "mlxgw is ready" not in (tmp_path / "serve.log").read_text() and time.time() < deadline:
            time.sleep(0.1)
        out = (tmp_path / "serve.log").read_text()
        assert "mlxgw is ready" in out and f"http://127.0.0.1:{port}/v1" in out
        # the URLs the backends registered (loopback: Redis is on this machine)
        assert f"  backends   demo-tiny-0 http://127.0.0.1:{bport}, demo-tiny-1 http://127.0.0.1:{bport + 1}" in out
        # The demo_model fixture built it: serve says it reuses that one (and where it is).
        assert f"using the demo model built earlier: {demo_model}" in out and "building the demo model" not in out
        # `mlxgw status` finds this stack's embedded Redis through the file serve leaves
        # (in the tests' own cache dir, never the user's: tests/conftest.py) ...
        assert serve_url_file().read_text().startswith("redis://")
        # ... on the port asked for (helper-69, -76, -77: it could not be chosen)
        assert serve_url_file().read_text().strip().endswith(f"@127.0.0.1:{rport}/0"), serve_url_file().read_text()
        assert serve_url_file().parent == Path(os.environ["MLXGW_CACHE_DIR"]) and Path.home() not in serve_url_file().parents
        # ... and its internal token beside it, readable only by the user, so a gateway or backend
        # can join this stack by hand (helper-48 had to restart serve with a token of its own).
        tok = serve_token_file()
        assert tok.parent == serve_url_file().parent and tok.stat().st_mode & 0o777 == 0o600
        req = urllib.request.Request(f"http://127.0.0.1:{bport}/v1/models",
                                     headers={"Authorization": "Bearer " + tok.read_text().strip()})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert f"  join       MLXGW_INTERNAL_TOKEN=$(cat {tok}) MLXGW_REDIS_URL=$(cat {serve_url_file()})" in out
        assert "(demo-tiny: 16 decode slots each)" in out
        assert (f"  kv kept    demo-tiny: prompt caches saved at stop and when idle, restored at start, in "
                f"{kv.resolve()}/demo-tiny-<i>"
                in out) and "  stop       Ctrl-C   (the backends save their prompt caches first)" in out
        st = _run(["status", "--json"])
        assert st.returncode == 0 and "demo-tiny-0" in st.stdout
        st = _run(["status"])  # says which Redis it read, and from where
        assert st.returncode == 0 and f"(from {serve_url_file()})" in st.stdout
        assert "model demo-tiny (cache layout shared)" in st.stdout, st.stdout
        # The embedded Redis dies: serve starts it again (same URL, empty), the backends
        # re-publish and register, and prefix routing comes back.
        import redis

        url = serve_url_file().read_text().strip()
        text = "You are a careful assistant. " * 40
        client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": text}], max_tokens=2)
        client = client.with_options(max_retries=0)  # see every answer
        os.kill(redis.Redis.from_url(url).info()["process_id"], signal.SIGKILL)
        deadline = time.time() + 30
        headers = {}
        while time.time() < deadline:
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="demo-tiny", messages=[{"role": "user", "content": text}], max_tokens=2)
            except openai.APIStatusError as e:
                # Until the backends' next heartbeat re-registers them in the empty Redis:
                # a 503 that says when to come back.
                assert e.status_code == 503 and e.response.headers["Retry-After"] == "1", e
                continue
            headers = raw.headers
            if headers.get("X-Mlxgw-Lookup") == "ok" and int(headers["X-Mlxgw-Matched-Tokens"]) >= 128:
                break
            time.sleep(0.3)
        assert headers.get("X-Mlxgw-Lookup") == "ok" and int(headers["X-Mlxgw-Matched-Tokens"]) >= 128, dict(headers)
        assert get_json(f"http://127.0.0.1:{port}/health")["degraded"] is False
        assert "embedded Redis exited with code -9; starting it again" in (tmp_path / "serve.log").read_text()
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    assert rc == 0
    # --cache-dir: each backend saved its cache in a directory of its own at the stop.
    out = (tmp_path / "serve.log").read_text()
    for i in (0, 1):
        assert f"saved the prompt cache to {kv.resolve()}/demo-tiny-{i}: " in out, out[-3000:]
        assert (kv / f"demo-tiny-{i}" / "snapshot" / "manifest.json").exists()
    # ... and that file goes with the stack, so status never points at a dead Redis.
    assert not serve_url_file().exists()
    for prt in (port, bport, bport + 1):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", prt)) != 0, f"port {prt} still open after stop"


def test_serve_gone_by_sighup_or_sigkill_leaves_nothing_running(demo_model, tmp_path):
    """A closed terminal (SIGHUP) stops the stack as Ctrl-C does; a serve killed outright
    (SIGKILL) leaves no child behind either: they notice their parent is gone (mlxgw.stopping)
    and the gateway stops the embedded Redis. Both used to leave everything running, holding
    the ports the next serve needs (helper-46)."""
    import psutil

    for sig in (signal.SIGHUP, signal.SIGKILL):
        kids = []
        port = free_port()
        bport = free_port_run(1, avoid=(port,))
        logf = tmp_path / f"serve-{sig.name}.log"
        # SIGHUP as a terminal session has it, however this test run was started (nohup ignores it).
        # (and a budget too small to cache anything: the ready summary repeats the backends' warning)
        # SIGHUP: a drain far longer than the test waits, cut short by a second stop signal
        drain = "60" if sig == signal.SIGHUP else "1"
        p = subprocess.Popen(MLXGW + ["serve", "--backends", "1", "--port", str(port), "--backend-port", str(bport),
                                      "--cache-bytes", "64K", "--drain-seconds", drain],
                             stdout=open(logf, "wb"), stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        try:
            deadline = time.time() + 120
            while time.time() < deadline and "mlxgw is ready" not in logf.read_text():
                assert p.poll() is None, logf.read_text()
                time.sleep(0.3)
            kids = psutil.Process(p.pid).children(recursive=True)
            names = sorted(k.name() for k in kids)
            assert len(kids) == 3 and any("redis-server" in n for n in names), names  # gateway, backend, Redis
            redis_proc = next(k for k in kids if "redis-server" in k.name())
            if True:  # with an answer still streaming, which the gateway drains
                import threading

                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(demo_model)
                stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
                streamed = []

                def stream():
                    try:
                        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
                        for _ in client.chat.completions.create(
                                model="demo-tiny", max_tokens=2000, stream=True, logit_bias={str(i): -100 for i in stops},
                                messages=[{"role": "user", "content": "go on"}]):
                            streamed.append(1)
                    except Exception:
                        pass  # cut off when its backend stops: expected

                threading.Thread(target=stream, daemon=True).start()
                deadline = time.time() + 30
                while len(streamed) < 20 and time.time() < deadline:
                    time.sleep(0.1)
                assert len(streamed) >= 20
            p.send_signal(sig)
            t_stop = time.time()
            if sig == signal.SIGHUP:  # Ctrl-C again (helper-69: ignored, the 60-s drain ran on)
                time.sleep(1.0)
                p.send_signal(signal.SIGINT)
            rc = p.wait(30)
            took = time.time() - t_stop
            # Redis first: it went while the answer was still draining (it leaked when the
            # drain outlasted the orphan's 20-s exit: helper-47).
            gone, alive = psutil.wait_procs([redis_proc], timeout=5)
            assert not alive, (sig.name, logf.read_text()[-2000:])
            gone, alive = psutil.wait_procs(kids, timeout=30)
            assert not alive, (sig.name, [k.name() for k in alive], logf.read_text()[-2000:])
        finally:  # nothing of this test left behind, whatever failed
            for k in kids:
                if k.is_running():
                    k.kill()
            if p.poll() is None:
                p.kill()
        out = logf.read_text()
        assert ("mlxgw is ready" in out and "  warning    demo-tiny: --cache-bytes 64K is 65536 bytes: less than 256 "
                "tokens of this model's KV (512 bytes a token), so next to nothing will be cached"
                in out.split("mlxgw is ready", 1)[1]), out[-3000:]
        if sig == signal.SIGHUP:
            assert rc == 0 and "mlxgw stopped." in out and took < 25, (took, out[-2000:])
            assert "mlxgw: stopping; answers in flight get up to 60 s to finish (Ctrl-C again to end them now)" \
                in out, out[-2000:]
            assert ("mlxgw: stopping now: the gateway ends its answers in flight (the backends still save their "
                    "caches; Ctrl-C once more to kill everything)") in out, out[-2000:]
            assert "stopping now (a second stop signal): 1 answer(s) in flight end without their drain" in out, \
                out[-2000:]
            assert ("answer from demo-tiny-0 cut: the gateway is stopping and it was cut short by a second stop "
                    "signal") in out, out[-2000:]
        else:
            assert rc == -signal.SIGKILL
            assert "the mlxgw serve that started it" in out and "is gone; stopping" in out, out[-2000:]
            assert "stopped the embedded Redis at redis://:***@127.0.0.1:" in out, out[-2000:]
            # serve's --drain-seconds reached the gateway (it took the flag and passed none on)
            assert "1 answer(s) in flight get up to 1 s to finish (--drain-seconds)" in out, out[-2000:]
        for prt in (port, bport):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", prt)) != 0, f"port {prt} still open after {sig.name}"


def test_a_backend_started_under_nohup_outlives_sighup(make_stack):
    """SIGHUP stops a backend (a closed terminal), unless it was started ignoring SIGHUP as
    ``nohup`` does: a backend started that way on another Mac must outlive the SSH session
    (it did until SIGHUP became a stop signal; helper-47)."""
    s = make_stack()
    kept = s.add_backend("kept", None, "--engine", "sim", start=False)
    kept.preexec_fn = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)
    kept.start(s.env())
    stopped = s.add_backend("stopped", None, "--engine", "sim", start=False)
    stopped.preexec_fn = lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)  # however this run was started
    stopped.start(s.env())
    kept.wait_healthy()
    stopped.wait_healthy()
    for b in (kept, stopped):
        b.proc.send_signal(signal.SIGHUP)
    assert stopped.proc.wait(20) == 0 and "backend stopped stopped" in stopped.log_path.read_text()
    time.sleep(1)
    assert kept.proc.poll() is None and get_json(kept.url + "/health")["status"] == "ok"


def test_a_port_is_checked_in_its_hosts_address_family():
    """helper-68: `serve --host ::` always said its port was in use (an IPv4 socket cannot bind ::)."""
    import pytest

    from mlxgw.launcher import port_free

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as v4:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        taken = v4.getsockname()[1]
        assert port_free("127.0.0.1", taken) is False
        assert port_free("127.0.0.1", free_port()) is True
    try:
        v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        v6.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 on this machine")
    with v6:
        v6.listen()
        assert port_free("::1", v6.getsockname()[1]) is False
        assert port_free("::", free_port()) is True and port_free("::1", free_port()) is True


def test_serve_reaches_its_gateway_at_the_loopback_of_its_listen_family():
    """helper-69: `serve --host ::` probed the gateway at 127.0.0.1 (it listens IPv6 only) and
    never said it was ready; a gateway on one address of the machine is probed there."""
    from mlxgw.util import local_base_url

    assert [local_base_url(h, 8000) for h in ("::", "0.0.0.0", "127.0.0.1", "10.1.2.3", "::1", "fe80::1")] == [
        "http://[::1]:8000", "http://127.0.0.1:8000", "http://127.0.0.1:8000", "http://10.1.2.3:8000",
        "http://[::1]:8000", "http://[fe80::1]:8000"]


def test_missing_model_path():
    r = _run(["serve", "--model", "/nonexistent/model", "--port", str(free_port())])
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_a_hub_model_that_cannot_be_fetched_is_one_error_line():
    """A hub id with no network (here: the hub's offline mode) is an expected failure: one
    line naming the cause and the way out, no traceback (a serve of three such backends
    printed about 200 lines of them before session 28)."""
    r = subprocess.run(MLXGW + ["backend", "--model", "mlxgw-test/no-such-model", "--port", str(free_port()),
                                "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "model load failed" in r.stderr and "looked up on the Hugging Face hub" in r.stderr, r.stderr


def test_status_says_where_a_dead_redis_url_came_from(tmp_path):
    # A serve that died without cleaning up left its URL: status names that file's source.
    (tmp_path / "serve-redis-url").write_text(f"redis://127.0.0.1:{free_port()}/0\n")
    for cmd in (["status"], ["top", "--iterations", "1"]):  # top used to leave the hint out
        r = subprocess.run(MLXGW + cmd, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "MLXGW_CACHE_DIR": str(tmp_path)})
        assert r.returncode == 4 and "Redis unreachable" in r.stderr, cmd
        assert "the URL a `mlxgw serve` left: is that serve still running, and the Redis it uses?" in r.stderr, cmd
    # --json: a script reading stdout gets JSON saying so (it used to get nothing at all).
    r = subprocess.run(MLXGW + ["status", "--json"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MLXGW_CACHE_DIR": str(tmp_path)})
    err = json.loads(r.stdout)["error"]
    assert r.returncode == 4 and err["type"] == "redis_unreachable", r.stdout
    assert err["redis_url"] == (tmp_path / "serve-redis-url").read_text().strip(), err
    assert err["hint"] == "the URL a `mlxgw serve` left: is that serve still running, and the Redis it uses?" and err["message"], err


def test_status_on_a_redis_that_never_answers_says_so():
    """A frozen Redis (SIGSTOP) accepts connections and answers nothing: `status` gives up after
    two reply timeouts and says that, not only redis-py's "Timeout reading from"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        t0 = time.monotonic()
        r = _run(["status", "--redis-url", f"redis://127.0.0.1:{s.getsockname()[1]}/0"])
    assert r.returncode == 4 and "did not answer within 3 s, twice" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def test_gateway_refuses_a_zero_publish_interval():
    r = _run(["gateway", "--load-publish-ms", "0", "--port", str(free_port())])
    assert r.returncode == 2 and "--load-publish-ms must be > 0 (got 0)" in r.stderr


def test_port_in_use(demo_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _run(["serve", "--model", demo_model, "--port", str(s.getsockname()[1])])
    assert r.returncode == 3 and "in use" in r.stderr


def test_redis_unreachable(demo_model):
    r = _run(["serve", "--model", demo_model, "--port", str(free_port()), "--backend-port", str(free_port_run(2)),
              "--redis-url", f"redis://127.0.0.1:{free_port()}/0"])
    assert r.returncode == 4 and "Redis unreachable" in r.stderr


def test_not_enough_memory_is_refused_before_loading(demo_model):
    # 40,000 tiny backends (ports 20000-59999, all valid) need more memory than any test machine has.
    # (The memory check comes before the ports are tried, so these need not be free.)
    r = _run(["serve", "--model", demo_model, "--backends", "40000", "--port", "19999", "--backend-port", "20000"])
    assert r.returncode == 5 and "not enough memory" in r.stderr


def test_watch_does_not_restart_children_stopped_with_the_launcher(caplog):
    """A terminal's Ctrl-C reaches the whole process group: children that exit with the
    launcher are not crashes (no "restarting" warning, no respawn); a crash is."""
    c = Child("b0", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), "")
    _spawn(c)
    stop = []

    def ctrl_c(_interval):  # the signal lands during the sleep; the child exits with it
        stop.append(True)
        c.proc.terminate()
        c.proc.wait(10)

    first = c.proc
    with caplog.at_level("WARNING", logger="mlxgw.serve"):
        watch([c], lambda: bool(stop), sleep=ctrl_c)
    assert c.proc is first and c.restarts == 0 and c.next_start == 0.0
    assert "restarting" not in caplog.text

    # Without a stop, the same exit is a crash: logged, then restarted after the backoff.
    calls = []

    def crash_then_stop(_interval):
        calls.append(True)
        if len(calls) == 1:
            c.proc.kill()
            c.proc.wait(10)
        elif len(calls) == 2:
            c.next_start = time.time()  # skip the 0.5 s backoff
        else:
            stop.append(True)

    stop.clear()
    caplog.clear()
    _spawn(c)
    first = c.proc
    with caplog.at_level("WARNING", logger="mlxgw.serve"):
        watch([c], lambda: bool(stop), sleep=crash_then_stop)
    try:
        assert "b0 exited with code -9; restarting in 0.5s" in caplog.text
        assert c.proc is not first and c.proc.poll() is None and c.restarts == 1
    finally:
        c.proc.kill()
        c.proc.wait(10)


def test_a_stopping_serve_puts_back_the_url_of_one_still_running(redis_server):
    """Two serves of one user: the second overwrites the URL file `mlxgw status` reads; when
    it stops, the first one's URL comes back if that Redis still answers, else the file goes."""
    from mlxgw.launcher import _forget_url, _write_url

    f, t = serve_url_file(), serve_token_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    mine = f"redis://127.0.0.1:{free_port()}/0"
    try:
        _write_url(mine, "mytoken")
        assert t.read_text().strip() == "mytoken" and t.stat().st_mode & 0o777 == 0o600
        _forget_url(mine, redis_server.url, "firsttoken")  # the first serve's Redis answers
        assert (f.read_text().strip(), t.read_text().strip()) == (redis_server.url, "firsttoken")
        _write_url(mine, "mytoken")
        _forget_url(mine, f"redis://127.0.0.1:{free_port()}/0", "firsttoken")  # it is gone
        assert not f.exists() and not t.exists()
        _write_url(redis_server.url, "third")  # a third serve replaced ours meanwhile: left alone
        _forget_url(mine, "", "")
        assert (f.read_text().strip(), t.read_text().strip()) == (redis_server.url, "third")
        # helper-68: a second serve on the same Redis (another --namespace) took the first's
        # token with it when it stopped
        _write_url(redis_server.url, "second")
        _forget_url(redis_server.url, redis_server.url, "third", token="second")
        assert (f.read_text().strip(), t.read_text().strip()) == (redis_server.url, "third")
    finally:
        f.unlink(missing_ok=True)
        t.unlink(missing_ok=True)


def test_watch_does_not_restart_a_child_that_exited_for_a_setting(caplog):
    """Exit 2 (a live backend's --id, a backend replaced under its id) or 6 is a setting to change:
    serve restarted it every 30 s for good (helper-64); it is said once and left stopped."""
    c = Child("b0", [sys.executable, "-c", "import sys; sys.exit(2)"], dict(os.environ), "")
    _spawn(c)
    c.proc.wait(30)
    first, calls = c.proc, []

    def tick(_interval):
        calls.append(True)
        if len(calls) == 2:
            c.next_start = time.time() if c.next_start != float("inf") else c.next_start

    with caplog.at_level("WARNING", logger="mlxgw.serve"):
        watch([c], lambda: len(calls) >= 4, sleep=tick)
    assert c.proc is first and c.restarts == 0 and c.next_start == float("inf")
    assert caplog.text.count("b0 exited with code 2 (a setting to change; its log above says why): not "
                             "restarted") == 1, caplog.text
    assert "restarting" not in caplog.text


def test_watch_kills_and_restarts_a_child_that_stopped_answering(caplog, monkeypatch):
    """A hung (stopped) backend left the registry and stayed there, the stack short of it, until
    someone acted (helper-64). A child whose health URL does not answer for `hung_after` s is
    killed and restarted; one that answers, even 503 (a model loading), is left alone."""
    import http.server
    import threading

    import mlxgw.launcher as launcher

    class Loading(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(launcher, "PROBE_EVERY", 0.1)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    hung = Child("b0", sleeper, dict(os.environ), "http://127.0.0.1:1/health")  # nothing answers there
    loading = Child("b1", sleeper, dict(os.environ), f"http://127.0.0.1:{srv.server_port}/health")
    for c in (hung, loading):
        _spawn(c)
    first, t0 = hung.proc, time.time()
    try:
        with caplog.at_level("WARNING", logger="mlxgw.serve"):
            watch([hung, loading], lambda: hung.restarts >= 1 or time.time() - t0 > 20, interval=0.2,
                  hung_after=1.0)
        assert hung.restarts == 1 and first.returncode == -9 and hung.proc.poll() is None
        assert "b0 has not answered http://127.0.0.1:1/health for 1 s (hung or stopped); killing it" in caplog.text
        assert loading.proc.poll() is None and loading.restarts == 0 and "b1 has not answered" not in caplog.text
    finally:
        srv.shutdown()
        for c in (hung, loading):
            c.proc.kill()
            c.proc.wait(10)


def test_the_ready_summary_names_the_url_each_backend_registers(capsys):
    """helper-77: backends on `host = "0.0.0.0"` with Redis elsewhere register this machine's
    network address, while serve's summary printed the loopback address it probes them at.
    serve gives each backend child the URL it registers (`backend.main.advertised_url`, tested
    in test_registry_faults) and the summary prints that."""
    from backend.main import advertised_url
    from mlxgw import config
    from mlxgw.launcher import Child, _summary

    cfg = config.ServeConfig(models=[config.ModelConfig(name="coder", host="0.0.0.0")])
    far = advertised_url("0.0.0.0", 9741, "redis://:pw@192.0.2.7:6379/0")[0]  # Redis on another machine
    assert far.endswith(":9741") and not far.startswith(("http://127.", "http://[::1]")), far
    _summary(cfg, "redis://:pw@192.0.2.7:6379/0", False,
             [Child("coder-1", [], {}, "http://127.0.0.1:9741/health", url=far)])
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("  backends"))
    assert line.startswith(f"  backends   coder-1 {far}   ("), line
