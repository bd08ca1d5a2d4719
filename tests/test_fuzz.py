"""Acceptance (issue 8): generated malformed requests never get a 5xx or crash anything.

The short run here (400 requests, the same ones every run) is part of the
default test command; ``python bench/fuzz.py --examples 10000`` is the full one.
"""

from bench.fuzz import run_fuzz


def test_fuzzed_requests_get_no_5xx(make_stack, demo_model):
    s = make_stack()
    b = s.add_backend("b0")
    s.wait()
    res = run_fuzz(s.redis_url, s.namespace, demo_model, examples=400, derandomize=True)
    print(f"fuzz: {res['requests']} requests, statuses {dict(res['statuses'])}")
    assert res["requests"] >= 400
    assert all(code < 500 for code in res["statuses"])
    assert res["statuses"][200] > 0 and sum(v for k, v in res["statuses"].items() if 400 <= k < 500) > 200
    assert res["errors_logged"] == []
    assert b.proc.poll() is None
