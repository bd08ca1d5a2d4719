"""The simulated engine keeps the real backend's cache accounting.

One real mlx-lm backend and one sim backend (``--engine sim``) get the same
request sequence; every request must report the same ``cached_tokens``
(prefix reuse, trimming a longer entry, the exact-hit cap, the shared system
prompt entry, LRU eviction by entry count, a branch point kept when its
last entry is evicted, continuing an answer).
"""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

from mlxgw import httpget

SYSTEM = "You are a careful assistant who answers in short sentences about Python code."


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _cached(url: str, path: str, body: dict) -> int:
    d = _post(url + path, body)
    return d["usage"]["prompt_tokens_details"]["cached_tokens"]


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(16, 3000, n).tolist()


def _sequence():
    """(path, body, expected cached tokens or None when only equality is known)."""
    a, b, c = _ids(1, 300), _ids(2, 50), _ids(3, 100)
    d, e, f, g = _ids(4, 120), _ids(5, 120), _ids(6, 120), _ids(7, 250)
    comp = "/v1/completions"
    chat = "/v1/chat/completions"
    one = {"max_tokens": 1, "temperature": 0}
    return [
        (comp, {"prompt": a, **one}, 0),
        (comp, {"prompt": a + b, **one}, 300),                 # extends the entry
        (comp, {"prompt": a[:200] + c, **one}, 200),           # trims a longer entry
        (comp, {"prompt": a + b, **one}, 349),                 # exact hit: one token left to prefill
        (comp, {"prompt": a[:200] + g, **one}, 200),           # a sibling (200 of 450 is no good hit)
        (chat, {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a list?"}], **one}, 0),
        (chat, {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain dict."}], **one}, "system"),
        (comp, {"prompt": d, **one}, 0),
        (comp, {"prompt": e, **one}, 0),
        (comp, {"prompt": f, **one}, 0),
        (comp, {"prompt": a + b, **one}, 0),                   # evicted (3 entries, LRU); a[:200], where
                                                               # two siblings branched, was kept (rule 6) but
                                                               # went next (the system group was the largest)
        (comp, {"prompt": d + c, "max_tokens": 3, "temperature": 0}, 0),   # d was evicted too
        (comp, {"prompt": d + c + e, **one}, None),            # continues prompt + answer
    ]


@pytest.mark.timeout(240)
def test_sim_cached_tokens_equal_real(make_stack):
    st = make_stack()
    flags = ("--cache-entries", "3", "--cache-bytes", "1GB", "--min-shared-tokens", "16")
    real = st.add_backend("real", None, *flags)
    sim = st.add_backend("sim", None, *flags, "--engine", "sim", "--sim-speed", "20",
                         "--sim-model-config", f"{st.model_path}/config.json", "--sim-dtype-bytes", "4")
    st.wait()
    system_tokens = None
    for i, (path, body, want) in enumerate(_sequence()):
        got_real = _cached(real.url, path, body)
        got_sim = _cached(sim.url, path, body)
        assert got_sim == got_real, f"request {i}: sim cached {got_sim}, real cached {got_real}"
        if want == "system":
            system_tokens = got_real
            assert 10 < got_real < 40, got_real  # the rendered system turn, not the whole prompt
        elif want is not None:
            assert got_real == want, f"request {i}: cached {got_real}, expected {want}"
        else:
            assert got_real >= 220, got_real  # at least d + c, the prompt of the answer it continues
    assert system_tokens is not None
    hr, hs = httpget.get_json(real.url + "/health"), httpget.get_json(sim.url + "/health")
    for k in ("requests", "hits", "misses", "prompt_tokens", "cached_tokens", "cache_entries", "cache_tokens",
              "cache_bytes", "shared_prefixes_kept", "cache_evictions", "cache_evicted_tokens", "prefill_saves",
              "prefill_handoffs"):
        assert hs[k] == hr[k], (k, hs[k], hr[k])
    assert hs["requests"] == 13 and hs["shared_prefixes_kept"] == 1
    # 12 entries were added (10 prompts not continuing their entry, the system segment, the kept
    # prefix); 3 remain and nothing else removes one here, so the budget evicted 9.
    assert (hs["cache_evictions"], hs["cache_entries"]) == (9, 3)


def test_sim_sglang_endpoints(make_stack):
    st = make_stack()
    sim = st.add_backend("sim", None, "--engine", "sim", "--sim-speed", "50", "--sim-token-scale", "8",
                         "--sim-attention-parity", "12320")
    st.wait()
    # What the gateways weigh a turn kept beside a running prefill by, in their unit (sim ids):
    # 8 decode steps a sim token, Qwen3-4B's attention parity 12,320 real tokens = 1,540 ids.
    h = httpget.get_json(sim.url + "/health")
    assert (h["decode_steps_per_token"], h["attention_parity_tokens"]) == (8.0, 1540)
    info = httpget.get_json(sim.url + "/server_info")
    assert info["served_model_name"] == st.model_name and info["dp_size"] == 1 and info["context_length"] == 8192
    assert httpget.get_json(sim.url + "/model_info")["is_generation"] is True
    assert httpget.get_status(sim.url + "/health_generate") == 200
    ids = _ids(7, 64)
    first = _post(sim.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}})
    again = _post(sim.url + "/generate", {"input_ids": ids + [20, 21], "sampling_params": {"max_new_tokens": 4}})
    assert first["usage"]["completion_tokens"] == 4 and first["choices"][0]["finish_reason"] == "length"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # Deterministic output: the same prompt gives the same text.
    repeat = _post(sim.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}})
    assert repeat["choices"][0]["text"] == first["choices"][0]["text"]
    # KV bytes from the default model config (Qwen3-4B, bf16: 147,456 bytes/token) times the token scale.
    entries = httpget.get_json(sim.url + "/internal/cache")["entries"]
    assert sorted(e["nbytes"] for e in entries) == sorted(e["tokens"] * 8 * 147456 for e in entries)
    bad = urllib.request.Request(sim.url + "/generate", data=b'{"sampling_params": {}}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(bad, timeout=10)
    assert ei.value.code == 400
    assert json.loads(ei.value.read())["error"]["param"] == "input_ids"
    # logprobs: the sim's tokens are certain (logprob 0), the sampled token the one alternative
    lp = _post(sim.url + "/v1/completions", {"prompt": ids, "max_tokens": 3, "logprobs": 2})["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [0.0, 0.0, 0.0]
    assert lp["top_logprobs"] == [{t: 0.0} for t in lp["tokens"]] and len(lp["tokens"]) == 3


@pytest.mark.timeout(120)
def test_sigint_withdraws_the_backend_from_redis_and_says_so(make_stack, redis_server):
    """A backend stopped with SIGINT (Ctrl-C) exits 0 and leaves nothing that
    routes: its registry record, its heartbeat entry and its owned blocks are
    gone, the stream records the ``cleared`` event, and its log says it stopped."""
    import signal

    import redis

    from mlxgw import schema

    st = make_stack()
    b = st.add_backend("b0", None, "--engine", "sim", "--cache-bytes", "1TB")
    st.wait()
    ids = _ids(21, 64)
    assert _cached(b.url, "/v1/completions", {"prompt": ids, "max_tokens": 1}) == 0
    r = redis_server.client()
    k = schema.Keys(st.namespace, st.model_name)
    blocks = k.blocks(schema.block_keys(st.model_name, ids, st.block_size))
    assert len(blocks) == 4
    deadline = time.time() + 5  # the reporter flushes saves in the background
    while not all(r.hexists(x, "b0") for x in blocks) and time.time() < deadline:
        time.sleep(0.05)
    assert all(r.hexists(x, "b0") for x in blocks)
    assert r.exists(k.backend("b0")) and r.zscore(k.backends, "b0") is not None

    b.signal(signal.SIGINT)
    assert b.proc.wait(30) == 0
    assert not r.exists(k.backend("b0"))
    assert r.zscore(k.backends, "b0") is None
    assert not any(r.hexists(x, "b0") for x in blocks)
    raw = redis.Redis.from_url(redis_server.url)  # event data is msgpack: no decoding
    last = schema.decode_event(raw.xrevrange(k.events, count=1)[0][1])
    assert (last["type"], last["backend"]) == (schema.EVENT_CLEARED, "b0")
    log = b.log_path.read_text()
    assert "backend b0 stopping" in log and "backend b0 stopped" in log


class FakeClock:
    """A clock that moves only when told or slept on (``t`` in seconds); ``slept`` records each wait."""

    def __init__(self):
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 9))  # 9 places: float sums such as 0.012 - 0.005 compare exactly
        self.t += s


