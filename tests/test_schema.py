"""The Redis schema contract: block hashing known answers and the lookup script."""

import time

import numpy as np
import pytest

from mlxgw import schema


def test_block_keys_known_answer():
    # Pinned vector: changing hashing breaks every deployed index, so it must be deliberate.
    ids = list(range(40))
    assert schema.block_keys("demo-tiny", ids, 16) == KNOWN


def _reference(model, ids, bs):
    import xxhash

    prev = xxhash.xxh3_64_intdigest(model.encode())
    out = []
    for i in range(len(ids) // bs):
        blk = b"".join(int(t).to_bytes(4, "little") for t in ids[i * bs:(i + 1) * bs])
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + blk)
        out.append(f"{prev:016x}")
    return out


KNOWN = ["4d4003ed7686570e", "61a93fbeef11ffab"]


def test_block_keys_match_reference_and_chain():
    ids = list(np.random.default_rng(0).integers(0, 50000, 300))
    assert schema.block_keys("m", ids, 64) == _reference("m", ids, 64)
    a = schema.block_keys("m", ids, 64)
    b = schema.block_keys("m", ids[:100] + [1] + ids[101:], 64)
    # Equal up to the changed block, different from it on (chained).
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))
    assert len(a) == 300 // 64
    assert schema.block_keys("other", ids, 64)[0] != a[0]
    assert schema.block_keys("m", ids[:63], 64) == []
    with pytest.raises(ValueError):
        schema.block_keys("m", ids, 0)


def test_packed_token_ids_roundtrip_and_hash_alike():
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 2**32, 200)] + [0, 2**32 - 1]
    raw = schema.token_bytes(ids)
    assert len(raw) == 4 * len(ids)
    assert raw[:4] == ids[0].to_bytes(4, "little")  # little-endian on every host
    assert schema.tokens_from_bytes(raw) == ids
    # The gateway hashes the packed bytes it forwards: same keys as the id list.
    assert schema.block_keys("m", raw, 64) == schema.block_keys("m", ids, 64) == _reference("m", ids, 64)
    assert schema.block_keys("m", raw[: 4 * 63], 64) == []
    with pytest.raises(ValueError):
        schema.tokens_from_bytes(raw[:5])
    with pytest.raises(OverflowError):
        schema.token_bytes([2**32])


def test_keys_carry_hash_tag():
    k = schema.Keys("ns", "my{model} x")
    assert k.block("ab") == "ns:{my_model__x}:blk:ab"
    assert k.backend("b0").startswith("ns:{my_model__x}:")


def test_lookup_counts_live_epoch_only(redis_server):
    r = redis_server.client()
    k = schema.Keys("tlookup", "m")
    blocks = ["a1", "a2", "a3"]
    # b0 live at epoch 2 owns 3 blocks; b1 live owns 1 block; b2 owns all but under an old epoch;
    # b3 owns all but its registry record is gone (dead).
    for bid, ep in (("b0", 2), ("b1", 1), ("b2", 5)):
        r.hset(k.backend(bid), mapping={"epoch": ep, "url": f"http://{bid}", "state": "ready", "active": 1,
                                         "queued_prefill_tokens": 7, "cache_bytes": 10, "cache_budget_bytes": 100})
        r.zadd(k.backends, {bid: time.time()})
    r.zadd(k.backends, {"b3": time.time()})
    for i, b in enumerate(blocks):
        r.hset(k.block(b), mapping={"b0": 2, "b2": 4, "b3": 1, **({"b1": 1} if i == 0 else {})})
    rows = r.eval(schema.LOOKUP_LUA, 1 + len(blocks), k.backends, *k.blocks(blocks), k.backend_prefix)
    got = {c.backend_id: c.depth_blocks for c in schema.parse_lookup(rows)}
    assert got == {"b0": 3, "b1": 1, "b2": 0}
    c = [c for c in schema.parse_lookup(rows) if c.backend_id == "b0"][0]
    assert (c.url, c.active, c.queued_prefill_tokens, c.free_cache_bytes) == ("http://b0", 1, 7, 90)


def test_lookup_tells_saved_copies_from_claims(redis_server):
    """A block value with the claim suffix ("2c") is owned only as a prompt being computed: the
    depth counts it, the saved depth stops before it. The backend's min_hit_tokens comes along."""
    r = redis_server.client()
    k = schema.Keys("tclaim", "m")
    for bid in ("b0", "b1"):
        r.hset(k.backend(bid), mapping={"epoch": 2, "url": f"http://{bid}", "state": "ready", "min_hit_tokens": 31})
        r.zadd(k.backends, {bid: time.time()})
    blocks = ["c1", "c2", "c3", "c4"]
    # b0: saved copy of 2 blocks, computing 4; b1: computing 3, nothing saved; a stale "1c" never counts
    vals = [("2", "2c"), ("2", "2c"), ("2c", "2c"), ("2c", "1c")]
    for b, (v0, v1) in zip(blocks, vals):
        r.hset(k.block(b), mapping={"b0": v0, "b1": v1})
    assert schema.block_value(2, True) == "2" and schema.block_value(2, False) == "2c"
    rows = r.eval(schema.LOOKUP_LUA, 1 + len(blocks), k.backends, *k.blocks(blocks), k.backend_prefix)
    got = {c.backend_id: (c.depth_blocks, c.saved_blocks, c.min_hit_tokens) for c in schema.parse_lookup(rows)}
    assert got == {"b0": (4, 2, 31), "b1": (3, 0, 31)}
    # an epoch's cleanup removes its claims too, never a newer epoch's
    r.sadd(k.owned("b1", 2), *k.blocks(blocks))
    assert r.eval(schema.CLEANUP_LUA, 1, k.owned("b1", 2), "b1", 2, 10) == 0
    assert [r.hget(k.block(b), "b1") for b in blocks] == [None, None, None, "1c"]


