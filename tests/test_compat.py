"""A backend whose token ids or block keys would not mean what the gateway's do is never
routed to (gateway/index.py `mismatch`): another tokenizer under the same served name (it
would answer nonsense to the ids the gateway forwards), another block size (it would never
match a prefix). The gateways publish what they expect (`schema.Keys.gateway_settings`), so
the backends left out and `mlxgw status` say so too. Real sim backends, a real gateway and
Redis."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mlxgw.httpget import get_json, post


def tokenizer_variant(src: str, dst: Path) -> str:
    """A copy of model ``src`` whose tokenizer gives two ordinary tokens each other's ids
    (weights and config symlinked): a model directory that loads, with another vocabulary."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "tokenizer.json":
            (dst / f.name).symlink_to(f)
    tj = json.loads((Path(src) / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return str(dst)


def s_redis(stack):
    import redis

    return redis.Redis.from_url(stack.redis_url)


def test_the_fingerprint_names_the_vocabulary(demo_model, tmp_path):
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    from mlxgw.prompt import tokenizer_fingerprint

    fp = tokenizer_fingerprint(load_tokenizer(Path(demo_model)))
    assert len(fp) == 16 and int(fp, 16) >= 0
    # the gateway's and the backend's loaders agree; a plain transformers load too
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(demo_model)) == fp
    other = tokenizer_variant(demo_model, tmp_path / "other")
    assert tokenizer_fingerprint(load_tokenizer(Path(other))) != fp


def test_a_backend_with_another_tokenizer_or_block_size_is_left_out(make_stack, tmp_path):
    s = make_stack()
    sim = ("--engine", "sim")
    good = s.add_backend("good", None, *sim)
    g = s.add_gateway()
    s.wait()
    # A backend whose --served-name no gateway serves (a model folder's name, say): registered,
    # never routed to; it says so itself once gateways have published (checked at the end).
    orphan = s.add_backend("orphan", None, *sim, "--served-name", "not-served")
    # Started after the gateway, as a backend on another machine would join.
    other = s.add_backend("other-tok", None, *sim, "--model", tokenizer_variant(s.model_path, tmp_path / "m"))
    blocks = s.add_backend("other-bs", None, *sim, "--block-size", str(s.block_size * 2))
    other.wait_healthy()
    blocks.wait_healthy()
    deadline = time.time() + 15
    while time.time() < deadline:
        health = get_json(g.url + "/health") or {}
        if len(health.get("incompatible", {}).get(s.model_name, {})) == 2:
            break
        time.sleep(0.2)
    left_out = health["incompatible"][s.model_name]
    assert sorted(left_out) == ["other-bs", "other-tok"], health
    assert left_out["other-bs"].startswith(f"block size {s.block_size * 2}, this gateway's is {s.block_size}")
    assert left_out["other-tok"].startswith("another tokenizer (vocabulary fingerprint ")
    assert health["backends"][s.model_name] == ["good"] and health["status"] == "ok"
    # Down for this gateway in /metrics (helper-85: they were absent, not 0)
    with urllib.request.urlopen(g.url + "/metrics", timeout=10) as resp:
        up = sorted(ln for ln in resp.read().decode().splitlines()
                    if ln.startswith("mlxgw:backend_up{") and f'model_name="{s.model_name}"' in ln)
    assert up == [f'mlxgw:backend_up{{backend="{b}",model_name="{s.model_name}"}} {v}'
                  for b, v in (("good", "1.0"), ("other-bs", "0.0"), ("other-tok", "0.0"))], up
    log = g.log_path.read_text()
    assert "backend other-tok (" in log and "is not routed to: another tokenizer" in log
    assert "backend other-bs (" in log and "is not routed to: block size" in log

    # The backends left out know it, from the settings the gateway publishes in Redis: their
    # /health and their own log (the operator of a backend on another Mac reads that one).
    gid = f"{socket.gethostname()}:{g.port}"
    want = {"other-bs": f"block size {s.block_size * 2}, gateway {gid}'s is {s.block_size} (--block-size must match)",
            "other-tok": "another tokenizer (vocabulary fingerprint "}
    for b in (other, blocks):
        deadline = time.time() + 10
        while time.time() < deadline and not (get_json(b.url + "/health") or {}).get("left_out_by"):
            time.sleep(0.2)
        said = get_json(b.url + "/health")["left_out_by"]
        assert list(said) == [gid] and said[gid].startswith(want[b.name]), said
        assert f"backend {b.name}: gateway {gid} does not route to it: {want[b.name]}" in b.log_path.read_text()
    assert get_json(good.url + "/health")["left_out_by"] == {}

    # `mlxgw status` shows the disagreement among the model's backends, each value with its owners.
    r = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url, "--namespace",
                        s.namespace], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())  # rich wraps long lines
    assert (f"backends disagree on block_size: {s.block_size} (good, other-tok); {s.block_size * 2} (other-bs); "
            "a gateway routes only to those matching its own") in out, out
    assert "backends disagree on tokenizer: " in out and "(good, other-bs); " in out, out
    assert f"gateway {gid} does not route to other-bs: {want['other-bs']}" in out, out
    assert f"gateway {gid} does not route to other-tok: {want['other-tok']}" in out, out
    rows = {ln.split("│")[1].strip(): ln for ln in r.stdout.splitlines() if ln.count("│") > 3}
    assert "left out" in rows["other-bs"] and "left out" in rows["other-tok"] and "ready" in rows["good"], rows
    assert "1 live, 2 left out" in rows["total"], rows
    r = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--json", "--redis-url", s.redis_url, "--namespace",
                        s.namespace], capture_output=True, text=True, timeout=60)
    d = json.loads(r.stdout)[s.model_name]
    # block_size, tokenizer, and model_files (other-tok's tokenizer.json is its own file)
    assert (d["total"]["live"], d["total"]["left_out"]) == (1, 2) and len(d["disagreements"]) == 3, d
    assert {b["id"]: sorted(b["left_out_by"]) for b in d["backends"]} == {"good": [], "other-bs": [gid],
                                                                          "other-tok": [gid]}, d
    # The record's own state stays the backend's ("ready"); a script reads the table's state here.
    assert {b["id"]: (b["state"], b["shown_state"]) for b in d["backends"]} == {
        "good": ("ready", "ready"), "other-bs": ("ready", "left out"), "other-tok": ("ready", "left out")}, d
    assert d["gateways"][gid]["block_size"] == s.block_size and len(d["gateways"][gid]["tokenizer"]) == 16, d
    assert d["disagreements"][0].startswith("backends disagree on block_size: ")

    # Every request goes to the one backend that shares both; distinct sessions would spread
    # them over three equal backends otherwise.
    served = []
    for i in range(9):
        st, h, body = post(g.url + "/v1/chat/completions",
                           {"model": s.model_name, "max_tokens": 2, "user": f"session-{i}",
                            "messages": [{"role": "user", "content": f"question {i}"}]})
        assert st == 200, body
        served.append(h["X-Mlxgw-Backend"])
    assert served == ["good"] * 9

    # With only those two left, a request is refused with the reasons, not sent to them.
    good.proc.terminate()
    good.proc.wait(10)
    deadline = time.time() + 15
    while time.time() < deadline and (get_json(g.url + "/health") or {}).get("backends", {}).get(s.model_name):
        time.sleep(0.2)
    st, h, body = post(g.url + "/v1/chat/completions",
                       {"model": s.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    err = json.loads(body)["error"]
    assert st == 503 and err["code"] == "no_backend", body
    assert "Retry-After" not in h  # a setting to fix, not a moment to wait
    assert err["message"].startswith(f"no live backend serves '{s.model_name}'; left out: other-bs: block size")
    assert "other-tok: another tokenizer" in err["message"]

    deadline = time.time() + 20
    while time.time() < deadline and "no gateway serves model" not in orphan.log_path.read_text():
        time.sleep(0.5)
    assert ("backend orphan: no gateway serves model 'not-served', so none routes to it; the gateways on this "
            f"Redis serve '{s.model_name}' (is --served-name the gateway's model name?)") in orphan.log_path.read_text()
    # Gone, its model name (which nothing serves) drops out of mlxgw status, top and the dashboard.
    from mlxgw.status import collect

    assert "not-served" in collect(s_redis(s), s.namespace)
    orphan.proc.kill()  # gone without a word: its record expires with its heartbeat TTL (2 s here)
    deadline = time.time() + 10
    while time.time() < deadline and "not-served" in collect(s_redis(s), s.namespace):
        time.sleep(0.2)
    assert sorted(collect(s_redis(s), s.namespace)) == [s.model_name]

    # A gateway that stops takes its settings out of Redis at once (not 10 s later).
    from mlxgw import schema

    key = schema.Keys(s.namespace, s.model_name).gateway_settings
    assert schema.fresh_gateway_settings(s_redis(s).hgetall(key), time.time()).keys() == {gid}
    g.stop()
    assert s_redis(s).hget(key, gid) is None


def test_backends_serving_other_files_under_one_name_are_pointed_out(make_stack, tmp_path):
    """A backend started from another model directory with the same tokenizer (a variant,
    another quantization, a fine-tune) is routed to like the others, so a request's answer
    depends on where it lands: `mlxgw status` says the backends' model files differ
    (helper-85: a sliding-window variant under the demo's name took 6 of 6 cold prompts,
    silently)."""
    s = make_stack()
    variant = tmp_path / "variant"
    variant.mkdir()
    for f in Path(s.model_path).iterdir():
        if f.name != "config.json":
            (variant / f.name).symlink_to(f)
    cfg = json.loads((Path(s.model_path) / "config.json").read_text())
    (variant / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    s.add_backend("orig", None, "--engine", "sim")
    s.add_backend("var", None, "--engine", "sim", "--model", str(variant))
    g = s.add_gateway()
    s.wait()
    assert sorted(get_json(g.url + "/health")["backends"][s.model_name]) == ["orig", "var"]  # both routed
    recs = {b: s_redis(s).hget(f"{s.namespace}:{{{s.model_name}}}:backend:{b}", "model_files") for b in ("orig", "var")}
    assert len(recs["orig"]) == 16 and recs["orig"] != recs["var"], recs
    r = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--json", "--redis-url", s.redis_url, "--namespace",
                        s.namespace], capture_output=True, text=True, timeout=60)
    d = json.loads(r.stdout)[s.model_name]
    (line,) = d["disagreements"]  # one value each, in either order
    head, a, note = line.split("; ")
    assert head.startswith("backends disagree on model_files: "), line
    assert {head.split(": ")[1], a} == {f"{recs['orig'].decode()} (orig)", f"{recs['var'].decode()} (var)"}, line
    assert note == "other weights or config under one name: answers differ by backend (see each one's model_path)"


def test_gateway_settings_age_out_and_are_pruned(redis_server):
    """A stopped gateway's entry stops counting after `GATEWAY_SETTINGS_FRESH` seconds and is
    deleted by the next gateway's prune (`PRUNE_SETTINGS_LUA`) after `GATEWAY_SETTINGS_PRUNE`."""
    from mlxgw import schema

    r = redis_server.client()
    key = schema.Keys("tprune", "m").gateway_settings
    now = time.time()
    r.hset(key, mapping={"live": schema.gateway_settings_value(16, "ab" * 8, now - 1),
                         "stopped": schema.gateway_settings_value(16, "ab" * 8, now - 30),
                         "gone": schema.gateway_settings_value(64, "cd" * 8, now - 120),
                         "junk": "not json"})
    fresh = schema.fresh_gateway_settings(r.hgetall(key), now)
    assert list(fresh) == ["live"] and fresh["live"]["block_size"] == 16, fresh
    assert r.eval(schema.PRUNE_SETTINGS_LUA, 1, key, f"{now - schema.GATEWAY_SETTINGS_PRUNE:.3f}") == 1
    assert sorted(r.hkeys(key)) == ["junk", "live", "stopped"]
    assert schema.incompatibility(16, "ab" * 8, 16, "ab" * 8) is None
    assert schema.incompatibility(16, "ab" * 8, 0, "") is None  # an older backend publishes neither
    assert schema.incompatibility(16, "", 32, "ab" * 8) == "block size 32, this gateway's is 16 (--block-size must match)"


def test_a_gateway_with_odd_settings_does_not_leave_the_backends_out_of_status(make_stack):
    """helper-76: one gateway started with another --block-size made `mlxgw status`, top and
    the dashboard show every backend `left out` ("0 live") while the other gateway served from
    them. That gateway is named on a line of its own; a backend counts as left out only when
    no gateway routes to it."""
    s = make_stack()
    sim = ("--engine", "sim")
    for b in ("b0", "b1"):
        s.add_backend(b, None, *sim)
    good = s.add_gateway()
    s.wait()
    odd = s.add_gateway("--block-size", str(s.block_size * 2))
    odd.wait_healthy(status=503)  # no backend it routes to
    gid = {g.name: f"{socket.gethostname()}:{g.port}" for g in (good, odd)}
    status = [sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url, "--namespace", s.namespace]
    why = f"block size {s.block_size}, gateway {gid[odd.name]}'s is {s.block_size * 2} (--block-size must match)"

    def settled(want_gateways: int) -> dict:
        deadline = time.time() + 15
        while True:
            d = json.loads(subprocess.run(status + ["--json"], capture_output=True, text=True, timeout=60).stdout)
            d = d.get(s.model_name, {})
            if len(d.get("gateways", {})) == want_gateways or time.time() > deadline:
                return d

    d = settled(2)
    assert d["stray_gateways"] == {gid[odd.name]: why}, d
    assert (d["total"]["live"], d["total"]["left_out"]) == (2, 0), d["total"]
    assert {b["id"]: (b["left_out"], b["left_out_by"], b["shown_state"]) for b in d["backends"]} == {
        "b0": (False, {}, "ready"), "b1": (False, {}, "ready")}, d
    out = " ".join(subprocess.run(status, capture_output=True, text=True, timeout=60).stdout.split())
    assert "2 live" in out and "left out" not in out, out
    assert f"gateway {gid[odd.name]} routes to none of this model's backends, which the other gateways use: {why}" \
        in out, out

    # A backend that only the odd gateway routes to: each gateway now routes to one of them, none
    # is stray, and every backend serves (a line names each gateway that skips one).
    s.add_backend("b2", None, *sim, "--block-size", str(s.block_size * 2)).wait_healthy()
    deadline = time.time() + 15
    while time.time() < deadline:
        d = settled(2)
        if len(d["backends"]) == 3:
            break
        time.sleep(0.3)
    assert d["stray_gateways"] == {} and (d["total"]["live"], d["total"]["left_out"]) == (3, 0), d
    assert {b["id"]: sorted(b["left_out_by"]) for b in d["backends"]} == {
        "b0": [gid[odd.name]], "b1": [gid[odd.name]], "b2": [gid[good.name]]}, d
    out = " ".join(subprocess.run(status, capture_output=True, text=True, timeout=60).stdout.split())
    assert f"gateway {gid[good.name]} does not route to b2: block size {s.block_size * 2}" in out, out
    assert "3 live" in out, out
