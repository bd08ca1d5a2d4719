"""Lookup cost vs block size: one Redis round trip for a 32k-token prompt.

Four live backends; one owns the whole prompt. Prints the lookup latency
(p50/p99, ms, client side, loopback) and the tokens a mid-block divergence
can lose (block size - 1).

    python bench/block_size.py
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxgw import schema  # noqa: E402
from mlxgw.harness import RedisServer  # noqa: E402


def main(argv=None) -> int:
    # No options: --help says what it does (it ran the benchmark: helper-72).
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog="Starts a private redis-server; prints a Markdown table.").parse_args(argv)
    srv = RedisServer().start()
    try:
        r = srv.client()
        ids = list(range(1000, 1000 + 32768))
        print("| block size | blocks | lookup p50 ms | lookup p99 ms | worst tokens lost |")
        print("|---|---|---|---|---|")
        for bs in (16, 32, 64, 128, 256):
            k = schema.Keys(f"bs{bs}", "m")
            for i in range(4):
                r.hset(k.backend(f"b{i}"), mapping={"epoch": 1, "url": "u", "state": "ready"})
                r.zadd(k.backends, {f"b{i}": time.time()})
            blocks = schema.block_keys("m", ids, bs)
            pipe = r.pipeline(transaction=False)
            for b in blocks:
                pipe.hset(k.block(b), "b0", 1)
            pipe.execute()
            script = r.register_script(schema.LOOKUP_LUA)
            keys = [k.backends, *k.blocks(blocks)]
            ts = []
            for _ in range(200):
                t0 = time.perf_counter()
                rows = script(keys=keys, args=[k.backend_prefix])
                ts.append((time.perf_counter() - t0) * 1000)
            depth = {c.backend_id: c.depth_blocks for c in schema.parse_lookup(rows)}
            assert depth["b0"] == len(blocks)
            ts.sort()
            print(f"| {bs} | {len(blocks)} | {statistics.median(ts):.2f} | {ts[int(len(ts) * 0.99) - 1]:.2f} | {bs - 1} |")
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
