"""The routing-policy switch: cache_aware (default), round_robin, least_loaded."""

from __future__ import annotations

import pytest

from gateway.route import RoutingConfig, rank
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
