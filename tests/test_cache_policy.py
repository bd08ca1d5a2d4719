"""The prompt-cache rules (docs/cache-policy.md), on real mlx-lm KV caches and real backends."""

import json
import re
import socket
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from backend.cache import PromptCache
from mlxgw.httpget import get_json, post
from texts import words


class Recorder:
    def __init__(self):
        self.saved, self.evicted = [], []

    def on_saved(self, e):
        self.saved.append(len(e))

    def on_evicted(self, e):
        self.evicted.append(len(e))


@pytest.fixture(scope="module")
def model(demo_model):
    from mlx_lm import load

    return load(demo_model)[0]


def kv_for(model, tokens):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    kv = make_prompt_cache(model)
    model(mx.array([tokens]), cache=kv)
    mx.eval([c.state for c in kv])
    return kv


def test_exact_hit_leaves_one_token(model):
    c = PromptCache()
    t = list(range(10, 60))
    c.insert(t, kv_for(model, t))
    hit = c.fetch(t)
    assert hit.reused == 49 and hit.kv[0].offset == 49
    hit = c.fetch(t + [7, 8])
    assert hit.reused == 50 and hit.kv[0].offset == 50
    hit = c.fetch(t[:20] + [1, 2, 3])  # trimmed back from a longer entry
    assert hit.reused == 20 and hit.kv[0].offset == 20
    assert c.fetch([5, 6, 7]).reused == 0


def test_good_hit_rule(model):
    rec = Recorder()
    c = PromptCache(min_hit_tokens=10, min_hit_ratio=0.5, listener=rec)
    sys_p = list(range(100, 130))  # 30-token system prompt
    a = sys_p + list(range(200, 240))
    ea = c.insert(a, kv_for(model, a), prompt_len=len(a))
    # Another conversation shares only the system prompt: a bad hit, so E stays.
    b = sys_p + list(range(300, 340))
    hit = c.fetch(b)
    assert hit.reused == 30 and hit.entry_id == ea.id
    c.insert(b, kv_for(model, b), reused_from=hit.entry_id, reused=hit.reused, prompt_len=len(b), system_tokens=30)
    assert sorted(len(e) for e in c.entries()) == [70, 70]
    # A sibling sharing the system prompt and a few more tokens is not a continuation either.
    b2 = sys_p + list(range(200, 205)) + list(range(500, 530))
    hit = c.fetch(b2)
    assert hit.reused == 35 and c.is_good_hit(35, len(b2), 30)
    c.insert(b2, kv_for(model, b2), reused_from=hit.entry_id, reused=35, prompt_len=len(b2), system_tokens=30)
    assert sorted(len(e) for e in c.entries()) == [65, 70, 70]
    # The same conversation grows (a good hit): its entry is replaced, not duplicated.
    a2 = a + list(range(400, 420))
    hit = c.fetch(a2)
    assert hit.reused == 70 and c.is_good_hit(70, len(a2), 30)
    c.insert(a2, kv_for(model, a2), reused_from=hit.entry_id, reused=70, prompt_len=len(a2), system_tokens=30)
    assert sorted(len(e) for e in c.entries()) == [65, 70, 90]
    assert rec.evicted == [70] and rec.saved == [70, 70, 65, 90]
    assert c.evictions == 0 and c.evicted_tokens == 0  # a replacement is not a budget eviction
    assert not c.is_good_hit(30, 70, 30)  # exactly the system prompt is never a good hit


def test_retry_replaces_the_entry_it_repeats(model):
    """A retry or regeneration of the same prompt (a new answer) replaces the entry holding
    the old answer: rule 1 leaves its reuse one token short of the prompt, and that must not
    make it a different conversation (each retry used to keep a full copy)."""
    rec = Recorder()
    c = PromptCache(min_hit_tokens=10, min_hit_ratio=0.5, listener=rec)
    p = list(range(100, 160))  # 60-token prompt
    first = p + [7, 8, 9]
    c.insert(first, kv_for(model, first), prompt_len=len(p))
    for answer in ([11, 12, 13], [21, 22, 23, 24]):
        hit = c.fetch(p)
        assert hit.reused == 59  # rule 1: one token left to prefill
        again = p + answer
        c.insert(again, kv_for(model, again), reused_from=hit.entry_id, reused=hit.reused, prompt_len=len(p))
    assert [len(e) for e in c.entries()] == [64]
    assert rec.saved == [63, 63, 64] and rec.evicted == [63, 63]
    # A prompt that stops short of the entry's prompt is a sibling, not a retry: both stay.
    short = p[:50] + [5, 5]
    hit = c.fetch(short)
    assert hit.reused == 50 and c.is_good_hit(50, len(short), 0)
    c.insert(short, kv_for(model, short), reused_from=hit.entry_id, reused=hit.reused, prompt_len=len(short))
    assert sorted(len(e) for e in c.entries()) == [52, 64]


def test_trimmable_drops_redundant_prefixes(model):
    c = PromptCache()
    s = list(range(10, 30))
    c.insert(s, kv_for(model, s), "system")
    u = s + list(range(40, 60))
    c.insert(u, kv_for(model, u), "user")
    longer = u + [1, 2, 3]
    c.insert(longer, kv_for(model, longer))
    assert sorted((len(e), e.cache_type) for e in c.entries()) == [(20, "system"), (43, "assistant")]


