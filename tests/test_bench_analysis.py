"""The replay benchmark's analysis: medians over rounds, paired ratios, and the
per-request split of hits lost against the pooled cache (README figures rest on it).

The candidate header is produced by the gateway's own `rank()` and `Scored.explain()`,
so a format change there breaks this test rather than the benchmark's numbers.
"""

from __future__ import annotations

import pytest

from bench.placement_model import BlockLRU, SharedBlockLRU, follow, hit_ratio
from bench.replay_routers import (_candidates, _series, combine_rounds, dump_requests, lost_hits, lost_hits_by_router,
                                  mean_ci95, multi_budget, paired, table)
from bench.trace import TraceRequest, oracle_hits, oracle_prefixes
from gateway.route import RoutingConfig, rank
from mlxgw.schema import Candidate


def _run(router: str, hit: float, p50: float, p99: float, per_request=None, evictions: int = 0) -> dict:
    return {"router": router, "requests": 2, "errors": 0, "error_samples": [], "per_backend": [1, 1],
            "ttfts": [p50, p99], "hit_ratio": hit, "ttft_p50": p50, "ttft_p99": p99, "e2e_p50": p50,
            "e2e_p99": p99, "throughput_rps": 1.0, "wall_s": 1.0, "load_share_max_mean": 1.0,
            "overhead_ms": None, "router_cpu_ms_per_request": None, "backend_cpu_s": 0.0,
            "evictions": evictions, "per_request": per_request or []}


def test_combine_rounds_gives_medians_ranges_and_pooled_ttfts():
    rounds = [[_run("mlxgw", 0.10, 1.0, 3.0)], [_run("mlxgw", 0.16, 2.0, 5.0)], [_run("mlxgw", 0.13, 4.0, 4.0)]]
    (row,) = combine_rounds(rounds)
    assert row["repeats"] == 3 and row["requests"] == 6
    assert row["hit_ratio"] == pytest.approx(0.13)
    assert row["ttft_p99"] == 4.0
    assert row["range"]["ttft_p50"] == [1.0, 4.0]
    assert row["ttfts"] == [1.0, 2.0, 3.0, 4.0, 4.0, 5.0]
    assert row["overhead_ms"] is None


def test_table_gives_the_median_budget_evictions():
    rounds = [[_run("mlxgw", 0.1, 1.0, 2.0, evictions=e)] for e in (5, 9, 7)]
    res = {"budgets": [{"fraction": 1.0, "per_backend_gb": 2.0, "runs": combine_rounds(rounds)}],
           "config": {"backends": 4}, "oracle_ratio": 0.2}
    row = [ln for ln in table(res).splitlines() if ln.startswith("| mlxgw |")][0]
    # budget evictions (median of 5, 9, 7), disk reads and GB written (none: no disk tier), errors
    assert row.split(" | ")[-4:] == ["7", "", "", "0 |"]
    # With a disk tier: the median reads and GB written.
    rounds = [[{**_run("mlxgw-disk", 0.1, 1.0, 2.0), "disk_reads": r, "disk_write_bytes": w}]
              for r, w in ((3, 2.0e9), (5, 7.5e9), (4, 4.25e9))]
    res["budgets"][0]["runs"] = combine_rounds(rounds)
    row = [ln for ln in table(res).splitlines() if ln.startswith("| mlxgw-disk |")][0]
    assert row.split(" | ")[-3:] == ["4", "4.2", "0 |"]


def test_paired_ratios_are_per_round():
    rounds = [[_run("mlxgw", 0.10, 1.0, 2.0), _run("sglang", 0.12, 2.0, 4.0), _run("pooled", 0.11, 1.0, 1.0)],
              [_run("mlxgw", 0.20, 3.0, 3.0), _run("sglang", 0.20, 1.0, 2.0), _run("pooled", 0.25, 1.0, 1.0)]]
    d = paired(rounds)
    assert d["mlxgw"]["p99_vs_sglang"] == [0.5, 1.5]
    assert d["mlxgw"]["p50_vs_sglang"] == [0.5, 3.0]
    assert d["mlxgw"]["hit_minus_sglang"] == pytest.approx([-0.02, 0.0])
    assert d["mlxgw"]["hit_minus_pooled"] == pytest.approx([-0.01, -0.05])
    assert d["pooled"]["p99_vs_sglang"] == [0.25, 0.5] and "hit_minus_pooled" not in d["pooled"]
    assert "sglang" not in d


