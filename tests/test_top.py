"""``mlxgw top``: live view from Redis alone, bounded by --iterations."""

import json
import re
import subprocess
import sys
import time

import redis

from mlxgw.httpget import post
from mlxgw.redis_client import connect
from mlxgw.status import History, collect, model_total
from mlxgw.top import render, sparkline
from rich.console import Console
from texts import words


def test_top_live_against_stack(make_stack, redis_server):
    s = make_stack()
    s.add_backend("b0")
    s.add_backend("b1")
    s.add_gateway()
    s.wait()
    msg = {"model": s.model_name, "messages": [{"role": "user", "content": words(200, seed=21)}], "max_tokens": 8}
    assert post(s.gateway.url + "/v1/chat/completions", msg)[0] == 200

    top = subprocess.Popen([sys.executable, "-m", "mlxgw", "top", "--redis-url", redis_server.url, "--namespace",
                            s.namespace, "--iterations", "4", "--interval", "0.6"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while top.poll() is None and time.time() - t0 < 60:  # the same prompt again for as long as top runs
        post(s.gateway.url + "/v1/chat/completions", msg)
        time.sleep(0.1)
    stdout, stderr = top.communicate(timeout=30)
    assert top.returncode == 0, stderr
    assert time.time() - t0 < 30
    frames = stdout.split("mlxgw top  namespace")[1:]
    assert len(frames) == 4  # bounded: exactly --iterations frames
    # Even the first frame has measured rates (a baseline snapshot is taken before it), not "-".
    assert re.search(r"model demo-tiny: 2 backends \(2 live\), \d+ active; last interval: \d+\.\d\d req/s, "
                     r"token hit ratio \d\.\d\d",
                     frames[0])
    last = frames[-1]
    assert "model demo-tiny: 2 backends" in last
    rows = {ln.split("│")[1].strip(): ln for ln in last.splitlines() if ln.startswith("│")}
    assert set(rows) == {"b0", "b1"}
    # The owner of the prompt served the repeats: a nonzero cumulative hit ratio and a full-height bar.
    owner = max(rows, key=lambda b: float(rows[b].split("│")[8]))
    assert float(rows[owner].split("│")[8]) > 0.5
    assert "█" in rows[owner].split("│")[9]
    assert "routed" in last and "matched=" in last


def test_top_sorts_by_load_and_rates_follow_counters(make_stack, redis_server):
    s = make_stack()
    s.add_backend("b0")
    s.add_backend("b1")
    s.wait()
    r = redis.Redis.from_url(redis_server.url)  # bytes, as `mlxgw top` reads (events carry msgpack)
    data = collect(r, s.namespace)
    recs = data[s.model_name]["backends"]
    assert {x["id"] for x in recs} == {"b0", "b1"}
    # Same real records, b1 made the busier one: it must come first.
    for x in recs:
        x["active"] = "3" if x["id"] == "b1" else "0"
    hist = History()
    hist.add(data, t=100.0)
    later = {m: {"backends": [dict(x) for x in d["backends"]], "recent_events": []} for m, d in data.items()}
    for x in later[s.model_name]["backends"]:
        if x["id"] == "b1":
            for k, inc in (("requests", 4), ("prompt_tokens", 400), ("cached_tokens", 300),
                           ("generated_tokens", 20), ("ttft_seconds_sum", 0.2), ("ttft_count", 4)):
                x[k] = str(float(x.get(k, 0)) + inc)
    hist.add(later, t=102.0)
    (p,) = hist.backend_series(s.model_name, "b1")
    assert p == {"t": 102.0, "rps": 2.0, "hit_ratio": 0.75, "gen_tps": 10.0, "ttft_ms": 50.0}
    assert hist.model_series(s.model_name)[-1]["rps"] == 2.0
    con = Console(width=150, record=True)
    con.print(render(later, hist, s.namespace))
    text = con.export_text()
    rows = [ln.split("│")[1].strip() for ln in text.splitlines() if ln.startswith("│")]
    assert rows == ["b1", "b0"]
    assert "model demo-tiny: 2 backends (2 live), 3 active; last interval: 2.00 req/s" in text, text
    # helper-69: one whose check of its own URL failed was counted as serving
    for x in later[s.model_name]["backends"]:
        if x["id"] == "b1":
            x["url_problem"] = "its registered URL http://127.0.0.1:1 refused the connection"
    con = Console(width=150, record=True)
    con.print(render(later, hist, s.namespace))
    text = con.export_text()
    assert "model demo-tiny: 2 backends (1 live, 1 url problem), 0 active" in text, text
    assert sparkline([0.0, 0.5, 1.0, None], hi=1.0) == "▁▅█ "


def test_status_titles_name_the_cache_layouts():
    from mlxgw.status import layouts_note

    assert layouts_note([{"cache_layout": "shared"}, {"cache_layout": "shared"}]) == " (cache layout shared)"
    assert layouts_note([{"cache_layout": "whole"}, {"cache_layout": "shared"}, {"cache_layout": "shared"}]) == (
        " (cache layouts shared x2, whole x1)")
    assert layouts_note([{"id": "b0"}]) == ""  # a backend from before the field


def test_a_backend_that_missed_its_heartbeats_shows_as_silent():
    from mlxgw.status import backend_view

    rec = {"id": "b0", "state": "ready", "last_heartbeat": "100.0", "heartbeat_interval": "1.0"}
    assert backend_view(rec, now=102.0)["state"] == "ready"  # two intervals: one beat late at most
    v = backend_view(rec, now=103.6)
    assert (v["state"], v["silent"], v["age_s"]) == ("silent 4s", True, 3.6)
    slow = {**rec, "heartbeat_interval": "10"}
    assert backend_view(slow, now=120.0)["state"] == "ready"
    assert backend_view({k: v for k, v in rec.items() if k != "heartbeat_interval"}, now=103.0)["silent"]  # 1 s default


def test_status_total_row_sums_backends_and_pools_the_hit_ratio():
    from mlxgw.status import total_row

    now = time.time()
    recs = [{"id": "a", "state": "ready", "active": "2", "queued_prefill_tokens": "100", "cache_entries": "3",
             "cache_bytes": str(3 * 2**20), "cache_evictions": "1", "prompt_tokens": "1000", "cached_tokens": "900",
             "last_heartbeat": str(now), "heartbeat_interval": "1"},
            {"id": "b", "state": "ready", "active": "1", "queued_prefill_tokens": "0", "cache_entries": "1",
             "cache_bytes": str(2**20), "cache_evictions": "0", "prompt_tokens": "3000", "cached_tokens": "100",
             "last_heartbeat": str(now - 60), "heartbeat_interval": "1"}]
    # 1000 cached of 4000 prompt tokens: 0.25, not the mean of 0.90 and 0.03; b is silent: its
    # cache counts, its stale request does not
    assert total_row(recs) == ["total", "1 live", "", "2", "100", "", "4", "4.0", "1", "0.25", "", ""]


def test_cache_and_disk_mib_are_rounded_once_as_health_figures_would_be():
    """0.7498 MiB reads "0.7" in the table, as ``f"{health['disk_bytes'] / 2**20:.1f}"`` does; the
    view rounded to two decimals first (0.75, then "0.8")."""
    from mlxgw.status import backend_view, total_row

    now = time.time()
    nbytes = int(0.7498 * 2**20)
    rec = {"id": "a", "state": "ready", "active": "0", "queued_prefill_tokens": "0", "cache_entries": "1",
           "cache_bytes": str(nbytes), "disk_bytes": str(nbytes), "disk_budget_bytes": str(64 << 20),
           "disk_reads": "1", "last_heartbeat": str(now), "heartbeat_interval": "1"}
    v = backend_view(rec, now)
    assert (f"{v['cache_mb']:.1f}", f"{v['disk_mb']:.1f}") == ("0.7", "0.7")
    assert total_row([rec])[7:10] == ["0.7", "0", "0.7 / 1"]


def test_a_cache_the_kv_in_flight_empties_is_named():
    """helper-86: a backend running 16 contexts in a 2 GiB budget kept nothing (every save evicted
    at once) and status showed only ``cache MiB`` 0. Named when entries are 0 while at least two
    requests run and the budget has evicted; not for an idle or a fresh backend."""
    from mlxgw.status import problem_lines, starved_cache_lines

    base = {"id": "a", "active": "16", "cache_entries": "0", "cache_evictions": "287",
            "cache_budget_bytes": str(2 << 30)}
    assert starved_cache_lines([base]) == [
        "backend a: its prompt cache holds nothing while 16 requests run (287 entries evicted so far): their KV "
        "fills its 2048 MiB budget, so each next turn is computed whole (raise --cache-bytes, or lower "
        "--decode-concurrency)"]
    assert starved_cache_lines([{**base, "active": "1"}, {**base, "cache_evictions": "0"},
                                {**base, "cache_entries": "3"}]) == []
    assert problem_lines({"backends": [base], "gateways": {"g": {}}})[-1].startswith("backend a: its prompt cache")


def test_dead_backends_still_listed_do_not_hide_the_gateways_503_line_and_routed_events_say_why():
    """helper-87: with the only backend dead but still listed (the janitor's grace), the line
    saying the gateways answer 503 was missing; and a routed event's line did not show its route
    reason (a `seed` decision was invisible without --json)."""
    from mlxgw.status import event_line, problem_lines

    d = {"backends": [], "gateways": {"gw1": {}}, "silent": ["b0"]}
    lines = problem_lines(d)
    assert lines[1] == ("no live backend for this model: gateway gw1 answers 503 no_backend until one registers "
                        "(`mlxgw backend` with this --namespace and --served-name)"), lines
    assert problem_lines({**d, "silent": []})[0].startswith("no backend registered for this model: gateway gw1")
    assert problem_lines({**d, "gateways": {}}) == lines[:1]  # nothing serves it: no 503 to speak of
    e = {"type": "routed", "backend": "b1", "ts": "0", "request": "r1", "reason": "seed", "matched": 0,
         "prompt_tokens": 2200, "lookup": "ok"}
    assert event_line(e).split()[1:] == ["routed", "b1", "reason=seed", "matched=0", "prompt_tokens=2200", "lookup=ok"]


def test_active_is_shown_against_the_decode_slots():
    """``12/16``: a backend's active requests of its decode slots (above them requests wait,
    docs/cache-policy.md "Decode slots"); a record without ``decode_slots`` (an older backend)
    shows the bare count."""
    from mlxgw.status import backend_view, model_total, total_row

    now = time.time()
    base = {"state": "ready", "queued_prefill_tokens": "0", "last_heartbeat": str(now), "heartbeat_interval": "1"}
    recs = [{**base, "id": "a", "active": "20", "waiting": "4", "decode_slots": "16"},
            {**base, "id": "b", "active": "3", "waiting": "0", "decode_slots": "16"}]
    assert [backend_view(r, now)["active_text"] for r in recs] == ["20/16", "3/16"]
    assert backend_view({**base, "id": "old", "active": "2"}, now)["active_text"] == "2"
    # Beside them, the two measurements the gateways turn a wait for a slot into tokens with.
    rated = {**recs[0], "prefill_tps": "1843.6", "decode_seconds": "3.249"}
    assert [backend_view(r, now)["rates_text"] for r in (rated, {**rated, "decode_seconds": "0"}, recs[1])] == [
        "1844 / 3.2", "1844 / -", "- / -"]
    t = model_total(recs)
    assert (t["active"], t["slots"], t["waiting"]) == (23, 32, 4)
    assert total_row(recs)[3] == "23/32"
    # A silent backend's (stale) requests and slots, and a left-out one's, are no capacity to use.
    gone = [{**recs[1], "id": "c", "last_heartbeat": str(now - 60)},
            {**recs[1], "id": "d", "left_out_by": {"gw1": "another block size"}}]
    t = model_total(recs + gone)
    assert (t["live"], t["left_out"], t["active"], t["slots"], t["waiting"]) == (2, 1, 23, 32, 4), t
    assert total_row(recs + gone)[1:4] == ["2 live, 1 left out", "", "23/32"]


def test_a_backend_without_the_token_among_ones_with_it_is_named():
    """A backend joined by hand without the internal token answers anyone (helper-49): status
    names it when the model's other backends require the token; all without is a choice."""
    from mlxgw.status import open_backends, open_lines

    recs = [{"id": "a", "auth": "token", "url": "http://h:1"}, {"id": "b", "auth": "none", "url": "http://h:2"},
            {"id": "old", "url": "http://h:3"}]  # an older backend publishes no auth: not named
    assert [r["id"] for r in open_backends(recs)] == ["b"]
    assert open_lines(recs) == ["backend b answers without the internal token the others require: anything that "
                                "reaches http://h:2 can skip the gateways' keys and limits (start it with "
                                "MLXGW_INTERNAL_TOKEN; docs/security.md)"]
    assert open_backends([{**r, "auth": "none"} for r in recs]) == []


def test_status_shows_a_model_whose_only_backend_died_with_that_backend_named(make_stack, redis_server):
    """The only backend killed and no gateway to sweep it: its record expires but the registry
    still lists it. Status said "no models registered" (the model looked as if it never
    existed, helper-59); it names the model and the dead backend."""
    s = make_stack()
    b0 = s.add_backend("b0")
    b0.wait_healthy()
    post(b0.url + "/v1/chat/completions", {"model": s.model_name, "max_tokens": 1,
                                           "messages": [{"role": "user", "content": words(30, seed=59)}]})
    b0.kill()
    r = redis_server.client()
    deadline = time.time() + 15
    while r.exists(f"{s.namespace}:{{{s.model_name}}}:backend:b0") and time.time() < deadline:
        time.sleep(0.2)
    dead: dict = {}
    assert collect(connect(redis_server.url, 5), s.namespace, dead=dead) == {} and dead == {s.model_name: ["b0"]}
    st = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", redis_server.url,
                         "--namespace", s.namespace], capture_output=True, text=True, timeout=60)
    out = st.stdout
    assert "no models registered" not in out and st.returncode == 3, (st.returncode, out)
    assert (f"model {s.model_name}: no live backend or gateway; no heartbeat past their TTL (silent: dead, stopped "
            "or cut off; one that resumes registers again, and a gateway's janitor removes the others after its "
            "--janitor-grace): b0") in out, out
    js = json.loads(subprocess.run([sys.executable, "-m", "mlxgw", "status", "--json", "--redis-url", redis_server.url,
                                    "--namespace", s.namespace], capture_output=True, text=True, timeout=60).stdout)
    # The model's history stays readable (helper-86: with no live backend, `--json` showed no
    # events): the one request's save, after the backend's start.
    evs = js[s.model_name].pop("recent_events")
    assert [(e["type"], e["backend"]) for e in evs] == [("saved", "b0"), ("started", "b0")], evs
    assert js == {s.model_name: {"backends": [], "gateways": {}, "silent": ["b0"],
                                 "total": model_total([]), "disagreements": [], "open_backends": []}}
    assert js[s.model_name]["total"]["live"] == 0
    lines = out.splitlines()
    assert [ln.split()[1:3] for ln in lines[-2:]] == [["saved", "b0"], ["started", "b0"]], out