def test_eviction_order(model):
    rec = Recorder()
    c = PromptCache(max_entries=3, listener=rec, share_min_tokens=8)
    for i, kind in enumerate(["system", "assistant", "assistant"]):
        t = [1000 + i] + list(range(10, 20))
        c.insert(t, kv_for(model, t), kind)
    t = [2000] + list(range(10, 20))
    c.insert(t, kv_for(model, t), "user")
    # The largest group (assistant) loses its least recently used entry.
    assert rec.evicted == [11]
    assert sorted(int(e.tokens[0]) for e in c.entries()) == [1000, 1002, 2000]
    assert c.evictions == 1 and c.evicted_tokens == 11
    # The next victim (placement's figure, gateway.route) is the older assistant entry.
    by_first = {int(e.tokens[0]): e for e in c.entries()}
    assert by_first[1002].used_at <= by_first[2000].used_at
    assert c.victim_used_at() == by_first[1002].used_at
    assert c.kv_bytes_per_token() == sum(e.nbytes for e in c.entries()) / 33
    # Every group now holds one entry and assistant goes first: using 1002 refreshes its
    # time, and it stays the victim.
    c.fetch([1002] + list(range(10, 20)) + [7])
    assert c.victim_used_at() == by_first[1002].used_at and by_first[1002].used_at >= by_first[2000].used_at
    assert PromptCache().victim_used_at() == 0.0 and PromptCache().kv_bytes_per_token() == 0.0


def test_a_reuse_shorter_than_a_block_is_no_use_of_the_entry(model):
    """helper-73: every prompt reuses the chat template's opening tokens from some entry, and
    that refreshed the entry's LRU recency, so an abandoned conversation outlived the active
    ones. Only a reuse of at least `share_min_tokens` (a block) counts as a use."""
    rec = Recorder()
    c = PromptCache(max_entries=3, listener=rec, share_min_tokens=8)
    opening = [1, 2, 3, 4, 5]  # what every prompt starts with (a template's opening tokens)
    for i in range(3):  # A, B, C: three conversations, oldest first
        t = opening + [1000 + i] * 10
        c.insert(t, kv_for(model, t))
    a = {int(e.tokens[5]): e for e in c.entries()}[1000]
    before = (a.last_used, a.used_at, a.hits)
    hit = c.fetch(opening + [7] * 10)  # a new conversation: 5 tokens shared with the entries
    assert hit.reused == 5 and (a.last_used, a.used_at, a.hits) == before
    t = opening + [1003] * 10
    c.insert(t, kv_for(model, t))
    assert rec.evicted == [15] and sorted(int(e.tokens[5]) for e in c.entries()) == [1001, 1002, 1003]
    # a reuse of a block or more is a use: B, then refreshed, outlives C
    hit = c.fetch(opening + [1001] * 4)
    assert hit.reused == 8  # at least one token left to prefill (mlx-lm PR 625)
    t = opening + [1004] * 10
    c.insert(t, kv_for(model, t))
    assert sorted(int(e.tokens[5]) for e in c.entries()) == [1001, 1003, 1004]


def test_branch_point_kept_when_its_last_entry_is_evicted(model):
    """Rule 6: three prompts that share 300 tokens and then diverge leave that
    prefix behind as a system entry, compact (its bytes are 300 tokens' worth,
    not the evicted entry's buffer), when memory pressure evicts them all; a
    fourth prompt reuses it."""
    rec = Recorder()
    c = PromptCache(max_entries=3, min_shared_tokens=64, listener=rec)
    shared = list(range(100, 400))
    a, b = shared + list(range(1000, 1100)), shared + list(range(2000, 2050))
    b2 = shared[:250] + list(range(2500, 2600))  # branches earlier: 250 tokens shared with a and b
    for p in (a, b, b2):
        c.insert(p, kv_for(model, p), prompt_len=len(p))
    assert [e.branches for e in c.entries()] == [[300, 250], [300, 250], [250, 250]]
    for i in range(2):  # unrelated prompts push them out
        t = [3000 + i] + list(range(10, 120))
        c.insert(t, kv_for(model, t), prompt_len=len(t))
    assert c.shared_kept == 0  # b2 still held the 250 shared tokens when a and b left
    t = [3002] + list(range(10, 120))
    c.insert(t, kv_for(model, t), prompt_len=len(t))
    kept = [e for e in c.entries() if len(e) == 250]
    shared = shared[:250]
    assert len(kept) == 1 and kept[0].cache_type == "system" and c.shared_kept == 1
    assert kept[0].tokens.tolist() == shared and kept[0].kv[0].offset == 250
    full = kv_for(model, shared)
    assert kept[0].nbytes == sum(x.keys[..., :250, :].nbytes + x.values[..., :250, :].nbytes for x in full)
    assert kept[0].nbytes < sum(x.nbytes for x in full)  # the 256-token-step buffer was not kept
    assert rec.saved.count(250) == 1 and sorted(rec.evicted)[-3:] == [350, 350, 400]
    d = shared + list(range(2900, 2940))  # ids inside the demo vocabulary (3,072): MLX does not bounds-check
    hit = c.fetch(d)
    assert hit.reused == 250 and hit.entry_id == kept[0].id
    # the KV is right: the next token's logits equal a cold prefill's
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    warm = model(mx.array([d[250:]]), cache=hit.kv)[0, -1]
    cold = model(mx.array([d]), cache=make_prompt_cache(model))[0, -1]
    assert mx.allclose(warm, cold, atol=1e-4).item()