def test_a_backend_variant_pairs_with_the_peer_in_front_of_the_same_backends():
    """``mlxgw-disk`` (backends with a disk tier) meets ``sglang-disk`` and ``pooled-disk``, not
    the peers in front of backends without one; a variant with no such peer falls back."""
    rounds = [[_run("mlxgw-disk", 0.30, 1.0, 2.0), _run("mlxgw-disk-sync", 0.30, 1.0, 4.0),
               _run("sglang", 0.10, 1.0, 8.0), _run("sglang-disk", 0.28, 1.0, 4.0),
               _run("pooled", 0.10, 1.0, 1.0), _run("pooled-disk", 0.32, 1.0, 1.0), _run("mlxgw-lw0", 0.1, 1.0, 4.0)]]
    d = paired(rounds)
    assert d["mlxgw-disk"]["p99_vs_sglang"] == [0.5] and d["mlxgw-disk-sync"]["p99_vs_sglang"] == [1.0]
    assert d["mlxgw-disk"]["hit_minus_pooled"] == pytest.approx([-0.02])
    assert d["mlxgw-disk"]["peers"] == ["sglang-disk", "pooled-disk"] and d["mlxgw-lw0"]["peers"] == ["sglang", "pooled"]
    assert d["mlxgw-lw0"]["p99_vs_sglang"] == [0.5] and d["mlxgw-lw0"]["hit_minus_pooled"] == pytest.approx([0.0])
    assert "hit_minus_pooled" not in d["pooled-disk"]


def test_per_round_series_gets_a_95_percent_interval_from_four_rounds():
    m, h = mean_ci95([0.01, 0.03, 0.02, 0.04])
    assert m == pytest.approx(0.025)
    # sample sd 0.0129099, t(3) = 3.182, sqrt(4) = 2
    assert h == pytest.approx(3.182 * 0.0129099 / 2, rel=1e-4)
    assert _series([0.5, 1.5, 1.0], "{:.2f}x") == "0.50x / 1.50x / 1.00x (median 1.00x)"
    assert _series([0.01, 0.03, 0.02, 0.04], "{:+.3f}") == (
        "+0.010 / +0.030 / +0.020 / +0.040 (median +0.025; mean +0.025, 95% CI +0.004 to +0.046)")


def _routed(owner_depth: int, owner_queued: int) -> dict:
    """Route headers as the gateway sends them: b0 owns ``owner_depth`` blocks and has
    ``owner_queued`` prefill tokens in flight from this gateway, b1 is idle and owns nothing."""
    cands = [Candidate("b0", 1, "u0", 0, 0, "ready", depth_blocks=owner_depth),
             Candidate("b1", 1, "u1", 0, 0, "ready")]
    d = rank(cands, 4096, 64, inflight={"b0": (3, owner_queued)}, cfg=RoutingConfig())
    return {"backend": d.ranked[0].cand.backend_id, "candidates": " ".join(s.explain() for s in d.ranked),
            "reason": d.reason}