def test_cleanup_keeps_newer_epoch(redis_server):
    r = redis_server.client()
    k = schema.Keys("tclean", "m")
    r.hset(k.block("x"), mapping={"b0": 1})
    r.hset(k.block("y"), mapping={"b0": 2})  # re-claimed by the new epoch
    r.sadd(k.owned("b0", 1), k.block("x"), k.block("y"))
    left = r.eval(schema.CLEANUP_LUA, 1, k.owned("b0", 1), "b0", 1, 10)
    assert left == 0
    assert r.hgetall(k.block("x")) == {}
    assert r.hgetall(k.block("y")) == {"b0": "2"}


def test_event_roundtrip():
    f = schema.event_fields(schema.EVENT_SAVED, "b0", 3, {"tokens": 5, "blocks": 1})
    d = schema.decode_event({k.encode(): (v.encode() if isinstance(v, str) else v) for k, v in f.items()})
    assert d["type"] == "saved" and d["backend"] == "b0" and d["epoch"] == "3"
    assert d["data"] == {"tokens": 5, "blocks": 1}


def test_the_queue_comments_are_taken_out_and_the_cached_count_read():
    """A backend's keep-alives while a request waits for a decode slot and the cache hit it sends
    once the prefill starts (`schema.parse_queue_comments`): counted, read and taken out of
    whatever chunk they arrive in; the marks' words inside an answer are left alone."""
    from mlxgw import schema

    q, c = schema.QUEUED_COMMENT, schema.cached_comment(573)
    assert c == b": mlxgw-cached 573\n\n"
    assert schema.parse_queue_comments(q + q + c + b": keepalive 512/574\n\n") == (b": keepalive 512/574\n\n", 2, 573)
    assert schema.parse_queue_comments(q) == (b"", 1, None)
    said = b'data: {"content": "x\\n: mlxgw-cached 9"}\n\n'
    assert schema.parse_queue_comments(said) == (said, 0, None)
    assert schema.parse_queue_comments(b": mlxgw-cached 9\n\n", at_line_start=False) == (b": mlxgw-cached 9\n\n", 0, None)
    assert schema.parse_queue_comments(c + b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", 0, 573)


def test_the_progress_comment_gives_the_tokens_left_from_the_last_whole_one():
    """A stream's prefill progress (`schema.progress_comment`): the tokens left by the last whole
    comment in a read; a piece of one split between reads is skipped for the whole one before it."""
    one, two = schema.progress_comment(512, 2000), schema.progress_comment(640, 2000)
    assert one == b": keepalive 512/2000\n\n"
    assert schema.parse_progress(b"data: {}\n\n" + one + two) == 1360
    assert schema.parse_progress(one + two[:14]) == 1488
    assert schema.parse_progress(two[:14]) is None
    assert schema.parse_progress(b": keepalive\n\n") is None  # the gateway's own keep-alive
    assert schema.parse_progress(schema.progress_comment(2000, 2000)) == 0


def test_the_failed_comment_is_found_in_any_chunk_and_taken_out():
    """A backend's reason for cutting a stream (`schema.failed_comment`) may arrive glued to the
    data before it: the gateway takes it out whole and keeps the rest."""
    from mlxgw import schema

    c = schema.failed_comment("the batch failed (ValueError: x\nspread over lines)", fatal=False)
    assert c == b": mlxgw-failed batch the batch failed (ValueError: x spread over lines)\n\n"
    assert schema.parse_failed_comment(b'data: {"a": 1}\n\n' + c) == (
        b'data: {"a": 1}\n\n', (False, "the batch failed (ValueError: x spread over lines)"))
    assert schema.parse_failed_comment(schema.failed_comment("engine failure", fatal=True)) == (
        b"", (True, "engine failure"))
    assert schema.parse_failed_comment(b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", None)
    # The mark's words inside an answer (a data line's JSON) cut nothing; nor at a chunk's start
    # that continues a line
    said = b'data: {"content": ": mlxgw-failed batch x"}\n\n'
    assert schema.parse_failed_comment(said) == (said, None)
    assert schema.parse_failed_comment(b': mlxgw-failed batch x"}\n\n', at_line_start=False)[1] is None
    assert schema.parse_failed_comment(said + c)[1] == (False, "the batch failed (ValueError: x spread over lines)")
