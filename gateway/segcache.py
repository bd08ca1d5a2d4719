r"""Token ids of rendered chat text, cached per segment between added tokens.

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

A long piece that is not cached (a pasted file, the first turn's tool
definitions) is cut further into up to one chunk per CPU, and the chunks are
tokenized in one batch call, which the Rust side spreads over its threads: a
cold 8k-token piece in two thirds of the time on 2 cores (5.5 against 8.4 ms in
process, session 19). A cut is made only at a
space between two letters (``"word| word"``): in byte-level BPE tokenizers the
pre-tokenizer's regex (GPT-2's, Llama 3's, Qwen's: `` ?\p{L}+`` or
``[^\r\n\p{L}\p{N}]?\p{L}+``) always ends a pre-token at that letter and
starts the next at that space, and BPE merges never cross pre-tokens.
`chunking_unsupported_reason` admits only that shape (Unicode normalizers,
regex splits, byte-level, a BPE model) and then checks the cut on probe strings;
other tokenizers keep whole pieces.
"""

from __future__ import annotations

import json
import logging
import os
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
#: Characters per chunk of a long uncached piece (~600 tokens, ~0.6 ms to tokenize here): pieces
#: shorter than two chunks go whole, as the batch call's thread hand-off would eat the gain.
DEFAULT_CHUNK_CHARS = 2048


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


_UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}


def _steps(node: Optional[dict], seq_key: str) -> list[dict]:
    """A pipeline stage's steps: a ``Sequence``'s ``seq_key`` list, one step, or none."""
    if not node:
        return []
    return (node.get(seq_key) or []) if node.get("type") == "Sequence" else [node]


def _shape_reason(spec: dict) -> Optional[str]:
    """Why the tokenizer's pipeline (``Tokenizer.to_str()`` as JSON) may merge across a
    letter-space-letter cut; None when it is the byte-level BPE shape the module docstring names."""
    for n in _steps(spec.get("normalizer"), "normalizers"):
        if n.get("type") not in _UNICODE_NORMALIZERS:
            return f"normalizer {n.get('type')} is not per character"
    splits = False
    for step in _steps(spec.get("pre_tokenizer"), "pretokenizers"):
        kind = step.get("type")
        if kind == "ByteLevel":
            splits |= bool(step.get("use_regex", True))
        elif kind == "Split":
            # Only an isolated regex split leaves each match a pre-token of its own; the merged
            # behaviours glue a space to the word before or after it.
            if "Regex" not in (step.get("pattern") or {}) or step.get("invert") or step.get("behavior") != "Isolated":
                return f"pre-tokenizer Split ({step.get('behavior')}) is not an isolated regex split"
            splits = True
        elif kind != "Digits":
            return f"pre-tokenizer {kind} is not a byte-level regex split"
    if not splits:
        return "no pre-tokenizer regex splits words"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return f"model {model.get('type')} is not a deterministic BPE"
    return None


def _cut_probes() -> list[tuple[str, str]]:
    """(left, right) pairs: ``left`` ends with a letter, ``right`` is a space and a letter onwards."""
    lefts = ["a", "word", "it's", "x.y", "1a", "a\n\nb", "  a", "é", "e\u0301a", "中文", "Straße", "ΑΒΓ", "привет",
             "ﬁ", "<a", "'s", "A1b", "\t a", "ünï", "😀a"]
    rights = [" a", " word", " s", " é", " ﬁx", " 中文", " Ωmega", " a1", " a.", " a\n", " a  ", " a's", " e\u0301",
              " x\tz", " ab cd", " a😀", " Ἀ", " ǅ", " ʰ", " ａ"]
    return [(left, right) for left in lefts for right in rights]


def chunking_unsupported_reason(hf) -> Optional[str]:
    """Why cutting an uncached piece at a letter-space-letter position could change its ids
    for ``hf`` (a transformers fast tokenizer); None when it is safe (module docstring)."""
    bt = getattr(hf, "backend_tokenizer", None)
    if bt is None:
        return "not a fast (Rust) tokenizer"
    reason = _shape_reason(json.loads(bt.to_str()))
    if reason is not None:
        return reason
    for left, right in _cut_probes():
        whole = bt.encode(left + right, add_special_tokens=False).ids
        if whole != bt.encode(left, add_special_tokens=False).ids + bt.encode(right, add_special_tokens=False).ids:
            return f"probe {left!r}|{right!r} tokenizes differently when cut"
    return None


