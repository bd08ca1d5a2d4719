"""The gateway's Redis client packs commands with hiredis (``gateway/index.py::hiredis_packing``):
the same bytes as redis-py's Python packer, on a real Redis."""

import asyncio

import redis.asyncio as aioredis

from gateway.index import OwnershipIndex
from mlxgw import schema


def test_hiredis_packing_sends_the_bytes_python_would(redis_server):
    keys = schema.Keys("t-pack", "m").blocks(schema.block_keys("m", list(range(64 * 512)), 64))
    args = ("EVALSHA", "ab" * 20, 513, "t-pack:backends", *keys, "ns", b"\x00\xff raw", 7, 2**40, 0.25, "é")
    plain = b"".join(aioredis.Connection().pack_command(*args))

    async def run():
        index = OwnershipIndex(redis_server.url, namespace="t-pack")
        pool = index.redis.connection_pool
        conn = pool.connection_class(**pool.connection_kwargs)
        packed = b"".join(conn.pack_command(*args))
        # Real commands through the swapped connections: bytes, a pipeline, the lookup script.
        await index.redis.set("t-pack:k", b"\x00\xff raw")
        got = await index.redis.get("t-pack:k")
        pipe = index.redis.pipeline(transaction=False)
        pipe.incrby("t-pack:n", 2**40).get("t-pack:n")
        piped = await pipe.execute()
        found = await index.lookup("m", [k.rsplit(":", 1)[1] for k in keys])
        name = type(conn).__name__
        await index.close()
        return packed, got, piped, found, name

    packed, got, piped, found, name = asyncio.run(run())
    assert name == "HiredisConnection"
    assert packed == plain and len(packed) > 512 * 30
    assert got == b"\x00\xff raw" and piped == [2**40, str(2**40).encode()]
    assert found.status == "ok" and found.candidates == []  # no backend registered in this namespace
