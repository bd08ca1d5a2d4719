"""The routing policy (gateway/route.py, docs/routing.md): pure-function cases,
then several gateways sharing one Redis, and session affinity when Redis is gone."""

import json
import threading
import time

import pytest
import redis

from gateway.route import RoutingConfig, rank
from mlxgw.harness import RedisServer, Stack
from mlxgw.httpget import get_json, post
from mlxgw.schema import Candidate
from texts import words


def cand(bid, depth=0, queued=0, active=0, gw_req=0, gw_tok=0, used=0, hb_queued=0, hb_active=0):
    """``queued``/``active``: work the gateways have in flight there (what routing counts by default);
    ``hb_*``: the backend's own heartbeat figures."""
    return Candidate(bid, 1, f"http://{bid}", hb_active, hb_queued, "ready", used, 10**9, depth,
                     gw_req + active, gw_tok + queued)


W = RoutingConfig().load_weight  # 0.03: cost per token of queued work (docs/routing.md)


def test_longest_prefix_wins_below_the_balance_thresholds():
    # The cost alone: "b" is idle and holds none of the prompt, and "a"'s 3,000 queued tokens are
    # over twice its 640-token claim, so seeding would move the request (test_route_policy).
    d = rank([cand("a", depth=10, queued=3000), cand("b", depth=0)], 1000, 64, cfg=RoutingConfig(seed_empty=False))
    assert [s.cand.backend_id for s in d.ranked] == ["a", "b"] and d.reason == "prefix"
    assert d.best.matched == 640 and d.best.prefill == 360
    assert [s.cost for s in d.ranked] == [360 + W * 3000, 1000]


def test_queued_prefill_moves_a_request_when_waiting_costs_more_than_the_prefix():
    # cost = prefill + W x queued: "a" owns 640 tokens but 25000 queued tokens cost 750 > 640.
    d = rank([cand("a", depth=10, queued=25000), cand("b", depth=0)], 1000, 64)
    assert d.best.cand.backend_id == "b" and [s.cost for s in d.ranked] == [1000, 360 + W * 25000]
    assert not any(s.overloaded for s in d.ranked)  # the cost did it, not the guard
    # A cold prompt goes to the backend with the least queued prefill, whatever the request counts.
    d = rank([cand("a", queued=5000, active=1), cand("b", queued=100, active=3)], 1000, 64,
             cfg=RoutingConfig(decode_weight=0))
    assert d.best.cand.backend_id == "b"


def test_heartbeat_load_is_counted_only_when_asked():
    # The heartbeat is up to a second old; the gateways' in-flight counters are current.
    stale = [cand("a", depth=10, hb_queued=50000, hb_active=9), cand("b")]
    d = rank(stale, 1000, 64)
    assert d.best.cand.backend_id == "a" and (d.best.queued, d.best.active) == (0, 0)
    d = rank(stale, 1000, 64, cfg=RoutingConfig(heartbeat_load=True))
    assert d.best.cand.backend_id == "b" and d.ranked[1].queued == 50000 and d.ranked[1].active == 9


def test_pending_claims_count_as_owned_prefix():
    d = rank([cand("a", depth=2), cand("b")], 1000, 64, pending={"b": 10})
    assert d.best.cand.backend_id == "b" and d.best.matched == 640 and d.ranked[1].matched == 128