def test_sim_step_times_follow_mlx_lm_steps_with_scaled_tokens():
    """With ``token_scale`` S, a step that prefills is one real mlx-lm step (one
    real decode step plus a chunk), a running sequence emits a sim token every S
    real decode steps, a finished prompt's first token comes one real decode step
    later, and a decode-only step runs the real steps until the next token is due."""
    from backend.sim import SimBatchGenerator, SimTiming

    # t_weights = 1/decode_rate = 0.01 s (no KV term); a chunk of n ids = n * 4 / 1000 s.
    timing = SimTiming(prefill_rate=1000, decode_rate=100, kv_bytes_per_token=0, ref_context=0, token_scale=4)
    clock = FakeClock()
    slept = clock.slept
    gen = SimBatchGenerator(timing, (16, 100), completion_batch_size=8, prefill_batch_size=2,
                            prefill_step_size=10, sleep=clock.sleep, clock=clock)

    def step():
        slept.clear()
        _, resp = gen.next()
        return round(slept[0], 6), [(r.uid, r.finish_reason) for r in resp]

    (a,) = gen.insert_segments([[list(range(20, 41))]], [3], [None], [[]])  # 21 ids: 20 prefilled + the last
    assert [step(), step()] == [(0.04, []), (0.04, [])]      # two chunks of 10, nothing decoding
    assert step() == (0.0, [])                                # the prompt ends: a joins the decode batch
    assert step() == (0.01, [(a, None)])                      # first token: one real decode step
    (b,) = gen.insert_segments([[list(range(50, 91))]], [1], [None], [[]])  # 41 ids
    # b prefills in 4 steps of (one real decode step + a chunk); a emits once every 4 of them.
    assert [step() for _ in range(4)] == [(0.05, [])] * 3 + [(0.05, [(a, None)])]
    assert step() == (0.01, [])                               # b ends its prompt (a decodes one real step)
    assert step() == (0.01, [(b, "length")])                  # b's first token, one real step later
    assert step() == (0.02, [(a, "length")])                  # a was due in 2 more real steps
    assert step() == (0.0, [])                                # nothing left


