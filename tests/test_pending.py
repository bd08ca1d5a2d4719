"""Pending ownership (gateway/pending.py): a prefix routed to a backend counts
as owned there until the backend's own report can have landed in Redis."""

import json
import time

from gateway.pending import PendingClaims, RecentRoutes
from gateway.tokenize import load_model_info
from mlxgw.harness import RedisServer, Stack
from mlxgw.httpget import get_json, post
from mlxgw.prompt import render_chat
from texts import words


def test_claims_give_each_backend_its_depth_and_expire_after_grace():
    p = PendingClaims(grace=1.0)
    a = p.add("a", ["k0", "k1"])
    b = p.add("b", ["k0", "k1", "k2", "k3"])
    assert p.depths(["k0", "k1", "k2", "x"], now=0) == {"a": 2, "b": 3}
    assert p.depths(["x", "k1"], now=0) == {}  # chained keys: a miss on block 0 ends the match
    p.release(a, ok=True, now=10.0)
    assert p.depths(["k0", "k1"], now=10.5) == {"a": 2, "b": 2}  # within the grace
    assert p.depths(["k0", "k1"], now=11.0) == {"b": 2}  # expired
    p.release(b, ok=False, now=11.0)  # failed request: dropped at once
    assert p.depths(["k0"], now=11.0) == {} and len(p) == 0


def test_claims_are_counted_per_request():
    p = PendingClaims(grace=0)
    h1, h2 = p.add("a", ["k0"]), p.add("a", ["k0"])
    p.release(h1, ok=True)
    assert p.depths(["k0"]) == {"a": 1}  # the second request still holds it
    p.release(h2, ok=True)
    assert p.depths(["k0"]) == {}


def test_depths_on_real_chained_keys_of_a_long_prompt():
    from mlxgw import schema

    ids = list(range(1000, 1000 + 64 * 512))  # a 32k-token prompt: 512 blocks
    keys = schema.block_keys("m", ids, 64)
    p = PendingClaims(grace=0)
    claims = [p.add("a", keys[:100]), p.add("b", keys), p.add("a", keys[:300])]
    p.add("c", schema.block_keys("m", [7] + ids[1:], 64))  # differs in block 0: never matches
    fork = schema.block_keys("m", ids[: 64 * 200] + [1] + ids[64 * 200 + 1:], 64)
    assert p.depths(keys) == {"a": 300, "b": 512}
    assert p.depths(fork) == {"a": 200, "b": 200}  # equal up to the changed block only
    assert p.depths(keys[:150]) == {"a": 150, "b": 150}
    p.release(claims[2], ok=True)
    assert p.depths(keys) == {"a": 100, "b": 512} and len(p) == 3


def test_recent_routes_keep_one_route_per_branch_and_a_key_budget():
    r = RecentRoutes(max_keys=10)
    r.add("a", ["k0", "k1"])
    r.add("a", ["k0", "k1", "k2", "k3"])  # the next turn: the first route is dropped for it
    r.add("b", ["k0", "k1", "x2"])  # a sibling on another backend
    assert len(r) == 2 and r.keys == 7
    assert r.depths(["k0", "k1", "k2", "k3", "k4"]) == {"a": 4, "b": 2}
    assert r.depths(["k0", "k1", "x2"]) == {"a": 2, "b": 3} and r.depths(["z0", "k1"]) == {}
    r.add("c", ["m0", "m1", "m2", "m3", "m4"])  # 12 keys > 10: the oldest route goes
    assert r.keys == 8 and r.depths(["k0", "k1", "k2"]) == {"b": 2}
    assert r.depths(["m0", "m1"]) == {"c": 2}
    r.add("b", ["k0", "k1", "x2", "x3"])  # continues b's route: replaces it
    assert len(r) == 2 and r.keys == 9 and r.depths(["k0", "k1", "x2", "x3"]) == {"b": 4}
    r.add("a", ["k0", "k1"])  # 11 keys: c's route goes
    assert len(r) == 2 and r.depths(["k0", "k1", "x2", "x3"]) == {"a": 2, "b": 4}
    r.forget("b")  # b restarted: its memory cache is gone, a's route to the same prefix stays
    assert len(r) == 1 and r.keys == 2 and r.depths(["k0", "k1", "x2", "x3"]) == {"a": 2}
    r.add("b", ["n0"])  # routes to b again after its restart count
    assert r.depths(["n0"]) == {"b": 1}


