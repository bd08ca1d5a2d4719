"""GET /dashboard in a real headless Chromium after real traffic; a screenshot goes to test-output."""

import re
import time

import pytest

from mlxgw import browser
from mlxgw.harness import LOG_DIR
from mlxgw.httpget import get_json, get_status, post
from mlxgw.redis_client import connect
from texts import words


def _wait_data(url: str, pred, timeout: float = 15.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        d = get_json(url + "/dashboard/data") or {}
        if pred(d):
            return d
        time.sleep(0.2)
    raise AssertionError(f"dashboard data never matched: {d}")


def test_dashboard_page_self_contained(make_stack):
    s = make_stack()
    s.add_backend("b0")
    s.add_gateway()
    s.wait()
    import urllib.request

    with urllib.request.urlopen(s.gateway.url + "/dashboard") as r:
        assert r.headers["Content-Type"].startswith("text/html")
        page = r.read().decode()
    # No CDN, no external resource of any kind; the icon inline, so a browser does not ask for
    # /favicon.ico (a 404 the gateway counts as an error: helper-46).
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(?!data:)', page)
    assert '<link rel="icon" href="data:,">' in page
    # A browser opening /health or /metrics asks for /favicon.ico: no icon, and no error counted.
    errors = get_json(s.gateway.url + "/health")["errors"]
    assert get_status(s.gateway.url + "/favicon.ico") == 204
    assert get_json(s.gateway.url + "/health")["errors"] == errors
    assert "http://" not in page and "https://" not in page
    d = _wait_data(s.gateway.url, lambda d: d.get("models"))
    assert d["redis"] == "ok" and d["models"][0]["name"] == s.model_name
    assert [b["id"] for b in d["models"][0]["backends"]] == ["b0"]
    assert get_status(s.gateway.url + "/dashboard/nope") == 404


def test_dashboard_renders_backends_and_hits_in_chromium(make_stack, redis_server):
    if browser.find_chromium() is None:
        pytest.skip("Chromium is not installed (scripts/setup.sh test installs Debian's 'chromium'; "
                    "or set MLXGW_CHROMIUM to a Chrome/Chromium binary)")
    s = make_stack()
    s.add_backend("b0")
    s.add_backend("b1")
    s.add_gateway()
    s.wait()
    g = s.gateway.url
    for i in range(6):  # two conversations, each resent: repeats are prefix hits
        msg = {"model": s.model_name, "messages": [{"role": "user", "content": words(120, seed=30 + i % 2)}],
               "max_tokens": 4}
        assert post(g + "/v1/chat/completions", msg)[0] == 200
    want_hits = {b.name: get_json(b.url + "/health")["hits"] for b in s.backends}
    assert sum(want_hits.values()) >= 4  # every repeat reused its conversation's prefix
    # The heartbeat carries the counters to Redis; the dashboard samples Redis.
    _wait_data(g, lambda d: d.get("models") and d["models"][0]["totals"]["hits"] == sum(want_hits.values()))
    # and a sample past the traffic, so the charts have a series to draw (one sample reads "waiting")
    _wait_data(g, lambda d: len(d["models"][0]["series"]) >= 2 and d["models"][0]["series"][-1]["rps"] == 0)
    r = redis_server.client()
    assert {b: int(r.hget(f"{s.namespace}:{{{s.model_name}}}:backend:{b}", "hits")) for b in want_hits} == want_hits

    dom = browser.dump_dom(g + "/dashboard")
    assert 'data-loaded="1"' in dom, dom[:2000]
    dom = dom.split("<script>", 1)[0]  # what the page's JS rendered, not its templates
    rows = dict(re.findall(r'<tr data-backend="([^"]+)">(.*?)</tr>', dom, re.S))
    assert set(rows) == {"b0", "b1"}
    shown = {b: int(re.search(r'data-field="hits">(\d+)<', rows[b]).group(1)) for b in rows}
    assert shown == want_hits
    assert int(re.search(r'data-field="total-hits">(\d+)<', dom).group(1)) == sum(want_hits.values())
    assert float(re.search(r'data-field="total-hit_ratio">([\d.]+)<', dom).group(1)) > 0
    assert "routed" in dom and "matched=" in dom  # the event stream
    # Each chart draws its samples: a line, or a dot for a sample alone between gaps (helper-84:
    # a burst within one interval left the hit-ratio chart blank).
    hit_chart = dom.split("token hit ratio (per interval)", 1)[1].split("</svg>", 1)[0]
    assert "<circle" in hit_chart or re.search(r'<path d="M[^"]* L', hit_chart), hit_chart

    png = browser.screenshot(g + "/dashboard", LOG_DIR / "dashboard.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_dashboard_keeps_the_last_sample_while_redis_is_down(make_stack, redis_server):
    """helper-70: while Redis did not answer, every backend read `silent 5s` (its record aged
    against the clock) though it served; the dashboard shows them as last sampled, and why."""
    import asyncio

    from gateway.dashboard import Dashboard
    from mlxgw.harness import RedisServer

    s = make_stack()
    s.add_backend("b0", None, "--engine", "sim")
    s.wait()
    own = RedisServer()
    own.start()
    try:
        async def go():
            d = Dashboard(own.url, s.namespace)
            # sample the stack's Redis once, through this one's client (bytes, as the dashboard's own)
            d.redis = connect(redis_server.url, 1.0)
            await d.sample()
            assert d.error is None and d.latest[s.model_name]["backends"][0]["id"] == "b0"
            d.redis = own.client()
            own.stop()  # Redis gone
            await d.sample()
            d.sampled_at -= 6  # as if it had been gone 6 s (more than two heartbeats)
            payload = d.payload()
            d.redis.close()
            return payload

        p = asyncio.run(go())
    finally:
        own.stop()
    assert p["redis"].startswith("ConnectionError"), p["redis"]
    (m,) = p["models"]
    assert m["totals"]["ready"] == 1, m["totals"]
    assert m["backends"][0]["state"] == "ready (6 s ago; Redis unreachable)", m["backends"][0]["state"]
