"""The backend's multi-entry prompt cache and its policy (one file, on purpose).

Entries are token sequences with the KV cache (mlx-lm per-layer cache objects)
holding exactly those tokens. Semantics follow mlx-lm's ``LRUPromptCache``
(reuse the longest entry that is a prefix of the prompt, or trim a longer
trimmable one), with these rules on top (``docs/cache-policy.md``):

1. An exact hit leaves one token to prefill: reuse is capped at
   ``len(prompt) - 1`` (ml-explore/mlx-lm PR 625).
2. ``reused`` is the number of prompt tokens actually served from the cache;
   the server reports it as ``cached_tokens`` (same PR).
3. An entry is replaced by the request that reused it only on a *good hit*:
   ``reused > max(min_hit_tokens, system_tokens)`` and
   ``reused / prompt_len > min_hit_ratio`` (exo PR 1817 / issue 1816), and
   the new prompt continues the entry's own prompt (it starts with all of
   the entry's prompt tokens: the same conversation, a retry or a
   regeneration, not a sibling that shares the system prompt plus a few
   tokens). A ``system`` entry is never replaced,
   so a shared system prompt survives every conversation built on it.
4. Non-trimmable caches (rotating windows, SSM state) are reused only when the
   entry is an exact prefix of the prompt (mlx-lm ``can_trim_prompt_cache``).
5. Budgets: an entry count and a byte budget; eviction picks the least
   recently used entry of the largest type group among assistant, user,
   system (mlx-lm's ``CacheOrder``), and ``trim_to`` lets the engine count
   in-flight requests' KV against the byte budget.
6. Shared prefixes outlive their conversations (opt-in, ``min_shared_tokens``
   > 0; measured in docs/benchmarks.md: within noise at tight budgets, a small loss
   with memory for the working set, likely because kept entries are shielded
   like system prompts by rule 5's grouping): when budget pressure evicts
   the last entry holding a prefix that at least two other prompts branched
   from (each diverged inside the entry's prompt, not in its generated tail,
   and reusing the prefix would not be a good hit by rule 3: both of those
   are the same conversation going on), and that prefix is at least
   ``min_shared_tokens`` long, the prefix stays as a ``system`` entry of its
   own: several conversations share it, as they share a system prompt. A
   radix cache keeps the shared inner node when it evicts a leaf (SGLang
   ``RadixCache.evict``); one branch is not enough here, because an edited
   or regenerated last message branches the same conversation once.

7. Storage (``layout="shared"``, the backend's default since session 28;
   ``"whole"`` is mlx-lm's one copy per entry): a prefix several entries share is
   held once. Each entry's KV is a chain of segments (per-layer K/V slices of a
   token range); a new entry that shares at least ``share_min_tokens`` with an
   entry stores only what follows, splitting the shared segment where the two
   diverge; a hit is materialised by concatenating its chain (a copy, as the
   whole layout's fetch copies). The byte budget counts each segment once; an
   eviction frees the segments no other entry's chain passes through. The
   design of SGLang's ``RadixCache`` and of exo's radix-trie KV prefix cache
   (exo-explore/exo issue 1986, PR 1929), under this file's entries and rules.
   Layers the ops cannot slice (rotating windows, SSM state) keep whole entries.

8. Disk tier (opt-in, ``disk``: a `backend.disktier.DiskTier`): an entry the
   budgets evict (rule 5) is written to disk instead of dropped (trimmable
   entries of at least ``share_min_tokens``), and its blocks stay owned; a
   prompt whose longest cached prefix is on disk, longer by at least
   ``share_min_tokens`` than the best in memory, reads that entry's KV back for
   the request (it stays on disk; the request's own save, extending it, then
   takes its place in memory). Files hold chains of parts, as rule 7's segments
   in memory: an entry that continues one on disk (the next turn of its
   conversation, written when the budget evicts it in turn) writes only its new
   tokens, and replaces the entry it continues. SGLang's HiCache and Dynamo's KV
   block manager offload evicted KV to slower tiers in the same way.

Every insert and every removal goes through `_add` / `_remove`, which call
the listener, so Redis sees each one (nothing leaves silently).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

log = logging.getLogger("mlxgw.backend.cache")

#: Seconds between two log lines about entries larger than the whole budget (`PromptCache.insert`).
OVERSIZE_LOG_EVERY = 60.0

CACHE_TYPES = ("assistant", "user", "system")
LAYOUTS = ("whole", "shared")


class Segment:
    """KV of tokens ``[start, end)`` of every prompt whose chain passes through it (rule 7).

    ``parts`` is what the ops stored for that range (per-layer K/V slices; a token count
    in the simulator), ``nbytes`` its size, ``parent`` the segment ending at ``start``
    (None at 0), ``refs`` the entries ending here plus the child segments.
    """

    __slots__ = ("start", "end", "parts", "nbytes", "parent", "refs")

    def __init__(self, start: int, end: int, parts, nbytes: int, parent: Optional["Segment"]):
        self.start, self.end, self.parts, self.nbytes, self.parent = start, end, parts, nbytes, parent
        self.refs = 0

    def chain_nbytes(self) -> int:
        """Bytes of this segment and its ancestors: the KV of an entry ending here."""
        return sum(x.nbytes for x in self.chain())

    def chain(self) -> list["Segment"]:
        """This segment and its ancestors, root first."""
        return root_first(self)


def root_first(node) -> list:
    """``node`` and its ancestors (``parent`` links), root first: a rule 7 segment's chain, or
    a disk tier part's (`backend.disktier`)."""
    out = []
    while node is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


class CacheListener(Protocol):
    """Receives every change of the cache's contents (the reporter implements it)."""

    def on_saved(self, entry: "CacheEntry") -> None: ...

    def on_evicted(self, entry: "CacheEntry") -> None: ...