def test_a_restarted_backend_loses_this_gateways_recent_routes():
    """The registry snapshot's epoch change (`OwnershipIndex._log_changes`) tells its listeners,
    which the gateway wires to `RecentRoutes.forget`; a move to a new URL alone does not."""
    from gateway.index import OwnershipIndex
    from mlxgw.schema import Candidate

    idx = OwnershipIndex("redis://127.0.0.1:1/0")
    idx.snapshot_at = 1.0  # not the first snapshot
    told: list[str] = []
    idx.on_restart.append(told.append)

    def cand(b, url, epoch):
        return Candidate(backend_id=b, url=url, epoch=epoch, active=0, queued_prefill_tokens=0, state="ready")

    idx._log_changes({"m": [cand("b0", "u0", 1), cand("b1", "u1", 1)]},
                     {"m": [cand("b0", "u0", 2), cand("b1", "u9", 1)]})
    assert told == ["b0"]


def test_without_redis_a_conversation_goes_back_where_this_gateway_sent_it(demo_model):
    """While Redis cannot answer, the gateway routes by where it last sent each prefix
    (gateway.pending.RecentRoutes), past the pending claims' grace: a turn without a session
    key goes back to its cache. Before session 28 it went where load and free cache sent it
    (here: the emptier b1, for every conversation), recomputing its whole prompt."""
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        s.add_backend("b0")
        s.add_gateway("--pending-grace", "0")
        s.wait()
        firsts = [words(900, seed=300 + i) for i in range(3)]  # ~1,200 tokens: above min_hit_tokens
        for t in firsts:
            assert _ask(s.gateway.url, t)["X-Mlxgw-Backend"] == "b0"  # the only backend then
        s.add_backend("b1")
        s.wait()
        r.stop()
        for t in firsts:
            h = _ask(s.gateway.url, t + " and one more question")
            assert h["X-Mlxgw-Lookup"] == "error"
            assert h["X-Mlxgw-Backend"] == "b0" and h["X-Mlxgw-Route-Reason"] == "prefix", h
            assert int(h["X-Mlxgw-Matched-Tokens"]) >= 1024 and int(h["X-Mlxgw-Cached-Tokens"]) >= 1024, h
    finally:
        s.stop()
        r.cleanup()