def test_status_after_a_clean_stop_exits_3_naming_what_served_before(make_stack, redis_server):
    """helper-70: after a clean stop, status said "no models registered" (the models set still
    named the model) and exited 0, as for a healthy cluster: a script could not tell."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    b0.wait_healthy()
    cmd = [sys.executable, "-m", "mlxgw", "status", "--redis-url", redis_server.url, "--namespace", s.namespace]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=60).returncode == 0
    b0.stop()
    st = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    lines = st.stdout.splitlines()
    assert st.returncode == 3 and lines[1:3] == [
        f"no live backend or gateway under namespace '{s.namespace}' (models registered before: {s.model_name})",
        f"model {s.model_name}, recent events:"], (st.returncode, st.stdout)
    # How it went: the backend's withdrawal (`cleared`) after its start, newest first.
    assert [ln.split()[1:3] for ln in lines[3:]] == [["cleared", "b0"], ["started", "b0"]], st.stdout
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60)
    d = json.loads(js.stdout)
    assert js.returncode == 3 and list(d) == [s.model_name] and d[s.model_name]["backends"] == [], js.stdout
    assert [e["type"] for e in d[s.model_name]["recent_events"]] == ["cleared", "started"], js.stdout
    fresh = subprocess.run(cmd[:-1] + [s.namespace + "-none"], capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 3 and fresh.stdout.splitlines()[-1] == (
        f"no live backend or gateway under namespace '{s.namespace}-none'"), fresh.stdout


def test_event_types_keep_a_backends_start_in_view_past_its_saves(make_stack, redis_server):
    """helper-86: lifecycle events (a backend's start, stop, loss) drowned among saves and routing
    decisions in status's last 10. ``--event-types`` picks types (``lifecycle``: started, cleared,
    lost) among each model's last 2,000 events; an unknown type is a usage error (exit 2)."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim")
    b0.wait_healthy()
    for k in range(12):  # twelve distinct prompts: twelve `saved` events after the `started`
        post(b0.url + "/v1/chat/completions", {"model": s.model_name, "max_tokens": 1,
                                               "messages": [{"role": "user", "content": words(40, seed=300 + k)}]})
    cmd = [sys.executable, "-m", "mlxgw", "status", "--redis-url", redis_server.url, "--namespace", s.namespace]

    def shown(*extra):
        out = subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=60).stdout
        return [ln.split()[1:3] for ln in out.splitlines() if re.match(r"\s+\d\d:\d\d:\d\d ", ln)]

    assert shown() == [["saved", "b0"]] * 10
    assert shown("--event-types", "lifecycle") == [["started", "b0"]]
    assert shown("--event-types", "saved,started", "--events", "13") == [["saved", "b0"]] * 12 + [["started", "b0"]]
    assert shown("--events", "0") == []
    js = json.loads(subprocess.run(cmd + ["--json", "--event-types", "started"], capture_output=True, text=True,
                                   timeout=60).stdout)
    assert [(e["type"], e["url"]) for e in js[s.model_name]["recent_events"]] == [("started", b0.url)]
    bad = subprocess.run(cmd + ["--event-types", "lifecycle,bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown event type 'bogus'" in bad.stderr, bad.stderr


def test_top_keeps_polling_while_redis_is_down():
    """Once running, a frame Redis does not answer says so and the next one tries again; top
    quit with code 4 on the first failed poll (helper-63), though `mlxgw serve` restarts its
    Redis within a second. A Redis unreachable at the start is still exit 4."""
    from mlxgw.harness import RedisServer

    r = RedisServer().start()
    try:
        top = subprocess.Popen([sys.executable, "-m", "mlxgw", "top", "--redis-url", r.url, "--iterations", "6",
                                "--interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.6)  # the baseline and a frame or two
        r.stop()
        time.sleep(1.2)
        r.start()  # the same port: clients reconnect
        stdout, stderr = top.communicate(timeout=60)
    finally:
        r.cleanup()
    assert top.returncode == 0, stderr
    frames = stdout.split("mlxgw top  namespace")[1:]
    assert len(frames) == 6, stdout
    down = [f for f in frames if "Redis unreachable at" in f]
    assert down and "Redis unreachable" not in frames[-1], stdout
    gone = subprocess.run([sys.executable, "-m", "mlxgw", "top", "--redis-url", r.url, "--iterations", "1"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 4 and "Redis unreachable" in gone.stderr


def test_top_follows_a_restarted_serve_to_its_new_redis(tmp_path):
    """A restarted `mlxgw serve` runs its embedded Redis on a new port and leaves the new URL in
    its file; a `top` left open on the old URL said "unreachable" for good (helper-64). Started
    without --redis-url, it re-reads the file when its Redis does not answer."""
    import os

    from mlxgw.harness import RedisServer

    old, new = RedisServer().start(), RedisServer().start()
    url_file = tmp_path / "serve-redis-url"
    url_file.write_text(old.url + "\n")
    env = {**os.environ, "MLXGW_CACHE_DIR": str(tmp_path)}
    env.pop("MLXGW_REDIS_URL", None)
    try:
        top = subprocess.Popen([sys.executable, "-m", "mlxgw", "top", "--iterations", "8", "--interval", "0.5"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(1.6)
        old.stop()  # serve stopped; the next one's Redis is elsewhere
        url_file.write_text(new.url + "\n")
        stdout, stderr = top.communicate(timeout=60)
    finally:
        old.cleanup()
        new.cleanup()
    assert top.returncode == 0, stderr
    frames = stdout.split("mlxgw top  namespace")[1:]
    assert len(frames) == 8 and not any("Redis unreachable" in f for f in frames[-4:]), stdout


def test_status_shows_each_backends_uptime_and_epoch():
    """A backend serve restarted (or one crash-looping) showed nowhere but serve's log: no
    uptime, no restart count (helper-64). The table has its time since it registered and its
    epoch, which grows by one with each start under its id."""
    from mlxgw.status import backend_view, duration_text

    now = time.time()
    v = backend_view({"id": "a", "state": "ready", "started_at": str(now - 7), "epoch": "5",
                      "last_heartbeat": str(now)}, now)
    assert (v["up_s"], v["epoch"]) == (7.0, 5)
    assert [duration_text(x) for x in (None, 7, 125, 5400, 3 * 86400)] == ["?", "7s", "2m", "1.5h", "3.0d"]
    assert backend_view({"id": "old", "last_heartbeat": str(now)}, now)["up_s"] is None


def test_status_names_a_gateway_waiting_for_backends(make_stack):
    """helper-74: with only a gateway registered, status exited 3 under an empty table and no
    line said that nothing serves the model."""
    s = make_stack()
    s.add_gateway().wait_healthy(status=503)  # no_backends
    gid = None
    deadline = time.time() + 15
    cmd = [sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url, "--namespace", s.namespace]
    while time.time() < deadline:
        js = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60).stdout)
        if js.get(s.model_name, {}).get("gateways"):
            gid = next(iter(js[s.model_name]["gateways"]))
            break
        time.sleep(0.3)
    assert gid, "the gateway never published its settings"
    st = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    lines = st.stdout.splitlines()
    assert st.returncode == 3 and lines[-2:] == [
        f"model {s.model_name}",
        f"no backend registered for this model: gateway {gid} answers 503 no_backend until one registers "
        "(`mlxgw backend` with this --namespace and --served-name)"], (st.returncode, st.stdout)
    # top shows the same line (helper-77: it showed none of status's lines)
    top = subprocess.run([sys.executable, "-m", "mlxgw", "top", "--redis-url", s.redis_url, "--namespace",
                          s.namespace, "--iterations", "1"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and f"no backend registered for this model: gateway {gid} answers 503" in \
        " ".join(top.stdout.split()), top.stdout
    # And a backend whose --served-name is not the gateway's model is told so, though no backend
    # serves the gateway's model yet (the models set did not name it: the check found nothing).
    typo = s.add_backend("typo", None, "--engine", "sim", "--served-name", "typo-name")
    typo.wait_healthy()
    deadline = time.time() + 20
    while time.time() < deadline and "no gateway serves model" not in typo.log_path.read_text():
        time.sleep(0.5)
    assert ("backend typo: no gateway serves model 'typo-name', so none routes to it; the gateways on this "
            f"Redis serve '{s.model_name}' (is --served-name the gateway's model name?)") in typo.log_path.read_text()


def test_status_says_when_no_gateway_serves_a_models_backends(make_stack):
    """helper-76: backends with no live gateway (none started, another --namespace, or a
    --served-name typo) showed as live in status with no line saying nothing routes to them."""
    s = make_stack()
    s.add_backend("b0", None, "--engine", "sim").wait_healthy()
    status = [sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url, "--namespace", s.namespace]
    st = subprocess.run(status, capture_output=True, text=True, timeout=60)
    out = " ".join(st.stdout.split())
    assert st.returncode == 0 and f"(from --redis-url), namespace {s.namespace}" in out, out
    assert ("no live gateway serves this model, so nothing routes to its backends: no gateway runs under namespace "
            f"'{s.namespace}' (start `mlxgw gateway`, or is its --namespace another?)") in out, out
    # A gateway for the model: the line goes; a backend under a mistyped name gets it, naming the model served.
    s.add_gateway()
    s.wait()
    s.add_backend("typo", None, "--engine", "sim", "--served-name", "demo-tinny").wait_healthy()
    deadline = time.time() + 15
    while time.time() < deadline:
        js = json.loads(subprocess.run(status + ["--json"], capture_output=True, text=True, timeout=60).stdout)
        if "demo-tinny" in js and js[s.model_name]["gateways"]:
            break
        time.sleep(0.3)
    out = " ".join(subprocess.run(status, capture_output=True, text=True, timeout=60).stdout.split())
    assert out.count("no live gateway serves this model") == 1, out
    assert ("no live gateway serves this model, so nothing routes to its backends: the gateways here serve "
            f"'{s.model_name}' (is the backends' --served-name the gateways' model name?)") in out, out


def test_an_idle_backend_beside_one_whose_requests_wait_for_a_slot_is_named():
    """helper-88: b1 idled at 0/16 beside b0 at 16/16 with requests waiting, and only the table
    showed it. Named for a ready backend with nothing to do while a live one has every decode
    slot busy and requests waiting; not while the busy one only fills its slots, nor for a
    backend that is draining, silent or using more than a quarter of its slots."""
    import time

    from mlxgw.status import idle_beside_busy_lines, problem_lines

    now = time.time()
    beat = {"last_heartbeat": str(now), "heartbeat_interval": "1", "state": "ready", "decode_slots": "16"}
    b0 = {**beat, "id": "b0", "active": "16", "waiting": "9", "queued_prefill_tokens": "41000"}
    b1 = {**beat, "id": "b1", "active": "0", "waiting": "0", "queued_prefill_tokens": "0"}
    tail = ("b0 has all 16 decode slots busy and 9 requests waiting for one (41000 prompt tokens queued): the "
            "gateways send a request where the longest prefix of it is cached unless the load there, or its wait "
            "for a slot, outweighs the prefill that saves, so conversations with a long history cached there stay "
            "(docs/routing.md, \"The wait for a decode slot\")")
    line = "backend b1 has nothing to do while " + tail
    assert idle_beside_busy_lines([b0, b1]) == [line]
    # helper-89: 1 of 16 slots in use beside a peer at 19/16 said nothing; up to a quarter is named.
    assert idle_beside_busy_lines([b0, {**b1, "active": "4"}]) == ["backend b1 runs 4 of its 16 decode slots while "
                                                                   + tail]
    assert idle_beside_busy_lines([b0, {**b1, "active": "5"}]) == []
    assert idle_beside_busy_lines([b0, {**b1, "active": "1", "waiting": "1"}]) == []
    assert problem_lines({"backends": [b0, b1], "gateways": {"g": {}}})[-1] == line
    assert idle_beside_busy_lines([{**b0, "waiting": "0"}, b1]) == []  # slots full, nobody waiting
    assert idle_beside_busy_lines([b0, {**b1, "state": "draining"}]) == []
    assert idle_beside_busy_lines([b0, {**b1, "last_heartbeat": str(now - 60)}]) == []  # silent
    assert idle_beside_busy_lines([{**b0, "last_heartbeat": str(now - 60)}, b1]) == []  # the busy one silent


def _cells(text: str, ids: str = "demo-tiny-") -> list[list[str]]:
    """The stripped cells of a rendered table's rows whose text has ``ids``."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if ids in line]


def test_status_table_fits_a_narrow_terminal_with_short_headers_and_whole_figures():
    """helper-94: at 120 columns the table cut every backend id (``demo-t…``). helper-98: at 80
    columns the cells wrapped character by character (the URL over 8 lines, ``0/16`` as ``0/1``
    and ``6``, the hit ratio as ``0.`` and ``74``). Now: every column at full width when they
    fit; else short headers, and columns leave (URL first) with a line naming them; no figure
    is ever split, and a 48 ms decode keeps two digits."""
    import io

    from rich.console import Console

    from mlxgw.status import dropped_line, status_table

    now = time.time()
    base = {"state": "ready", "queued_prefill_tokens": "0", "last_heartbeat": str(now), "heartbeat_interval": "1",
            "decode_slots": "16", "started_at": str(now - 100), "epoch": "1", "prompt_tokens": "1000",
            "cached_tokens": "740"}
    recs = [{**base, "id": "demo-tiny-0", "url": "http://127.0.0.1:11941", "active": "1", "prefill_tps": "3369",
             "decode_seconds": "0.048"},
            {**base, "id": "demo-tiny-1", "url": "http://127.0.0.1:11942", "active": "0", "state": "draining"}]

    def show(width):
        con = Console(width=width, file=io.StringIO(), record=True)
        t, dropped = status_table("demo-tiny", recs, now, width)
        con.print(t)
        text = con.export_text()
        assert max(len(line) for line in text.splitlines()) <= width, text
        return text, dropped

    text, dropped = show(200)
    assert dropped == []
    assert "┃ prefill tok/s / decode s ┃" in text and "┃ hit ratio (tokens) ┃" in text
    assert _cells(text)[0][:6] == ["demo-tiny-0", "ready", "http://127.0.0.1:11941", "1/16", "0", "3369 / 0.048"]
    text, dropped = show(120)
    assert dropped == ["url"]
    assert "┃ pf tok/s / dec s ┃" in text
    assert _cells(text)[1][:5] == ["demo-tiny-1", "draining", "0/16", "0", "- / -"], text
    text, dropped = show(80)
    assert dropped == ["url", "prefill tok/s / decode s", "evictions", "up (epoch)"]
    assert _cells(text) == [["demo-tiny-0", "ready", "1/16", "0", "0", "0.0", "0.74", "0.0"],
                            ["demo-tiny-1", "draining", "0/16", "0", "0", "0.0", "0.74", "0.0"]], text
    assert _cells(text, "total") == [["total", "2 live", "1/32", "0", "0", "0.0", "0.74", ""]], text
    assert dropped_line(dropped) == ("(left out to fit this terminal: url, prefill tok/s / decode s, evictions, "
                                     "up (epoch); a wider terminal or --json shows them)")
    # Without a width (output piped or captured): every column, whole headers.
    assert status_table("demo-tiny", recs, now)[1] == []


def test_top_on_a_narrow_terminal_keeps_whole_figures_and_names_the_columns_left_out():
    """helper-94: with every column unwrappable, `mlxgw top` at 100 columns drew some at zero
    width (empty headers); helper-98: at 80 columns most cells were cut to ellipses (``0/…``).
    Now ids, states, active/slots and the hit ratio stay whole at 80 and 100 columns, the
    columns left out are named, and at 200 every column shows."""
    import io

    from mlxgw.top import History, render

    now = time.time()
    base = {"state": "ready", "queued_prefill_tokens": "0", "last_heartbeat": str(now), "heartbeat_interval": "1",
            "decode_slots": "16", "requests": "10", "prompt_tokens": "1000", "cached_tokens": "460"}
    data = {"demo-tiny": {"backends": [{**base, "id": "demo-tiny-0", "active": "1"},
                                       {**base, "id": "demo-tiny-1", "active": "0", "state": "draining"}],
                          "recent_events": [], "gateways": {}}}
    hist = History()
    hist.add(data, t=now - 2)
    hist.add(data, t=now)
    for width, left_out in ((80, "cache MiB, cache use, requests, hit ratio / interval, heartbeat s"),
                            (100, "cache use, requests, heartbeat s"), (200, None)):
        con = Console(width=width, file=io.StringIO(), record=True)
        con.print(render(data, hist, "ns", now=now, width=width))
        text = con.export_text()
        assert max(len(line) for line in text.splitlines()) <= width, text
        rows = _cells(text)
        assert [r[:4] for r in rows] == [["demo-tiny-0", "ready", "1/16", "0"],
                                         ["demo-tiny-1", "draining", "0/16", "0"]], text
        assert all("0.46" in r for r in rows) and "…" not in text, text
        if left_out is None:
            assert "left out" not in text and "┃ hit ratio / interval ┃" in text, text
        else:
            flat = " ".join(text.split())  # the line wraps at the terminal's width
            assert (f"(left out to fit this terminal: {left_out}; a wider terminal or `mlxgw status --json` shows "
                    "them)") in flat, text
