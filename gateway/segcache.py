"""Token ids of rendered chat text, cached per segment between added tokens.

An agent conversation re-sends its whole history every turn; tokenizing a
31k-token prompt with a plain transformers call costs ~45 ms on this machine
(bench/results/overhead.md), and all but the newest message was tokenized the
turn before. `SegmentEncoder` splits the rendered text at the tokenizer's added
tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``...), takes each
piece's ids from a byte-bounded LRU keyed by the piece's text, tokenizes only
the pieces it has not seen, and concatenates.

Why that equals tokenizing the whole text: Hugging Face ``tokenizers``
(``AddedVocabulary::extract_and_normalize``) first cuts the input at every
added token, then normalizes, pre-tokenizes and runs the model on each piece
separately; no merge crosses an added token. That holds only when

* every added token has ``normalized=False`` (matched on the raw text, as we
  match it) and ``lstrip = rstrip = single_word = False`` (otherwise the
  token swallows neighbouring whitespace or matches only at word bounds);
* no step depends on a piece's position in the whole input: a ``Metaspace``
  pre-tokenizer (or normalizer prepend) with ``prepend_scheme="first"`` (Llama
  2 / Mistral style SentencePiece conversions) adds ``▁`` only to the very first
  piece, so a piece encoded alone gets a ``▁`` it would not get in place
  (``tests/test_segment_cache.py`` shows both failures on real tokenizers);
* the backend tokenizer has no truncation or padding configured, and it is a
  fast (Rust) tokenizer.

`unsupported_reason` checks the flags and then compares both paths on probe
strings built around every added token; a tokenizer that fails keeps the
plain path (`SegmentEncoder.create` returns None). The equality on real chats is
`tests/test_segment_cache.py`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from typing import Optional

log = logging.getLogger("mlxgw.gateway.segcache")

#: Approximate bytes one cached id holds: a list slot (8) plus an int object (28, allocated as 32).
BYTES_PER_ID = 40
#: Default LRU budget per model: ~1.6 M cached tokens, e.g. fifty 30k-token conversations.
DEFAULT_CACHE_BYTES = 64 * 2**20


def _plain(hf, text: str) -> list[int]:
    """The plain path transformers' ``apply_chat_template(tokenize=True)`` takes."""
    return list(hf(text, add_special_tokens=False)["input_ids"])


def _probes(added: list[str]) -> list[str]:
    """Strings that put each added token against every kind of neighbour."""
    sides = ["a", " a", "a ", "\n", " \n ", "  ", "1", "é", "ünï ", "\t", ".", "", "ab\n\ncd  "]
    out = []
    for i, tok in enumerate(added):
        for j, left in enumerate(sides):
            right = sides[(i + j + 3) % len(sides)]
            out.append(f"{left}{tok}{right}")
        other = added[(i + 1) % len(added)]
        out += [f"{tok}{tok}", f"x {tok} y {other} z", f"Hello world{tok}\nuser\nHi there{other} ok"]
    return out


def unsupported_reason(hf) -> Optional[str]:
    """Why per-segment encoding would differ from the plain call for ``hf``; None when it is safe.

    Args:
        hf: a transformers tokenizer (the ``_tokenizer`` of mlx-lm's ``TokenizerWrapper``).

    Returns:
        None, or a one-line reason (see the module docstring for the rules).
    """
    bt = getattr(hf, "backend_tokenizer", None)
    if bt is None:
        return "not a fast (Rust) tokenizer"
    if bt.truncation is not None or bt.padding is not None:
        return "the backend tokenizer has truncation or padding configured"
    try:
        added = bt.get_added_tokens_decoder()
    except AttributeError:
        return "tokenizers too old to list added tokens"
    if not added:
        return "no added tokens to split at"
    for tok in added.values():
        for flag in ("normalized", "lstrip", "rstrip", "single_word"):
            if getattr(tok, flag, False):
                return f"added token {tok.content!r} has {flag}=True"
    spec = json.loads(bt.to_str())
    if '"prepend_scheme": "first"' in json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer")]):
        return "Metaspace prepend_scheme='first' marks only the input's first piece"
    split = _splitter(sorted({t.content for t in added.values()}))
    lookup = {t.content: i for i, t in added.items()}
    for probe in _probes(sorted(lookup)):
        seg = _encode_parts(bt, split.split(probe), lookup)
        if seg != _plain(hf, probe):
            return f"probe {probe!r} tokenizes differently per segment"
    return None