def test_lost_hits_splits_the_shortfall_by_cause():
    moved = _routed(owner_depth=2, owner_queued=200_000)  # queue far longer than the 128 cached tokens
    guarded = _routed(owner_depth=40, owner_queued=300_000)  # past the balance guard's 262,144 tokens
    stayed = _routed(owner_depth=40, owner_queued=0)
    assert moved["backend"] == "b1" and stayed["backend"] == "b0"
    assert guarded["backend"] == "b1" and guarded["reason"] == "balance" and moved["reason"] == "load"
    assert _candidates(moved["candidates"]) == {"b0": 128, "b1": 0}
    nobody = {"backend": "b1", "candidates": "b1:matched=0 b0:matched=0"}
    ours = [{"cached": 0, "route": moved},       # moved past b0's 128 tokens
            {"cached": 5, "route": nobody},      # 4 short: less than a block
            {"cached": 1000, "route": stayed},   # b0 owned 2560 but held 1000 when it arrived
            {"cached": 0, "route": nobody},      # 640 the pooled cache had, nobody owned
            {"cached": 2560, "route": stayed},   # as good as pooled: not counted
            {"cached": 0, "route": guarded},     # moved off b0's 2560 by the guard
            {"cached": 0, "route": {**nobody, "lookup": "timeout"}}]  # owned maybe, but the lookup gave up
    pool = [{"cached": 128}, {"cached": 9}, {"cached": 2560}, {"cached": 640}, {"cached": 2560}, {"cached": 2560},
            {"cached": 320}]
    lh = lost_hits([_run("mlxgw", 0, 0, 0, ours), _run("pooled", 0, 0, 0, pool)], block=64)
    assert lh == {"reference": "pooled", "requests": 6, "ids": 128 + 4 + 1560 + 640 + 2560 + 320,
                  "reference_cached_ids": 8457 + 320, "guard_requests": 1,
                  "moved_requests": 2, "moved_ids": 128 + 2560, "behind_requests": 1, "behind_ids": 1560,
                  "unowned_requests": 1, "unowned_ids": 640, "no_lookup_requests": 1, "no_lookup_ids": 320,
                  "sub_block_requests": 1, "sub_block_ids": 4,
                  "chance_requests": 0, "chance_ids": 0}
    # Given what the trace itself shares per request: the second one's 4 ids and the
    # fourth's 640 lie beyond it (ours reused all the trace shares), so they are chance.
    for i, r in enumerate(ours):
        r["i"] = i
    shared = [128, 5, 2560, 0, 2560, 2560, 320]
    by_trace = lost_hits([_run("mlxgw", 0, 0, 0, ours), _run("pooled", 0, 0, 0, pool)], 64, shared=shared)
    assert by_trace == {**lh, "requests": 6, "sub_block_requests": 0, "sub_block_ids": 0, "unowned_requests": 0,
                        "unowned_ids": 0, "chance_requests": 2, "chance_ids": 4 + 640}
    assert lost_hits([_run("mlxgw", 0, 0, 0, ours)]) is None
    assert lost_hits([_run("mlxgw-lw0", 0, 0, 0, ours), _run("pooled", 0, 0, 0, pool)], 64, "mlxgw-lw0") == lh
    # against another router of the round (sglang-router) the same way
    vs = lost_hits([_run("mlxgw", 0, 0, 0, ours), _run("sglang", 0, 0, 0, pool)], 64, reference="sglang")
    assert vs == {**lh, "reference": "sglang"}
    both = lost_hits_by_router([_run("mlxgw", 0, 0, 0, ours), _run("sglang", 0, 0, 0, pool),
                                _run("pooled", 0, 0, 0, pool[:1] + [{"cached": 0}] * 6)], 64)
    assert [x["reference"] for x in both["mlxgw"]] == ["pooled", "sglang"]
    assert both["mlxgw"][0]["requests"] == 1 and both["mlxgw"][1] == vs


def test_oracle_reuses_the_longest_seen_prefix_and_leaves_one_token():
    reqs = [TraceRequest(0, 3 * 512, 1, [1, 2, 3]), TraceRequest(1, 4 * 512, 1, [1, 2, 3, 4]),
            TraceRequest(2, 2 * 512, 1, [1, 9]), TraceRequest(3, 2 * 512, 1, [1, 2])]
    hit, total = oracle_hits(reqs, 512)
    assert oracle_prefixes(reqs, 512) == [0, 3 * 512, 512, 2 * 512 - 1]
    assert total == 11 * 512
    assert hit == 3 * 512 + 512 + (2 * 512 - 1)


