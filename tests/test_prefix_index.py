"""backend.prefixindex: the sorted index the disk tier looks prompts up in, against a scan."""

import numpy as np
import pytest

from backend.cache import common_prefix
from backend.prefixindex import PrefixIndex


def _seqs(rng, n):
    """Sequences with shared heads (a few system prompts, conversations growing from them)."""
    heads = [rng.integers(0, 4, int(rng.integers(0, 40))) for _ in range(4)]
    out = []
    for _ in range(n):
        base = out[int(rng.integers(0, len(out)))] if out and rng.random() < 0.4 else heads[int(rng.integers(0, 4))]
        cut = int(rng.integers(0, len(base) + 1))
        out.append(np.concatenate([base[:cut], rng.integers(0, 4, int(rng.integers(0, 30)))]).astype(np.int32))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_lookups_equal_a_scan_through_adds_and_removes(seed):
    rng = np.random.default_rng(seed)
    seqs = _seqs(rng, 120)
    idx, live = PrefixIndex(), {}
    for step in range(400):
        if live and rng.random() < 0.4:  # remove one
            k = list(live)[int(rng.integers(0, len(live)))]
            idx.remove(k, live.pop(k))
        else:
            k = step
            live[k] = seqs[int(rng.integers(0, len(seqs)))]
            idx.add(k, live[k])
        assert len(idx) == len(live)
        q = seqs[int(rng.integers(0, len(seqs)))][: int(rng.integers(0, 60))]
        scan = {k: common_prefix(t, q) for k, t in live.items()}
        best, n = idx.longest(q)
        assert n == max(scan.values(), default=0) and (best is None) == (not live)
        if best is not None:
            assert scan[best] == n
        for floor in (1, 3, 10):
            assert idx.sharing(q, floor) == {k: c for k, c in scan.items() if c >= floor}


def test_removing_what_is_not_there_raises():
    idx = PrefixIndex()
    idx.add(1, np.array([1, 2, 3], dtype=np.int32))
    with pytest.raises(KeyError):
        idx.remove(2, np.array([1, 2, 3], dtype=np.int32))
    with pytest.raises(KeyError):
        idx.remove(1, np.array([1, 2], dtype=np.int32))
    idx.remove(1, np.array([1, 2, 3], dtype=np.int32))
    assert len(idx) == 0 and idx.longest(np.array([1], dtype=np.int32)) == (None, 0)