def _splitter(contents: list[str]) -> re.Pattern:
    # Longest first: at one position the regex takes the first alternative that
    # matches, which is then the longest, as the Rust side's leftmost-longest
    # Aho-Corasick match does.
    alts = sorted(contents, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(a) for a in alts) + ")")


def _encode_parts(bt, parts: list[str], lookup: dict[str, int]) -> list[int]:
    """Uncached reference: odd parts are added tokens, even parts plain text."""
    out: list[int] = []
    for i, p in enumerate(parts):
        if i & 1:
            out.append(lookup[p])
        elif p:
            out.extend(bt.encode(p, add_special_tokens=False).ids)
    return out


class SegmentEncoder:
    """Tokenize rendered chat text with per-segment caching; same ids as the plain call.

    Args:
        hf: a transformers fast tokenizer that `unsupported_reason` accepts
            (use `create`, which checks).
        max_bytes: LRU budget in approximate bytes held (the segment's
            ``sys.getsizeof`` plus `BYTES_PER_ID` per id); a segment larger
            than the whole budget is encoded and not kept.

    Thread-safe: the gateway renders in a thread pool.
    """

    def __init__(self, hf, max_bytes: int = DEFAULT_CACHE_BYTES):
        self._bt = hf.backend_tokenizer
        # ``encode_batch_fast`` (huggingface/tokenizers PR 1587; older releases lack it, then
        # the plain batch call) skips the character offsets we never read: the same ids
        # (tests/test_segment_cache.py), a cold 32k-token piece in ~21 ms instead of ~28 ms
        # on this machine's demo tokenizer.
        self._encode_batch = getattr(self._bt, "encode_batch_fast", self._bt.encode_batch)
        added = self._bt.get_added_tokens_decoder()
        self._lookup = {t.content: i for i, t in added.items()}
        self._split = _splitter(list(self._lookup)).split
        self.max_bytes = max_bytes
        self._lru: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0  # cached segments used
        self.misses = 0  # segments tokenized
        self.hit_tokens = 0
        self.miss_tokens = 0

    @classmethod
    def create(cls, hf, max_bytes: int = DEFAULT_CACHE_BYTES) -> Optional["SegmentEncoder"]:
        """A `SegmentEncoder` for ``hf``, or None (logged) when per-segment ids could differ."""
        if max_bytes <= 0:
            return None
        reason = unsupported_reason(hf)
        if reason is not None:
            log.warning("token-id segment cache off for this tokenizer: %s", reason)
            return None
        return cls(hf, max_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens=False``), equal to the plain call."""
        parts = self._split(text)  # even indices: text pieces; odd: added tokens
        found: dict[str, list[int]] = {}
        missing: list[str] = []
        with self._lock:
            for p in parts[0::2]:
                if not p or p in found:
                    continue
                ids = self._lru.get(p)
                if ids is None:
                    found[p] = ids  # placeholder, keeps `missing` unique
                    missing.append(p)
                else:
                    self._lru.move_to_end(p)
                    found[p] = ids
        if missing:
            # One batch call even for one piece: the batch calls release the GIL
            # (``encode`` holds it, freezing the gateway's event loop for the ~30 ms
            # of a cold 30k-token piece), and the Rust side may spread several
            # pieces over threads.
            encs = self._encode_batch(missing, add_special_tokens=False)
            for p, e in zip(missing, encs):
                found[p] = e.ids
        out: list[int] = []
        lookup = self._lookup
        for i, p in enumerate(parts):
            if i & 1:
                out.append(lookup[p])
            elif p:
                out.extend(found[p])
        with self._lock:
            miss = 0
            for p in missing:
                miss += len(found[p])
                self._store(p, found[p])
            self.hits += len(found) - len(missing)
            self.misses += len(missing)
            self.miss_tokens += miss
            self.hit_tokens += sum(len(v) for v in found.values()) - miss
        return out

    def _store(self, piece: str, ids: list[int]) -> None:
        """Insert one piece, evicting least recently used ones; the caller holds the lock."""
        cost = sys.getsizeof(piece) + BYTES_PER_ID * len(ids)
        if cost > self.max_bytes or piece in self._lru:
            return
        self._lru[piece] = ids
        self.bytes += cost
        while self.bytes > self.max_bytes:
            k, v = self._lru.popitem(last=False)
            self.bytes -= sys.getsizeof(k) + BYTES_PER_ID * len(v)

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> dict:
        """Counters: entries, bytes, hits/misses in segments and in tokens."""
        return {"entries": len(self._lru), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens}