def test_a_claimed_prefix_counts_only_from_the_backends_hold_threshold():
    """A prefix only being computed on a backend is shared by waiting for its prefill, which the
    backend does from its min_hit_tokens on; below that the claim reuses nothing, and only the
    saved copy counts (gateway.route.servable_blocks)."""
    def c(bid, depth, saved, min_hit=1000, queued=0):
        x = cand(bid, depth=depth, queued=queued)
        x.saved_blocks, x.min_hit_tokens = saved, min_hit
        return x

    # "a" computes the common first block (claim) and holds nothing; "b" holds it saved
    d = rank([c("a", 1, 0), c("b", 1, 1, queued=200)], 1000, 64)
    assert [(s.cand.backend_id, s.matched) for s in d.ranked] == [("b", 64), ("a", 0)]
    # a claim of 16 blocks (1024 tokens >= 1000) is worth waiting for; 15 blocks are not
    d = rank([c("a", 16, 2), c("b", 0, 0)], 2000, 64)
    assert d.best.cand.backend_id == "a" and d.best.matched == 1024
    d = rank([c("a", 15, 2), c("b", 0, 0)], 2000, 64)
    assert d.ranked[[s.cand.backend_id for s in d.ranked].index("a")].matched == 128
    # this gateway's pending claims follow the same rule
    d = rank([c("a", 0, 0), c("b", 0, 0)], 2000, 64, pending={"a": 3})
    assert [s.matched for s in d.ranked] == [0, 0]
    d = rank([c("a", 0, 0), c("b", 0, 0)], 2000, 64, pending={"a": 20})
    assert d.best.cand.backend_id == "a" and d.best.matched == 1280
    # a backend that publishes no threshold (0) counts every claim, as before
    d = rank([c("a", 1, 0, min_hit=0), c("b", 0, 0)], 1000, 64)
    assert d.best.cand.backend_id == "a" and d.best.matched == 64
    # --short-claims: the rule before (every claimed block counts)
    d = rank([c("a", 1, 0), c("b", 1, 1, queued=200)], 1000, 64, cfg=RoutingConfig(short_claims=True))
    assert [(s.cand.backend_id, s.matched) for s in d.ranked] == [("a", 64), ("b", 64)]