def _fill(model, cache, prompts):
    """Insert each prompt (or (tokens, prompt_len) for prompt + generated tokens)."""
    for p in prompts:
        t, n = p if isinstance(p, tuple) else (p, len(p))
        cache.insert(t, kv_for(model, t), prompt_len=n)
    return cache


def test_no_branch_point_without_two_siblings(model):
    """Rule 6 keeps nothing for the same conversation going on (it diverges in
    its generated tail, or reusing the prefix is a good hit), for one sibling
    only, below ``min_shared_tokens``, or while another entry holds the prefix."""
    p = list(range(100, 400))

    def after(n):  # n prompts' worth of unrelated entries push everything out
        return [[3000 + i] + list(range(10, 120)) for i in range(n)]

    def tail(k):
        return list(range(1000 * k, 1000 * k + 100))

    cases = {
        # two turns continue one answer, each diverging in its generated tail
        "generated tail": [(p + [7, 8, 9], 300), p + [7, 5] + tail(1), p + [7, 6] + tail(2)],
        "one sibling": [p + tail(1), p + tail(2)],
        "below min_shared_tokens": [p[:40] + tail(k) for k in (1, 2, 3)],
    }
    for name, prompts in cases.items():
        c = _fill(model, PromptCache(max_entries=3, min_shared_tokens=64), prompts)
        _fill(model, c, after(3))
        assert c.shared_kept == 0, name
        assert sorted(len(e) for e in c.entries()) == [111, 111, 111], name
    # Rule 6 is opt-in: by default three siblings leave nothing behind.
    c = _fill(model, PromptCache(max_entries=3), [p[:100] + tail(k) for k in (1, 2, 3)])
    _fill(model, c, after(3))
    assert c.shared_kept == 0 and sorted(len(e) for e in c.entries()) == [111, 111, 111]
    # Good hits (300 of 400 tokens, min_hit_tokens 100): the same conversation by rule 3.
    c = _fill(model, PromptCache(max_entries=3, min_shared_tokens=64, min_hit_tokens=100),
              [p + tail(k) for k in (1, 2, 3)])
    assert [e.branches for e in c.entries()] == [[], [], []]
    # Three siblings, one evicted: the other two still hold the prefix.
    c = _fill(model, PromptCache(max_entries=4, min_shared_tokens=64), [p[:100] + tail(k) for k in (1, 2, 3)])
    _fill(model, c, after(2))
    assert c.shared_kept == 0 and sorted(len(e) for e in c.entries()) == [111, 111, 200, 200]


def test_untrimmable_exact_prefix_only():
    from mlx_lm import load

    from mlxgw.demo_model import ensure_demo_model

    model = load(str(ensure_demo_model("swa")))[0]
    c = PromptCache()
    t = list(range(10, 310))  # longer than the 128-token window: not trimmable
    e = c.insert(t, kv_for(model, t))
    assert e is not None and not e.trimmable
    assert c.fetch(t + [5, 6]).reused == 300  # an exact prefix is reused
    assert c.fetch(t[:200] + [5, 6]).reused == 0  # a diverging prompt cannot trim it
    assert c.fetch(t).reused == 0  # and an exact hit cannot leave one token


def _chat(url, msgs, **kw):
    status, headers, body = post(url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, **kw})
    assert status == 200, body
    return json.loads(body)


def _hang_up_after_first_chunk(b, body: dict) -> dict:
    """Stream ``body`` to backend ``b``'s chat endpoint, close the connection after the first
    chunk, and return its /health once it has nothing active (the abandoned request saved)."""
    raw = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", b.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        buf = b""
        while b"data: {" not in buf:
            buf += sock.recv(4096)
    deadline = time.time() + 10
    while time.time() < deadline and get_json(b.url + "/health")["active"] != 0:
        time.sleep(0.05)
    return get_json(b.url + "/health")


