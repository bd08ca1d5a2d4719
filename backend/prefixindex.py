"""Token sequences in lexicographic order, for longest-prefix lookups in O(log n).

The disk tier (`backend.disktier`) may hold thousands of entries, and every request's lookup
and every spill compares the prompt with them: scanning took 43 ms per lookup for 1,000
entries of 30k tokens sharing a 10k-token system prompt (session 34). Kept sorted, the entry
sharing the longest prefix with a query is next to the query's place in the order, and the
entries sharing at least k tokens with it are a contiguous run around that place; with the
longest common prefix (LCP) of each pair of neighbours stored, walking that run costs no
token comparison (the LCP array of suffix arrays: LCP(q, s[j+1]) = min(LCP(q, s[j]),
LCP(s[j], s[j+1])) for q <= s[j] <= s[j+1]).
"""

from __future__ import annotations

import bisect
from typing import Optional

import numpy as np

from .cache import common_prefix


def _key(tokens: np.ndarray) -> bytes:
    """Big-endian bytes of non-negative token ids: their byte order is the sequences' order."""
    return np.asarray(tokens, dtype=">u4").tobytes()


class PrefixIndex:
    """Sequences of token ids (int32 arrays of ids >= 0), each under an int id, kept sorted.

    `longest` finds the sequence sharing the longest prefix with a query with two token
    comparisons after a binary search; `sharing` lists every sequence sharing at least
    ``floor`` tokens, with its exact common prefix, two token comparisons in all. `add` and
    `remove` cost a binary search, two comparisons and a list insert (memmove). Memory: 4
    bytes per token beside the arrays. Not thread-safe.
    """

    def __init__(self):
        self._keys: list[tuple[bytes, int]] = []  # (key, id), sorted
        self._tokens: list[np.ndarray] = []  # parallel to _keys
        self._lcp: list[int] = []  # _lcp[j]: common prefix of sequences j and j + 1, tokens

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, ident: int, tokens: np.ndarray) -> None:
        """Insert ``tokens`` under ``ident`` (ids are unique; equal sequences may repeat)."""
        t = np.asarray(tokens, dtype=np.int32)
        item = (_key(t), ident)
        i = bisect.bisect_left(self._keys, item)
        self._keys.insert(i, item)
        self._tokens.insert(i, t)
        # The pair (i-1, i+1) becomes (i-1, i) and (i, i+1).
        left = common_prefix(self._tokens[i - 1], t) if i > 0 else None
        right = common_prefix(t, self._tokens[i + 1]) if i + 1 < len(self._tokens) else None
        if left is not None and right is not None:
            self._lcp[i - 1:i] = [left, right]
        elif left is not None:
            self._lcp.append(left)
        elif right is not None:
            self._lcp.insert(0, right)

    def remove(self, ident: int, tokens: np.ndarray) -> None:
        """Remove the sequence ``add`` put under ``ident``. Raises KeyError if it is not here."""
        item = (_key(tokens), ident)
        i = bisect.bisect_left(self._keys, item)
        if i >= len(self._keys) or self._keys[i] != item:
            raise KeyError(ident)
        m = len(self._keys)
        del self._keys[i]
        del self._tokens[i]
        if m == 1:
            return
        if i == 0:
            del self._lcp[0]
        elif i == m - 1:
            del self._lcp[i - 1]
        else:  # neighbours i-1 and i+1 meet: their common prefix is the smaller of the two
            self._lcp[i - 1:i + 1] = [min(self._lcp[i - 1], self._lcp[i])]

    def longest(self, query: np.ndarray) -> tuple[Optional[int], int]:
        """``(id, tokens)`` of a sequence sharing the longest prefix with ``query``; ``(None, 0)``
        when empty. Of several as long, one whose place is next to the query's."""
        i = bisect.bisect_left(self._keys, (_key(query),))
        best, n = None, 0
        for j in (i - 1, i):
            if 0 <= j < len(self._keys):
                c = common_prefix(self._tokens[j], query)
                if best is None or c > n:
                    best, n = self._keys[j][1], c
        return best, n

    def sharing(self, query: np.ndarray, floor: int = 1) -> dict[int, int]:
        """id -> common prefix with ``query`` (tokens) of every sequence sharing at least
        ``floor`` (>= 1) tokens with it."""
        out: dict[int, int] = {}
        i = bisect.bisect_left(self._keys, (_key(query),))
        if i < len(self._keys):  # rightwards from the query's place
            c = common_prefix(self._tokens[i], query)
            j = i
            while c >= floor:
                out[self._keys[j][1]] = c
                if j + 1 >= len(self._keys):
                    break
                c = min(c, self._lcp[j])
                j += 1
        if i > 0:  # leftwards
            c = common_prefix(self._tokens[i - 1], query)
            j = i - 1
            while c >= floor:
                out[self._keys[j][1]] = c
                if j == 0:
                    break
                c = min(c, self._lcp[j - 1])
                j -= 1
        return out
