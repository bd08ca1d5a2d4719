"""Which waiting request a backend prefills next (``--prefill-order``, backend/engine.py).

Three sim backends, one per order, get the same three cold prompts: a long
one A, a second long one B 0.3 s later, a short one C 0.6 s later. Each
long prompt is about 2 s of prefill alone, C one step. Prefill is compute
bound, so prompts batched together share it.

* ``shorter-beside`` and ``step-beside`` (default; C fits in one step): B is not shorter than what A has left, so it
  waits its turn; C is, and is prefilled beside A at once. Answers: C, then
  A, then B about a whole prefill later.
* ``fifo``: B joins A as it arrives and they share the compute, so both
  finish late and close together; C waits for a free slot and ends after A.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from mlxgw.httpget import get_json


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(16, 3000, n).tolist()


def _timed_requests(url: str) -> dict[str, float]:
    """Send A, B, C (at 0, 0.3, 0.6 s); return each one's answer time from A's send, in seconds."""
    prompts = {"A": (_ids(11, 2000), 0.0), "B": (_ids(12, 2000), 0.3), "C": (_ids(13, 40), 0.6)}
    done: dict[str, float] = {}
    t0 = time.monotonic()

    def send(name: str, ids: list[int], at: float) -> None:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            usage = json.loads(r.read())["usage"]
        assert usage["prompt_tokens"] == len(ids) and usage["prompt_tokens_details"]["cached_tokens"] == 0
        done[name] = time.monotonic() - t0

    threads = [threading.Thread(target=send, args=(k, ids, at)) for k, (ids, at) in prompts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


@pytest.mark.timeout(180)
def test_short_prompt_goes_beside_a_long_one_and_long_ones_keep_their_order(make_stack):
    st = make_stack()
    # 64 ids (512 tokens at scale 8) per prefill step: ~63 ms alone at speed 5;
    # a 2000-id prompt is 32 steps, ~2 s.
    flags = ["--engine", "sim", "--sim-token-scale", "8", "--sim-speed", "5", "--prefill-step-size", "64",
             "--prefill-concurrency", "2", "--cache-bytes", "1TB"]
    st.add_backend("fifo", None, *flags, "--prefill-order", "fifo")
    st.add_backend("beside", None, *flags, "--prefill-order", "shorter-beside")
    st.add_backend("step", None, *flags)  # no flag: the default order is step-beside
    st.wait()
    # What each publishes for the gateways' seeding rule (gateway.route.seed_wait): only step-beside
    # bounds what starts beside a running prefill by a figure they know, its step.
    assert [get_json(b.url + "/health")["prefill_beside_tokens"] for b in st.backends] == [0, 0, 64]
    # A sim token stands for 8 real ones, so one output token is 8 decode steps (each beside a chunk).
    assert [get_json(b.url + "/health")["decode_steps_per_token"] for b in st.backends] == [8.0] * 3
    out: dict[str, dict[str, float]] = {}
    runs = [threading.Thread(target=lambda b=b: out.__setitem__(b.name, _timed_requests(b.url))) for b in st.backends]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    fifo, beside, step = (out[b.name] for b in st.backends)
    # shorter-beside, step-beside: C within a few steps of its arrival, A before B by about B's own prefill.
    for got in (beside, step):
        assert sorted(got, key=got.get) == ["C", "A", "B"], got
        assert got["C"] - 0.6 < 0.6, got
        assert got["B"] - got["A"] > 1.2, got
    # fifo: A and B shared the compute and ended close together, C after A.
    assert abs(fifo["B"] - fifo["A"]) < 0.8, fifo
    assert fifo["C"] > fifo["A"], fifo
    assert fifo["A"] > beside["A"] + 0.8, (fifo, beside)