def test_an_abandoned_turn_replaces_its_own_entry_in_a_full_cache(make_stack):
    """The entry count full (3 of 3), a conversation's next turn whose client hangs up mid-decode
    is still saved: it replaces that conversation's own previous entry (rule 3), so it evicts
    nobody. It was skipped as if it needed a fourth entry, and the next turn recomputed all it
    added (helper-60, with the default 64 entries filled by one-off requests)."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-entries", "3", "--min-hit-tokens", "100")
    b.wait_healthy()
    turn0 = [{"role": "user", "content": words(300, seed=70)}]
    r0 = _chat(b.url, turn0)
    for seed in (71, 72):  # two other sessions fill the entry count
        _chat(b.url, [{"role": "user", "content": words(40, seed=seed)}])
    before = {e["id"]: e["tokens"] for e in get_json(b.url + "/internal/cache")["entries"]}
    assert len(before) == 3
    turn1 = turn0 + [{"role": "assistant", "content": r0["choices"][0]["message"]["content"]},
                     {"role": "user", "content": words(60, seed=73)}]
    h = _hang_up_after_first_chunk(b, {"messages": turn1, "max_tokens": 2000, "ignore_eos": True})
    assert (h["abandoned_saves_skipped"], h["cache_evictions"]) == (0, 0), h
    after = {e["id"]: e["tokens"] for e in get_json(b.url + "/internal/cache")["entries"]}
    (turn0_id,) = [i for i, n in before.items() if n == max(before.values())]
    assert len(after) == 3 and turn0_id not in after and set(before) - {turn0_id} < set(after)
    r1 = _chat(b.url, turn1)  # the retry reuses the whole abandoned prompt (rule 1: all but one token)
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["prompt_tokens"] - 1


def test_shared_system_prompt_survives_ten_conversations(make_stack):
    s = make_stack()
    b = s.add_backend("b0")
    b.wait_healthy()
    system = {"role": "system", "content": words(300, seed=7)}
    for i in range(10):
        r = _chat(b.url, [system, {"role": "user", "content": words(40, seed=100 + i)}])
    entries = get_json(b.url + "/internal/cache")["entries"]
    sys_entries = [e for e in entries if e["cache_type"] == "system"]
    assert len(sys_entries) == 1
    sys_len = sys_entries[0]["tokens"]
    assert len(entries) == 11  # the system prompt + ten conversations, none overwritten
    r = _chat(b.url, [system, {"role": "user", "content": words(40, seed=999)}])
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= sys_len


def test_a_fan_out_of_twenty_calls_keeps_other_conversations_cached(make_stack):
    """An agent's fan-out (20 sub-agent calls on one long context, each its own entry) on a
    backend with the default budgets: memory is far from full, so no other conversation is
    evicted. With 16 entries, the default until session 30, the entry count bound first and
    evicted them (helper-46: 11 evictions at 0.25% of the byte budget)."""
    s = make_stack()
    b = s.add_backend("b0", None, "--engine", "sim")
    b.wait_healthy()
    other = [{"role": "user", "content": words(300, seed=61)}]
    first = _chat(b.url, other)
    task = words(600, seed=62)
    for i in range(20):
        _chat(b.url, [{"role": "user", "content": f"{task}\nsub-task {i}: {words(8, seed=70 + i)}"}])
    again = _chat(b.url, other + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                  {"role": "user", "content": "and then?"}])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    h = get_json(b.url + "/health")
    assert h["cache_evictions"] == 0 and h["cache_entries"] >= 21, h


def test_system_segment_saved(make_stack):
    s = make_stack()
    b = s.add_backend("b0")
    b.wait_healthy()
    msgs = [{"role": "system", "content": words(200, seed=8)}, {"role": "user", "content": "hello"}]
    r = _chat(b.url, msgs)
    kinds = sorted((e["cache_type"], e["tokens"]) for e in get_json(b.url + "/internal/cache")["entries"])
    assert [k for k, _ in kinds] == ["assistant", "system"]
    # The KV holds the prompt and every token returned (each step feeds the token it returns).
    assert kinds[0][1] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == r["usage"]["prompt_tokens"] + 3
    from gateway.tokenize import load_model_info
    from mlxgw.prompt import render_chat

    cp = render_chat(load_model_info(s.model_name, s.model_path).tokenizer, msgs)
    assert kinds[1][1] == cp.system_tokens and 200 < cp.system_tokens < r["usage"]["prompt_tokens"]


def test_tools_block_saved_like_a_system_prompt(make_stack):
    """With tools and no system message, the tools block the template renders first is saved
    as a system entry and shared by every conversation using those tools."""
    from gateway.tokenize import load_model_info
    from mlxgw.prompt import render_chat

    s = make_stack()
    b = s.add_backend("b0")
    b.wait_healthy()
    props = {f"field_{i}": {"type": "string", "description": words(12, seed=300 + i)} for i in range(12)}
    tools = [{"type": "function", "function": {"name": "lookup", "description": words(40, seed=9),
                                               "parameters": {"type": "object", "properties": props}}}]
    tok = load_model_info(s.model_name, s.model_path).tokenizer
    for i in range(4):
        msgs = [{"role": "user", "content": words(30, seed=200 + i)}]
        r = _chat(b.url, msgs, tools=tools)
    block = render_chat(tok, msgs, tools).system_tokens
    assert block > 200
    sys_entries = [e for e in get_json(b.url + "/internal/cache")["entries"] if e["cache_type"] == "system"]
    assert [e["tokens"] for e in sys_entries] == [block]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= block


def test_save_on_disconnect(make_stack):
    s = make_stack()
    b = s.add_backend("b0")
    b.wait_healthy()
    msgs = [{"role": "user", "content": words(400, seed=9)}]
    body = json.dumps({"messages": msgs, "max_tokens": 2000, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", b.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        buf = b""
        while b"data:" not in buf:  # wait for the first token, then hang up mid-decode
            buf += sock.recv(4096)
    deadline = time.time() + 10
    while time.time() < deadline and get_json(b.url + "/health")["active"] != 0:
        time.sleep(0.05)
    entries = get_json(b.url + "/internal/cache")["entries"]
    assert len(entries) == 1
    r = _chat(b.url, msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    prompt_len = entries[0]["tokens"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= min(prompt_len, r["usage"]["prompt_tokens"]) - 5


def test_a_prompt_larger_than_the_budget_is_counted_and_said(make_stack, redis_server):
    """helper-73: a prompt whose KV is larger than the whole --cache-bytes was never cached, and
    nothing said so (no counter, no log line). `cache_oversize` counts it, the log says it once a
    minute, and `mlxgw status` gives the backend a line."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "64K")  # 128 tokens of the demo model's KV
    b.wait_healthy()
    msgs = [{"role": "user", "content": words(300, seed=64)}]
    for i in (1, 2):
        out = _chat(b.url, msgs)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and out["usage"]["prompt_tokens"] > 128
        assert get_json(b.url + "/health")["cache_oversize"] == i
    said = [ln for ln in b.log_path.read_text().splitlines() if "larger than the whole prompt-cache budget" in ln]
    assert len(said) == 1 and "(64.0 KiB --cache-bytes): not kept in memory, so its next turn is computed again; " \
        "raise --cache-bytes to cache prompts this long (1 such so far" in said[0], said
    assert get_json(b.url + "/internal/cache")["entries"] == []
    deadline = time.time() + 10
    while True:  # the registry has the count with the next heartbeat
        out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", redis_server.url, "--namespace",
                              s.namespace], capture_output=True, text=True, timeout=60).stdout
        if "2 prompt(s)" in out or time.time() > deadline:
            break
        time.sleep(0.5)
    assert ("backend b0: 2 prompt(s) larger than its whole cache budget were not kept in memory (raise "
            "--cache-bytes)") in " ".join(out.split()), out