def test_attention_parity_comes_from_the_models_flops():
    """The depth at which a prompt token's attention FLOPs equal its matmuls' (`backend.attention`):
    Qwen3-4B's config.json (hidden 2560, MLP 9728, 36 layers, 32 heads of 128, 8 KV heads) gives
    12,320 tokens; the demo model 360 (64 wide, MLP 176, 4 heads of 16, 2 KV heads), and twice that
    with half its layers sliding-window; none when no layer attends over the whole context or the
    config says too little; a mixture of experts counts its active experts' width."""
    from backend.attention import attention_parity_tokens
    from mlxgw.demo_model import VARIANTS

    qwen3_4b = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert attention_parity_tokens(qwen3_4b) == 12320
    assert attention_parity_tokens({"text_config": qwen3_4b}) == 12320
    assert attention_parity_tokens(VARIANTS["tiny"]) == 360
    assert attention_parity_tokens(VARIANTS["swa"]) == 720  # layer_types: one of two is full
    assert attention_parity_tokens({**VARIANTS["tiny"], "layer_types": ["sliding_attention"] * 2}) == 0
    assert attention_parity_tokens({**VARIANTS["tiny"], "use_sliding_window": True}) == 0
    assert attention_parity_tokens({"hidden_size": 64}) == 0
    # 8 of 128 experts of width 768 active, heads as Qwen3-30B-A3B (48 layers, 32 x 128, 4 KV heads)
    moe = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
    assert attention_parity_tokens(moe) == round(2 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 3 * 2048 * 6144)
                                                 / (4 * 4096))