def test_multi_budget_choices():
    b = [0.05, 0.2, 1.0]
    assert [multi_budget("first", i, b) for i in range(3)] == [True, False, False]
    assert [multi_budget("last", i, b) for i in range(3)] == [False, False, True]
    assert [multi_budget("0.05,1", i, b) for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError):
        multi_budget("most", 0, b)


def test_dump_requests_writes_one_line_per_request_of_every_round(tmp_path):
    import json

    def req(i, cached, backend=None):
        route = {"backend": backend, "reason": "prefix"} if backend else {}
        return {"i": i, "prompt": 100, "cached": cached, "ttft": 0.01 * (i + 1), "e2e": 0.5, "status": 200,
                "error": None, "route": route}

    rounds = [[_run("mlxgw", 0.1, 1, 2, [req(0, 64, "b1"), req(1, 0, "b0")]), _run("sglang", 0.1, 1, 2, [req(0, 32)])],
              [_run("mlxgw", 0.1, 1, 2, [req(0, 96, "b2")]), _run("sglang", 0.1, 1, 2, [req(0, 0)])]]
    res = {"budgets": [{"fraction": 0.2, "runs": combine_rounds(rounds)}]}
    assert dump_requests(res, tmp_path / "r.jsonl") == 5
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["router"], r["round"], r["i"], r["cached"]) for r in rows] == [
        ("mlxgw", 1, 0, 64), ("mlxgw", 1, 1, 0), ("mlxgw", 2, 0, 96), ("sglang", 1, 0, 32), ("sglang", 2, 0, 0)]
    assert rows[0]["backend"] == "b1" and rows[0]["reason"] == "prefix" and rows[0]["budget"] == 0.2
    assert "backend" not in rows[3]  # sglang-router sends no route headers


def test_ttft_bands_gives_band_medians_and_paired_differences():
    from bench.ttft_bands import bands_table

    def row(router, rnd, i, prompt, ttft, status=200, budget=1.0):
        return {"budget": budget, "round": rnd, "router": router, "i": i, "prompt": prompt, "cached": 0,
                "ttft": ttft, "e2e": ttft, "status": status}

    rows = [row("a", 1, 0, 10, 0.010), row("a", 1, 1, 20, 0.030), row("a", 1, 2, 300, 0.200),
            row("b", 1, 0, 10, 0.005), row("b", 1, 1, 20, 0.010), row("b", 1, 2, 300, 0.250),
            row("a", 2, 0, 10, 0.012), row("b", 2, 0, 10, 0.002),
            row("a", 1, 3, 10, 9.0, status=500), row("a", 1, 4, 10, 9.0, budget=0.2)]  # both ignored
    t = bands_table(rows, 1.0, ["a", "b"], "b", edges=(0, 128))
    assert t["bands"] == [(0, 128), (128, None)]
    assert t["n"]["a"] == [3, 1] and t["n"]["b"] == [3, 1]
    assert t["median"]["a"] == [pytest.approx(0.012), pytest.approx(0.2)]
    # Paired within a round: (0.010-0.005, 0.030-0.010, 0.012-0.002) -> median 0.010; band 2: -0.05.
    assert t["paired"]["a"] == [pytest.approx(0.010), pytest.approx(-0.05)]
    assert t["paired"]["b"] == [0.0, 0.0]


