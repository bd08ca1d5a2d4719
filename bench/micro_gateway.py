"""In-process costs of the gateway's per-request steps, by prompt length in blocks.

For 1, 128 and 512 blocks of 64 tokens (64 to 32k tokens), medians over
``--reps`` calls:

* ``lookup``: `gateway.index.OwnershipIndex.lookup` against a real
  ``redis-server`` (one live backend registered, nothing owned: the script
  walks the registry and stops at the first unowned block), with the
  gateway's hiredis packing and with redis-py's asyncio default (packing in
  Python), side by side; the packing alone both ways; and a plain ``PING``
  round trip for scale;
* ``pending``: one request's `gateway.pending.PendingClaims` work (depths,
  add, release) with 8 other claims in flight on the same first block;
* ``forward ids``: msgpack pack + unpack of the forward body with the ids as
  a msgpack integer array, and packed by `mlxgw.schema.token_bytes` (plus the
  unpacking on the backend side, `tokens_from_bytes`).

    python bench/micro_gateway.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import msgpack
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.index import OwnershipIndex  # noqa: E402
from gateway.pending import PendingClaims  # noqa: E402
from mlxgw import schema  # noqa: E402
from mlxgw.harness import RedisServer  # noqa: E402


def median_ms(fn, reps: int) -> float:
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1000


async def amedian_ms(fn, reps: int) -> float:
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        await fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1000


async def lookups(url: str, sizes: list[int], reps: int) -> dict:
    idx = OwnershipIndex(url, "bench", deadline=1.0)
    py = OwnershipIndex(url, "bench", deadline=1.0)
    py.redis.connection_pool.connection_class = aioredis.Connection  # redis-py's own packing, in Python
    k = schema.Keys("bench", "m")
    await idx.redis.zadd(k.backends, {"b0": 1})
    await idx.redis.hset(k.backend("b0"), mapping={"epoch": 1, "url": "http://b0", "state": "ready"})
    out = {"ping_ms": await amedian_ms(idx.redis.ping, reps)}
    for nb in sizes:
        keys = schema.block_keys("m", list(range(64 * nb)), 64)
        out[nb] = await amedian_ms(lambda: idx.lookup("m", keys), reps)
        out[f"py{nb}"] = await amedian_ms(lambda: py.lookup("m", keys), reps)
        # The client-side share: packing the EVALSHA command.
        args = ["EVALSHA", "0" * 40, 1 + len(keys), k.backends, *k.blocks(keys), *idx._args(k)]
        for name, index in (("hpack", idx), ("pack", py)):
            conn = index.redis.connection_pool.make_connection()
            out[f"{name}{nb}"] = median_ms(lambda: conn.pack_command(*args), reps)
    await idx.close()
    await py.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="1,128,512")
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",")]
    redis = RedisServer().start()
    try:
        lk = asyncio.run(lookups(redis.url, sizes, args.reps))
    finally:
        redis.cleanup()
    print(f"Redis PING round trip: {lk['ping_ms']:.3f} ms")
    print("| blocks (x64 tokens) | lookup ms | lookup, redis-py packing in Python ms | packing: hiredis ms "
          "| packing: Python ms | pending claims ms | forward ids: msgpack list ms | packed ms |")
    print("|---|---|---|---|---|---|---|---|")
    for nb in sizes:
        ids = list(range(5000, 5000 + 64 * nb))
        keys = schema.block_keys("m", ids, 64)
        pc = PendingClaims(grace=0)
        for j in range(8):
            pc.add(f"o{j}", keys[: max(1, nb // 2)])

        def claims():
            pc.depths(keys)
            pc.release(pc.add("x", keys), ok=False)

        body = {"model": "m", "messages": [{"role": "user", "content": "x" * (4 * 64 * nb)}], "max_tokens": 1}

        def as_list():
            msgpack.unpackb(msgpack.packb(dict(body, _mlxgw={"prompt_ids": ids}), use_bin_type=True))

        def packed():
            raw = schema.token_bytes(ids)
            got = msgpack.unpackb(msgpack.packb(dict(body, _mlxgw={"prompt_ids": raw}), use_bin_type=True))
            schema.tokens_from_bytes(got["_mlxgw"]["prompt_ids"])

        print(f"| {nb} | {lk[nb]:.3f} | {lk[f'py{nb}']:.3f} | {lk[f'hpack{nb}']:.3f} | {lk[f'pack{nb}']:.3f} "
              f"| {median_ms(claims, args.reps):.3f} | {median_ms(as_list, args.reps):.3f} | {median_ms(packed, args.reps):.3f} |")
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
