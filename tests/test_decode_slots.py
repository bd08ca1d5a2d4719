"""Decode slots (``--decode-concurrency``, backend/engine.py): how many answers a backend
generates at once, and what a request beyond them does.

An agent's fan-out sends a dozen calls at once on one context, and prefix routing sends
them all to the context's backend. With 8 slots (the default until session 31) the calls
past the eighth waited for one of the first eight to finish before their first token; the
default is now 16 (docs/cache-policy.md, "Decode slots";
``bench/fanout.py``).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest

from mlxgw.httpget import get_json

CALLS = 12
ANSWER_IDS = 200  # at scale 8 and speed 8: about 1.4 s of decode at least


async def _first_tokens_and_ends(url: str, probe_at: int) -> tuple[list[float], list[float], dict]:
    """Send CALLS streamed cold requests at once; each one's first-token and end times (s),
    and the backend's ``/health`` read as the ``probe_at``-th call got its first token."""
    t0 = time.monotonic()
    started: list[int] = []
    probe: dict = {}

    async def one(session, i):
        prompt = np.random.default_rng(100 + i).integers(16, 3000, 40).tolist()
        body = {"prompt": prompt, "max_tokens": ANSWER_IDS, "stream": True}
        first = None
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            n = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    if any(c.get("text") for c in json.loads(line[6:]).get("choices") or []):
                        if first is None:
                            first = time.monotonic() - t0
                            started.append(i)
                            if len(started) == probe_at:
                                async with session.get(url + "/health") as h:
                                    probe.update(await h.json())
                        n += 1
        assert first is not None and n > 0
        return first, time.monotonic() - t0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        got = await asyncio.gather(*[one(session, i) for i in range(CALLS)])
    return [f for f, _ in got], [e for _, e in got], probe


@pytest.mark.timeout(120)
def test_a_fan_out_of_twelve_decodes_at_once_by_default_and_waits_past_a_lower_slot_count(make_stack):
    st = make_stack()
    flags = ["--engine", "sim", "--sim-token-scale", "8", "--sim-speed", "8", "--cache-bytes", "1TB"]
    default = st.add_backend("default", None, *flags)  # no flag: the default slot count
    eight = st.add_backend("eight", None, *flags, "--decode-concurrency", "8")
    st.wait()
    # Published, so the operator sees `active/slots` in mlxgw status, top and the dashboard.
    assert (get_json(default.url + "/health")["decode_slots"], get_json(eight.url + "/health")["decode_slots"]) == (16, 8)
    firsts, ends, health = asyncio.run(_first_tokens_and_ends(default.url, probe_at=CALLS))
    # 16 slots: every call is decoding before the first one has finished its answer.
    assert max(firsts) < min(ends), (sorted(firsts), sorted(ends))
    assert (health["active"], health["waiting"]) == (CALLS, 0), health
    firsts, ends, health = asyncio.run(_first_tokens_and_ends(eight.url, probe_at=8))
    # 8 slots: four calls get their first token only after an earlier call ended, and while
    # eight decode the backend says four wait (`waiting`, shown by mlxgw status as 12/8).
    assert sum(f > min(ends) for f in firsts) == CALLS - 8, (sorted(firsts), sorted(ends))
    assert (health["active"], health["waiting"]) == (CALLS, CALLS - 8), health


@pytest.mark.timeout(120)
def test_a_request_waiting_for_a_slot_queues_only_the_tokens_it_will_compute(make_stack):
    """``queued_prefill_tokens`` (registry, ``/health``, the metrics' waiting prefill tokens)
    counts a waiting request's prompt less the cache hit it found on arrival: helper-48 saw
    12 waiting fan-out calls counted at their whole 3,238-token prompts, 3,206 of them cached."""
    st = make_stack()
    b = st.add_backend("one", None, "--engine", "sim", "--sim-token-scale", "8", "--sim-speed", "8",
                       "--cache-bytes", "1TB", "--decode-concurrency", "1", "--prefill-concurrency", "1")
    st.wait()
    rng = np.random.default_rng(7)
    context = rng.integers(16, 3000, 400).tolist()
    tail = rng.integers(16, 3000, 10).tolist()

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(b.url + "/v1/completions", json={"prompt": context, "max_tokens": 1}) as r:
                assert r.status == 200  # the context is cached now
            first = asyncio.Event()

            async def long_answer():  # takes the one decode slot for about 1.4 s
                body = {"prompt": rng.integers(16, 3000, 40).tolist(), "max_tokens": ANSWER_IDS, "stream": True}
                async with s.post(b.url + "/v1/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            first.set()

            a = asyncio.create_task(long_answer())
            await first.wait()
            waiting = asyncio.create_task(s.post(b.url + "/v1/completions", json={"prompt": context + tail,
                                                                                  "max_tokens": 1}))
            health = {}
            for _ in range(100):
                async with s.get(b.url + "/health") as h:
                    health = await h.json()
                if health["waiting"] == 1:
                    break
                await asyncio.sleep(0.01)
            r = await waiting
            usage = (await r.json())["usage"]
            await a
            return health, usage

    health, usage = asyncio.run(run())
    assert health["waiting"] == 1 and health["active"] == 2, health
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 390, usage
    assert health["queued_prefill_tokens"] == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.timeout(120)
def test_a_waiting_request_pinned_to_a_prompt_saved_meanwhile_queues_only_its_tail(make_stack):
    """A cold fan-out: B arrives while A, sharing its context, is still in prefill; A's prompt
    is saved as its prefill ends and B takes its hit from it at once (docs/cache-policy.md),
    then waits for the one decode slot. B's queued tokens are its tail, not its whole prompt
    (helper-49: 12 such calls showed 68,544 queued tokens for ~300 to compute)."""
    st = make_stack()
    b = st.add_backend("one", None, "--engine", "sim", "--sim-token-scale", "8", "--sim-speed", "8",
                       "--cache-bytes", "1TB", "--decode-concurrency", "1", "--prefill-concurrency", "1")
    st.wait()
    rng = np.random.default_rng(8)
    context = rng.integers(16, 3000, 1200).tolist()  # ~0.7 s of prefill at this scale and speed

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def call(prompt, max_tokens):
                async with s.post(b.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}) as r:
                    return (await r.json())["usage"]

            a = asyncio.create_task(call(context + rng.integers(16, 3000, 10).tolist(), ANSWER_IDS))
            await asyncio.sleep(0.2)  # A is in prefill
            prompt_b = context + rng.integers(16, 3000, 10).tolist()
            waiting = asyncio.create_task(call(prompt_b, 1))
            health = {}
            for _ in range(400):  # until A's prefill ended and B was pinned, while A decodes
                async with s.get(b.url + "/health") as h:
                    health = await h.json()
                if health["waiting"] == 1 and health["prefill_saves"] >= 1:
                    break
                await asyncio.sleep(0.01)
            usage = await waiting
            await a
            return health, usage, len(prompt_b)

    health, usage, n = asyncio.run(run())
    assert health["waiting"] == 1 and health["prefill_saves"] == 1, health
    assert usage["prompt_tokens"] == n and usage["prompt_tokens_details"]["cached_tokens"] >= 1200, usage
    assert health["queued_prefill_tokens"] == n - usage["prompt_tokens_details"]["cached_tokens"], (health, usage)