def test_balance_guard_moves_work_off_an_overloaded_owner():
    cfg = RoutingConfig()  # abs 262144 tokens, rel 2.0, 256 tokens per running decode, load weight 0.03
    t = cfg.balance_abs_tokens
    prompt, depth = 4 * t, 4 * t * 9 // 10 // 64  # "a" owns ~90% of a 4T-token prompt
    busy = cand("a", depth=depth, queued=t + 1000)
    # By cost alone "a" wins: ~0.1 x 4T to prefill + W x (T + 1000) queued, far below 4T ...
    assert rank([busy, cand("b")], prompt, 64, cfg=RoutingConfig(balance_abs_tokens=10**12)).best.cand.backend_id == "a"
    # ... but T + 1000 queued tokens against 0 is over both thresholds: the guard moves it.
    d = rank([busy, cand("b")], prompt, 64, cfg=cfg)
    assert d.best.cand.backend_id == "b" and d.reason == "balance" and d.ranked[1].overloaded
    # Relative threshold: both busy, neither twice the other, so the prefix still wins.
    d = rank([cand("a", depth=depth, queued=3 * t), cand("b", queued=2 * t)], prompt, 64, cfg=cfg)
    assert d.best.cand.backend_id == "a" and not any(s.overloaded for s in d.ranked)
    # Running decodes count too: each is 256 tokens of load.
    d = rank([cand("a", depth=depth, active=t // 256 + 4), cand("b")], prompt, 64, cfg=cfg)
    assert d.best.cand.backend_id == "b" and d.reason == "balance"


def test_other_gateways_load_counts():
    # Another gateway has 30000 prefill tokens in flight to "a".
    d = rank([cand("a", depth=10, gw_req=3, gw_tok=30000), cand("b")], 1000, 64)
    assert d.best.cand.backend_id == "b" and d.ranked[1].queued == 30000 and d.ranked[1].active == 3
    # This gateway's own fresh counters add to the published ones.
    d = rank([cand("a", gw_req=1, gw_tok=100), cand("b")], 1000, 64, inflight={"a": (2, 50)})
    assert {s.cand.backend_id: (s.active, s.queued) for s in d.ranked}["a"] == (3, 150)


def test_cold_prompts_spread_and_session_affinity_is_only_a_tie_break():
    cands = [cand("a", used=500), cand("b", used=100), cand("c", used=300)]
    assert rank(cands, 500, 64).best.cand.backend_id == "b"  # most free cache first
    picks = {rank(cands, 500, 64, session=f"s{i}").best.cand.backend_id for i in range(30)}
    assert picks == {"a", "b", "c"}  # sessions spread over every backend
    one = [rank(cands, 500, 64, session="s7").best.cand.backend_id for _ in range(5)]
    assert len(set(one)) == 1  # and stick
    # A backend that owns 400 of 500 tokens is much cheaper: affinity never overrides it.
    owner = [cand("a"), cand("b"), cand("c", depth=25)]
    for i in range(30):
        assert rank(owner, 500, 16, session=f"s{i}").best.cand.backend_id == "c"


def test_baseline_policies():
    cands = [cand("a", depth=10, queued=50000), cand("b", queued=10), cand("c", queued=0, active=1)]
    assert rank(cands, 1000, 64, cfg=RoutingConfig(policy="longest_prefix")).best.cand.backend_id == "a"
    assert rank(cands, 1000, 64, cfg=RoutingConfig(policy="least_loaded")).best.cand.backend_id == "b"
    rr_cfg = RoutingConfig(policy="round_robin")
    rr = [rank(cands, 1000, 64, cfg=rr_cfg).best.cand.backend_id for _ in range(4)]
    assert rr == ["a", "b", "c", "a"]


def _ask(url, text, max_tokens=3, **kw):
    status, h, body = post(url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **kw})
    assert status == 200, body
    return h


def test_two_gateways_share_load_and_decisions(make_stack, redis_server):
    s = make_stack()
    # Heartbeats every 30 s: the backends' own load figures stay stale, so
    # what a gateway knows of the other's traffic comes from the published load.
    for b in ("b0", "b1"):
        s.add_backend(b, None, "--heartbeat-interval", "30", "--heartbeat-ttl", "90")
    g0, g1 = s.add_gateway(), s.add_gateway()
    s.wait()
    text = words(200, seed=61)
    first = _ask(g0.url, text)["X-Mlxgw-Backend"]
    # Same Redis state, same decision on every gateway (prefix owner; cold prompt by stable hash)
    # once g0 has published that its request ended (every 100 ms): until then g1 sees the owner
    # busier than the prefix, and the empty, idle other backend takes the turn ("Seeding").
    time.sleep(0.3)
    assert _ask(g1.url, text + " x")["X-Mlxgw-Backend"] == first
    cold = words(30, seed=62)
    ha = _ask(g0.url, cold)
    time.sleep(0.3)
    hb = _ask(g1.url, cold + " y")
    assert ha["X-Mlxgw-Backend"] == hb["X-Mlxgw-Backend"], (ha["X-Mlxgw-Candidates"], hb["X-Mlxgw-Candidates"])
    # A long request in flight through g0 ... (polled from g1 while it runs; on a
    # loaded machine a request can finish between two polls, so up to 3 fresh tries).
    # g0 publishes every 100 ms: wait until its finished requests are unpublished,
    # so the only in-flight work g1 can see is the long request's.
    time.sleep(0.3)
    for attempt in range(3):
        done = {}
        t = threading.Thread(target=lambda: done.setdefault(
            "h", _ask(g0.url, words(3500, seed=63 + attempt), max_tokens=2)))
        t.start()
        h = None
        while t.is_alive():
            h = _ask(g1.url, words(20, seed=int(time.time() * 1000) % 100000))
            if "active=1" in h["X-Mlxgw-Candidates"]:
                break
        t.join(60)
        if h is not None and "active=1" in h["X-Mlxgw-Candidates"]:
            break
    busy = done["h"]["X-Mlxgw-Backend"]
    # ... is visible to g1: published in Redis by g0 (the backends' own heartbeats are stale).
    seen = dict(c.split(":", 1) for c in h["X-Mlxgw-Candidates"].split())
    other = {"b0": "b1", "b1": "b0"}[busy]
    assert "active=1" in seen[busy] and "active=0" in seen[other], (busy, h["X-Mlxgw-Candidates"], h["X-Mlxgw-Lookup"])
    r = redis_server.client()
    from mlxgw import schema

    k = schema.Keys(s.namespace, s.model_name)
    gateways = set(r.zrange(k.gateways, 0, -1))
    assert len(gateways) == 2
    # Each routing event names the gateway that wrote it.
    raw = redis.Redis.from_url(redis_server.url)
    routed = [e for e in (schema.decode_event(f) for _, f in raw.xrange(k.events)) if e["type"] == schema.EVENT_ROUTED]
    assert {e["data"]["gateway"] for e in routed} == gateways, routed[:2]


def _candidate(h, backend: str) -> dict:
    """``backend``'s figures in a response's X-Mlxgw-Candidates: {"matched": "640", "active": "1", ...}."""
    cand = next(c for c in h["X-Mlxgw-Candidates"].split() if c.startswith(backend + ":"))
    return dict(kv.split("=") for kv in cand[len(backend) + 1:].split(",") if "=" in kv)


def _ask_after(url, system, user):
    """A 2-token chat answer to ``system`` then ``user``; its response headers."""
    status, h, body = post(url + "/v1/chat/completions", {
        "messages": [system, {"role": "user", "content": user}], "max_tokens": 2})
    assert status == 200, body
    return h


def test_a_backend_added_beside_a_busy_owner_of_the_system_prompt_takes_a_new_conversation(make_stack):
    """A new backend (nothing cached) gets a first turn sharing the cluster's system prompt
    as soon as the owner's load passes the prefix it would reuse ("Seeding",
    gateway.route); by the cost alone the owner kept every such turn until it was ~33 times
    the prefix busier (helper-85: 0 of 683 requests in 4.5 minutes on an added backend)."""
    s = make_stack()
    slow = ("--engine", "sim", "--sim-prefill-rate", "300")  # a 600-word prompt: ~2-3 s of prefill
    s.add_backend("b0", None, *slow)
    g0 = s.add_gateway()
    g1 = s.add_gateway("--no-seed-empty")  # the rule before, for contrast
    s.wait()
    system = {"role": "system", "content": words(100, seed=71)}

    def ask(g, user):
        return _ask_after(g.url, system, user)

    assert ask(g0, words(20, seed=72))["X-Mlxgw-Backend"] == "b0"  # b0 caches the system prompt
    s.add_backend("b1", None, *slow)
    s.wait()
    time.sleep(1.2)  # the first turn's pending claim has expired
    long = threading.Thread(target=ask, args=(g0, words(600, seed=73)))
    long.start()  # the owner is busy: its system prompt is cheaper than the new backend's nothing
    deadline = time.time() + 30
    while get_json(g0.url + "/health")["pending_claims"] < 1 and time.time() < deadline:
        time.sleep(0.02)
    old = ask(g1, words(20, seed=74))
    new = ask(g0, words(20, seed=75))
    long.join(60)
    assert (old["X-Mlxgw-Backend"], old["X-Mlxgw-Route-Reason"]) == ("b0", "prefix"), old["X-Mlxgw-Candidates"]
    assert (new["X-Mlxgw-Backend"], new["X-Mlxgw-Route-Reason"]) == ("b1", "seed"), new["X-Mlxgw-Candidates"]
    assert new["X-Mlxgw-Matched-Tokens"] == "0" and int(old["X-Mlxgw-Matched-Tokens"]) >= 128
    # Seeded once: b1 owns the system prompt now, and the usual cost decides from here on.
    time.sleep(1.2)
    third = ask(g0, words(20, seed=76))
    assert int(third["X-Mlxgw-Matched-Tokens"]) >= 128 and third["X-Mlxgw-Route-Reason"] == "prefix"


def test_a_turn_beside_its_owners_long_prefill_stays_for_a_short_answer_and_moves_for_a_long_one(make_stack):
    """An owner of a ~1,900-token system prompt starts a ~5,000-token prompt; a backend beside
    it is idle and empty. A turn on that system prompt (a few tokens to compute: one 128-token
    prefill step there, step-beside) decodes one token per step of that prefill if it stays, so
    the seeding rule charges its answer's steps (`gateway.route.seed_wait`): with
    ``max_tokens`` 2 it stays (832 tokens of wait against the ~1,900 it would recompute on the
    idle backend; the default, session 51's rule, charges the whole queue and moves it); with ``max_tokens``
    200 it moves (the whole prefill; session 52's opt-in rule charged only the running decodes
    and kept it: helper-94 measured such a turn answering after 3.4-5.3 s kept, 0.92 s moved)."""
    s = make_stack()
    flags = ("--engine", "sim", "--sim-prefill-rate", "1000", "--prefill-step-size", "128")
    s.add_backend("b0", None, *flags)
    g0 = s.add_gateway("--seed-beside")  # opt-in (helper-95: real backends' deep chunks cost more)
    s.wait()
    system = {"role": "system", "content": words(1150, seed=81)}

    def ask(user: str, max_tokens: int) -> dict:
        status, h, body = post(g0.url + "/v1/chat/completions", {
            "messages": [system, {"role": "user", "content": user}], "max_tokens": max_tokens})
        assert status == 200, body
        return h

    assert ask(words(10, seed=82), 1)["X-Mlxgw-Backend"] == "b0"  # b0 saves the system prompt
    s.add_backend("b1", None, *flags)
    s.wait()
    time.sleep(1.2)  # the first turn's pending claim has expired
    got: dict[str, dict] = {}
    long = threading.Thread(target=lambda: got.__setitem__("long", ask(words(3000, seed=83), 1)))
    long.start()
    deadline = time.time() + 30
    while get_json(g0.url + "/health")["pending_claims"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    short = threading.Thread(target=lambda: got.__setitem__("short", ask(words(10, seed=84), 2)))
    short.start()
    while get_json(g0.url + "/health")["pending_claims"] < 2 and time.time() < deadline:
        time.sleep(0.01)
    got["answer"] = ask(words(10, seed=85), 200)
    short.join(60)
    long.join(60)
    assert (got["long"]["X-Mlxgw-Backend"], got["long"]["X-Mlxgw-Route-Reason"]) == ("b0", "prefix")
    short, answer = got["short"], got["answer"]
    assert (short["X-Mlxgw-Backend"], short["X-Mlxgw-Route-Reason"]) == ("b0", "prefix"), short["X-Mlxgw-Candidates"]
    assert int(short["X-Mlxgw-Matched-Tokens"]) >= 1408
    assert (answer["X-Mlxgw-Backend"], answer["X-Mlxgw-Route-Reason"]) == ("b1", "seed"), answer["X-Mlxgw-Candidates"]
    assert answer["X-Mlxgw-Matched-Tokens"] == "0"


@pytest.mark.parametrize("progress", [True, False], ids=["default", "no-prefill-progress"])
def test_a_streamed_prompts_queued_prefill_counts_down_by_its_backends_progress(make_stack, redis_server, progress):
    """By default the gateway's queued figure for a streamed request (what it
    routes on and publishes to the other gateways) drops by each prefill step its backend reports
    (`schema.progress_comment`), not whole at its first token: a long prompt mostly done no longer
    reads as all still to do (`RoutingConfig.prefill_progress`). With ``--no-prefill-progress``, the whole prompt."""
    import numpy as np

    from mlxgw import schema

    s = make_stack()
    # 1,500 tokens at 2,000 tokens/s in 128-token steps: ~0.75 s, within the figure's 1 s window.
    s.add_backend("b0", None, "--engine", "sim", "--sim-prefill-rate", "2000", "--prefill-step-size", "128")
    g0 = s.add_gateway(*(() if progress else ("--no-prefill-progress",)))
    s.wait()
    keys, r = schema.Keys(s.namespace, s.model_name), redis_server.client()
    prompt = np.random.default_rng(86).integers(16, 3000, 1500).tolist()
    got = {}
    call = threading.Thread(target=lambda: got.update(r=post(g0.url + "/v1/completions", {
        "model": s.model_name, "prompt": prompt, "max_tokens": 1, "stream": True})))
    call.start()
    seen = []
    while call.is_alive():  # the gateway publishes its figures every 0.1 s
        for gid in r.zrange(keys.gateways, 0, -1):
            seen += [int(v.split(":")[1]) for v in r.hgetall(keys.gateway_load(gid)).values()]
        time.sleep(0.01)
    call.join()
    assert got["r"][0] == 200, got
    assert seen and max(seen) <= 1500, seen  # counted whole as it was sent (a busy machine may publish later)
    mid = sorted({q for q in seen if 0 < q < 1500})
    if progress:
        assert len(mid) >= 3 and all((1500 - q) % 128 == 0 for q in mid), seen
    else:
        assert mid == [] and 1500 in seen, seen


def test_a_backend_added_beside_an_owner_with_every_decode_slot_taken_takes_the_next_request(make_stack):
    """An owner of a long shared prefix whose every decode slot is taken cannot start the next
    request sharing it, however little load its running requests count for (256 tokens each,
    under the prefix): an idle empty backend takes it (`RoutingConfig.seed_when_full`; 20 agents
    on an 8,000-token system prompt kept an added backend idle, bench/agent_fleet.py, session 48).
    The decode slots come from the backend's registry record through the lookup."""
    import http.client

    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--decode-concurrency", "1", "--sim-decode-rate", "50")
    g0 = s.add_gateway()
    s.wait()
    system = {"role": "system", "content": words(700, seed=77)}  # ~900 tokens: more than one request's load

    def ask(g, user):
        return _ask_after(g.url, system, user)

    assert ask(g0, words(20, seed=78))["X-Mlxgw-Backend"] == "b0"  # b0 saves the system prompt
    s.add_backend("b1", None, "--engine", "sim")
    s.wait()
    # b0's only decode slot taken (for 40 s; closed below, which cancels it).
    sent = time.time()
    busy = http.client.HTTPConnection("127.0.0.1", g0.port, timeout=60)
    busy.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [system, {"role": "user", "content": words(20, seed=79)}], "max_tokens": 2000, "stream": True}),
        {"Content-Type": "application/json"})
    resp = busy.getresponse()
    assert resp.status == 200 and resp.getheader("X-Mlxgw-Backend") == "b0"
    deadline = time.time() + 30
    while get_json(b0.url + "/health")["active"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    # Past the first second its prompt no longer counts in the load: 256 tokens for the running
    # request, under the ~900 b0 holds, so by load alone b0 would keep the next one (the rule before).
    time.sleep(max(0.0, sent + 1.2 - time.time()))
    h = ask(g0, words(20, seed=80))
    assert get_json(b0.url + "/health")["active"] == 1  # still decoding
    busy.close()
    assert (h["X-Mlxgw-Backend"], h["X-Mlxgw-Route-Reason"]) == ("b1", "seed"), h["X-Mlxgw-Candidates"]
    assert h["X-Mlxgw-Matched-Tokens"] == "0"
    b0_row = _candidate(h, "b0")
    assert int(b0_row["matched"]) >= 640 and b0_row["active"] == "1", h["X-Mlxgw-Candidates"]  # passed over


def test_a_conversation_leaves_an_owner_with_every_decode_slot_taken_for_a_backend_with_its_system_prompt(
        make_stack, redis_server):
    """A conversation's next turn, owned by a backend whose every decode slot is taken, goes to
    an idle one that holds a shorter prefix (the system prompt) when the wait for a slot
    costs more than the prefill it would save: the owner's measured decode time and prefill
    rate, from its registry record through the lookup (`gateway.route.slot_wait`; helper-89:
    turns waited on an owner with 18 requests on 16 slots beside a backend with one). A gateway
    with ``--slot-wait-weight 0`` (the rule before) keeps such a turn on the owner."""
    import http.client

    from mlxgw import schema

    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--decode-concurrency", "1", "--sim-decode-rate", "50")
    b1 = s.add_backend("b1", None, "--engine", "sim")
    g0 = s.add_gateway()
    g1 = s.add_gateway("--slot-wait-weight", "0")
    s.wait()
    system = {"role": "system", "content": words(100, seed=81)}

    def chat(url, messages, max_tokens=2):
        status, h, body = post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})
        assert status == 200, body
        return h, json.loads(body)

    chat(b1.url, [system, {"role": "user", "content": "hello"}])  # b1 holds the system prompt
    # Two conversations' first turns on b0, 25-token answers at 50 tokens/s: ~0.5 s of decode each.
    turns = []
    for seed in (82, 83):
        first = [system, {"role": "user", "content": words(150, seed=seed)}]
        _, body = chat(b0.url, first, max_tokens=25)
        turns.append((first, first + [body["choices"][0]["message"], {"role": "user", "content": words(10, seed=seed)}]))
    k = schema.Keys(s.namespace, s.model_name)
    r = redis_server.client()
    # Until the record has both figures, and the heartbeat after the second turn's end (an earlier
    # one had the first turn's decode alone: 0.472 against /health's 0.471 in a CI run)
    deadline = time.time() + 10
    while time.time() < deadline:
        took = float(r.hget(k.backend("b0"), "decode_seconds") or 0)
        if (took > 0 and float(r.hget(k.backend("b0"), "prefill_tps") or 0) > 0
                and get_json(b0.url + "/health")["decode_seconds"] == took):
            break
        time.sleep(0.1)
    assert 0.3 < took < 3.0, took  # 24 tokens after the first at 50/s: ~0.5 s
    assert get_json(b0.url + "/health")["decode_seconds"] == took
    # b0's one slot taken through g1 (the first turn again: b0 owns all of it), for 40 s unless
    # closed, which cancels it; g0 counts it from g1's published in-flight figures.
    sent = time.time()
    busy = http.client.HTTPConnection("127.0.0.1", g1.port, timeout=60)
    busy.request("POST", "/v1/chat/completions", json.dumps({"messages": turns[0][0], "max_tokens": 2000, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = busy.getresponse()
    assert resp.status == 200 and resp.getheader("X-Mlxgw-Backend") == "b0"
    time.sleep(max(0.0, sent + 1.2 - time.time()))  # its prompt out of the queued figure
    moved, _ = chat(g0.url, turns[0][1])
    kept = {}
    waiter = threading.Thread(target=lambda: kept.update(chat(g1.url, turns[1][1])[0]))
    waiter.start()  # waits for b0's slot
    while get_json(b0.url + "/health")["active"] < 2 and time.time() < sent + 30:
        time.sleep(0.05)
    busy.close()
    waiter.join(60)
    assert (moved["X-Mlxgw-Backend"], moved["X-Mlxgw-Route-Reason"]) == ("b1", "wait"), moved["X-Mlxgw-Candidates"]
    b0_row, b1_row = _candidate(moved, "b0"), _candidate(moved, "b1")
    assert b0_row["active"] == "1" and float(b0_row["wait"]) > 0, moved["X-Mlxgw-Candidates"]
    assert 0 < int(b1_row["matched"]) < int(b0_row["matched"]), moved["X-Mlxgw-Candidates"]  # b0 owned more
    assert (kept["X-Mlxgw-Backend"], kept["X-Mlxgw-Route-Reason"]) == ("b0", "prefix"), kept["X-Mlxgw-Candidates"]
    # It waited, and says so: its wait is shown, not counted.
    kept_b0 = _candidate(kept, "b0")
    assert kept_b0["active"] == "1" and float(kept_b0["wait"]) > 0, kept["X-Mlxgw-Candidates"]
    assert float(kept_b0["cost"]) < float(_candidate(kept, "b1")["cost"]), kept["X-Mlxgw-Candidates"]


def test_session_affinity_keeps_routing_without_redis(demo_model):
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        for b in ("b0", "b1", "b2"):
            s.add_backend(b)
        s.add_gateway()
        s.wait()
        r.stop()  # no ownership lookups from here on: load + affinity only
        seen = {}
        for sess in ("alice", "bob", "carol", "dave"):
            picks = set()
            for turn in range(3):
                h = _ask(s.gateway.url, words(40, seed=70 + turn), user=sess)
                assert h["X-Mlxgw-Lookup"] == "error"
                picks.add(h["X-Mlxgw-Backend"])
            assert len(picks) == 1, (sess, picks)
            seen[sess] = picks.pop()
        assert len(set(seen.values())) >= 2  # different sessions spread
        h = _ask(s.gateway.url, words(40, seed=99), prompt_cache_key="alice")
        assert h["X-Mlxgw-Backend"] == seen["alice"]  # prompt_cache_key is the same session key as user
        assert get_json(s.gateway.url + "/health")["degraded"] is True
    finally:
        s.stop()
        r.cleanup()


def test_lookup_deadline_fails_open_and_is_counted(make_stack, redis_server):
    s = make_stack()
    s.add_backend("b0")
    s.add_backend("b1")
    s.add_gateway("--lookup-deadline-ms", "50", "--pending-grace", "0")  # ownership from Redis alone
    s.wait()
    text = words(200, seed=81)
    h0 = _ask(s.gateway.url, text)
    assert h0["X-Mlxgw-Lookup"] == "ok"
    # The gateway records the route as the request's handler ends, which on a loaded machine can
    # come after the client has its answer (in service, the pending claim's grace covers that).
    time.sleep(0.3)
    redis_server.client().execute_command("CLIENT", "PAUSE", 1500, "ALL")  # Redis stops answering
    t0 = time.time()
    h = _ask(s.gateway.url, text + " more")
    # Routed without Redis, by where this gateway last sent the prefix (no pending grace here).
    assert h["X-Mlxgw-Lookup"] == "timeout" and int(h["X-Mlxgw-Matched-Tokens"]) > 0
    assert h["X-Mlxgw-Backend"] == h0["X-Mlxgw-Backend"] and time.time() - t0 < 5
    time.sleep(1.6)
    assert _ask(s.gateway.url, text + " again")["X-Mlxgw-Lookup"] == "ok"  # and it recovers by itself
    lookups = get_json(s.gateway.url + "/health")["lookups"]
    assert lookups["timeout"] == 1 and lookups["ok"] == 2


def test_a_model_this_gateway_cannot_route_is_apart_and_makes_it_no_healthier(make_stack):
    """A backend registered under another model name (started without --served-name, say) used
    to count in the gateway's /health "backends" (a 200 with none of the gateway's own models
    served) and in /v1/models, whose model this gateway then answered with a 404."""
    from mlxgw.httpget import get_status

    s = make_stack()
    s.add_backend("b1", None, "--engine", "sim", "--served-name", "elsewhere").wait_healthy()
    gw = s.add_gateway()
    deadline = time.time() + 30
    while not (get_json(gw.url + "/health") or {}).get("not_served") and time.time() < deadline:
        time.sleep(0.2)
    h = get_json(gw.url + "/health")
    assert get_status(gw.url + "/health") == 503 and h["status"] == "no_backends", h
    assert h["backends"] == {"demo-tiny": []} and h["not_served"] == {"elsewhere": ["b1"]}, h
    assert [m["id"] for m in get_json(gw.url + "/v1/models")["data"]] == ["demo-tiny"]
    assert get_status(gw.url + "/v1/models/elsewhere") == 404
    s.add_backend("b0", None, "--engine", "sim")
    s.wait()
    h = get_json(gw.url + "/health")
    assert h["status"] == "ok" and h["backends"] == {"demo-tiny": ["b0"]} and h["not_served"] == {"elsewhere": ["b1"]}