def test_abandoned_request_is_saved_only_into_free_space(make_stack):
    """A request whose client went away never evicts another session's entry."""
    probe = make_stack()
    p = probe.add_backend("probe")
    p.wait_healthy()
    _chat(p.url, [{"role": "user", "content": words(300, seed=61)}])
    per_entry = get_json(p.url + "/internal/cache")["entries"][0]["nbytes"]

    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", str(int(per_entry * 2.5)))
    b.wait_healthy()
    for seed in (62, 63):  # two sessions fill the budget
        _chat(b.url, [{"role": "user", "content": words(300, seed=seed)}])
    before = sorted(e["id"] for e in get_json(b.url + "/internal/cache")["entries"])
    assert len(before) == 2
    # A third session's client hangs up mid-decode: its KV does not fit beside the two.
    h = _hang_up_after_first_chunk(b, {"messages": [{"role": "user", "content": words(300, seed=64)}],
                                       "max_tokens": 2000})
    assert h["abandoned_saves_skipped"] == 1
    assert h["cache_evictions"] == 0  # nothing was evicted for it
    assert sorted(e["id"] for e in get_json(b.url + "/internal/cache")["entries"]) == before
    # The same request completed normally is saved, evicting one of the two.
    _chat(b.url, [{"role": "user", "content": words(300, seed=64)}])
    after = sorted(e["id"] for e in get_json(b.url + "/internal/cache")["entries"])
    assert len(after) == 2 and len(set(after) & set(before)) == 1 and max(after) > max(before)
    h = get_json(b.url + "/health")
    assert h["cache_evictions"] == 1 and h["cache_evicted_tokens"] > 300
    # Ops see it in `mlxgw status` (from the registry record, with the next heartbeat).
    deadline = time.time() + 10
    while True:
        r = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", s.redis_url,
                            "--namespace", s.namespace], capture_output=True, text=True, timeout=60)
        header = next(ln for ln in r.stdout.splitlines() if "evictions" in ln)
        row = next(ln for ln in r.stdout.splitlines() if "│ b0 " in ln)
        cols = [c.strip() for c in re.split("[│┃]", header)]  # rich draws the header with heavy bars
        evictions = [c.strip() for c in row.split("│")][cols.index("evictions")]
        if evictions != "0" or time.time() > deadline:
            break
        time.sleep(0.2)
    assert evictions == "1", r.stdout