@pytest.mark.timeout(120)
def test_the_queued_figure_follows_a_long_prompt_chunk_by_chunk(make_stack):
    """``queued_prefill_tokens`` (``/health``, the registry, the metrics; gateways with
    ``--heartbeat-load``) drops by each prefill step's chunk as the running prompt progresses,
    not by the whole prompt at its end, when a long prompt mostly done read as all still to do."""
    st = make_stack()
    # 2,000 tokens at 1,000 tokens/s in 128-token steps: about 2 s, 16 chunks.
    b = st.add_backend("one", None, "--engine", "sim", "--sim-prefill-rate", "1000", "--prefill-step-size", "128",
                       "--cache-bytes", "1TB")
    st.wait()
    prompt = np.random.default_rng(9).integers(16, 3000, 2000).tolist()

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def complete():
                async with s.post(b.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
                    return r.status, await r.json()

            call = asyncio.create_task(complete())
            seen = []
            while not call.done():
                async with s.get(b.url + "/health") as h:
                    seen.append((await h.json())["queued_prefill_tokens"])
                await asyncio.sleep(0.02)
            status, body = await call
            assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, body
            async with s.get(b.url + "/health") as h:
                return seen, (await h.json())["queued_prefill_tokens"]

    seen, after = asyncio.run(run())
    seen = seen[next(i for i, q in enumerate(seen) if q):]  # from the request's arrival
    mid = sorted({q for q in seen if 0 < q < len(prompt)})
    # the figure steps down by whole chunks (the prompt's last token is fed to its first decode step)
    assert len(mid) >= 5 and all((len(prompt) - q) % 128 == 0 for q in mid), seen
    assert seen == sorted(seen, reverse=True), seen
    assert after == 0


def test_one_decode_slot_runs_one_answer_whatever_the_prefill_concurrency(make_stack):
    """``--decode-concurrency 1`` with the default ``--prefill-concurrency`` 2 ran two answers at
    once (mlx-lm raises its completion batch to the prefill batch) while ``/health``, the registry
    record and the gateways said 1 (helper-91): the prefills are lowered to the decode slots, so
    each answer's first token comes after the one before it ended."""
    import http.client
    import threading

    from texts import words

    s = make_stack()
    b = s.add_backend("b0", None, "--engine", "sim", "--decode-concurrency", "1", "--sim-decode-rate", "20")
    b.wait_healthy()
    times = {}

    def stream(i):
        conn = http.client.HTTPConnection("127.0.0.1", b.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": "demo-tiny", "max_tokens": 30, "stream": True,  # 1.5 s of decode each
            "messages": [{"role": "user", "content": words(20, seed=i)}]}), {"Content-Type": "application/json"})
        resp, first = conn.getresponse(), None
        for line in resp:
            if line.startswith(b"data:") and first is None:
                first = time.monotonic()
        times[i] = (first, time.monotonic())
        conn.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    spans = sorted(times.values())
    assert len(spans) == 3 and all(f is not None for f, _ in spans), times
    for (_, end), (first, _) in zip(spans, spans[1:]):
        assert first >= end - 0.05, spans  # one at a time: the next starts once one has ended
    assert get_json(b.url + "/health")["decode_slots"] == 1
    assert "--prefill-concurrency 2 is above --decode-concurrency 1" in b.log_path.read_text()


def test_engine_figures_before_the_model_has_loaded(demo_model):
    """A backend's ``/health`` during its start reads the engine's figures before the model has
    loaded: they are zeros, not an AttributeError (helper-91: a 500 with a traceback on every
    start, from the decode time of the running requests, which do not exist yet)."""
    from backend.cache import PromptCache
    from backend.engine import MLXEngine

    cache = PromptCache(max_entries=8, max_bytes=2**30, layout="shared", share_min_tokens=16, min_hit_tokens=32)
    eng = MLXEngine(str(demo_model), cache, 2**30, decode_concurrency=4, prefill_concurrency=8)
    st = eng.stats()
    assert (st["active"], st["waiting"], st["decode_slots"], st["decode_seconds"]) == (0, 0, 4, 0.0)
    assert eng.prefill_concurrency == 4