def test_ttft_tail_splits_the_slowest_requests_into_own_prefill_and_wait():
    from bench.ttft_bands import tail_table

    def row(rnd, i, prompt, cached, ttft, cands=None, status=200):
        r = {"budget": 1.0, "round": rnd, "router": "a", "i": i, "prompt": prompt, "cached": cached,
             "ttft": ttft, "e2e": ttft, "status": status}
        if cands:
            r["candidates"] = cands
        return r

    # 150 requests per round: the slowest 1% is the slowest 2 (round(1.5)).
    rows = [row(1, i, 100, 0, 0.1) for i in range(148)] + [row(2, i, 100, 0, 0.1) for i in range(148)]
    rows += [row(1, 200, 1000, 0, 0.9, "b0:matched=0,queued=700,active=1 b1:matched=0,queued=300,active=2"),
             row(1, 201, 2000, 500, 0.8, "b0:matched=0,queued=100,active=1"),
             row(2, 200, 1000, 0, 0.7),
             row(2, 201, 500, 0, 0.6),
             row(2, 202, 100, 0, 9.0, status=500)]  # failed: not counted
    t = tail_table(rows, 1.0, ["a"], ids_per_s=1000.0)["a"]
    assert t["n"] == 4 and t["cold"] == 3
    # Own prefill 1.0, 1.5, 1.0, 0.5 s -> median 1.0; rest -0.1, -0.7, -0.3, 0.1 -> median -0.2.
    assert t["prefill"] == pytest.approx(1.0) and t["wait"] == pytest.approx(-0.2)
    assert t["queued"] == pytest.approx(200)  # least queued per request: 300 and 100


def test_estimate_compares_the_predicted_wait_with_the_actual_one():
    from bench.ttft_bands import estimate_table

    def row(rnd, i, prompt, cached, ttft, backend, cands, router="mlxgw"):
        return {"budget": 1.0, "round": rnd, "router": router, "i": i, "prompt": prompt, "cached": cached,
                "ttft": ttft, "e2e": ttft, "status": 200, "backend": backend, "candidates": cands}

    two = "b0:matched=0,queued={},active=1,load=9,cost=9 b1:matched=0,queued={},active=0,load=9,cost=9"
    rows = [row(1, 0, 1000, 0, 1.5, "b0", two.format(200, 400)),  # own 1.0 s, rest 0.5, predicted 0.2
            row(1, 1, 500, 100, 0.6, "b1", two.format(100, 300)),  # own 0.4, rest 0.2, predicted 0.3
            row(1, 2, 100, 0, 0.1, "b0", two.format(0, 0)),  # own 0.1, rest 0.0, predicted 0.0
            row(1, 3, 100, 0, 9.0, "b0", "", router="sglang"),  # another router: not counted
            {**row(1, 4, 100, 0, 0.1, "b0", two.format(0, 0)), "status": 500}]  # failed: not counted
    e = estimate_table(rows, 1.0, "mlxgw", ids_per_s=1000.0)
    assert e["n"] == 3
    assert e["predicted"] == pytest.approx([0.2, 0.2])  # sorted 0.0, 0.2, 0.3: index 1 and int(1.8) = 1
    assert e["actual"] == pytest.approx([0.2, 0.2, 0.2])
    assert e["error"] == pytest.approx([-0.1, 0.0, 0.0])  # sorted -0.1, 0.0, 0.3: indexes 0, 1, 1
    # The slowest request of the round (1.5 s) went to b0 with 200 queued against b1's 400: least queued.
    assert e["tail_n"] == 1 and e["tail_least"] == 1
    assert e["tail_predicted"] == pytest.approx(0.2) and e["tail_actual"] == pytest.approx(0.5)
    assert estimate_table(rows, 0.2, "mlxgw", 1000.0) == {}


def test_overhead_paired_median_interval_uses_binomial_order_statistics():
    from bench.overhead import median_ci95, paired_added

    # n = 10: P(B <= 1) = 11/1024 <= 2.5% < P(B <= 2) = 56/1024, so ranks 2 and 9
    assert median_ci95([float(x) for x in range(10, 0, -1)]) == (5.5, 2.0, 9.0)
    assert median_ci95([float(x) for x in range(1, 51)])[1:] == (18.0, 33.0)  # n = 50: ranks 18 and 33
    with pytest.raises(ValueError):
        median_ci95([1.0] * 5)
    lat = {"direct": [0.010] * 8, "mlxgw": [0.011, 0.012, 0.0115, 0.013, 0.0105, 0.012, 0.011, 0.014]}
    pa = paired_added(lat, "mlxgw")
    assert pa["median_ms"] == pytest.approx(1.75) and (pa["lo_ms"], pa["hi_ms"]) == (pytest.approx(0.5), pytest.approx(4.0))
    assert paired_added({"mlxgw": lat["mlxgw"]}, "mlxgw") is None