def _open_stream(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    """Send a streamed completion; the caller reads or closes the socket."""
    raw = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def _sibling_during_prefill(backend, a: list[int], b: list[int]) -> int:
    """Stream prompt ``a``; send ``b`` while ``a`` is in prefill (at 64 tokens a step, ``a``'s
    3,000 tokens take far longer than 50 ms); return ``b``'s cached tokens once both ended."""
    sock = _open_stream(backend.port, {"prompt": a, "max_tokens": 1, "temperature": 0})
    try:
        time.sleep(0.05)
        st, _, body = post(backend.url + "/v1/completions", {"prompt": b, "max_tokens": 1, "temperature": 0})
        assert st == 200, body
        assert b"[DONE]" in _read_all(sock)
    finally:
        sock.close()
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_request_sharing_a_prompt_in_prefill_waits_and_reuses_it(make_stack):
    """B arrives while A's long prompt is being prefilled: B waits for that prefill, A's prompt is
    saved as it ends, and B reuses it (SGLang's in-batch prefix caching; our free-space save)."""
    import numpy as np

    s = make_stack()
    flags = ("--min-hit-tokens", "64", "--prefill-step-size", "64")
    on = s.add_backend("on", None, *flags)
    off = s.add_backend("off", None, *flags, "--no-prefill-save")
    s.wait()
    a = np.random.default_rng(5).integers(16, 3000, 3000).tolist()
    b = a[:2500] + np.random.default_rng(6).integers(16, 3000, 20).tolist()
    for backend, want in ((on, 2500), (off, 0)):
        assert _sibling_during_prefill(backend, a, b) == want, backend.name
    # Only A was saved early (B computed 20 tokens and nobody waited for it); A's final save
    # (prompt + answer) then replaced the early entry.
    h = get_json(on.url + "/health")
    assert h["prefill_saves"] == 1 and get_json(off.url + "/health")["prefill_saves"] == 0
    lengths = sorted(e["tokens"] for e in get_json(on.url + "/internal/cache")["entries"])
    assert lengths == [2521, 3001], lengths


def test_prefill_save_may_evict_for_the_waiting_request(make_stack):
    """With one cache entry allowed and an unrelated prompt X in it, A's early save finds no free
    space. By default A's prompt KV is handed straight to B, which reuses it (nothing saved, nothing
    evicted for it); with --no-prefill-handoff B computes everything; with --prefill-save-evicts X
    is evicted for A's saved prompt and B reuses that (B's reuse is certain, X's only possible)."""
    import numpy as np

    s = make_stack()
    flags = ("--min-hit-tokens", "64", "--prefill-step-size", "64", "--cache-entries", "1")
    ev = s.add_backend("ev", None, *flags, "--prefill-save-evicts")
    hand = s.add_backend("hand", None, *flags)
    none = s.add_backend("none", None, *flags, "--no-prefill-handoff")
    s.wait()
    x = np.random.default_rng(4).integers(16, 3000, 200).tolist()
    a = np.random.default_rng(5).integers(16, 3000, 3000).tolist()
    b = a[:2500] + np.random.default_rng(6).integers(16, 3000, 20).tolist()
    for backend, want, saves, handoffs in ((ev, 2500, 1, 0), (hand, 2500, 0, 1), (none, 0, 0, 0)):
        st, _, body = post(backend.url + "/v1/completions", {"prompt": x, "max_tokens": 1, "temperature": 0})
        assert st == 200, body
        assert [e["tokens"] for e in get_json(backend.url + "/internal/cache")["entries"]] == [201]
        assert _sibling_during_prefill(backend, a, b) == want, backend.name
        h = get_json(backend.url + "/health")
        assert (h["prefill_saves"], h["prefill_handoffs"]) == (saves, handoffs), backend.name


def test_a_waiting_request_keeps_the_prompt_saved_for_it_when_the_entry_is_evicted(make_stack):
    """B waits for A's prefill, whose prompt is saved for it; before B is admitted (C, an unrelated
    chat, is ahead of it for the one prefill slot) C's system-prompt save evicts that entry (one
    entry allowed). B took its hit from the saved entry at once (pinned), so it still reuses A's
    prompt; taking it at admission (--no-prefill-save-pin, the rule before session 29) it found
    nothing. With the shared layout such saves fit where a whole copy went to the hand-over."""
    import numpy as np

    s = make_stack()
    flags = ("--min-hit-tokens", "64", "--prefill-step-size", "64", "--cache-entries", "1",
             "--prefill-concurrency", "1", "--prefill-order", "fifo")
    pin = s.add_backend("pin", None, *flags)
    late = s.add_backend("late", None, *flags, "--no-prefill-save-pin")
    s.wait()
    a = np.random.default_rng(5).integers(16, 3000, 3000).tolist()
    b = a[:2500] + np.random.default_rng(6).integers(16, 3000, 20).tolist()
    c = {"model": s.model_name, "max_tokens": 1, "temperature": 0,
         "messages": [{"role": "system", "content": words(300, seed=21)}, {"role": "user", "content": words(900, seed=22)}]}
    for backend, want in ((pin, 2500), (late, 0)):
        sa = _open_stream(backend.port, {"prompt": a, "max_tokens": 1, "temperature": 0})
        try:
            time.sleep(0.05)
            sc = _open_stream(backend.port, c, "/v1/chat/completions")
            try:
                deadline = time.monotonic() + 10  # C's chat is rendered and tokenized first (slow on a busy CI box)
                while get_json(backend.url + "/health")["active"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert get_json(backend.url + "/health")["active"] == 2  # C waits behind A's prefill
                st, _, body = post(backend.url + "/v1/completions", {"prompt": b, "max_tokens": 1, "temperature": 0})
                assert st == 200, body
                assert b"[DONE]" in _read_all(sc)
            finally:
                sc.close()
            assert b"[DONE]" in _read_all(sa)
        finally:
            sa.close()
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == want, backend.name
        h = get_json(backend.url + "/health")
        assert (h["prefill_saves"], h["prefill_handoffs"]) == (1, 0), backend.name
        assert h["cache_evictions"] >= 2, backend.name  # A's entry went before B was admitted, then more


def test_request_sharing_a_decoding_prompt_reuses_it(make_stack):
    """B arrives while A decodes: A's prompt is saved as B is admitted (the generated tokens
    trimmed off the KV mlx-lm's generation batch holds), and B reuses it."""
    import numpy as np

    s = make_stack()
    on = s.add_backend("on")
    off = s.add_backend("off", None, "--no-prefill-save")
    s.wait()
    tok = AutoTokenizer.from_pretrained(s.model_path)
    a = np.random.default_rng(9).integers(16, 3000, 800).tolist()
    b = a[:700] + np.random.default_rng(10).integers(16, 3000, 20).tolist()
    # A decodes 3000 tokens (EOS banned); B is sent once A's first token arrived.
    body_a = {"prompt": a, "max_tokens": 3000, "temperature": 0, "logit_bias": {str(tok.eos_token_id): -100}}
    for backend, want in ((on, 700), (off, 0)):
        sock = _open_stream(backend.port, body_a)
        try:
            sock.settimeout(60)
            buf = b""
            while b'"text"' not in buf:
                buf += sock.recv(65536)
            st, _, body = post(backend.url + "/v1/completions", {"prompt": b, "max_tokens": 1, "temperature": 0})
            assert st == 200, body
            assert get_json(backend.url + "/health")["active"] == 1  # A was still decoding
        finally:
            sock.close()
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == want, backend.name
    assert get_json(on.url + "/health")["prefill_saves"] == 1


def _read_all(sock: socket.socket, timeout: float = 60.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while b"[DONE]" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf



def test_request_cancelled_while_waiting_is_dropped(make_stack, redis_server):
    """A client that goes away while its request waits for a prefill slot ends it there:
    nothing computed, nothing saved, the engine's counts back to zero, and the blocks its
    arrival claimed in Redis withdrawn."""
    import numpy as np

    from mlxgw import schema

    s = make_stack()
    b = s.add_backend("b0", None, "--prefill-concurrency", "1", "--prefill-step-size", "64")
    s.wait()
    a = np.random.default_rng(7).integers(16, 3000, 3000).tolist()
    other = np.random.default_rng(8).integers(16, 3000, 200).tolist()
    sock_a = _open_stream(b.port, {"prompt": a, "max_tokens": 1, "temperature": 0})
    try:
        time.sleep(0.05)
        sock_b = _open_stream(b.port, {"prompt": other, "max_tokens": 5, "temperature": 0})
        time.sleep(0.05)
        assert get_json(b.url + "/health")["active"] == 2
        sock_b.close()  # B still waits: A holds the only prefill slot
        assert b"[DONE]" in _read_all(sock_a)
    finally:
        sock_a.close()
    deadline = time.time() + 10
    while time.time() < deadline and get_json(b.url + "/health")["active"]:
        time.sleep(0.05)
    h = get_json(b.url + "/health")
    assert (h["active"], h["queued_prefill_tokens"], h["requests"]) == (0, 0, 1)
    assert [e["tokens"] for e in get_json(b.url + "/internal/cache")["entries"]] == [3001]
    # /metrics counts it as cancelled (helper-84: a request ended while it waited was in none)
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(b.url + "/metrics", timeout=5) as resp:
        fams = text_string_to_metric_families(resp.read().decode())
    ended = {x.labels["finished_reason"]: x.value for f in fams for x in f.samples
             if x.name == "mlxgw:request_success_total"}
    assert (ended.get("cancelled"), ended.get("length")) == (1.0, 1.0), ended
    keys, r = schema.Keys(s.namespace, s.model_name), redis_server.client()
    owners = [r.hget(keys.block(k), "b0") for k in schema.block_keys(s.model_name, other, s.block_size)]
    assert len(owners) == 12 and owners == [None] * 12  # B's claim is gone
    assert all(r.hget(keys.block(k), "b0") for k in schema.block_keys(s.model_name, a, s.block_size))


@pytest.mark.parametrize("pin", ["by-reference", "copy"])
def test_waiting_requests_pin_their_hits_without_copies(make_stack, pin):
    """Eight requests continuing X arrive while D decodes (one request at a time). Pinned by
    reference (`--pin-by-reference`), their hits add no bytes, so D's save evicts nothing and Y is
    still a hit afterwards; pinned as private copies (the default), their eight 300-token
    copies count as KV in flight (1.2 MB) against the 1 MB budget and D's save evicts Y (by
    reference: X, Y and D's entries, 538 KB, fit). Every waiter reuses X's 300 tokens either way."""
    import threading

    import numpy as np

    s = make_stack()
    flags = ["--decode-concurrency", "1", "--prefill-concurrency", "1", "--cache-bytes", "1MB"] + (["--pin-by-reference"] if pin == "by-reference" else [])
    b = s.add_backend("b0", None, *flags)
    s.wait()
    rng = np.random.default_rng(36)
    x, y, d = (rng.integers(16, 3000, n).tolist() for n in (300, 300, 50))
    for p in (x, y):
        st, _, body = post(b.url + "/v1/completions", {"prompt": p, "max_tokens": 1, "temperature": 0})
        assert st == 200, body
    sk = _open_stream(b.port, {"prompt": d, "max_tokens": 800, "temperature": 0, "ignore_eos": True})
    cached: list = []

    def turn(i: int) -> None:
        st, _, body = post(b.url + "/v1/completions", {"prompt": x + [7 + i, 5], "max_tokens": 1, "temperature": 0})
        cached.append(json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] if st == 200 else body)

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while get_json(b.url + "/health")["waiting"] < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        h = get_json(b.url + "/health")
        assert (h["active"], h["waiting"], h["cache_evictions"]) == (9, 8, 0), h  # all wait for D, pinned
        assert b"[DONE]" in _read_all(sk)
    finally:
        sk.close()
        for t in threads:
            t.join(60)
    assert cached == [300] * 8
    st, _, body = post(b.url + "/v1/completions", {"prompt": y + [9], "max_tokens": 1, "temperature": 0})
    got = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    evictions = get_json(b.url + "/health")["cache_evictions"]
    if pin == "by-reference":
        assert (got, evictions) == (300, 0)
    else:
        assert got == 0 and evictions >= 2


@pytest.mark.parametrize("share", [None, "0.5"])
def test_max_inflight_share_holds_a_request_whose_kv_would_not_fit(make_stack, share):
    """With --max-inflight-share 0.5 of a 1 MB budget (1,024 tokens of the demo model's KV in
    flight), a 1,100-token prompt arriving while D decodes waits until D ends, then runs; without
    it, it is admitted beside D at once."""
    import threading

    import numpy as np

    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "1MB", *(["--max-inflight-share", share] if share else []))
    s.wait()
    rng = np.random.default_rng(37)
    x, d, q = (rng.integers(16, 3000, n).tolist() for n in (100, 50, 1100))
    st, _, body = post(b.url + "/v1/completions", {"prompt": x, "max_tokens": 1, "temperature": 0})
    assert st == 200, body  # the cache now knows its KV bytes per token
    sk = _open_stream(b.port, {"prompt": d, "max_tokens": 800, "temperature": 0, "ignore_eos": True})
    got: list = []
    t = threading.Thread(target=lambda: got.append(post(b.url + "/v1/completions", {"prompt": q, "max_tokens": 1})))
    try:
        deadline = time.monotonic() + 30
        while get_json(b.url + "/health")["active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        t.start()
        if share:  # Q waits for D's KV to leave, however long D decodes
            while get_json(b.url + "/health")["active"] < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.2)
            h = get_json(b.url + "/health")
            assert (h["active"], h["waiting"], h["memory_waits"]) == (2, 1, 1), h
        else:  # Q runs beside D and is answered while D still decodes (a 1,100-token prefill, 800 steps)
            t.join(60)
            h = get_json(b.url + "/health")
            assert (h["active"], h["waiting"], h["memory_waits"]) == (1, 0, 0), h
        assert b"[DONE]" in _read_all(sk)
    finally:
        sk.close()
        t.join(60)
    assert got and got[0][0] == 200, got
    h = get_json(b.url + "/health")
    assert h["memory_waits"] == (1 if share else 0)
    # The setting shows in /health (and the registry record), the waits in /metrics (helper-61: only
    # the counter told whether it was on).
    assert (h["max_inflight_share"], h["cache_budget_bytes"]) == (float(share or 0), 2**20), h
    import urllib.request

    metrics = urllib.request.urlopen(b.url + "/metrics", timeout=10).read().decode()
    assert re.search(r'^mlxgw:memory_waits_total\{model_name="[^"]+"\} %s\.0$' % (1 if share else 0), metrics, re.M)


@pytest.mark.parametrize("floor", [None, "0.5"])
def test_cache_floor_share_keeps_entries_the_kv_in_flight_would_evict(make_stack, floor):
    """A 1 MB budget (2,048 tokens of the demo model's KV, 512 bytes a token): while D's
    1,800-token prompt decodes, the KV in flight takes nearly all of it, so the next save (S, a
    short request) evicts Y's 300 tokens; with --cache-floor-share 0.5 the cache keeps 512 KB
    whatever is in flight, and Y is still a hit beside D."""
    import numpy as np

    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "1MB", *(["--cache-floor-share", floor] if floor else []))
    s.wait()
    rng = np.random.default_rng(41)
    y, d, sh, more = (rng.integers(16, 3000, n).tolist() for n in (300, 1800, 120, 20))
    st, _, body = post(b.url + "/v1/completions", {"prompt": y, "max_tokens": 1, "temperature": 0})
    assert st == 200, body
    # 3,000 steps: D decodes well past the checks below (with 800, a fast run once saw D end first)
    sk = _open_stream(b.port, {"prompt": d, "max_tokens": 3000, "temperature": 0, "ignore_eos": True})
    try:
        deadline = time.monotonic() + 30
        while get_json(b.url + "/health")["active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(1.5)  # D is through its prefill and decoding: over 900 KB in flight and growing
        st, _, body = post(b.url + "/v1/completions", {"prompt": sh, "max_tokens": 1, "temperature": 0})
        assert st == 200, body  # S's save trims the cache to what the KV in flight leaves
        st, _, body = post(b.url + "/v1/completions", {"prompt": y + more, "max_tokens": 1, "temperature": 0})
        assert st == 200, body
        assert get_json(b.url + "/health")["active"] == 1  # D still decoding: Y was looked up beside it
        cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (300 if floor else 0)
        assert b"[DONE]" in _read_all(sk)
    finally:
        sk.close()


def test_waiting_request_keeps_the_hit_it_had_on_arrival(make_stack):
    """The entry a waiting request matched on arrival can be evicted before it is admitted;
    the hit was pinned on arrival, so it is still reused. Here B continues X; it waits behind A's
    long prefill (one prefill slot) while D, decoding alongside, ends and its save evicts X
    (one cache entry)."""
    import numpy as np

    s = make_stack()
    b = s.add_backend("b0", None, "--prefill-concurrency", "1", "--prefill-step-size", "64", "--cache-entries", "1")
    s.wait()
    rng = np.random.default_rng(9)
    x, d, a = (rng.integers(16, 3000, n).tolist() for n in (300, 50, 6000))
    st, _, body = post(b.url + "/v1/completions", {"prompt": x, "max_tokens": 1, "temperature": 0})
    assert st == 200, body
    socks = [_open_stream(b.port, {"prompt": d, "max_tokens": 60, "temperature": 0, "ignore_eos": True})]
    try:
        time.sleep(0.02)
        socks.append(_open_stream(b.port, {"prompt": a, "max_tokens": 1, "temperature": 0}))
        time.sleep(0.02)
        st, _, body = post(b.url + "/v1/completions", {"prompt": x + [7, 8, 9], "max_tokens": 1, "temperature": 0})
        assert st == 200, body
        for sk in socks:
            assert b"[DONE]" in _read_all(sk)
    finally:
        for sk in socks:
            sk.close()
    assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 300