@dataclass(eq=False)
class CacheEntry:
    """One cached prompt.

    Attributes:
        tokens: int32 array, the tokens whose keys/values ``kv`` holds.
        kv: mlx-lm per-layer cache objects (``make_prompt_cache`` shape);
            None when ``seg`` holds the KV (rule 7).
        nbytes: bytes of this entry's KV (with rule 7, of its whole chain,
            part of which other entries may share).
        cache_type: ``"system"`` (a shared system-prompt segment),
            ``"user"`` (a prompt saved before its answer) or ``"assistant"``
            (prompt plus generated tokens).
        trimmable: whether ``kv`` can be trimmed (reused for a shorter prefix).
        prompt_tokens: how many of ``tokens`` were the request's prompt (the
            rest were generated).
    """

    tokens: np.ndarray
    kv: Any
    nbytes: int
    cache_type: str
    trimmable: bool
    id: int = 0
    last_used: int = 0
    used_at: float = 0.0  # unix time (s) of last_used, for the gateway's placement (gateway.route)
    hits: int = 0
    prompt_tokens: int = 0
    branches: list = field(default_factory=list)  # rule 6: lengths where other prompts branched off, longest first
    shared_used: int = 0  # rule 6: clock of the last branch
    seg: Optional[Segment] = None  # rule 7: the last segment of this entry's chain (``kv`` is then None)
    on_disk: bool = False  # rule 8: an entry of the disk tier (its KV in a file, ``kv`` None)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class CacheHit:
    """What `PromptCache.fetch` found for a prompt.

    ``kv`` is a private copy already trimmed to ``reused`` tokens (None on a
    miss); ``entry_id`` names the entry it came from. ``read``: a disk-tier read
    still under way (``fetch(defer=True)``, rule 8): ``kv`` is None until
    `PromptCache.finish_read` (``read.done`` tells when). ``seg``: a hit pinned by
    reference (``fetch(by_reference=True)``, rule 7's layout): ``kv`` is None and the
    segment whose chain holds the ``reused`` tokens keeps a reference until
    `PromptCache.materialise` copies them out or `PromptCache.drop` lets it go.
    """

    kv: Any
    reused: int
    entry_id: Optional[int]
    entry_len: int = 0
    read: Any = None
    seg: Optional["Segment"] = None


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays, in tokens.

    Compared in windows growing 8x from 256 tokens, so two prompts that differ early cost
    a few hundred comparisons, not their whole length (the memory cache compares each prompt
    with every entry; 1,000 entries of 30k tokens that differ after their first 10k took
    44 ms comparing whole lengths, 31 ms in windows, on the test VM in session 34)."""
    n = min(a.shape[0], b.shape[0])
    start, width = 0, 256
    while start < n:
        end = min(n, start + width)
        diff = np.flatnonzero(a[start:end] != b[start:end])
        if diff.size:
            return start + int(diff[0])
        start, width = end, width * 8
    return n


def kv_nbytes(kv) -> int:
    return int(sum(c.nbytes for c in kv))


def kv_trimmable(kv) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return bool(can_trim_prompt_cache(kv))


def kv_trim(kv, n: int) -> None:
    from mlx_lm.models.cache import trim_prompt_cache

    if n > 0:
        trim_prompt_cache(kv, n)


class PromptCache:
    """Multi-entry prompt cache with the policy described in the module docstring.

    Args:
        max_entries: most entries kept (>= 1).
        max_bytes: byte budget of all entries' KV.
        min_hit_tokens: floor of a good hit, in tokens (exo uses 1000).
        min_hit_ratio: reused/prompt ratio a good hit must exceed.
        listener: told of every save and eviction.
        ops: KV operations (nbytes, trimmable, trim, copy, prefix); the
            defaults call mlx-lm; the simulated engine passes its own.
        min_shared_tokens: shortest shared prefix kept when its last entry
            is evicted (rule 6), tokens; 0 (the default) turns rule 6 off.
            The block size is the natural value: a shorter prefix cannot
            attract routing.
        layout: ``"whole"`` (one KV copy per entry, mlx-lm's way) or
            ``"shared"`` (rule 7: a shared prefix held once).
        share_min_tokens: with ``"shared"``, the shortest common prefix an
            entry shares instead of holding its own copy, tokens (shorter
            ones would only add segments to concatenate); also the shortest
            entry rule 8 writes to disk, the least gain of a disk read, and the
            least reuse that counts as a use of an entry (its LRU recency).
        disk: rule 8's disk tier (`backend.disktier.DiskTier`), or None.

    Raises ValueError for ``max_entries < 1`` or an unknown layout.
    Not thread-safe: the engine thread owns it.
    """

    def __init__(
        self,
        max_entries: int = 64,
        max_bytes: int = 1 << 62,
        min_hit_tokens: int = 1000,
        min_hit_ratio: float = 0.5,
        listener: Optional[CacheListener] = None,
        ops: Optional["KVOps"] = None,
        min_shared_tokens: int = 0,
        layout: str = "whole",
        share_min_tokens: int = 32,
        disk: Any = None,
    ):
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown cache layout {layout!r} (one of {', '.join(LAYOUTS)})")
        self.layout = layout
        self.share_min_tokens = max(1, share_min_tokens)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_hit_tokens = min_hit_tokens
        self.min_hit_ratio = min_hit_ratio
        self.listener = listener
        self.ops = ops or KVOps()
        self.disk = disk
        self.min_shared_tokens = min_shared_tokens
        self.shared_kept = 0  # rule 6: prefixes kept as their own entry
        self.evictions = 0  # entries evicted by the budgets (rule 5), since start
        # Entries larger than the whole byte budget, never kept in memory (`insert`), since start;
        # said in the log at most once a minute (`OVERSIZE_LOG_EVERY`).
        self.oversize = 0
        self._oversize_said = float("-inf")
        self.version = 0  # bumped by every new entry (a pinned lookup may be bettered)
        self.evicted_tokens = 0
        self._entries: dict[int, CacheEntry] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.nbytes = 0

    # -- queries ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def get(self, entry_id: int) -> Optional[CacheEntry]:
        return self._entries.get(entry_id)

    def best_match(self, prompt) -> tuple[Optional[CacheEntry], int]:
        """The entry serving the longest prefix of ``prompt`` and that length.

        The length is capped at ``len(prompt) - 1`` (rule 1). Ties go to the
        shorter entry (no trim needed, and a shared system entry wins over a
        conversation that extends it).
        """
        p = np.asarray(prompt, dtype=np.int32)
        cap = len(p) - 1
        best, best_n = None, 0
        for e in self._entries.values():
            c = common_prefix(e.tokens, p)
            if e.trimmable:
                n = min(c, cap)
            else:
                # Rule 4: only an exact prefix, and never the whole prompt.
                n = len(e) if (c == len(e) and len(e) <= cap) else 0
            if n > best_n or (n == best_n and n > 0 and best is not None and len(e) < len(best)):
                best, best_n = e, n
        return best, best_n

    def fetch(self, prompt, defer: bool = False, by_reference: bool = False) -> CacheHit:
        """Find the best entry for ``prompt`` and return a trimmed private copy.

        Returns a `CacheHit` with ``reused`` tokens (0 and ``kv=None`` on a
        miss). The entry's recency is refreshed when the hit reuses at least
        ``share_min_tokens`` (a block): the chat template's opening tokens, which
        every prompt shares, refreshed whichever entry served them, so an abandoned
        conversation outlived active ones (helper-73). With a disk tier (rule 8), an
        entry there serving at least ``share_min_tokens`` more of the prompt than
        memory does is read instead: in this thread, or with ``defer`` by the
        tier's reader thread (the hit's ``read``; `finish_read` completes it).

        ``by_reference``: for an entry held as a chain of segments (rule 7), take a
        reference to the chain's first ``reused`` tokens instead of a copy (the hit's
        ``seg``, the segment ending at ``reused``, split off in place when needed; no bytes
        added: they stay counted in the cache, and an eviction frees them only once the
        reference is gone). A waiting request pins
        its hit this way, as SGLang locks the radix nodes of a request's prefix; it
        must end with `materialise` or `drop`. Entries of the ``whole`` layout are copied.
        """
        e, n = self.best_match(prompt)
        if self.disk is not None:
            for x in self.disk.reap():  # background writes that failed: those prefixes are gone
                self._tell_evicted(x)
        if self.disk is not None and len(self.disk):
            d, nd = self.disk.best_match(np.asarray(prompt, dtype=np.int32))
            if d is not None and nd >= n + self.share_min_tokens:
                job = self.disk.read_async(d, nd, next(self._clock)) if defer else None
                if job is not None:
                    return CacheHit(None, nd, d.id, len(d), read=job)
                kv, gone = self.disk.read(d, nd, next(self._clock))
                if kv is not None:  # holding the nd tokens
                    return CacheHit(kv, nd, d.id, len(d))
                for x in gone:  # unreadable: dropped, their prefixes no longer here
                    self._tell_evicted(x)
        if e is None or n == 0:
            return CacheHit(None, 0, None)
        if e.seg is not None and by_reference:
            # The chain cut at n (a split in place when n falls inside a segment): a pin holds
            # only the tokens it reuses. Holding the whole segment kept up to the entry's length
            # once it was evicted: a request reusing a conversation's 512-token first block
            # pinned a 20k-token segment (measured: fewer hits than copies, session 36).
            seg = self._node_at(e.seg, n)
            seg.refs += 1
            hit = CacheHit(None, n, e.id, len(e), seg=seg)
        elif e.seg is not None:
            hit = CacheHit(self._materialise(e.seg, n), n, e.id, len(e))
        else:
            kv = self.ops.copy(e.kv)
            self.ops.trim(kv, len(e) - n)
            hit = CacheHit(kv, n, e.id, len(e))
        if n >= self.share_min_tokens:  # a use (the backend's `hits` counter has the same floor)
            self._touch(e)
            e.hits += 1
        return hit

    def finish_read(self, hit: CacheHit) -> CacheHit:
        """Complete a deferred disk-tier read (``hit.read``, done): the hit with its KV, trimmed
        to ``hit.reused``, or a miss when the read failed (the entry is then dropped and the
        listener told; the caller may `fetch` again for what memory holds). Engine thread."""
        kv, gone = self.disk.finish(hit.read)
        for x in gone:
            self._tell_evicted(x)
        if kv is None:
            return CacheHit(None, 0, None)
        return CacheHit(kv, hit.reused, hit.entry_id, hit.entry_len)

    def materialise(self, hit: CacheHit) -> CacheHit:
        """The hit with its KV: a hit pinned by reference (``hit.seg``) gets a private copy of
        its ``reused`` tokens and lets go of its reference (the segments are freed then if no
        entry holds them any more); any other hit is returned as it is. Engine thread."""
        if hit.seg is None:
            return hit
        kv = self._materialise(hit.seg, hit.reused)
        self.drop(hit)
        return CacheHit(kv, hit.reused, hit.entry_id, hit.entry_len)

    def drop(self, hit: Optional[CacheHit]) -> None:
        """Let go of a hit pinned by reference without using it (a request cancelled while it
        waited, or given a longer hit); nothing for other hits or None. Engine thread."""
        if hit is not None and hit.seg is not None:
            seg, hit.seg = hit.seg, None
            self._release(seg)

    def added_nbytes(self, tokens, kv, common: Optional[dict[int, int]] = None) -> int:
        """Bytes that saving ``kv`` (holding ``tokens``) would add to the cache: all of its
        bytes, or with rule 7 those of the tokens after the longest prefix a held chain
        shares (when at least ``share_min_tokens``). The engine's free-space checks use it.
        ``common``: entry id -> common prefix with ``tokens``, when the caller has it."""
        n = self.ops.nbytes(kv)
        if self.layout != "shared" or not self.ops.trimmable(kv) or not self.ops.sliceable(kv):
            return n
        t = np.asarray(tokens, dtype=np.int32)
        if common is None:
            common = {e.id: common_prefix(e.tokens, t) for e in self._entries.values()}
        c = self._sharing(common)[1]
        return n * (len(t) - c) // len(t) if len(t) else n

    def is_good_hit(self, reused: int, prompt_len: int, system_tokens: int) -> bool:
        """Rule 3 (exo PR 1817): may the request that reused an entry replace it?"""
        if prompt_len <= 0:
            return False
        return (
            reused > max(self.min_hit_tokens, system_tokens)
            and reused / prompt_len > self.min_hit_ratio
        )

    # -- updates ---------------------------------------------------------
    def insert(
        self,
        tokens,
        kv,
        cache_type: str = "assistant",
        *,
        reused_from: Optional[int] = None,
        reused: int = 0,
        prompt_len: int = 0,
        system_tokens: int = 0,
    ) -> Optional[CacheEntry]:
        """Save ``kv`` (holding exactly ``tokens``) as an entry.

        Args:
            tokens: token ids held by ``kv`` (prompt, plus generated tokens for
                ``assistant`` entries).
            kv: the request's KV cache; the cache takes ownership.
            cache_type: one of `CACHE_TYPES`.
            reused_from / reused / prompt_len / system_tokens: how the request
                used the cache (decides rule 3); ``prompt_len`` also records
                how much of ``tokens`` was prompt.

        Returns:
            The new entry, or None when nothing was saved in memory (empty
            tokens or an entry larger than the whole byte budget: with a disk
            tier, rule 8, that one is written there instead).
        """
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"unknown cache type {cache_type!r}")
        t = np.asarray(tokens, dtype=np.int32)
        if t.shape[0] == 0:
            return None
        nbytes = self.ops.nbytes(kv)
        trimmable = self.ops.trimmable(kv)
        if nbytes > self.max_bytes:
            self.oversize += 1
            self._say_oversize(len(t), nbytes)
            self.save_to_disk(t, kv, cache_type, prompt_len)
            return None

        # Each entry's common prefix with the new tokens, computed once for
        # the dedupe, rule 6 and the redundant-prefix drop below.
        common = {e.id: common_prefix(e.tokens, t) for e in self._entries.values()}

        # Same tokens already cached: keep one entry, refresh it.
        for e in self._entries.values():
            if len(e) == len(t) and common[e.id] == len(t):
                self._touch(e)
                if e.cache_type != "system" and cache_type == "system":
                    e.cache_type = "system"
                return e

        # Rule 6 bookkeeping, before rules 3 and the redundant-prefix drop
        # remove the entries this one continues (it inherits their marks).
        branches, shared_used = [], 0
        now = next(self._clock)
        for e in self._entries.values():
            c = common[e.id]
            if c >= e.prompt_tokens:  # continues e's prompt: same conversation
                branches += e.branches
                shared_used = max(shared_used, e.shared_used)
            elif c >= max(1, self.min_shared_tokens) and not self.is_good_hit(c, len(t), 0):
                # A sibling: it branches inside e's prompt, and reusing c tokens
                # would not be a good hit (rule 3 would call that a continuation).
                e.branches, e.shared_used = _longest(e.branches + [c]), now
                branches.append(min(c, len(t) - 1))
                shared_used = now

        # Rule 7: hold only what no entry holds yet, before rule 3 and the redundant-prefix
        # drop remove the entries this one continues (their segments become its chain).
        seg = None
        if self.layout == "shared" and trimmable and self.ops.sliceable(kv):
            seg = self._store(t, kv, common)
            nbytes = seg.chain_nbytes()
            kv = None

        for e in self._displaced(t, common, trimmable, reused_from, reused, prompt_len, system_tokens):
            self._remove(e)

        entry = CacheEntry(
            tokens=t,
            kv=kv,
            nbytes=nbytes,
            cache_type=cache_type,
            trimmable=trimmable,
            id=next(self._ids),
            last_used=next(self._clock),
            used_at=time.time(),
            prompt_tokens=min(prompt_len, len(t)) if prompt_len else len(t),
            branches=_longest(branches),
            shared_used=shared_used,
            seg=seg,
        )
        # Rule 8: disk entries this one extends stay there until it is written to disk in turn,
        # as the start of its chain (only its new tokens are written; `DiskTier.put`).
        self._add(entry)
        self.trim_to(max_entries=self.max_entries, max_bytes=self.max_bytes, keep=entry)
        return entry if entry.id in self._entries else None

    def _displaced(self, t: np.ndarray, common: dict[int, int], trimmable: bool, reused_from: Optional[int],
                   reused: int, prompt_len: int, system_tokens: int) -> list[CacheEntry]:
        """The entries saving ``t`` removes (``common``: entry id -> common prefix with ``t``;
        the other arguments as `insert`'s): the reused entry it replaces (rule 3) and the
        conversation entries it extends."""
        out = []
        # Rule 3: replace the reused entry only on a good hit.
        if reused_from is not None and reused_from in self._entries:
            old = self._entries[reused_from]
            if (
                old.cache_type != "system"
                # The new tokens continue old's whole prompt. Not `reused >=
                # old.prompt_tokens`: rule 1 caps an exact repeat's reuse one
                # token short, so a retry or regeneration would never replace
                # its entry and each one kept a full copy of the prompt.
                and common[old.id] >= old.prompt_tokens
                and self.is_good_hit(reused, prompt_len, system_tokens)
            ):
                out.append(old)
        # A trimmable entry serves every prefix of itself, so conversation
        # entries it extends only take space (mlx-lm drops them too). System
        # entries stay: they outlive any one conversation in the LRU.
        if trimmable:
            out += [e for e in self._entries.values()
                    if e.cache_type != "system" and len(e) < len(t) and common[e.id] == len(e) and e not in out]
        return out

    def fits_beside(self, tokens, kv, free_bytes: int, *, reused_from: Optional[int] = None, reused: int = 0,
                    prompt_len: int = 0, system_tokens: int = 0) -> bool:
        """True if saving ``kv`` (holding ``tokens``; the other arguments as `insert`'s) evicts
        nothing: the entry count stays within ``max_entries`` and the bytes it adds within
        ``free_bytes``, counting what the save itself removes (the entry it replaces, rule 3,
        and the entries it extends). A conversation's next turn replacing its own entry in a
        full cache fits (helper-60: an abandoned turn was not saved once 64 entries were held)."""
        t = np.asarray(tokens, dtype=np.int32)
        common = {e.id: common_prefix(e.tokens, t) for e in self._entries.values()}
        if any(len(e) == len(t) and common[e.id] == len(t) for e in self._entries.values()):
            return True  # already held: the save only refreshes it
        gone = self._displaced(t, common, self.ops.trimmable(kv), reused_from, reused, prompt_len, system_tokens)
        added = self.added_nbytes(t, kv, common) - sum(e.nbytes for e in gone if e.seg is None)
        return added <= free_bytes and len(self._entries) - len(gone) < self.max_entries

    def trim_to(
        self,
        *,
        max_entries: Optional[int] = None,
        max_bytes: Optional[int] = None,
        keep: Optional[CacheEntry] = None,
    ) -> int:
        """Evict until within ``max_entries`` and ``max_bytes``; returns entries evicted.

        Only these evictions count in ``evictions`` / ``evicted_tokens`` (a
        backend whose counts stay 0 had memory for everything it saw);
        replacements by rule 3 and dropped redundant prefixes do not.

        ``keep`` is evicted last (the entry just saved). The engine calls this
        with ``max_bytes = budget - in_flight_bytes`` so live requests' KV
        counts against the budget. For the byte budget only entries whose removal
        frees bytes are evicted (`_frees`): a chain whose last segment another
        entry's chain or a waiting request's pinned hit also holds stays, since
        evicting it would lose the entry and free nothing.
        """
        n = 0
        max_entries = self.max_entries if max_entries is None else max_entries
        max_bytes = self.max_bytes if max_bytes is None else max_bytes
        while self._entries and (len(self._entries) > max_entries or self.nbytes > max_bytes):
            victim = self._pick_victim(keep, frees_only=len(self._entries) <= max_entries)
            if victim is None:
                break
            self._spill(victim)
            self._keep_shared_prefix(victim)
            self._remove(victim)
            n += 1
            self.evictions += 1
            self.evicted_tokens += len(victim)
        return n

    def save_to_disk(self, tokens, kv, cache_type: str = "assistant", prompt_len: int = 0, *, cuts=(),
                     used_at: Optional[float] = None, hits: int = 0) -> Optional[CacheEntry]:
        """Rule 8: save ``kv`` (holding exactly ``tokens``) straight to the disk tier: an entry
        larger than the whole memory budget, one the engine keeps only if it fits in free
        memory (an abandoned request's), or a saved entry a restart's smaller memory budget
        leaves out (`backend.persist.restore`; ``cuts``: its segment starts, ``used_at`` /
        ``hits`` as saved). Most recently used in the tier. Returns the tier entry; None
        without a tier, for a non-trimmable KV or one shorter than ``share_min_tokens``, or
        when the write failed."""
        t = np.asarray(tokens, dtype=np.int32)
        if self.disk is None or len(t) < self.share_min_tokens or not self.ops.trimmable(kv):
            return None
        e = CacheEntry(tokens=t, kv=None, nbytes=self.ops.nbytes(kv), cache_type=cache_type, trimmable=True,
                       id=next(self._ids), last_used=next(self._clock),
                       used_at=time.time() if used_at is None else used_at, hits=hits,
                       prompt_tokens=min(prompt_len, len(t)) if prompt_len else len(t))
        return self._to_disk(e, kv, cuts)

    def _spill(self, victim: CacheEntry) -> None:
        """Rule 8: write ``victim`` (being evicted) to the disk tier, before it leaves memory,
        so its blocks never leave Redis in between."""
        if self.disk is None or not victim.trimmable or len(victim) < self.share_min_tokens:
            return
        kv = self._materialise(victim.seg, len(victim)) if victim.seg is not None else victim.kv
        if kv is not None:
            # Parts cut where the memory chain's segments start (other prompts branched there).
            self._to_disk(victim, kv, [x.start for x in victim.seg.chain()] if victim.seg is not None else [])

    def _to_disk(self, entry: CacheEntry, kv, cuts=()) -> Optional[CacheEntry]:
        # The prompt's end is a cut too: the next turn re-renders the generated tail its own way.
        d, dropped = self.disk.put(entry, kv, [*cuts, entry.prompt_tokens], min_share=self.share_min_tokens)
        if d is not None and self.listener is not None:  # before the drops: its prefixes never leave Redis
            self.listener.on_saved(d)
        for x in dropped + self.disk.reap():
            self._tell_evicted(x)
        return d

    def announce_disk(self) -> None:
        """Tell the listener of the disk tier's entries adopted from an earlier run (rule 8),
        as `backend.persist.restore` does for the memory entries it restores."""
        if self.disk is not None and self.listener is not None:
            for d in self.disk.entries():
                self.listener.on_saved(d)

    def _tell_evicted(self, e: CacheEntry) -> None:
        if self.listener is not None:
            self.listener.on_evicted(e)

    def _keep_shared_prefix(self, victim: CacheEntry) -> None:
        """Rule 6: save ``victim``'s shared prefix as an entry of its own.

        Only when no other entry still serves that prefix, and before the
        victim is removed, so its blocks never leave Redis in between.
        """
        # The longest prefix two other prompts branched from (at or past it).
        n = victim.branches[1] if len(victim.branches) > 1 else 0
        if not self.min_shared_tokens or n < self.min_shared_tokens or n >= len(victim) or not victim.trimmable:
            return
        head = victim.tokens[:n]
        for e in self._entries.values():
            if e is not victim and e.trimmable and len(e) >= n and common_prefix(e.tokens, head) == n:
                return
        if victim.seg is not None:  # rule 7: the kept prefix is the victim's chain up to n
            kv, seg = None, self._node_at(victim.seg, n)
            seg.refs += 1
            nbytes = seg.chain_nbytes()
        else:
            kv, seg = self.ops.prefix(victim.kv, len(victim), n), None
            nbytes = self.ops.nbytes(kv)
        kept = CacheEntry(
            tokens=head.copy(), kv=kv, nbytes=nbytes, cache_type="system", trimmable=True,
            id=next(self._ids), last_used=max(victim.last_used, victim.shared_used), used_at=victim.used_at,
            prompt_tokens=n, seg=seg,
        )
        victim.kv = None  # ``prefix`` may have taken it over
        self._add(kept)
        self.shared_kept += 1

    # -- restore (backend.persist) ------------------------------------------
    def restore_segment(self, start: int, end: int, parts, parent: Optional[Segment]) -> Segment:
        """A segment read back from disk (tokens ``[start, end)`` under ``parent``); its bytes
        count against the budget from now on. Referenced by the child segments and entries
        restored after it (`restore_entry`)."""
        seg = Segment(start, end, parts, self.ops.parts_nbytes(parts), parent)
        if parent is not None:
            parent.refs += 1
        self.nbytes += seg.nbytes
        return seg

    def restore_entry(self, tokens, cache_type: str, *, kv=None, seg: Optional[Segment] = None,
                      prompt_tokens: int = 0, used_at: float = 0.0, hits: int = 0,
                      branches: Optional[list] = None) -> CacheEntry:
        """Add an entry read back from disk as it was saved (no rule 3 replacement, no dedupe):
        the KV in ``kv`` (whole layout) or the chain ending at ``seg`` (rule 7, from
        `restore_segment`). Restored in least recently used order, so the LRU order survives.
        The listener hears of it like any save. Raises ValueError when the KV does not hold
        exactly ``tokens`` (a damaged file)."""
        t = np.asarray(tokens, dtype=np.int32)
        if cache_type not in CACHE_TYPES or (seg is None) == (kv is None):
            raise ValueError("an entry needs a cache type and exactly one of kv / seg")
        if seg is not None and seg.end != len(t):
            raise ValueError(f"segment chain ends at {seg.end}, the entry holds {len(t)} tokens")
        if seg is not None:
            seg.refs += 1
        e = CacheEntry(
            tokens=t, kv=kv, nbytes=seg.chain_nbytes() if seg is not None else self.ops.nbytes(kv),
            cache_type=cache_type, trimmable=True if seg is not None else self.ops.trimmable(kv),
            id=next(self._ids), last_used=next(self._clock), used_at=used_at, hits=hits,
            prompt_tokens=min(prompt_tokens, len(t)) or len(t), branches=_longest(branches or []), seg=seg,
        )
        self._add(e)
        return e

    def clear(self, disk: bool = True) -> None:
        """Evict everything, with ``disk`` the disk tier's entries too (each eviction reported)."""
        for e in list(self._entries.values()):
            self._remove(e)
        if disk and self.disk is not None:
            for d in self.disk.clear():
                self._tell_evicted(d)

    def victim_used_at(self) -> float:
        """Unix time (s) the next eviction victim was last used; 0.0 when the cache is empty.

        The gateway places a cold prompt where the budget would evict the
        least recently used entry (gateway.route). Safe to call from another
        thread: it works on a snapshot of the entries.
        """
        v = _victim(list(self._entries.values()), None)
        return v.used_at if v is not None else 0.0

    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache per cached token, averaged over the entries (0.0 when empty)."""
        entries = list(self._entries.values())
        n = sum(len(e) for e in entries)
        return sum(e.nbytes for e in entries) / n if n else 0.0

    def _say_oversize(self, tokens: int, nbytes: int) -> None:
        """Log (at most once per `OVERSIZE_LOG_EVERY` s) that an entry of ``tokens`` tokens and
        ``nbytes`` bytes of KV is larger than the whole byte budget: helper-73 sent a 7k-token
        prompt three times past a 3 MB budget and saw three full prefills, no counter move
        and no line."""
        now = time.monotonic()
        if now - self._oversize_said < OVERSIZE_LOG_EVERY:
            return
        self._oversize_said = now
        from mlxgw.util import size_text

        where = "written to the disk tier instead" if self.disk is not None else "so its next turn is computed again"
        log.warning("a %d-token prompt's KV (%s) is larger than the whole prompt-cache budget (%s --cache-bytes): "
                    "not kept in memory, %s; raise --cache-bytes to cache prompts this long (%d such so far: "
                    "cache_oversize in /health)", tokens, size_text(nbytes), size_text(self.max_bytes), where,
                    self.oversize)

    def _touch(self, e: CacheEntry) -> None:
        e.last_used = next(self._clock)
        e.used_at = time.time()

    def _pick_victim(self, keep: Optional[CacheEntry], frees_only: bool = False) -> Optional[CacheEntry]:
        entries = self._entries.values()
        if frees_only:
            entries = [e for e in entries if _frees(e)]
            if keep is not None and not _frees(keep):
                keep = None
        return _victim(entries, keep)

    def _add(self, e: CacheEntry) -> None:
        self._entries[e.id] = e
        if e.seg is None:  # a chain's bytes were counted as its segments were stored
            self.nbytes += e.nbytes
        self.version += 1
        if self.listener is not None:
            self.listener.on_saved(e)

    def _remove(self, e: CacheEntry) -> None:
        if self._entries.pop(e.id, None) is None:
            return
        if e.seg is not None:
            self._release(e.seg)
        else:
            self.nbytes -= e.nbytes
        if self.listener is not None:
            self.listener.on_evicted(e)
        e.kv = None
        e.seg = None

    # -- rule 7: segments --------------------------------------------------
    def _store(self, t: np.ndarray, kv, common: dict[int, int]) -> Segment:
        """Store ``kv`` (holding exactly ``t``) as a chain: the longest prefix an entry's chain
        already holds (at least ``share_min_tokens``) is shared, the rest copied into a new
        segment. Returns the chain's last segment with one reference taken for the entry."""
        best, c = self._sharing(common)
        node = self._node_at(best.seg, c) if best is not None else None
        if c < len(t):
            parts = self.ops.slice(kv, c, len(t))
            tail = Segment(c, len(t), parts, self.ops.parts_nbytes(parts), node)
            if node is not None:
                node.refs += 1
            self.nbytes += tail.nbytes
        else:
            tail = node  # the new tokens are a prefix of a held chain: nothing to store
        tail.refs += 1
        return tail

    def _sharing(self, common: dict[int, int]) -> tuple[Optional[CacheEntry], int]:
        """The entry whose chain a new prompt shares most of, and how many tokens (``common``:
        entry id -> common prefix with the prompt); ``(None, 0)`` below ``share_min_tokens``."""
        best, c = None, 0
        for e in self._entries.values():
            if e.seg is not None and common[e.id] > c:
                best, c = e, common[e.id]
        return (best, c) if c >= self.share_min_tokens else (None, 0)

    def _node_at(self, seg: Segment, n: int) -> Segment:
        """The segment of ``seg``'s chain that ends at token ``n`` (0 < n <= seg.end), splitting
        the one that spans ``n`` in place: it keeps its children and becomes ``[n, end)``
        under a new parent ``[start, n)``."""
        while seg.start >= n:
            seg = seg.parent
        if seg.end == n:
            return seg
        left, right = self.ops.split_parts(seg.parts, n - seg.start)
        lb, rb = self.ops.parts_nbytes(left), self.ops.parts_nbytes(right)
        head = Segment(seg.start, n, left, lb, seg.parent)
        head.refs = 1
        self.nbytes += lb + rb - seg.nbytes
        seg.start, seg.parts, seg.nbytes, seg.parent = n, right, rb, head
        return head

    def _release(self, seg: Optional[Segment]) -> None:
        """Drop one reference to ``seg``; free it, and so on up its chain, when none is left."""
        while seg is not None:
            seg.refs -= 1
            if seg.refs > 0:
                return
            self.nbytes -= seg.nbytes
            parent, seg.parts, seg.parent = seg.parent, None, None
            seg = parent

    def _materialise(self, seg: Segment, n: int):
        """A private KV cache holding the first ``n`` tokens of ``seg``'s chain (a copy)."""
        pieces = [(x.parts, min(x.end, n) - x.start) for x in seg.chain() if x.start < n]
        return self.ops.join(pieces, n)


def file_xxh3(path) -> str:
    """xxh3-128 (hex) of a file's bytes, read in 8 MiB chunks."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


#: Metadata ``format`` of the disk tier's host-written KV files (`KVOps.write_host`).
HOST_FORMAT = "mlxgw-kv-1"


@dataclass
class HostKV:
    """A host (numpy) copy of a KV cache's plain layers (`KVOps.to_host`); ``dtype`` is the
    safetensors name (``BF16``, ``F16``, ``F32``)."""

    layers: list
    dtype: str


@functools.lru_cache(maxsize=1)
def _dtype_names() -> dict:
    """mlx dtype -> safetensors dtype name, for the KV dtypes `KVOps.to_host` copies (mlx is
    imported on first use, as everywhere in this module)."""
    import mlx.core as mx

    return {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}


def _frees(e: CacheEntry) -> bool:
    """True if removing ``e`` frees bytes: an entry of the ``whole`` layout always; a chain
    (rule 7) when nothing else holds its last segment (a longer entry's chain passing
    through it, or a waiting request's hit pinned by reference: `PromptCache.fetch`)."""
    return e.seg is None or e.seg.refs <= 1


def _victim(entries, keep: Optional[CacheEntry]) -> Optional[CacheEntry]:
    # mlx-lm's CacheOrder: take from the largest group, ties in the order
    # assistant, user, system; within a group the least recently used.
    groups = {t: [] for t in CACHE_TYPES}
    for e in entries:
        if e is not keep:
            groups[e.cache_type].append(e)
    if not any(groups.values()):
        return keep
    kind = max(CACHE_TYPES, key=lambda t: (len(groups[t]), -CACHE_TYPES.index(t)))
    return min(groups[kind], key=lambda e: e.last_used)


def _longest(lengths: list) -> list:
    """Rule 6 keeps the longest few branch lengths (two decide; a few spare)."""
    return sorted(lengths, reverse=True)[:4]


def _compact(x):
    """A copy of ``x`` (a token slice of a ``(batch, kv_heads, tokens, head_dim)`` array) in a
    buffer of its own, so the buffer it was cut from can be freed. ``mx.contiguous`` copies a
    slice along the token axis only when it is not row contiguous already: with one sequence and
    one KV head (MQA models) it returns a view that keeps the whole buffer alive (measured with
    ``np.shares_memory``), so those get an explicit ``mx.array`` copy."""
    import mlx.core as mx

    return mx.array(x) if x.shape[0] * x.shape[1] == 1 else mx.contiguous(x)


class KVOps:
    """KV-cache operations the cache needs, backed by mlx-lm's cache functions.

    Rule 7's segments (``sliceable`` .. ``join``) hold plain ``KVCache`` layers as
    per-layer ``(keys, values)`` arrays of shape ``(batch, kv_heads, tokens, head_dim)``.
    """

    def sliceable(self, kv) -> bool:
        """True when every layer is a plain mlx-lm ``KVCache`` holding keys (rule 7)."""
        from mlx_lm.models.cache import KVCache

        return bool(kv) and all(type(c) is KVCache and c.keys is not None for c in kv)

    def slice(self, kv, start: int, end: int):
        """Compact copies of tokens ``[start, end)`` of each layer: ``[(keys, values)]``."""
        import mlx.core as mx

        parts = [(_compact(c.keys[..., start:end, :]), _compact(c.values[..., start:end, :])) for c in kv]
        mx.eval([a for kvs in parts for a in kvs])
        return parts

    def parts_nbytes(self, parts) -> int:
        return int(sum(k.nbytes + v.nbytes for k, v in parts))

    def split_parts(self, parts, at: int):
        """``parts`` cut at token ``at``: (compact copies of the first ``at``, of the rest)."""
        import mlx.core as mx

        left = [(_compact(k[..., :at, :]), _compact(v[..., :at, :])) for k, v in parts]
        right = [(_compact(k[..., at:, :]), _compact(v[..., at:, :])) for k, v in parts]
        mx.eval([a for kvs in left + right for a in kvs])
        return left, right

    def join(self, pieces, n: int):
        """A new list of ``KVCache`` holding ``n`` tokens: the first ``count`` tokens of each
        ``(parts, count)`` in ``pieces``, concatenated in order."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        out = []
        for layer in range(len(pieces[0][0])):
            c = KVCache()
            c.keys = mx.concatenate([p[layer][0][..., :m, :] for p, m in pieces], axis=2)
            c.values = mx.concatenate([p[layer][1][..., :m, :] for p, m in pieces], axis=2)
            c.offset = n
            out.append(c)
        mx.eval([a for c in out for a in (c.keys, c.values)])
        return out

    # Persistence (backend.persist): a segment's parts as one safetensors file of per-layer
    # keys/values; a whole entry's KV through mlx-lm's own prompt-cache file format.
    def save_parts(self, parts, path: str) -> None:
        """Write a segment's ``[(keys, values)]`` to ``path`` (a ``.safetensors`` file)."""
        import mlx.core as mx

        mx.save_safetensors(path, {f"{i}.{n}": a for i, kv in enumerate(parts) for n, a in zip("kv", kv)})

    def load_parts(self, path: str):
        """Read `save_parts`' file back (arrays evaluated, the file closed)."""
        import mlx.core as mx

        d = mx.load(path)
        parts = [(d[f"{i}.k"], d[f"{i}.v"]) for i in range(len(d) // 2)]
        mx.eval([a for kv in parts for a in kv])
        return parts

    def save_kv(self, kv, path: str) -> None:
        """Write a whole entry's KV (any mlx-lm cache types) with ``mlx_lm``'s ``save_prompt_cache``."""
        from mlx_lm.models.cache import save_prompt_cache

        save_prompt_cache(path, kv)

    def load_kv(self, path: str, prefetched: bool = False):
        """Read a file of `save_kv` or `write_host` back as a list of mlx-lm cache layers
        (arrays evaluated: read now, not at the first hit). ``prefetched``: `prefetch` read it
        moments ago (the sim then models no disk time)."""
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache

        arrays, meta = mx.load(path, return_metadata=True)
        if meta.get("format") == HOST_FORMAT:
            kv = self._layers([(arrays[f"{i}.k"], arrays[f"{i}.v"]) for i in range(len(arrays) // 2)])
        else:
            del arrays
            kv = load_prompt_cache(path)
        mx.eval([c.state for c in kv])
        return kv

    # The disk tier's write-behind (backend.disktier): the engine thread hands numpy views of
    # the KV's buffers to a writer thread, which writes them with no MLX call (MLX stays on
    # the engine thread).
    def to_host(self, kv):
        """Plain ``KVCache`` layers as host (numpy) arrays for the writer thread: ``[(keys,
        values)]`` of shape ``(batch, kv_heads, tokens, head_dim)`` (bfloat16 as its uint16
        bits) plus the dtype name; None for other layer types (the caller writes those with
        `save_kv`). Zero-copy where it can be: each array is a view of the evaluated mlx
        buffer (which it keeps alive; the cache never changes an evicted entry's arrays), so
        the engine thread copies nothing; only a layer whose buffer runs past its ``offset``
        (mlx-lm grows buffers in steps) is made contiguous first. (A fresh numpy copy cost
        first-touch page faults: 6 s for 2.25 GiB on the test VM, bench/disk_tier.py.)"""
        if not self.sliceable(kv):
            return None
        import mlx.core as mx

        dtype = kv[0].keys.dtype
        if dtype not in _dtype_names() or any(c.keys.dtype != dtype or c.values.dtype != dtype for c in kv):
            return None

        def host(a, n):
            if a.shape[2] != n:
                a = mx.contiguous(a[..., :n, :])
            if dtype == mx.bfloat16:
                a = a.view(mx.uint16)  # same bytes; numpy has no bfloat16
            mx.eval(a)
            return np.asarray(memoryview(a))

        return HostKV([(host(c.keys, c.offset), host(c.values, c.offset)) for c in kv], _dtype_names()[dtype])

    def host_nbytes(self, host) -> int:
        return int(sum(k.nbytes + v.nbytes for k, v in host.layers))

    def host_slice(self, host, start: int, end: int, copy: bool = False):
        """Tokens ``[start, end)`` of a `to_host` copy: views (`write_host` makes each contiguous
        as it writes it, in the writer thread), or with ``copy`` arrays of their own, so the
        views' whole buffers need not stay alive until the write (the disk tier copies a slice
        that is a small part of its entry: the next turn of a long conversation)."""
        cut = (lambda a: np.ascontiguousarray(a[:, :, start:end, :])) if copy else (lambda a: a[:, :, start:end, :])
        return HostKV([(cut(k), cut(v)) for k, v in host.layers], host.dtype)

    def kv_parts(self, kv):
        """Plain ``KVCache`` layers holding exactly their tokens (`load_kv`, `from_host`) as
        ``[(keys, values)]``, the pieces `join` concatenates."""
        return [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in kv]

    def write_host(self, host, path: str) -> str:
        """Write a `to_host` copy to ``path`` as a safetensors file mlx ``load`` reads (the
        format's 8-byte header length, JSON header, raw little-endian data; written here
        because numpy has no bfloat16 for the ``safetensors`` package). Any thread. Returns
        the file's xxh3-128 (hex), computed as it is written."""
        import xxhash

        header, offset, arrays = {}, 0, []
        for i, (k, v) in enumerate(host.layers):
            for name, a in ((f"{i}.k", k), (f"{i}.v", v)):
                a = np.ascontiguousarray(a)
                header[name] = {"dtype": host.dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
                offset += a.nbytes
                arrays.append(a)
        header["__metadata__"] = {"format": HOST_FORMAT}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        raw = len(raw).to_bytes(8, "little") + raw
        h = xxhash.xxh3_128(raw)
        # Owner-only from the start: the KV decodes to the prompt (docs/security.md).
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(raw)
            for a in arrays:
                m = memoryview(a).cast("B")
                h.update(m)
                f.write(m)
        return h.hexdigest()

    def prefetch(self, path: str) -> str:
        """Read a disk-tier file through the page cache with no MLX call (the tier's reader
        thread), so `load_kv` in the engine thread then copies from memory instead of waiting
        on the disk; returns the file's xxh3-128 (hex). (Reading it into numpy and copying
        that into mlx arrays took 4x as long in the engine thread as mlx's own load from the
        page cache on the test VM: 3.0 against 0.76 s for 2.25 GiB.)"""
        return file_xxh3(path)

    def from_host(self, host):
        """Cache layers holding a `to_host` copy again (a disk-tier read before its write ended)."""
        import mlx.core as mx

        dtype = {v: k for k, v in _dtype_names().items()}[host.dtype]

        def dev(a):
            x = mx.array(a)
            return x.view(mx.bfloat16) if dtype == mx.bfloat16 else x

        kv = self._layers([(dev(k), dev(v)) for k, v in host.layers])
        mx.eval([c.state for c in kv])
        return kv

    def _layers(self, pairs):
        from mlx_lm.models.cache import KVCache

        out = []
        for k, v in pairs:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, int(k.shape[2])
            out.append(c)
        return out

    def nbytes(self, kv) -> int:
        return kv_nbytes(kv)

    def trimmable(self, kv) -> bool:
        return kv_trimmable(kv)

    def trim(self, kv, n: int) -> None:
        kv_trim(kv, n)

    def copy(self, kv):
        return copy.deepcopy(kv)

    def prefix(self, kv, length: int, n: int):
        """A KV cache holding the first ``n`` of ``length`` tokens of ``kv``.

        ``kv`` is being evicted and may be consumed. Plain ``KVCache``
        layers get compact copies, so the bytes beyond ``n`` are freed (an
        mlx-lm trim only moves the offset); other layer types are trimmed in
        place and keep their buffers, which ``nbytes`` still counts.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        if all(type(c) is KVCache and c.keys is not None for c in kv):
            out = []
            for c in kv:
                d = KVCache()
                d.keys = _compact(c.keys[..., :n, :])
                d.values = _compact(c.values[..., :n, :])
                d.offset = n
                out.append(d)
            mx.eval([a for d in out for a in (d.keys, d.values)])
            return out
        kv_trim(kv, length - n)
        return kv