def test_follow_replays_a_dumps_routing_into_per_backend_lrus():
    reqs = [TraceRequest(i, 1024, 1, ids) for i, ids in enumerate([[1, 2], [3, 4], [5, 6], [1, 2, 7]])]
    routing = {0: "a", 1: "b", 2: "a", 3: "a"}
    # 7 distinct blocks; 8/7 of them over two backends is 4 blocks each: request 0 and 2 fit.
    assert follow(reqs, routing, 8 / 7, 0, 3) == (True, 0, 2)
    # 3 blocks each: storing request 2 evicts request 0's entry on backend a.
    assert follow(reqs, routing, 6 / 7, 0, 3) == (False, -1, 2)
    # One pooled LRU of 8 blocks holds all three; request 0's is still the next victim.
    assert follow(reqs, {i: "p" for i in range(4)}, 8 / 7, 0, 3) == (True, 0, 4)
    with pytest.raises(KeyError):
        follow(reqs, {0: "a"}, 1.0, 0, 3)


def test_shared_layout_holds_a_common_prefix_once():
    """Two prompts sharing blocks 1, 2 in a 4-block budget: one KV copy per entry (our backend,
    mlx-lm) holds 6 blocks and evicts the first prompt; blocks held once fit both."""
    whole, shared = BlockLRU(4), SharedBlockLRU(4)
    for lru in (whole, shared):
        assert lru.use([1, 2, 3], 0.0) == 0
        assert lru.use([1, 2, 4], 1.0) == 2
    assert whole.use([1, 2, 3], 2.0) == 2  # from [1, 2, 4]: [1, 2, 3] was evicted
    assert shared.use([1, 2, 3], 2.0) == 3
    # Over budget, the least recently used prompts lose their deepest blocks first; the prefix
    # they share stays while the budget allows.
    assert shared.use([5, 6], 3.0) == 0
    assert set(shared.stamp) == {1, 2, 5, 6} and shared.match([1, 2, 4]) == (2, None)
    reqs = [TraceRequest(i, 1024, 1, ids) for i, ids in enumerate([[1, 2, 3], [1, 2, 4], [1, 2, 3]])]
    # 4 distinct blocks, budget 1.0 pooled: the third request reuses 2 blocks (whole) or 3, each
    # capped at its length minus one token.
    assert hit_ratio(reqs, 1.0, pooled=True, layout="whole") == pytest.approx((1024 + 1024) / (3 * 1536))
    assert hit_ratio(reqs, 1.0, pooled=True, layout="shared") == pytest.approx((1024 + 1535) / (3 * 1536))


