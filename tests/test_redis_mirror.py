"""Acceptance: Redis state matches the backend's real cache, and liveness expires."""

import time

import redis

from mlxgw import schema
from mlxgw.httpget import get_json, post
from texts import words


def _chat(url, text, max_tokens=4):
    status, headers, body = post(url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
    assert status == 200, body
    return headers


def _prompt_blocks(stack, text):
    from gateway.tokenize import load_model_info
    from mlxgw.prompt import render_chat

    info = load_model_info(stack.model_name, stack.model_path)
    ids = render_chat(info.tokenizer, [{"role": "user", "content": text}]).token_ids
    return schema.block_keys(stack.model_name, ids, stack.block_size)


def _owners(r, stack, blocks):
    k = schema.Keys(stack.namespace, stack.model_name)
    return [r.hgetall(k.block(b)) for b in blocks]


def test_ownership_follows_saves_and_evictions(make_stack, redis_server):
    r = redis_server.client()
    # Measure one entry's size on a backend with room, then give another a budget of 1.5 entries.
    probe = make_stack()
    b = probe.add_backend("probe")
    b.wait_healthy()
    p1, p2 = words(300, seed=11), words(300, seed=12)
    _chat(b.url, p1)
    entry_bytes = get_json(b.url + "/internal/cache")["entries"][0]["nbytes"]
    assert entry_bytes > 0

    s = make_stack()
    b0 = s.add_backend("b0", None, "--cache-bytes", str(int(entry_bytes * 1.5)))
    b0.wait_healthy()
    blocks1, blocks2 = _prompt_blocks(s, p1), _prompt_blocks(s, p2)
    assert len(blocks1) >= 15

    _chat(b0.url, p1)
    epoch = str(get_json(b0.url + "/internal/cache")["epoch"])
    assert all(o == {"b0": epoch} for o in _owners(r, s, blocks1))

    _chat(b0.url, p2)  # does not fit beside p1: p1's entry is evicted
    cache = get_json(b0.url + "/internal/cache")
    assert len(cache["entries"]) == 1
    only1 = [b for b in blocks1 if b not in set(blocks2)]  # the first block (template header) is shared
    assert len(only1) >= len(blocks1) - 1
    assert _owners(r, s, only1) == [{}] * len(only1)
    assert all(o == {"b0": epoch} for o in _owners(r, s, blocks2))
    # Redis holds exactly the blocks the live entries cover.
    k = schema.Keys(s.namespace, s.model_name)
    assert r.smembers(k.owned("b0", epoch)) == set(k.blocks(cache["entries"][0]["blocks"]))
    assert sorted(cache["owned"]) == sorted(cache["entries"][0]["blocks"])
    events = [schema.decode_event(f)["type"] for _, f in redis.Redis.from_url(redis_server.url).xrange(k.events)]
    assert "saved" in events and "evicted" in events


def test_registry_heartbeat_expires_when_killed(make_stack, redis_server):
    r = redis_server.client()
    s = make_stack()
    b0 = s.add_backend("b0")
    b0.wait_healthy()
    k = schema.Keys(s.namespace, s.model_name)
    rec = r.hgetall(k.backend("b0"))
    assert rec["state"] == "ready" and rec["url"] == b0.url and int(rec["pid"]) == b0.proc.pid
    assert 0 < r.pttl(k.backend("b0")) <= 2000
    hb1 = float(rec["last_heartbeat"])
    time.sleep(1.2)
    assert float(r.hget(k.backend("b0"), "last_heartbeat")) > hb1
    b0.kill()
    time.sleep(2.5)  # TTL 2 s
    assert r.exists(k.backend("b0")) == 0


def test_restart_gets_new_epoch_and_old_claims_never_route(make_stack, redis_server):
    r = redis_server.client()
    s = make_stack()
    b0 = s.add_backend("b0")
    b0.wait_healthy()
    text = words(200, seed=21)
    _chat(b0.url, text)
    k = schema.Keys(s.namespace, s.model_name)
    blocks = _prompt_blocks(s, text)
    assert r.hget(k.block(blocks[0]), "b0") == "1"
    b0.kill()
    b0 = s.add_backend("b0", b0.port)
    b0.wait_healthy()
    assert r.hget(k.backend("b0"), "epoch") == "2"
    rows = r.eval(schema.LOOKUP_LUA, 1 + len(blocks), k.backends, *k.blocks(blocks), k.backend_prefix)
    assert [(c.backend_id, c.depth_blocks) for c in schema.parse_lookup(rows)] == [("b0", 0)]
    # The old epoch's claims are cleaned up in the background.
    deadline = time.time() + 5
    while time.time() < deadline and r.hget(k.block(blocks[0]), "b0") is not None:
        time.sleep(0.1)
    assert r.hget(k.block(blocks[0]), "b0") is None


def test_a_claim_then_the_save_writes_each_state_change_once():
    """Reference counts (backend/report.py): a request's claim makes its blocks owned as being
    computed (one write each), its save turns them into a saved copy (one write each), the
    claim's release then changes nothing Redis sees, and the entry's eviction withdraws them
    (one delete each)."""
    import numpy as np

    from backend.cache import CacheEntry
    from backend.report import Reporter

    rep = Reporter("redis://127.0.0.1:1/0", "ns", "m", "b0", "http://x", block_size=16)
    prompt = list(range(100, 164))  # 4 full blocks
    keys = schema.block_keys("m", prompt, 16)
    handle = rep.claim(prompt)
    assert rep._pending == {k: False for k in keys}  # claimed only: written "<epoch>c"
    rep._pending.clear()  # what a flush takes
    entry = CacheEntry(tokens=np.array(prompt + [7], dtype=np.int32), kv=None, nbytes=0,
                       cache_type="assistant", trimmable=True)
    rep.on_saved(entry)
    assert rep._pending == {k: True for k in keys}  # now a saved copy: written "<epoch>"
    rep._pending.clear()
    rep.release(handle)
    assert rep._pending == {} and rep.owned_blocks() == set(keys)  # still saved: nothing to write
    rep.on_evicted(entry)
    assert rep._pending == {k: None for k in keys} and rep.owned_blocks() == set()
    # a second claim on saved blocks changes nothing in Redis; its release neither
    rep.on_saved(entry)
    rep._pending.clear()
    rep.release(rep.claim(prompt))
    assert rep._pending == {}


def test_cache_figures_reach_the_registry_with_each_save(make_stack, redis_server):
    # A heartbeat every 30 s: what the record shows after a request came with the save itself.
    r = redis_server.client()
    s = make_stack()
    b0 = s.add_backend("b0", None, "--heartbeat-interval", "30", "--heartbeat-ttl", "60")
    b0.wait_healthy()
    k = schema.Keys(s.namespace, s.model_name)
    assert float(r.hget(k.backend("b0"), "cache_bytes")) == 0
    t0 = time.time()
    _chat(b0.url, words(300, seed=13))
    (e1,) = get_json(b0.url + "/internal/cache")["entries"]
    rec = r.hgetall(k.backend("b0"))
    assert int(rec["cache_bytes"]) == e1["nbytes"] > 0
    assert float(rec["cache_victim_used_at"]) == e1["used_at"] >= round(t0, 3)
    assert float(rec["kv_bytes_per_token"]) == round(e1["nbytes"] / e1["tokens"], 1)
    _chat(b0.url, words(300, seed=14))
    cache = get_json(b0.url + "/internal/cache")
    entries = cache["entries"]
    assert len(entries) == 2
    rec = r.hgetall(k.backend("b0"))
    # What the cache holds: the two prompts' shared template header once (cache rule 7).
    assert cache["layout"] == "shared" and int(rec["cache_bytes"]) == cache["nbytes"] < sum(e["nbytes"] for e in entries)
    # The rest of the record's cache figures are of the same moment, not of the last heartbeat.
    assert (int(rec["cache_entries"]), int(rec["cache_tokens"]), int(rec["blocks_owned"])) == (
        2, sum(e["tokens"] for e in entries), len(cache["owned"]))
    assert int(rec["blocks_owned"]) > 0 and rec["cache_evictions"] == "0"
    assert rec["cache_layout"] == "shared" and rec["auth"] == "none"  # started by hand without the token
    log = b0.log_path.read_text()
    assert "registered at" in log and "shared layout; 16 decode slots)" in log
    # What it serves, as in its record (`mlxgw status` compares model_files across a model's backends).
    h = get_json(b0.url + "/health")
    assert (h["model_path"], h["model_files"]) == (rec["model_path"], rec["model_files"]) and len(h["model_files"]) == 16
    assert f"(model {s.model_name} from {rec['model_path']}, files {rec['model_files']}, epoch " in log
    # Started by hand without the internal token (as here): it says anything local may skip the gateways.
    assert "backend b0 has no internal token: anything that reaches http://127.0.0.1:" in log
    # The next victim is the first entry (least recently used; the second request's lookup
    # touched it, as its template header is a shared prefix, before the new entry was saved).
    first = next(e for e in entries if e["id"] == e1["id"])
    assert float(rec["cache_victim_used_at"]) == first["used_at"] == min(e["used_at"] for e in entries)
    # The gateway's lookup hands both figures to routing.
    rows = r.eval(schema.LOOKUP_LUA, 1, k.backends, k.backend_prefix, "", "", "")
    (cand,) = schema.parse_lookup(rows)
    assert cand.victim_used_at == first["used_at"] and cand.kv_bytes_per_token == float(rec["kv_bytes_per_token"])
    # ... and what a short remainder starts beside: one prefill step (512, step-beside by default).
    assert cand.prefill_beside_tokens == int(rec["prefill_beside_tokens"]) == 512
    # ... and the engine steps one output token takes (mlx-lm: one), which turns an answer's
    # tokens into the prefill chunks it decodes beside.
    assert cand.decode_steps_per_token == float(rec["decode_steps_per_token"]) == 1.0
    # ... and the depth at which its prompt tokens' attention costs as much as the rest (the demo
    # model's config: 64 wide, MLP 176, 4 heads of 16; backend.attention).
    assert cand.attention_parity_tokens == int(rec["attention_parity_tokens"]) == 360