def test_sim_prefill_cost_grows_with_depth_only_when_asked():
    """``--sim-attention-parity P``: a chunk of n tokens d deep costs ``1 + (d + n/2)/P`` times the
    flat rate's time, over the cited benchmark's (2,048 tokens from depth 0) ``1 + 1024/P``; off
    (0, the default) depth costs nothing, as before. A step's chunks each count at their own
    prompt's depth, padded to the widest."""
    from backend.sim import SimBatchGenerator, SimTiming

    flat = SimTiming(prefill_rate=1000, token_scale=4)
    assert flat.prefill_seconds(512, 0) == flat.prefill_seconds(512, 10_000) == 512 * 4 / 1000
    deep = SimTiming(prefill_rate=1000, token_scale=4, attention_parity=1024)
    assert deep.prefill_seconds(512, 0) == pytest.approx(2.048)  # the benchmark's prompt: the flat rate
    assert deep.prefill_seconds(128, 512) == pytest.approx(0.512 * (1 + (2048 + 256) / 1024) / 2)
    timing = SimTiming(prefill_rate=1000, decode_rate=100, kv_bytes_per_token=0, ref_context=0, token_scale=4,
                       attention_parity=1024)
    clock = FakeClock()
    gen = SimBatchGenerator(timing, (16, 100), completion_batch_size=8, prefill_batch_size=2,
                            prefill_step_size=10, sleep=clock.sleep, clock=clock)
    gen.insert_segments([[list(range(20, 41))]], [3], [None], [[]])  # 21 ids: 20 prefilled + the last
    gen.next()
    gen.next()
    # chunks of 10 ids (40 real tokens) at depth 0 and then 10 ids (40 real) deep
    assert clock.slept == [pytest.approx(0.04 * (1 + 20 / 1024) / 2), pytest.approx(0.04 * (1 + 60 / 1024) / 2)]
    gen.insert_segments([[list(range(50, 71))]], [1], [None], [[]])  # a second prompt beside the first one's end
    clock.slept.clear()
    gen.next()  # the first prompt ends (its last id joins the decode batch); the second's first chunk
    assert clock.slept == [pytest.approx(0.04 * (1 + 20 / 1024) / 2)]


def test_sim_real_step_overhead_is_taken_out_of_the_modelled_time():
    """The real time a step spends (in the sim and, while work is left, in the
    engine loop between steps) is part of the modelled step, not added to it;
    an overrun is caught up by the next steps, by at most MAX_LAG seconds, and
    an idle gap is never credited."""
    from backend.sim import SimBatchGenerator, SimTiming

    # No decode term: a step of one 10-id chunk models 10 / 1000 = 0.01 s.
    timing = SimTiming(prefill_rate=1000, decode_rate=1e9, kv_bytes_per_token=0, ref_context=0, token_scale=1)
    clock = FakeClock()
    own: list[float] = []

    def read():
        now = clock.t
        clock.t += own.pop() if own else 0.0  # the step's own real time passes after its first reading
        return now

    gen = SimBatchGenerator(timing, (16, 100), prefill_batch_size=1, prefill_step_size=10,
                            sleep=clock.sleep, clock=read)

    def step(loop_s, step_s):
        clock.t += loop_s  # the engine loop's real time before the step
        own.append(step_s)
        gen.next()
        return clock.slept[-1]

    gen.insert_segments([[list(range(20, 81))]], [1], [None], [[]])  # 61 ids: six chunks of 10, then the last
    assert step(0.002, 0.003) == 0.007   # a first step: its own 3 ms come off its 10
    assert step(0.002, 0.003) == 0.005   # still busy: the loop's 2 ms come off too
    assert step(0.0, 0.015) == 0.0       # overruns its 10 ms by 5 ms ...
    assert step(0.0, 0.0) == 0.005       # ... which the next step catches up
    assert clock.t == pytest.approx(0.042)  # 2 ms of idle loop before the first step, then 4 x 10 ms
    assert step(0.3, 0.0) == 0.0         # a 300 ms stall: only MAX_LAG (50 ms) of it is caught up,
    assert step(0.0, 0.0) == 0.0         # so these two steps are free (due 0.302 and 0.312 < now 0.342)
    assert gen._prompt and not gen._gen
    step(0.0, 0.0)                       # the last prompt id joins the decode batch
    step(0.0, 0.0)                       # its one output token ends the work
    assert not (gen._prompt or gen._gen or gen._unprocessed)
    gen.insert_segments([[list(range(20, 31))]], [1], [None], [[]])  # 11 ids: one chunk of 10
    assert step(1.0, 0.0) == 0.01        # after an idle second, a full 10 ms step: idle time is not credited
