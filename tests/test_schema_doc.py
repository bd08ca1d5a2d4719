"""docs/redis-schema.md cannot drift from the code: walk it against a live stack."""

import re
import time
from pathlib import Path

from mlxgw.httpget import post
from texts import words

DOC = (Path(__file__).parent.parent / "docs" / "redis-schema.md").read_text()


def _documented_keys():
    """(regex, type, always present) for each key row of the first table."""
    rows = []
    for line in DOC.splitlines():
        m = re.match(r"\| `(NS:[^`]+)` \| (\w+)", line)
        if m:
            pat = re.escape(m.group(1))
            pat = pat.replace("NS", "(?P<ns>[^:]+)", 1).replace(r"\{M\}", r"\{[^}]+\}")
            pat = pat.replace("B:E", "[^:]+:[0-9]+").replace(":B", ":[^:]+").replace("<hex>", "[0-9a-f]{16}")
            pat = pat.replace(":G", ":.+")
            rows.append((re.compile("^" + pat + "$"), m.group(2).lower(), "only while" not in line))
    return rows


def _documented_record_fields():
    section = DOC.split("## The registry record", 1)[1].split("##", 1)[0]
    fields = set()
    for line in section.splitlines():
        m = re.match(r"\| (`.*?`(?:, `.*?`)*) \|", line)
        if m:
            fields |= set(re.findall(r"`(\w+)`", m.group(1)))
    return fields


def test_live_keys_are_all_documented(make_stack, redis_server):
    s = make_stack()
    s.add_backend("b0")
    s.add_gateway()
    s.wait()
    status, _, _ = post(s.gateway.url + "/v1/chat/completions",
                        {"model": s.model_name, "messages": [{"role": "user", "content": words(100, seed=4)}],
                         "max_tokens": 2})
    assert status == 200
    r = redis_server.client()
    gateways = f"{s.namespace}:{{{s.model_name}}}:gateways"
    for _ in range(40):  # written at least once a second
        if r.exists(gateways):
            break
        time.sleep(0.1)
    docs = _documented_keys()
    assert len(docs) == 13
    keys = [k for k in r.scan_iter(match="*") if k.startswith(s.namespace + ":") or k == f"{s.namespace}:models"]
    seen_patterns = set()
    for k in keys:
        matches = [(p, t) for p, t, _ in docs if p.match(k)]
        assert matches, f"undocumented key {k}"
        p, t = matches[0]
        typ = r.type(k)
        if typ == "none":  # a transient key (a gateway's in-flight load) gone since the scan
            continue
        assert typ == ("zset" if t == "zset" else t), (k, typ, t)
        seen_patterns.add(p.pattern)
    # every documented key exists on a live stack (the transient ones only while in use)
    assert seen_patterns >= {p.pattern for p, _, always in docs if always}

    record = r.hgetall(f"{s.namespace}:{{{s.model_name}}}:backend:b0")
    documented = _documented_record_fields()
    assert set(record) <= documented, set(record) - documented
    assert {"epoch", "url", "active", "queued_prefill_tokens", "blocks_owned"} <= set(record)


def test_status_cli_reads_redis_alone(make_stack, redis_server):
    import json as _json
    import subprocess
    import sys

    s = make_stack()
    s.add_backend("b0")
    s.wait()
    post(s.backends[0].url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    # The record's counters land with the backend's next heartbeat: read until they have.
    deadline = time.time() + 10
    while True:
        out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--json", "--redis-url", redis_server.url,
                              "--namespace", s.namespace], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        data = _json.loads(out.stdout)
        (b,) = data[s.model_name]["backends"]
        if int(b["requests"]) >= 1 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert b["id"] == "b0" and b["state"] == "ready" and b["requests"] == 1
    # Numbers as numbers, text as text (all were strings before session 28).
    assert isinstance(b["epoch"], int) and isinstance(b["cache_bytes"], int) and isinstance(b["last_heartbeat"], float)
    assert isinstance(b["url"], str) and isinstance(b["engine"], str)
    assert {e["type"] for e in data[s.model_name]["recent_events"]} >= {"saved"}
    txt = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", redis_server.url,
                          "--namespace", s.namespace], capture_output=True, text=True, timeout=60)
    assert txt.returncode == 0 and "b0" in txt.stdout
    # the text view gives each event's details, as `mlxgw top` does
    saved = next(e for e in data[s.model_name]["recent_events"] if e["type"] == "saved")
    assert saved["tokens"] > 0
    lines = [ln for ln in txt.stdout.splitlines() if " saved " in ln]
    assert any(f"tokens={saved['tokens']}" in ln and f"cache_type={saved['cache_type']}" in ln for ln in lines), lines
