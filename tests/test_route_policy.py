"""The routing-policy switch: cache_aware (default), round_robin, least_loaded."""

from __future__ import annotations

import pytest

from gateway.route import RoutingConfig, rank, seed_wait
from mlxgw.schema import Candidate


def _cands():
    # b1 owns 4 blocks of the prompt but is the busiest; b2 is idle.
    return [
        Candidate("b0", 1, "http://b0", active=0, queued_prefill_tokens=0, gw_requests=2, gw_prefill_tokens=100, state="ready", depth_blocks=0),
        Candidate("b1", 1, "http://b1", active=0, queued_prefill_tokens=0, gw_requests=5, gw_prefill_tokens=900, state="ready", depth_blocks=4),
        Candidate("b2", 1, "http://b2", active=0, queued_prefill_tokens=0, gw_requests=0, gw_prefill_tokens=0, state="ready", depth_blocks=0),
    ]


def test_default_policy_is_cache_aware_and_prefers_the_owner():
    cfg = RoutingConfig()
    assert cfg.policy == "cache_aware" and cfg.load_weight == 0.03
    # b1 owns 3200 of 4000 tokens: 800 to prefill + 0.03 x (900 queued + 5 x 256 running) = 865.4 < 4000.
    cands = _cands()
    cands[1].depth_blocks = 200
    d = rank(cands, 4000, 16, cfg=cfg)
    assert d.best.cand.backend_id == "b1" and d.best.matched == 3200 and d.best.cost == pytest.approx(865.4)
    # On a 100-token prompt its 64 owned tokens are not worth its queue: 36 + 65.4 > 100 on idle b2.
    d = rank(_cands(), 100, 16, cfg=cfg)
    assert d.best.cand.backend_id == "b2" and d.ranked[1].cand.backend_id == "b1"
    # At weight 0.1 the same queue costs 218: b1 falls behind b0 (100 + 0.1 x (100 + 2 x 256) = 161.2).
    d = rank(_cands(), 100, 16, cfg=RoutingConfig(load_weight=0.1))
    assert [s.cand.backend_id for s in d.ranked] == ["b2", "b0", "b1"]


def test_round_robin_cycles_in_id_order():
    cfg = RoutingConfig(policy="round_robin")
    picks = [rank(_cands(), 100, 16, cfg=cfg).best.cand.backend_id for _ in range(6)]
    assert picks == ["b0", "b1", "b2", "b0", "b1", "b2"]
    # Matched prefixes are still reported (headers), only the order ignores them.
    assert {s.cand.backend_id: s.matched for s in rank(_cands(), 100, 16, cfg=cfg).ranked}["b1"] == 64