def cut_points(text: str, n: int) -> list[int]:
    """Up to ``n - 1`` increasing indices ``i`` near ``k * len(text) / n`` with ``text[i] == " "``
    between two letters (``str.isalpha``: Unicode category L, as the regexes' letter class).

    Linear in ``len(text)``: each search starts where the previous one stopped.
    """
    out: list[int] = []
    start, size = 1, len(text)
    for k in range(1, n):
        i = text.find(" ", max(start, size * k // n))
        while i != -1 and not (i + 1 < size and text[i - 1].isalpha() and text[i + 1].isalpha()):
            i = text.find(" ", i + 1)
        if i == -1:
            break
        out.append(i)
        start = i + 1
    return out


def special_affixes(hf) -> Optional[tuple[list[int], list[int]]]:
    """The ids ``hf(text)`` puts before and after ``hf(text, add_special_tokens=False)`` for one
    text (a BOS, an EOS: the tokenizer's post-processor), or None when they are not the same for
    every probe. A text-completion prompt is then ``prefix + SegmentEncoder.encode(text) + suffix``.
    """
    found = None
    for probe in ("a", "hello world", "x <|im_start|> y\n", " 12 é"):
        full = list(hf(probe)["input_ids"])
        bare = _plain(hf, probe)
        n = len(bare)
        k = next((k for k in range(len(full) - n + 1) if full[k:k + n] == bare), None)
        if k is None:
            return None
        got = (full[:k], full[k + n:])
        if found is not None and got != found:
            return None
        found = got
    return found


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
        chunk_chars: characters per chunk of a long uncached piece; 0 never
            cuts pieces (`create` passes 0 when `chunking_unsupported_reason`
            objects).
        max_chunks: chunks per piece at most (default: the CPU count).

    Thread-safe: the gateway renders in a thread pool.
    """

    def __init__(self, hf, max_bytes: int = DEFAULT_CACHE_BYTES, chunk_chars: int = DEFAULT_CHUNK_CHARS,
                 max_chunks: Optional[int] = None):
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
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks or os.cpu_count() or 1
        self.chunked = 0  # pieces tokenized in several chunks
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
        chunk_reason = chunking_unsupported_reason(hf)
        if chunk_reason is not None:
            log.info("long pieces tokenize whole for this tokenizer: %s", chunk_reason)
        return cls(hf, max_bytes, DEFAULT_CHUNK_CHARS if chunk_reason is None else 0)

    def _chunks(self, piece: str) -> list[str]:
        """``piece`` cut at `cut_points` into about ``chunk_chars``-sized chunks (at most ``max_chunks``)."""
        n = min(self.max_chunks, len(piece) // self.chunk_chars) if self.chunk_chars > 0 else 1
        if n < 2:
            return [piece]
        bounds = [0, *cut_points(piece, n), len(piece)]
        return [piece[a:b] for a, b in zip(bounds, bounds[1:])]

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
        chunked = 0
        if missing:
            # One batch call even for one piece: the batch calls release the GIL
            # (``encode`` holds it, freezing the gateway's event loop for the ~30 ms
            # of a cold 30k-token piece), and the Rust side spreads the pieces and
            # chunks over its threads.
            batch: list[str] = []
            spans = []
            for p in missing:
                chunks = self._chunks(p)
                spans.append((len(batch), len(batch) + len(chunks)))
                batch += chunks
            encs = self._encode_batch(batch, add_special_tokens=False)
            for p, (a, b) in zip(missing, spans):
                if b - a == 1:
                    found[p] = encs[a].ids
                else:
                    found[p] = [i for e in encs[a:b] for i in e.ids]
                    chunked += 1
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
            self.chunked += chunked
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
        """Counters: entries, bytes, hits/misses in segments and in tokens, pieces tokenized in chunks."""
        return {"entries": len(self._lru), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens,
                "chunked": self.chunked}
