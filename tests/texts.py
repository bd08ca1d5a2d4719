"""Deterministic prompt text for tests and benchmarks."""

import random

WORDS = ("agent tool cache prefix token backend gateway redis block model prompt system user assistant "
         "memory latency throughput request response stream session history file code search edit run test "
         "error result value function argument return class module import path config server client").split()


def words(n: int, seed: int) -> str:
    """``n`` pseudo-random words from a fixed list, reproducible for a given seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))