def test_least_loaded_orders_by_running_then_queued():
    d = rank(_cands(), 100, 16, inflight={"b2": (3, 0)}, cfg=RoutingConfig(policy="least_loaded"))
    assert [s.cand.backend_id for s in d.ranked] == ["b0", "b2", "b1"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        RoutingConfig(policy="random")


def _full(bid, victim_at, load_tokens=0, depth=0, free=0, queued=0):
    # A backend whose 1 GB cache is full (``free`` bytes left), 1 KB of KV per token;
    # its load is running requests (256 tokens each) unless ``queued`` prompt tokens are given.
    return Candidate(bid, 1, f"http://{bid}", active=0, queued_prefill_tokens=0, gw_requests=load_tokens // 256,
                     gw_prefill_tokens=queued, state="ready", depth_blocks=depth, saved_blocks=depth,
                     cache_bytes=2**30 - free, cache_budget_bytes=2**30, victim_used_at=victim_at,
                     kv_bytes_per_token=1024.0)


PLACE = RoutingConfig(placement_slack_tokens=256)


def test_placement_sends_a_cold_prompt_where_the_oldest_entry_is_evicted():
    assert RoutingConfig().placement_slack_tokens == 0  # opt-in (docs/routing.md)
    # b0 is the cheapest (no load) but would evict an entry used at t=500; b1 costs
    # 0.03 x 19 x 256 = 146 tokens more (within the 256 slack) and evicts one used at t=100.
    cands = [_full("b0", 500.0), _full("b1", 100.0, load_tokens=5000), _full("b2", 50.0, load_tokens=20000)]
    d = rank(cands, 4000, 16, cfg=PLACE)
    assert d.best.cand.backend_id == "b1" and d.reason == "placement" and d.best.evicts
    # b2's victim is older still, but 0.03 x 78 x 256 = 599 tokens costlier: beyond the slack.
    assert [s.cand.backend_id for s in d.ranked] == ["b1", "b0", "b2"]
    # Slack 0 turns placement off: cost alone decides.
    d = rank(cands, 4000, 16, cfg=RoutingConfig(placement_slack_tokens=0))
    assert d.best.cand.backend_id == "b0" and d.reason == "load"
    # A wider slack reaches b2.
    assert rank(cands, 4000, 16, cfg=RoutingConfig(placement_slack_tokens=1000)).best.cand.backend_id == "b2"


def test_placement_prefers_room_and_leaves_prefix_hits_and_roomy_bests_alone():
    # b1 has room for the 4000 new tokens (4000 x 1 KB < 8 MB free): it evicts nothing.
    cands = [_full("b0", 100.0), _full("b1", 900.0, load_tokens=5000, free=8 << 20)]
    d = rank(cands, 4000, 16, cfg=PLACE)
    assert d.best.cand.backend_id == "b1" and not d.best.evicts and d.ranked[1].evicts
    # The cheapest has room itself: nothing to improve, cost decides.
    cands = [_full("b0", 900.0, free=8 << 20), _full("b1", 100.0, load_tokens=100)]
    assert rank(cands, 4000, 16, cfg=PLACE).best.cand.backend_id == "b0"
    # b0 owns 100 blocks (1600 tokens): a different matched prefix is never traded for placement.
    cands = [_full("b0", 900.0, depth=100), _full("b1", 100.0)]
    d = rank(cands, 4000, 16, cfg=PLACE)
    assert d.best.cand.backend_id == "b0" and d.reason == "prefix" and d.best.matched == 1600
    # b1's victim is oldest, but the 2000 prompt tokens queued there overflow its 1 MB of
    # room: that victim is as good as gone, so b2 (victim still there) takes the prompt.
    cands = [_full("b0", 500.0), _full("b1", 100.0, queued=2000, free=1 << 20), _full("b2", 300.0, load_tokens=512)]
    d = rank(cands, 4000, 16, cfg=PLACE)
    assert d.best.cand.backend_id == "b2" and d.reason == "placement"
    # With every victim due to go, cost decides (no burst piles onto one stale figure).
    cands = [_full("b0", 500.0, queued=100), _full("b1", 100.0, queued=200)]
    assert rank(cands, 4000, 16, cfg=PLACE).best.cand.backend_id == "b0"
    # A backend that publishes no victim time (0) is not taken for the oldest.
    cands = [_full("b0", 500.0), _full("b1", 0.0)]
    assert rank(cands, 4000, 16, cfg=PLACE).best.cand.backend_id == "b0"
    # Unknown KV size (an empty cache has published none): no eviction assumed.
    empty = Candidate("b2", 1, "http://b2", active=0, queued_prefill_tokens=0, state="ready",
                      cache_budget_bytes=2**30)
    d = rank([_full("b0", 500.0), empty], 4000, 16, cfg=PLACE)
    assert not d.ranked[[s.cand.backend_id for s in d.ranked].index("b2")].evicts


def _seed_cands(owner_queued: int, saved: bool = True, empty_bytes: int = 0, empty_active: int = 0):
    # "a" owns the prompt's 2,048-token system prefix (32 blocks of 64) and has owner_queued
    # tokens of prefill waiting; "b" has just started: nothing cached, nothing to do.
    a = Candidate("a", 1, "http://a", active=0, queued_prefill_tokens=0, state="ready", depth_blocks=32,
                  saved_blocks=32 if saved else 0, gw_requests=1, gw_prefill_tokens=owner_queued,
                  cache_bytes=10**9, min_hit_tokens=1000)
    b = Candidate("b", 2, "http://b", active=empty_active, queued_prefill_tokens=0, state="ready",
                  cache_bytes=empty_bytes)
    return [a, b]


def test_an_empty_idle_backend_takes_a_request_its_owner_has_no_decode_slot_for():
    """An 8,192-token system prompt saved on "a", 16 requests in flight there on its 16 decode
    slots: 16 x 256 = 4,096 tokens of load, under the prefix, kept every request on "a" (20
    agents: an added backend idle beside 4 requests waiting for a slot; bench/agent_fleet.py,
    session 48). A 17th request would wait for a slot there: the idle empty "b" takes it."""

    def cands(in_flight, slots=16, b_active=0):
        a = Candidate("a", 1, "http://a", active=0, queued_prefill_tokens=0, state="ready", depth_blocks=128,
                      saved_blocks=128, gw_requests=in_flight, cache_bytes=10**9, decode_slots=slots)
        b = Candidate("b", 2, "http://b", active=b_active, queued_prefill_tokens=0, state="ready", decode_slots=16)
        return [a, b]

    d = rank(cands(16), 9000, 64)
    assert (d.best.cand.backend_id, d.reason) == ("b", "seed") and d.ranked[1].cand.backend_id == "a"
    assert rank(cands(15), 9000, 64).reason == "prefix"  # a slot is free on "a"
    assert rank(cands(16, slots=0), 9000, 64).reason == "prefix"  # slots not published
    assert rank(cands(16), 9000, 64, cfg=RoutingConfig(seed_when_full=False)).reason == "prefix"  # the rule before
    assert rank(cands(16, b_active=1), 9000, 64).best.cand.backend_id == "a"  # "b" is not idle
    # This gateway's own requests in flight count as the other gateways' do.
    assert rank(cands(10), 9000, 64, inflight={"a": (6, 0)}).reason == "seed"


def test_a_conversation_leaves_an_owner_with_every_decode_slot_taken_for_a_backend_holding_its_system_prompt():
    """helper-89 (session 48): "a" holds a conversation's 9,472 tokens with 18 requests in
    flight on 16 decode slots; "b" holds the 8,000-token system prompt with one. At load
    weight alone "a" cost 601 against "b"'s 1,929 tokens, so the turn waited for a slot there.
    Its wait: (18 - 16 + 1) / 16 x 9 s a request decodes x 1,600 prefill tokens/s = 2,700 tokens
    (the sim's M4 Max figures for 200-token answers at 16 x 9k context) puts "a" at 2,866
    against "b"'s 1,508 (1,500 to prefill). At 2.5 s of decode (a wait of 750 tokens) "a" keeps it:
    a shorter wait than the prefill it saves. Only a backend with compute to spare takes it: at
    most a quarter of its slots in use and no prompt queued (the prefill a move adds would
    delay a busy one's own queue)."""

    def cands(active=18, held=9.0, tps=1600.0, slots=16, b_active=1, b_queued=0, b_heartbeat=0):
        a = Candidate("a", 1, "http://a", active=0, queued_prefill_tokens=0, state="ready", depth_blocks=148,
                      saved_blocks=148, gw_requests=active, cache_bytes=10**9, decode_slots=slots,
                      prefill_tps=tps, decode_seconds=held)
        b = Candidate("b", 2, "http://b", active=b_heartbeat, queued_prefill_tokens=0, state="ready",
                      depth_blocks=125, saved_blocks=125, gw_requests=b_active, gw_prefill_tokens=b_queued,
                      cache_bytes=10**9, decode_slots=16, prefill_tps=tps, decode_seconds=held)
        return [a, b]

    d = rank(cands(), 9500, 64)
    assert d.best.cand.backend_id == "b" and d.reason == "wait"
    a = d.ranked[1]
    assert (a.matched, a.wait) == (9472, pytest.approx(2700.0))
    assert a.cost == pytest.approx(28 + 0.03 * 18 * 256)  # the wait shown beside it, not in it
    assert d.best.cost == pytest.approx(1500 + 0.03 * 256) and d.best.wait == 0
    assert "wait=2700" in a.explain() and "wait" not in d.best.explain()
    assert rank(cands(held=2.5), 9500, 64).best.cand.backend_id == "a"
    assert rank(cands(b_active=4), 9500, 64).reason == "wait"  # a quarter of its slots
    for kw in ({"b_active": 5}, {"b_queued": 64}, {"b_heartbeat": 5}):  # no compute to spare
        d = rank(cands(**kw), 9500, 64)
        assert (d.best.cand.backend_id, d.reason) == ("a", "prefix"), kw
        assert d.best.wait == pytest.approx(2700.0), kw
    # A free slot on "a", or figures not measured or published yet: no wait.
    for kw in ({"active": 15}, {"held": 0.0}, {"tps": 0.0}, {"slots": 0}):
        d = rank(cands(**kw), 9500, 64)
        assert d.best.cand.backend_id == "a" and d.best.wait == 0, kw
    # Weight 0: the rule before (A/B runs); the wait is shown, not counted.
    d = rank(cands(), 9500, 64, cfg=RoutingConfig(slot_wait_weight=0))
    assert (d.best.cand.backend_id, d.best.wait) == ("a", pytest.approx(2700.0))
    assert d.best.cost == pytest.approx(28 + 0.03 * 18 * 256)


def test_an_empty_idle_backend_takes_a_shared_prefix_once_its_owner_is_busier_than_the_prefix():
    # 2,200-token prompt: on "a" 152 to prefill + 0.03 x (3,000 + 256) = 250 tokens of cost,
    # on "b" 2,200; at load_weight alone "a" keeps it until its load passes ~68k tokens.
    d = rank(_seed_cands(3000), 2200, 64)
    assert d.best.cand.backend_id == "b" and d.reason == "seed"
    assert [s.cand.backend_id for s in d.ranked] == ["b", "a"]  # the owner stays the retry
    # Owner load 1,500 + 256 = 1,756 < the 2,048 tokens "b" would recompute: the owner keeps it.
    d = rank(_seed_cands(1500), 2200, 64)
    assert d.best.cand.backend_id == "a" and d.reason == "prefix"
    # Past a prefix "a" is still computing (claimed, not saved: a burst or fan-out pending ownership
    # gathers there) the load must exceed twice the prefix: 3,256 < 4,096 keeps it, 4,256 does not.
    assert rank(_seed_cands(3000, saved=False), 2200, 64).best.cand.backend_id == "a"
    d = rank(_seed_cands(4000, saved=False), 2200, 64)
    assert d.best.cand.backend_id == "b" and d.reason == "seed"
    # seed_claim_factor 0: only past a saved prefix (session 46's rule); 1: as past a saved one.
    assert rank(_seed_cands(4000, saved=False), 2200, 64, cfg=RoutingConfig(seed_claim_factor=0)).reason == "prefix"
    assert rank(_seed_cands(3000, saved=False), 2200, 64, cfg=RoutingConfig(seed_claim_factor=1)).reason == "seed"
    # Other prompts in "b"'s cache do not matter (helper-86: one 32-token entry kept a backend
    # idle for 6 minutes beside a busy peer); a request of its own does (its heartbeat).
    assert rank(_seed_cands(3000, empty_bytes=4096), 2200, 64).reason == "seed"
    assert rank(_seed_cands(3000, empty_active=1), 2200, 64).best.cand.backend_id == "a"
    # ... or this gateway has a request in flight there.
    assert rank(_seed_cands(3000), 2200, 64, inflight={"b": (1, 0)}).best.cand.backend_id == "a"
    # The rule before (A/B runs).
    d = rank(_seed_cands(3000), 2200, 64, cfg=RoutingConfig(seed_empty=False))
    assert d.best.cand.backend_id == "a" and d.reason == "prefix"


def test_a_turn_beside_the_owners_prefill_stays_only_when_its_answer_ends_before_the_move_would_pay():
    """helper-94's case (session 52, two real backends, 64-token blocks, 512-token prefill
    steps, step-beside): a turn with 50 new tokens past 1,536 saved on "a", where a 7,053-token
    prompt is prefilling (6,285 queued in the figures, one request running), "b" idle and empty.
    Kept, its 16-token answer decodes one token per 512-token chunk of that prefill (measured
    E2E 3.4-5.3 s kept, 0.92 s moved): 256 running + 512 (its chunk, padded) + 1,280 (2.5 steps
    to its first token) + 5,005 (the rest of the prefill, under 15 more chunks) = 7,053 > 1,536.
    Past 6,016 saved tokens a 4-token answer stays: 256 + 512 + 1,280 + 3 x 512 = 3,584 < 6,016,
    where the move would recompute 6,016 tokens (about 3 s there) for an answer done in about
    7 steps (session 52's rule charged 256 and kept both; the default, session 51's, charges 6,541
    and moves both). Opt-in (``--seed-beside``): helper-95 measured on real backends that where it
    keeps a turn the default moves, the move answered sooner (its chunks' depth is left out)."""
    def cands(saved: int, beside: int = 512, steps_per_token: float = 1.0, queued: int = 6285, block: int = 64):
        a = Candidate("a", 1, "http://a", active=0, queued_prefill_tokens=0, state="ready", depth_blocks=saved // block,
                      saved_blocks=saved // block, gw_requests=1, gw_prefill_tokens=queued,
                      cache_bytes=10**9, min_hit_tokens=512, prefill_beside_tokens=beside,
                      decode_steps_per_token=steps_per_token)
        b = Candidate("b", 2, "http://b", active=0, queued_prefill_tokens=0, state="ready")
        return [a, b]

    beside = RoutingConfig(seed_beside=True)
    d = rank(cands(1536), 1586, 64, cfg=beside, answer_tokens=16)
    assert (d.best.cand.backend_id, d.reason, d.ranked[1].load) == ("b", "seed", 6541)
    assert seed_wait(d.ranked[1], 64, beside=True, answer_tokens=16) == 7053
    d = rank(cands(6016), 6066, 64, cfg=beside, answer_tokens=4)
    assert (d.best.cand.backend_id, d.reason, d.best.matched) == ("a", "prefix", 6016)
    assert seed_wait(d.best, 64, beside=True, answer_tokens=4) == 3584
    # A longer answer, or no max_tokens (as long as the queue: the load plus the padded chunk).
    assert rank(cands(6016), 6066, 64, cfg=beside, answer_tokens=16).reason == "seed"
    assert rank(cands(6016), 6066, 64, cfg=beside).reason == "seed"
    # The default: the whole load, 6,541 > 6,016.
    assert rank(cands(6016), 6066, 64, answer_tokens=4).reason == "seed"
    # A remainder longer than the backend's step, or a backend that publishes none (fifo,
    # shorter-beside, older backends): behind the queue, the whole load.
    assert rank(cands(6016, beside=32), 6066, 64, cfg=beside, answer_tokens=4).reason == "seed"
    assert rank(cands(6016, beside=0), 6066, 64, cfg=beside, answer_tokens=4).reason == "seed"
    # Past a claim (the prefix still computing there) the request waits for that prefill whatever
    # its remainder: the whole load counts (6,541 > 2 x 3,008 past a 3,008-token claim).
    claim = cands(6016)
    claim[0].saved_blocks = 0
    claim[0].depth_blocks = 47
    assert rank(claim, 3058, 64, cfg=beside, answer_tokens=4).reason == "seed"
    # Session 51's synthetic-trace case in the sim's units (16 ids a 512-token block, a step of
    # 16 ids, decode weight 8): 544 of 560 ids saved beside a 1,216-id prompt. A 1-token answer
    # ends with its first decode step: 8 + 16 + 40 = 64 < 544, it stays (the replay's kept ones
    # answered in 12-19 ms, seeded in 96-160 ms). A sim token stands for 32 real decode steps
    # (`decode_steps_per_token`), so a 2-token answer decodes beside 32 more chunks:
    # 8 + 16 + 40 + 512 = 576 > 544, seeded. Read as one step a token it would stay (80).
    cfg = RoutingConfig(decode_weight=8, seed_beside=True)
    sim = cands(544, beside=16, steps_per_token=32.0, queued=1216, block=16)
    d = rank(sim, 560, 16, cfg=cfg, answer_tokens=1)
    assert (d.best.cand.backend_id, d.reason, seed_wait(d.best, 16, True, answer_tokens=1)) == ("a", "prefix", 64)
    d = rank(sim, 560, 16, cfg=cfg, answer_tokens=2)
    assert (d.best.cand.backend_id, d.reason, seed_wait(d.ranked[1], 16, True, answer_tokens=2)) == ("b", "seed", 576)
    sim[0].decode_steps_per_token = 1.0
    d = rank(sim, 560, 16, cfg=cfg, answer_tokens=2)
    assert (d.best.cand.backend_id, d.reason, seed_wait(d.best, 16, True, answer_tokens=2)) == ("a", "prefix", 80)
    # Busy with running decodes (charged whatever the remainder): 80 running x 8 = 640 > 544.
    busy = cands(544, beside=16, steps_per_token=32.0, queued=0, block=16)
    busy[0].gw_requests = 80
    assert rank(busy, 560, 16, cfg=cfg, answer_tokens=1).reason == "seed"


def test_a_turn_beside_a_deep_prefill_is_weighed_by_the_backends_attention_parity():
    """helper-95's case A2 (session 53, two real demo-model backends): a turn with 50 new tokens
    past 4,160 saved on "a", where a prompt with 3,961 tokens left is prefilling 4-8k tokens deep;
    a 4-token answer. Flat (no parity published) the estimate keeps it: 256 + 512 + 1,280 +
    3 x 512 = 3,584 < 4,160. Measured, the move answered sooner (TTFT 1.34-1.42 s against
    1.48-1.93 s, E2E 1.34-1.43 s against 2.85-3.22 s): the owner's chunks sat deep (~0.45 s a step
    against 0.17 s for a fresh 512-token chunk). With the demo model's attention parity (360) the
    owner's part counts (1 + 4160/360) / (1 + 2080/360) = 1.85 times: 256 + 3,328 x 1.85 = 6,421,
    and it moves. The sim's Qwen3-4B (12,320 real tokens, 385 in 32-token sim ids) past 544 ids
    keeps a one-token answer: 8 + 56 x 1.41 = 87."""
    from gateway.route import depth_ratio

    def cands(parity: int):
        a = Candidate("a", 1, "http://a", active=0, queued_prefill_tokens=0, state="ready", depth_blocks=65,
                      saved_blocks=65, gw_requests=1, gw_prefill_tokens=3961, cache_bytes=10**9, min_hit_tokens=512,
                      prefill_beside_tokens=512, attention_parity_tokens=parity)
        b = Candidate("b", 2, "http://b", active=0, queued_prefill_tokens=0, state="ready")
        return [a, b]

    beside = RoutingConfig(seed_beside=True)
    d = rank(cands(0), 4210, 64, cfg=beside, answer_tokens=4)
    assert (d.best.cand.backend_id, d.reason, seed_wait(d.best, 64, True, answer_tokens=4)) == ("a", "prefix", 3584)
    d = rank(cands(360), 4210, 64, cfg=beside, answer_tokens=4)
    assert (d.best.cand.backend_id, d.reason) == ("b", "seed")
    assert round(seed_wait(d.ranked[1], 64, True, answer_tokens=4)) == 6421
    # The candidates header shows the charge beside the load (helper-96 read a move past
    # load=2801 < matched=5184 as the rule broken).
    assert "load=4217,seed_wait=6421,cost=" in d.ranked[1].explain()
    assert round(depth_ratio(4160, 360), 3) == 1.852 and depth_ratio(4160, 0) == depth_ratio(0, 360) == 1.0
    sim = cands(385)
    sim[0].depth_blocks = sim[0].saved_blocks = 34
    sim[0].gw_prefill_tokens, sim[0].prefill_beside_tokens, sim[0].decode_steps_per_token = 1216, 16, 32.0
    d = rank(sim, 560, 16, cfg=RoutingConfig(decode_weight=8, seed_beside=True), answer_tokens=1)
    assert (d.best.cand.backend_id, d.reason, round(seed_wait(d.best, 16, True, answer_tokens=1))) == ("a", "prefix", 87)


def test_the_owners_queued_prefill_after_its_reported_progress_decides_the_seeding():
    """Session 52's synthetic replay (sim ids): an 832-id prompt, 784 cached on "a", 48 to compute;
    "a" has one 1,504-id prompt of this gateway queued. Counted whole (8 + 1,504 > 784) it seeded
    the idle "b", though that prompt was partly done. Its backend's progress comments now lower
    the figure (`InFlight.progress`): with 1,000 of it done, 8 + 504 < 784 and the request stays.
    (Session 52's opt-in ``seed_progress`` estimated the same from the time since it was sent;
    retired in session 55, as it counted reported progress twice.)"""
    from gateway.proxy import InFlight

    def cands():
        a = Candidate("a", 1, "http://a", active=0, queued_prefill_tokens=0, state="ready", depth_blocks=49,
                      saved_blocks=49, cache_bytes=10**9, min_hit_tokens=32, prefill_beside_tokens=16,
                      prefill_tps=10000.0)
        b = Candidate("b", 2, "http://b", active=0, queued_prefill_tokens=0, state="ready")
        return [a, b]

    cfg = RoutingConfig(decode_weight=8)
    f = InFlight()
    h = f.begin("a", 1504)
    assert rank(cands(), 832, 16, f.view(), cfg=cfg).reason == "seed"
    f.progress("a", h, 504)
    d = rank(cands(), 832, 16, f.view(), cfg=cfg)
    assert (d.best.cand.backend_id, d.reason, d.best.queued) == ("a", "prefix", 504)
    # Another gateway's queued prefill there (as published) counts too: 8 + 504 + 1000 > 784.
    other = cands()
    other[0].gw_prefill_tokens = 1000
    assert rank(other, 832, 16, f.view(), cfg=cfg).reason == "seed"