def _ask(url, text):
    status, h, body = post(url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert status == 200, body
    return h


def test_a_shared_prefix_follows_its_first_request_before_any_report(demo_model):
    # Redis is stopped after start-up: no backend report can reach the gateway,
    # so any matched prefix below comes from the gateway's own claims and routes.
    r = RedisServer().start()
    s = Stack(r.url, demo_model)
    try:
        for b in ("b0", "b1", "b2"):
            s.add_backend(b)
        s.add_gateway("--pending-grace", "2")
        s.wait()
        r.stop()
        tok = load_model_info("demo-tiny", demo_model).tokenizer
        base = words(400, seed=91)
        ids = [render_chat(tok, [{"role": "user", "content": base + t}]).token_ids for t in (" one", " two")]
        common = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
        block = s.block_size
        h1 = _ask(s.gateway.url, base + " one")
        h2 = _ask(s.gateway.url, base + " two")
        assert h1["X-Mlxgw-Lookup"] == h2["X-Mlxgw-Lookup"] == "error"
        assert h1["X-Mlxgw-Matched-Tokens"] == "0"
        assert h2["X-Mlxgw-Backend"] == h1["X-Mlxgw-Backend"]
        assert int(h2["X-Mlxgw-Matched-Tokens"]) == common // block * block > 0
        time.sleep(2.5)  # past the grace: the claims are gone, the gateway's memory of its
        # routes (gateway.pending.RecentRoutes, used only while Redis cannot answer) is not
        h3 = _ask(s.gateway.url, base + " three")
        assert h3["X-Mlxgw-Backend"] == h1["X-Mlxgw-Backend"]
        assert int(h3["X-Mlxgw-Matched-Tokens"]) == common // block * block
    finally:
        s.stop()
        r.cleanup()


def test_a_sibling_through_another_gateway_meets_the_prompt_in_prefill(make_stack):
    """Gateway 1 cannot see gateway 0's pending claims, but the backend claims a prompt's
    blocks in Redis from its arrival (backend.report `Reporter.claim`): a sibling sent through
    gateway 1 during the first prompt's prefill goes to the same backend and reuses it."""
    import threading

    import numpy as np

    a = np.random.default_rng(11).integers(16, 3000, 2000).tolist()
    b = a[:1500] + np.random.default_rng(12).integers(16, 3000, 20).tolist()
    # 2,000 tokens at 1,000 tokens/s: two seconds of prefill.
    sim = ("--engine", "sim", "--sim-prefill-rate", "1000", "--prefill-step-size", "64")
    for flags, same, cached in (((), True, 1500), (("--no-inflight-claims",), False, 0)):
        s = make_stack()
        for i in range(2):
            s.add_backend(f"b{i}", None, *sim, *flags)
        g0, g1 = s.add_gateway(), s.add_gateway()
        s.wait()
        first = {}
        t = threading.Thread(target=lambda: first.update(
            r=post(g0.url + "/v1/completions", {"model": s.model_name, "prompt": a, "max_tokens": 1})))
        t.start()
        time.sleep(0.5)
        st, h, body = post(g1.url + "/v1/completions", {"model": s.model_name, "prompt": b, "max_tokens": 1})
        t.join(30)
        assert st == 200 and first["r"][0] == 200, body
        assert (h["X-Mlxgw-Backend"] == first["r"][1]["X-Mlxgw-Backend"]) is same, flags
        assert int(h["X-Mlxgw-Matched-Tokens"]) == (1500 // s.block_size * s.block_size if same else 0)
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, flags
        s.stop()


def test_many_claims_under_one_shared_prefix_keep_exact_depths_and_leave_nothing_behind():
    """Agent traffic files every claim under one first block (a shared system prompt): depths
    stay exact per backend as claims come and go, and the count index empties with them."""
    from mlxgw import schema

    system = list(range(5000, 5000 + 64 * 8))  # 8 shared blocks
    prompts = [system + [i] * 64 * (1 + i % 5) for i in range(300)]  # 9-13 blocks each
    keys = [schema.block_keys("m", ids, 64) for ids in prompts]
    p = PendingClaims(grace=0.5)
    handles = [p.add(f"b{i % 3}", k) for i, k in enumerate(keys)]
    probe = schema.block_keys("m", system + [7] * 64 * 3 + [1] * 64, 64)  # request 7's first 3 own blocks
    assert p.depths(probe, now=0) == {"b0": 8, "b1": 11, "b2": 8}  # 7 % 3 == 1
    for i, h in enumerate(handles):
        if i % 3 == 1:
            p.release(h, ok=i != 7, now=1.0)  # request 7 failed: dropped at once
    assert p.depths(probe, now=1.0) == {"b0": 8, "b1": 8, "b2": 8} and len(p) == 299
    p.release(handles[1], ok=True, now=1.0)  # a second release of one claim changes nothing
    assert p.depths(probe, now=1.6) == {"b0": 8, "b2": 8} and len(p) == 200
    for h in handles:
        p.release(h, ok=False, now=2.0)
    assert p.depths(probe, now=2.0) == {} and len(p) == 0 and p._held._by_backend == {}


def test_pending_claims_counts_only_claims_within_their_grace():
    """`/health` `pending_claims` (`live`): a claim past its grace is not counted, whether or not
    a request was routed since (helper-59: 3 claims 50 s after the last request, grace 1 s)."""
    p = PendingClaims(grace=1.0)
    ended, live = p.add("b0", ["k1", "k2"]), p.add("b1", ["k3"])
    p.release(ended, True, now=time.monotonic() - 2)  # ended 2 s ago: its grace ran out 1 s ago
    assert len(p) == 2 and p.live() == 1 and len(p) == 1 and p.depths(["k1", "k2"]) == {}
    p.release(live, True)
    assert p.live() == 1  # within its grace



def test_in_flight_prefill_counts_for_a_second_and_choices_as_decodes():
    """This gateway's queued prefill (`gateway.proxy.InFlight`): a request's prefill counts for
    ``fresh`` seconds or until its first token, whichever is sooner (the window the load weight
    was measured with; counting streams until their first token lost in a side-by-side replay,
    session 45); a request counts its ``n`` choices as decodes until it ends."""
    from gateway.proxy import InFlight

    f = InFlight(fresh=0.2)
    a = f.begin("b0", 4000, decodes=1)
    f.begin("b0", 300, decodes=3)
    assert f.view() == {"b0": (4, 4300)}
    f.started("b0", a)
    assert f.view() == {"b0": (4, 300)}
    time.sleep(0.3)
    assert f.view() == {"b0": (4, 0)}
    f.end("b0", a)
    assert f.view() == {"b0": (3, 0)}


def test_a_next_turn_after_its_answer_is_not_held_by_a_claim_the_backend_did_not_keep(make_stack):
    """A claim ends with its request (`RoutingConfig.pending_grace` 0, session 47): an owner
    whose cache keeps nothing (here a budget below one prompt; in helper-87's fleet the KV in
    flight filling it) holds no turn it answered. With the claim kept 1 s past the answer, each
    next turn, sent at once, matched its previous prompt there and stayed on the busy owner
    beside an idle backend (helper-87: 0 of 82 requests on an added backend in 120 s)."""
    import http.client
    import threading

    s = make_stack()
    # A budget below one prompt's KV; decoding slowly, so the long request below outlasts the turns.
    b0 = s.add_backend("b0", None, "--engine", "sim", "--cache-bytes", "1MB", "--sim-decode-rate", "50")
    g0 = s.add_gateway()  # the default: grace 0
    g1 = s.add_gateway("--pending-grace", "30")  # a claim kept past the answer, for contrast
    s.wait()
    # Keeps b0 decoding (256 tokens of load in g0's figure, published to g1) through the turns;
    # closed at the end, which cancels it (a stopping gateway would wait for it).
    busy = http.client.HTTPConnection("127.0.0.1", g0.port, timeout=60)
    busy.request("POST", "/v1/completions", json.dumps({"model": s.model_name, "prompt": words(80, seed=90),
                                                        "max_tokens": 4000, "stream": True}),
                 {"Content-Type": "application/json"})
    assert busy.getresponse().status == 200
    deadline = time.time() + 30
    while (get_json(b0.url + "/health") or {}).get("active", 0) < 1 and time.time() < deadline:
        time.sleep(0.05)

    def turn(g, messages, max_tokens=4):
        status, h, body = post(g.url + "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})
        assert status == 200, body
        return h, messages + [json.loads(body)["choices"][0]["message"]]

    firsts = {}

    def first_turn(g, seed):  # ~400 tokens, well above min_hit_tokens; ~4 s of decode
        firsts[g.name] = turn(g, [{"role": "user", "content": words(300, seed=seed)}], max_tokens=200)

    ts = [threading.Thread(target=first_turn, args=a) for a in ((g0, 91), (g1, 92))]
    for t in ts:
        t.start()
    while get_json(b0.url + "/health")["active"] < 3 and time.time() < deadline:
        time.sleep(0.05)
    s.add_backend("b1", None, "--engine", "sim")  # listed while the first turns run
    s.wait()
    for t in ts:
        t.join(60)
    assert [firsts[g.name][0]["X-Mlxgw-Backend"] for g in (g0, g1)] == ["b0", "b0"]  # the only backend then
    # Each next turn at once, as an agent sends it: within a second of its previous answer.
    nxt = {g.name: turn(g, firsts[g.name][1] + [{"role": "user", "content": "and then?"}])[0] for g in (g0, g1)}
    assert get_json(b0.url + "/health")["active"] == 1  # still decoding: b0 was the busier one
    assert get_json(b0.url + "/health")["cache_entries"] == 0  # it kept neither turn
    # g0: nothing of the turn is on b0 (neither saved nor being computed), so the idle b1 takes it.
    assert (nxt["gw0"]["X-Mlxgw-Backend"], nxt["gw0"]["X-Mlxgw-Matched-Tokens"]) == ("b1", "0"), nxt["gw0"]
    # g1: the stale claim says b0 holds the previous prompt, and the busy b0 keeps the turn.
    assert nxt["gw1"]["X-Mlxgw-Backend"] == "b0" and int(nxt["gw1"]["X-Mlxgw-Matched-Tokens"]) >= 256, nxt["gw1"]
    busy.close()
