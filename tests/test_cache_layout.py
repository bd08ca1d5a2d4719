"""Cache rule 7 (opt-in ``--cache-layout shared``, backend/cache.py): a prefix several entries
share is held once, as a chain of segments; hits are the same KV a cold prefill computes."""

import pytest

from backend.cache import PromptCache
from backend.sim import SimKVOps, SimTiming
from test_cache_policy import Recorder, kv_for


@pytest.fixture(scope="module")
def model(demo_model):
    from mlx_lm import load

    return load(demo_model)[0]


def _per_token(model) -> int:
    """KV bytes of one token in the demo model (all layers, keys and values)."""
    kv = kv_for(model, [5, 6, 7, 8])
    return sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in kv)


def _logits_match(model, hit, prompt) -> bool:
    """The next token's logits after ``hit`` equal a cold prefill's."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    warm = model(mx.array([prompt[hit.reused:]]), cache=hit.kv)[0, -1]
    cold = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]
    return bool(mx.allclose(warm, cold, atol=1e-4).item())


SHARED = list(range(100, 400))  # 300 tokens, inside the demo vocabulary (3,072 ids)
A = SHARED + list(range(1000, 1100))
B = SHARED + list(range(2000, 2050))


def test_a_shared_prefix_is_held_once_and_hits_are_exact(model):
    per = _per_token(model)
    whole, shared = PromptCache(), PromptCache(layout="shared", share_min_tokens=64)
    for c in (whole, shared):
        for p in (A, B):
            c.insert(p, kv_for(model, p), prompt_len=len(p))
    assert shared.nbytes == (300 + 100 + 50) * per  # the 300 shared tokens once, compact
    assert whole.nbytes >= (400 + 350) * per  # one copy per entry (and mlx-lm's 256-token steps)
    assert [e.nbytes for e in shared.entries()] == [400 * per, 350 * per]  # each entry's whole chain
    for prompt, n in ((B + [2900, 2901], 350), (A[:320] + [2900], 320), (SHARED[:200] + [7], 200)):
        hit = shared.fetch(prompt)
        assert hit.reused == n and hit.kv[0].offset == n and hit.kv[0].keys.shape[2] == n
        assert _logits_match(model, hit, prompt), n
    # The fetched copy is private: decoding into it leaves the cache's segments as they were.
    hit = shared.fetch(A + [9])
    _logits_match(model, hit, A + [9, 10, 11])
    assert _logits_match(model, shared.fetch(A + [9]), A + [9])


def test_eviction_frees_only_what_no_other_entry_holds(model):
    per, rec = _per_token(model), Recorder()
    c = PromptCache(max_entries=2, layout="shared", share_min_tokens=64, listener=rec)
    for p in (A, B):
        c.insert(p, kv_for(model, p), prompt_len=len(p))
    other = list(range(10, 90))
    c.insert(other, kv_for(model, other), prompt_len=len(other))  # evicts A, the least recent
    assert rec.evicted == [400] and c.nbytes == (350 + 80) * per  # A's own 100 tokens only
    assert c.fetch(B + [3]).reused == 350 and _logits_match(model, c.fetch(B + [3]), B + [3])
    c.insert(A, kv_for(model, A), prompt_len=len(A))  # evicts `other` (B was used since)
    assert c.nbytes == (300 + 100 + 50) * per
    c.clear()
    assert c.nbytes == 0 and len(c) == 0 and sorted(rec.evicted) == [80, 350, 400, 400]


def test_a_conversation_going_on_extends_its_chain(model):
    """Rule 3 replaces the previous turn's entry: its tokens become the new entry's chain,
    nothing is copied twice and the budget counts the conversation once."""
    per = _per_token(model)
    c = PromptCache(layout="shared", share_min_tokens=64, min_hit_tokens=100)
    turn1 = A
    c.insert(turn1, kv_for(model, turn1), prompt_len=len(turn1))
    first = c.entries()[0]
    turn2 = A + list(range(2500, 2600))
    hit = c.fetch(turn2)
    assert hit.reused == 400
    c.insert(turn2, kv_for(model, turn2), reused_from=hit.entry_id, reused=hit.reused, prompt_len=len(turn2))
    (e,) = c.entries()
    assert e.id != first.id and len(e) == 500 and c.nbytes == 500 * per
    assert [(s.start, s.end) for s in e.seg.chain()] == [(0, 400), (400, 500)]
    assert _logits_match(model, c.fetch(turn2 + [5]), turn2 + [5])


def test_a_hit_pinned_by_reference_adds_no_bytes_and_outlives_its_entry(model):
    """A waiting request pins its hit as a reference to the segments (no copy: the bytes are
    the cache's, counted once); an eviction meanwhile frees only what the pin does not hold,
    the copy made at admission is the same KV a cold prefill computes, and letting go frees
    the rest. Before, each waiting request held a private copy beside the entry."""
    per, rec = _per_token(model), Recorder()
    c = PromptCache(layout="shared", share_min_tokens=64, listener=rec)
    c.insert(A, kv_for(model, A), prompt_len=len(A))
    prompt = A[:350] + [2900, 2901]
    pins = [c.fetch(prompt, by_reference=True) for _ in range(3)]
    assert [(h.kv, h.reused, h.seg.end) for h in pins] == [(None, 350, 350)] * 3  # the chain cut at 350
    assert c.nbytes == 400 * per  # three pins, no copy
    c.clear()  # the entry evicted while they wait: the 350 tokens they hold stay, the rest is freed
    assert rec.evicted == [400] and len(c) == 0 and c.nbytes == 350 * per
    hit = c.materialise(pins[0])
    assert hit.seg is None and pins[0].seg is None and hit.reused == 350 and hit.kv[0].offset == 350
    assert _logits_match(model, hit, prompt)
    c.drop(pins[1])
    assert c.nbytes == 350 * per  # one pin left
    c.drop(pins[2])
    c.drop(pins[2])  # a second drop is nothing
    assert c.nbytes == 0


def test_a_pinned_segment_split_by_a_later_save_still_gives_its_tokens(model):
    """A save sharing part of a pinned chain splits its segment in place; the pin's chain
    still holds its tokens (the copy at admission is exact) and its release frees them."""
    per = _per_token(model)
    c = PromptCache(layout="shared", share_min_tokens=64)
    c.insert(A, kv_for(model, A), prompt_len=len(A))
    pin = c.fetch(A[:390] + [7], by_reference=True)
    c.insert(B, kv_for(model, B), prompt_len=len(B))  # splits A's first segment at 300
    assert c.nbytes == (400 + 50) * per
    assert [(s.start, s.end) for s in pin.seg.chain()] == [(0, 300), (300, 390)]
    c.clear()
    assert c.nbytes == 390 * per  # what the pin holds of A's chain; the rest and B's own 50 freed
    hit = c.materialise(pin)
    assert hit.reused == 390 and _logits_match(model, hit, A[:390] + [7]) and c.nbytes == 0


def test_the_byte_budget_evicts_only_entries_that_free_bytes(model):
    """An entry whose chain a waiting request's pin holds would free nothing if evicted: the
    byte budget passes over it (and stops when nothing left frees bytes) rather than lose it
    to no gain; the entry-count budget still evicts it."""
    per, rec = _per_token(model), Recorder()
    c = PromptCache(layout="shared", share_min_tokens=64, listener=rec)
    for p in (A, B):
        c.insert(p, kv_for(model, p), prompt_len=len(p))
    c.fetch(B + [5])  # B is the most recent: A is the LRU victim
    pin = c.fetch(A + [5], by_reference=True)  # ...and pinned: its eviction would free nothing
    c.fetch(B + [6])
    assert c.trim_to(max_bytes=10 * per) == 1 and rec.evicted == [350]  # B's own 50 tokens freed
    assert [len(e) for e in c.entries()] == [400] and c.nbytes == 400 * per
    assert c.trim_to(max_entries=0) == 1 and rec.evicted == [350, 400] and c.nbytes == 400 * per
    c.drop(pin)
    assert c.nbytes == 0


def test_rule_6_keeps_the_shared_prefix_as_its_chain(model):
    """Rule 6 with segments: the kept system entry is the evicted chain's shared part (no copy)."""
    per = _per_token(model)
    c = PromptCache(max_entries=3, min_shared_tokens=64, layout="shared", share_min_tokens=64)
    b2 = SHARED[:250] + list(range(2500, 2600))
    for p in (A, B, b2):
        c.insert(p, kv_for(model, p), prompt_len=len(p))
    for i in range(3):  # unrelated prompts push them out
        t = [3000 + i] + list(range(10, 120))
        c.insert(t, kv_for(model, t), prompt_len=len(t))
    kept = [e for e in c.entries() if len(e) == 250]
    assert len(kept) == 1 and kept[0].cache_type == "system" and kept[0].nbytes == 250 * per
    assert c.nbytes == 250 * per + 2 * 111 * per
    d = SHARED[:250] + list(range(2900, 2940))
    hit = c.fetch(d)
    assert hit.reused == 250 and _logits_match(model, hit, d)


def test_the_sim_holds_the_same_tokens_as_the_real_layout(model):
    """The simulated engine's ops (SimKV counts tokens) give the same chains and byte counts, in
    tokens, as real KV arrays over one sequence of saves, replacements and evictions."""
    per = _per_token(model)
    timing = SimTiming(kv_bytes_per_token=per)
    real = PromptCache(max_entries=3, layout="shared", share_min_tokens=64, min_hit_tokens=100)
    sim = PromptCache(max_entries=3, layout="shared", share_min_tokens=64, min_hit_tokens=100, ops=SimKVOps())
    from backend.sim import SimKV

    seq = [A, B, A + list(range(2500, 2560)), SHARED[:200] + [7] * 30, list(range(10, 90)), B + [9] * 20]
    for p in seq:
        for c, kv in ((real, kv_for(model, p)), (sim, SimKV(len(p), timing))):
            hit = c.fetch(p)
            c.insert(p, kv, reused_from=hit.entry_id, reused=hit.reused, prompt_len=len(p))
        assert sorted(len(e) for e in real.entries()) == sorted(len(e) for e in sim.entries())
        assert real.nbytes == sim.nbytes, p[:3]
        assert sorted(e.nbytes for e in real.entries()) == sorted(e.nbytes for e in sim.entries())


def test_unknown_layout_is_an_error():
    with pytest.raises(ValueError, match="unknown cache layout 'paged'"):
        PromptCache(layout="paged")


def test_a_real_backend_answers_the_same_with_either_layout(make_stack):
    """Two real mlx-lm backends, one per layout, get the same conversations (a shared system
    prompt, two users, two turns each): the same greedy answers and cached tokens on every
    request, and the shared layout holds fewer bytes for the same entries."""
    import json

    from mlxgw.httpget import get_json, post
    from texts import words

    s = make_stack()
    whole = s.add_backend("b0", None, "--min-hit-tokens", "64", "--cache-layout", "whole")
    shared = s.add_backend("b1", None, "--min-hit-tokens", "64", "--cache-layout", "shared")
    whole.wait_healthy()
    shared.wait_healthy()
    system = {"role": "system", "content": words(300, seed=5)}
    convs = [[system, {"role": "user", "content": words(40, seed=6 + i)}] for i in range(2)]
    for turn in range(2):
        for i, msgs in enumerate(convs):
            answers = []
            for b in (whole, shared):
                st, _, raw = post(b.url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
                assert st == 200, raw
                out = json.loads(raw)
                answers.append((out["choices"][0]["message"]["content"],
                                out["usage"]["prompt_tokens_details"]["cached_tokens"]))
            assert answers[0] == answers[1], (turn, i, answers)
            if turn == 1 or i == 1:
                assert answers[1][1] > 300, answers  # the system prompt (or the whole first turn) reused
            convs[i] = msgs + [{"role": "assistant", "content": answers[0][0]},
                               {"role": "user", "content": words(20, seed=50 + i)}]
    cw, cs = get_json(whole.url + "/internal/cache"), get_json(shared.url + "/internal/cache")
    assert sorted(e["tokens"] for e in cw["entries"]) == sorted(e["tokens"] for e in cs["entries"])
    hw, hs = get_json(whole.url + "/health"), get_json(shared.url + "/health")
    assert 0 < hs["cache_bytes"] < hw["cache_bytes"], (hs["cache_bytes"], hw["cache_bytes"])


def test_free_space_checks_count_only_what_a_save_would_add():
    """The engine saves an abandoned request or an early prefill copy only into free space;
    with rule 7 what a save adds is the part no held chain has."""
    from backend.sim import SimKV

    t = SimTiming(kv_bytes_per_token=10)
    for layout, added in (("whole", 3500), ("shared", 500)):
        c = PromptCache(layout=layout, share_min_tokens=64, ops=SimKVOps())
        c.insert(A, SimKV(len(A), t), prompt_len=len(A))
        assert c.added_nbytes(B, SimKV(len(B), t)) == added, layout
        assert c.added_nbytes(list(range(5, 60)), SimKV(55, t)) == 550  # shares nothing


def test_segments_own_their_memory_with_one_kv_head():
    """A token slice of a one-sequence, one-KV-head array is row contiguous, and
    ``mx.contiguous`` returns it as a view of the whole buffer: a segment cut from it must
    not keep that buffer alive (``np.shares_memory`` on the CPU's buffers)."""
    import mlx.core as mx
    import numpy as np

    from backend.cache import _compact

    for heads in (1, 4):
        a = mx.random.normal((1, heads, 512, 8))
        mx.eval(a)
        cut = a[..., 50:300, :]
        b = _compact(cut)
        mx.eval(b)
        assert b.shape == (1, heads, 250, 8) and mx.array_equal(b, cut).item()
        assert not np.shares_memory(np.array(a, copy=False), np.array(b, copy=False)), heads
    one = mx.random.normal((1, 1, 512, 8))
    mx.eval(one)
    view = mx.contiguous(one[..., 50:300, :])
    mx.eval(view)
    assert np.shares_memory(np.array(one, copy=False), np.array(view, copy=False))  # why _compact exists