def test_ab_gateways_sees_which_checkout_a_gateway_imports(tmp_path):
    """``python -m`` imports from its working directory before PYTHONPATH: the base side of
    bench/ab_gateways.py must run from its own worktree (it did not before session 19)."""
    import os

    from bench.ab_gateways import ROOT, code_root

    (tmp_path / "gateway").mkdir()  # a namespace package, as in the repository
    (tmp_path / "gateway" / "app.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert code_root(env, tmp_path) == tmp_path.resolve()
    assert code_root(env, ROOT) == ROOT.resolve()  # started from this checkout: its code wins


@pytest.mark.parametrize("script", ["replay", "replay_routers"])
def test_a_missing_trace_is_one_message_and_exit_2(script, tmp_path):
    """Both replays stop before starting anything (replay.py printed the message once per
    policy, then a TypeError, before session 22)."""
    import subprocess
    import sys

    cmd = [sys.executable, f"bench/{script}.py", "--trace", str(tmp_path / "none.jsonl"), "--requests", "10"]
    if script == "replay":
        cmd += ["--policies", "cache_aware,round_robin"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("not found: get the Mooncake traces") == 1 and "Traceback" not in r.stderr, r.stderr


def test_inflight_shares_of_each_backends_budget():
    """bench/inflight.py: two backends of 16 ids each (half of a 64-id working set); A holds 16
    ids from 0 to 2 s and 16 more from 1 to 2 s (above 90% for 2 of the 4 s, peak twice its
    budget), B 16 ids from 0 to 0.5 s and from 3 to 4 s."""
    from bench.inflight import inflight_shares

    reqs = [TraceRequest(ms, 512, 1, [h]) for ms, h in ((0, 1), (1000, 2), (0, 3), (3000, 4))]
    rows = {0: {"backend": "a", "prompt": 16, "e2e": 2.0}, 1: {"backend": "a", "prompt": 16, "e2e": 1.0},
            2: {"backend": "b", "prompt": 16, "e2e": 0.5}, 3: {"backend": "b", "prompt": 16, "e2e": 1.0}}
    assert inflight_shares(reqs, rows, budget=0.5, compress=1.0, above=0.9) == {"a": (0.5, 2.0), "b": (0.375, 1.0)}


def test_results_name_the_commit_they_ran(tmp_path):
    """helper-72: the commits in the docs were written by hand; each results file now says which
    checkout made it, and whether its tracked files had uncommitted changes."""
    import re
    import subprocess

    from bench.provenance import ROOT, revision

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert re.fullmatch(re.escape(head) + r"( \+ uncommitted changes)?", revision()), revision()
    # a tracked file changed (in a throwaway clone, so this checkout is left alone)
    clone = tmp_path / "c"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    c_head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    assert revision(clone) == c_head
    (clone / "README.md").write_text("changed\n")
    (clone / "new-untracked-file").write_text("x\n")
    revision.cache_clear()
    assert revision(clone) == c_head + " + uncommitted changes"
    assert revision(tmp_path) == "unknown"  # not a checkout


def test_decisions_splits_the_tokens_a_run_lost_by_the_requests_it_seeded(tmp_path):
    """`bench/decisions.py` (session 55's reading of two gateways' losses): per run the
    decisions by reason and the prefix seeded requests left; against the base's same round,
    the cached tokens lost and gained and the part lost on seeded requests."""
    import json

    from bench.decisions import load_runs, owner_matched, summary

    assert owner_matched("b1:matched=0,queued=0,active=0 b0:matched=976,queued=1136,active=3") == 976
    assert owner_matched("") == 0

    def req(router, i, cached, reason, cands="b0:matched=0"):
        return {"budget": 1.0, "round": 1, "router": router, "i": i, "prompt": 100, "cached": cached,
                "reason": reason, "candidates": cands}

    rows = [req("mlxgw", 0, 90, "prefix"), req("mlxgw", 1, 0, "load"), req("mlxgw", 2, 50, "prefix"),
            req("mlxgw-x2", 0, 0, "seed", "b1:matched=0 b0:matched=96"), req("mlxgw-x2", 1, 7, "load"),
            req("mlxgw-x2", 2, 40, "prefix")]
    f = tmp_path / "dump.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = load_runs([str(f)])
    assert sorted(runs) == [(1.0, "mlxgw", 1), (1.0, "mlxgw-x2", 1)]
    lines = summary(runs, "mlxgw")
    assert "| 1 | mlxgw | 1 | 300 | 140 | load 1, prefix 2 | 0 / 0 / 0 |" in lines
    assert "| 1 | mlxgw-x2 | 1 | 300 | 47 | load 1, prefix 1, seed 1 | 100 / 96 / 0 |" in lines
    # lost 90 on request 0 (seeded) and 10 on request 2; gained 7 on request 1
    assert "| 1 | mlxgw-x2 | 1 | 100 (2) | 90 | 7 (1) |" in lines
