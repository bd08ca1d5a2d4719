"""The prompt cache's disk tier (cache rule 8, ``--disk-cache-bytes``).

The memory budget of a Mac's prompt cache is small beside its SSD: an agent
host with a 20 GB KV budget has hundreds of GB of disk, and an entry the
budget evicts is the KV of a conversation that often comes back (the user
was reading, the agent was running a tool). Recomputing a 30k-token prompt
takes 18 s at Qwen3-4B's 1,622 tok/s prefill on an M4 Max; reading its KV
(4.4 GB at 147,456 bytes/token) back from a 5-7 GB/s Apple SSD takes under
a second. So an entry evicted from memory is written here instead of
dropped, and a prompt whose longest cached prefix is on disk reads it back
before its prefill, for that request (it is not moved into memory: the
request's own save, extending it, replaces it there). The same two-tier design as
SGLang's HiCache (host memory and storage under the GPU's radix cache) and
Dynamo's KV block manager (G1 device, G2 host, G3 disk), at this cache's
entry granularity.

Entries are chains of parts, one file each (a safetensors file of per-layer
keys and values that mlx ``load`` reads, `KVOps.write_host`; one whole file
in mlx-lm's ``save_prompt_cache`` format for layer types that path does not
cover), as rule 7 chains segments in memory: an entry that continues a chain
already here writes only what follows it (an agent's conversation evicted
turn after turn writes each turn once, not the whole conversation again),
and a prefix several entries share is held once, also when an entry branches
off inside a part written before (it uses that part's first tokens when they
are at least ``branch_share`` of it). Its own byte budget (a part
counted once) and least-recently-used eviction of entries (deleting the parts
no other chain uses). Its entries keep their blocks owned in Redis
(the backend can still serve them, a disk read instead of a prefill), so the
`PromptCache` tells the listener of every entry that enters or leaves the
tier, as of the memory entries.

I/O beside the batch. Writes are behind the eviction: the engine thread hands
the writer thread views of the evicted arrays' own buffers (`KVOps.to_host`:
no copy, and no MLX call off the engine thread), so running decodes do not
pause for the disk; a read before the write ended takes those arrays instead
of the file. Entries waiting for the writer are held outside the memory
budget, at most ``max_pending_bytes`` (more waits for the writer; None: all
I/O in the caller's thread). Reads: the engine pins a request to a disk hit on
arrival (`read_async`), a reader thread reads the file through the page cache
(`KVOps.prefetch`), and the engine thread loads it from memory at admission
(`finish`); only the parts holding the prompt's prefix are read.

Across restarts (`checkpoint`, `_adopt`): the manifest (each part's file,
token range, parent, size and xxh3-128 checksum; each entry's last part and
metadata, least recently used first; the KV settings of
`backend.persist.kv_settings`; token ids in ``tokens-N.npz``) is
written at quiet moments and at a clean stop, so a killed backend comes back
with its tier as of its last quiet moment. The next start adopts the newest
entries that fit its budget under equal settings (every read checks each
file against its checksum); nothing an earlier run kept is deleted before
this run writes its own first entry. ``--cache-dir`` keeps the memory tier.
The engine thread calls every method (as it owns the `PromptCache`); the
writer and reader threads share only the queued entries and reads, under a
lock.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from mlxgw.util import size_text

from .cache import CacheEntry, file_xxh3, root_first
from .prefixindex import PrefixIndex

log = logging.getLogger("mlxgw.backend")

#: Tier files: ``tier-<n>.safetensors`` (`KVOps.write_host` or mlx-lm's format; the sim writes JSON).
_PREFIX, _SUFFIX = "tier-", ".safetensors"
MANIFEST = "manifest.json"
FORMAT = 2  # 2: chains of parts (session 34); 1: one whole file per entry, still adopted
#: Parts beyond which an entry's chain is not extended: a save continuing it writes a chain of
#: its own (a read opens one file per part).
MAX_CHAIN = 32
#: Shared fraction of a part from which a chain branches off inside it (`DiskTier._reusable`):
#: at a half, the part's tail kept for the new chain never weighs more than the write it saved.
BRANCH_SHARE = 0.5


class _Part:
    """KV of tokens ``[start, end)``, in one file (``path``): a safetensors file of per-layer
    keys and values (`KVOps.write_host`), or with ``whole`` a whole entry in mlx-lm's format
    (layer types the host path does not cover; never extended). A chain passing through it
    uses its tokens from ``start`` up to where its next part starts: at ``end``, or inside it
    where a conversation branched off one written before (`_spans`). ``refs``: the entries
    ending here plus the child parts. ``origin``: the entry whose save wrote it."""

    __slots__ = ("id", "start", "end", "nbytes", "parent", "refs", "path", "whole", "origin")

    def __init__(self, id: int, start: int, end: int, nbytes: int, parent: Optional["_Part"], path: Path,
                 whole: bool, origin: int = 0):
        self.id, self.start, self.end, self.nbytes, self.parent = id, start, end, nbytes, parent
        self.path, self.whole, self.origin = path, whole, origin
        self.refs = 0

    def chain(self) -> list["_Part"]:
        """This part and its ancestors, root first."""
        return root_first(self)


class DiskTier:
    """Entries evicted from memory, on disk, under a byte budget (cache rule 8).

    Args:
        directory: where the files go (made 0700: KV decodes to the prompts); files an
            earlier run left there are removed.
        max_bytes: byte budget of the files' KV (each part counted once), > 0.
        ops: the cache's `KVOps` (``to_host`` / ``host_slice`` / ``write_host`` / ``from_host`` /
            ``save_kv`` / ``load_kv`` / ``kv_parts`` / ``join`` / ``nbytes``).
        max_pending_bytes: KV waiting for the writer beyond which an eviction waits for it,
            bytes (None: no I/O beside the caller: every write and read in its thread).
        settings: the run's KV settings (`backend.persist.kv_settings`): a tier a clean stop
            left under equal settings is adopted, and `close` keeps this one; None: neither.
        max_chain: most parts of one entry's chain (``--disk-chain-parts``); 1: one whole
            file per entry, written in full at each spill (session 33's tier; the A/B knob).
        branch_share: a chain branches off inside a part when at least this fraction of the
            part's tokens is shared (``--disk-branch-share``, `_reusable`); 1: only at a
            part's end (session 34's tier; the A/B knob).

    Raises:
        ValueError: ``max_bytes <= 0``, ``max_chain < 1`` or ``branch_share`` not in (0, 1].
        OSError: the directory cannot be made or listed.
    """

    def __init__(self, directory: Path, max_bytes: int, ops, max_pending_bytes: Optional[int] = None,
                 settings: Optional[dict] = None, max_chain: int = MAX_CHAIN, branch_share: float = BRANCH_SHARE):
        if max_bytes <= 0:
            raise ValueError("the disk tier needs a byte budget > 0")
        if max_chain < 1:
            raise ValueError("an entry's chain needs at least one part")
        if not 0 < branch_share <= 1:
            raise ValueError("branch_share is a fraction of a part: in (0, 1]")
        self.max_chain, self.branch_share = max_chain, branch_share
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # the tier's own directory, owner-only even if the user made it
        self.settings = settings
        self.max_bytes = max_bytes
        self.ops = ops
        self.max_pending_bytes = max_pending_bytes
        self.nbytes = 0  # bytes of all parts (a part several entries share counted once)
        self._entries: dict[int, CacheEntry] = {}
        self._index = PrefixIndex()  # the entries' tokens, sorted: lookups in O(log n), not a scan
        self._tails: dict[int, _Part] = {}  # entry id -> the last part of its chain
        self._parts: dict[int, _Part] = {}  # part id -> part, every part on disk (or being written)
        self._part_ids = itertools.count(1)
        self._files = itertools.count(1)
        # Write-behind state, shared with the writer thread under _cond's lock.
        self._cond = threading.Condition()
        self._pending: dict[int, object] = {}  # part id -> its KV (`KVOps.host_slice`) not yet written
        self.pending_bytes = 0
        self._lost: list[tuple[int, int]] = []  # (part id, origin entry id) whose write failed, for `reap`
        self._full: Optional[Exception] = None  # a background write found the disk full, for `reap`
        self._said_full = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: Optional[threading.Thread] = None
        self._reads: queue.SimpleQueue = queue.SimpleQueue()  # `DiskRead` jobs for the reader thread
        self._reader: Optional[threading.Thread] = None
        # Figures since start (the backend's stats and registry record).
        self.spills = 0  # entries written here
        self.reads = 0  # entries read back for a prompt
        self.read_tokens = 0  # prompt tokens those reads served
        self.evictions = 0  # entries dropped from here by its budget
        self.failures = 0  # writes or reads that failed (the entry was dropped)
        self.write_bytes = 0  # KV bytes written to files (the SSD's wear; a failed write not counted)
        self.write_waits = 0  # evictions that waited for the writer (max_pending_bytes reached)
        self._sums: dict[int, str] = {}  # part id -> its file's xxh3-128
        # Across restarts (`checkpoint`, `_adopt`).
        self._synced: set[int] = set()  # parts whose file was flushed for a manifest
        self._sizes: dict[int, int] = {}  # part id -> its file's bytes, as the manifest records them
        self._version = 0  # bumped by every change of the entries on disk
        self._checkpointed = 0  # `_version` the manifest on disk describes
        self._tokens_file = ""  # the token file the manifest on disk names
        self._foreign: Optional[str] = None  # why a tier an earlier run kept is not used (it stays till a write)
        self._stale: list[Path] = []  # files of that tier, or of entries this run's budget left out
        self._left: dict = {"parts": [], "entries": []}  # manifest records of those left-out entries
        # Files the manifest on disk names are deleted only once a newer manifest stops naming
        # them (helper-56: a kill soon after a turn continued a chain left a manifest naming a
        # file already deleted, and the next start lost every entry built on it).
        self._named: set[str] = set()
        self._doomed: dict[Path, int] = {}  # released parts' files (-> bytes) the manifest on disk still names
        self.adopted = self._adopt()  # (entries, tokens, bytes, what was left and why) or None

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def parts(self, entry: CacheEntry) -> list[tuple[int, int, str]]:
        """``entry``'s chain as ``(start, end, file name)`` per part, root first: the tokens
        ``[start, end)`` it uses of each file (a file may hold more, `_Part`)."""
        return [(a, b, p.path.name) for p, a, b in _spans(self._tails[entry.id].chain(), len(entry))]

    def drop(self, entry: CacheEntry) -> None:
        """Remove ``entry`` (the parts no other entry uses deleted); the caller tells the listener."""
        self._drop(entry)

    def best_match(self, prompt: np.ndarray) -> tuple[Optional[CacheEntry], int]:
        """The entry holding the longest prefix of ``prompt`` (int32 array) and its length in
        tokens, capped at ``len(prompt) - 1`` (rule 1). Entries here are all trimmable."""
        ident, c = self._index.longest(prompt)
        n = min(c, len(prompt) - 1)
        return (self._entries[ident], n) if ident is not None and n > 0 else (None, 0)

    def put(self, entry: CacheEntry, kv, cuts=(), min_share: int = 1) -> tuple[Optional[CacheEntry], list[CacheEntry]]:
        """Write ``kv`` (holding exactly ``entry.tokens``; a whole KV, not a segment chain) as a
        tier entry with ``entry``'s metadata and recency: queued for the writer thread
        (write-behind), or written now.

        Only what the tier does not hold is written: the entry's chain starts with the
        longest chain of parts already here that its tokens continue (at least ``min_share``
        tokens, ending at a part's end or inside one, `_reusable`), and the rest goes into new
        parts cut at ``cuts``
        (token positions: the memory chain's segment starts and the end of the prompt, where
        other prompts may branch off). An agent's conversation evicted turn after turn so
        writes each turn's new tokens, not the whole conversation again, and conversations
        sharing a system prompt hold it once. Entries the new one continues (it starts with
        their whole prompt: the same conversation; or it covers them) leave the tier; their
        parts stay where the new chain uses them.

        Returns ``(the tier entry or None, the tier entries dropped or evicted)``; None when
        the entry exceeds the whole budget or a write made now failed (logged; the entry is
        then simply gone, as without a tier). The caller tells the listener of both, the new
        entry first.
        """
        nbytes = self.ops.nbytes(kv)
        if nbytes > self.max_bytes:
            return None, []
        self._clear_stale()
        t, n = entry.tokens, len(entry)
        common = self._index.sharing(t)  # entry id -> common prefix, of those sharing any (the rest: 0)
        host = self.ops.to_host(kv)  # None: layers the host path does not cover, one whole file
        base, b = self._reusable(common, min_share) if host is not None else (None, 0)
        if self.max_chain == 1:
            cuts = ()
        if base is not None:
            base.refs += 1  # pinned: the drops and evictions below must not free it
        gone = [e for e in (self._entries[i] for i in common)
                if (common[e.id] == len(e) and len(e) <= n)
                or (e.cache_type != "system" and common[e.id] >= e.prompt_tokens)]
        for e in gone:
            self._drop(e)
        if host is None:
            plan = [(0, n, None, nbytes)]
        else:
            bounds = [b, *sorted({int(c) for c in cuts if b < c < n}), n] if b < n else []
            # Views would keep the whole entry's buffers alive until their write: a slice that is
            # a small part of it (a long conversation's next turn) is copied, in a buffer its size.
            small = 4 * (n - b) < n and self.max_pending_bytes is not None
            plan = []
            for s, e in zip(bounds, bounds[1:]):
                piece = self.ops.host_slice(host, s, e, copy=small)
                plan.append((s, e, piece, self.ops.host_nbytes(piece)))
        need = sum(x[3] for x in plan)
        while self._entries and self.nbytes + need > self.max_bytes:
            victim = min(self._entries.values(), key=lambda e: e.last_used)
            self._drop(victim)
            self.evictions += 1
            gone.append(victim)
        if self.nbytes + need > self.max_bytes:  # only the pinned chain is left, and no room beside it
            self._release(base)
            return None, gone
        tail, written = base, []
        for s, e, piece, size in plan:
            path = self.directory / f"{_PREFIX}{next(self._files)}{_SUFFIX}"
            part = _Part(next(self._part_ids), s, e, size, tail, path, whole=host is None, origin=entry.id)
            if tail is not None:
                tail.refs += 1
            self._parts[part.id] = part
            self.nbytes += size
            written.append((part, piece))
            tail = part
        if base is not None and tail is not base:
            self._release(base)  # its new child holds it now
        if tail is not base:
            tail.refs += 1  # the entry's reference (a chain reused whole keeps the pin as that)
        if self.max_pending_bytes is None or host is None:
            for part, piece in written:
                try:
                    if piece is None:  # mlx-lm's format; its checksum is taken if it is kept (`_write_manifest`)
                        self.ops.save_kv(kv, str(part.path))
                    else:
                        self._sums[part.id] = self.ops.write_host(piece, str(part.path))
                    os.chmod(part.path, 0o600)
                    self.write_bytes += part.nbytes
                except Exception as err:  # OSError (disk full), or mlx's RuntimeError for a failed write
                    self._release(tail)
                    self.failures += 1
                    if getattr(err, "errno", None) == errno.ENOSPC:
                        self._disk_full(err)
                    log.warning("disk tier: could not write %s (%d tokens, %s): %s; the entry is dropped",
                                part.path, len(entry), size_text(part.nbytes), err)
                    return None, gone
        d = CacheEntry(
            tokens=t, kv=None, nbytes=sum(p.nbytes for p in tail.chain()), cache_type=entry.cache_type,
            trimmable=True, id=entry.id, last_used=entry.last_used, used_at=entry.used_at, hits=entry.hits,
            prompt_tokens=entry.prompt_tokens, on_disk=True,
        )
        self._entries[d.id] = d
        self._index.add(d.id, d.tokens)
        self._tails[d.id] = tail
        self.spills += 1
        self._version += 1
        if self.max_pending_bytes is not None and host is not None:
            for part, piece in written:
                self._write_behind(part, piece)
        self._make_room()
        return d, gone

    def _reusable(self, common: dict[int, int], min_share: int) -> tuple[Optional[_Part], int]:
        """Where a new entry's chain branches off the held ones (``common``: entry id -> common
        prefix with its tokens): ``(part, at)``, the new parts starting at token ``at`` under
        ``part``, for the largest ``at`` of at least ``min_share`` tokens; ``(None, 0)`` if none.

        ``at`` is a part's end, or inside the part where the tokens diverge when at least
        ``branch_share`` (a half) of that part's own tokens are shared: a conversation that
        branched off one written before (the traces' shared prefixes end inside parts,
        measured in session 34) then holds the prefix once, and the part's unshared tail,
        kept as long as the new chain lives, never weighs more than the write it saved. Chains of ``max_chain`` parts are not
        extended (a read opens a file per part)."""
        best, at = None, 0
        for ident, c in common.items():
            if c < min_share or c <= at:
                continue
            spans = _spans(self._tails[ident].chain(), len(self._entries[ident]))
            i = next(i for i, (_, _, end) in enumerate(spans) if c < end or i == len(spans) - 1)
            p, a, end = spans[i]
            depth = i + 1
            if c >= end:  # the whole entry: branch at its end
                cand = end
            elif c - a >= self.branch_share * (p.end - a):  # inside p: enough of what p holds is shared
                cand = c
            else:  # back to p's parent, at p's start
                p, cand, depth = (spans[i - 1][0], a, i) if i > 0 else (None, 0, 0)
            if p is None or p.whole or depth > self.max_chain - 1 or cand < min_share or cand <= at:
                continue
            best, at = p, cand
        return best, at

    def read(self, entry: CacheEntry, n: int, clock: int) -> tuple[object, Optional[CacheEntry]]:
        """Read ``entry``'s first ``n`` tokens of KV now, in the caller's thread: each part from
        its queued arrays when its write has not ended, else from its file (checked against
        its checksum first, when it has one); only the parts holding
        those tokens. The entry stays, its recency set to ``clock`` (the memory cache's clock).
        Returns what `finish` does."""
        entry.last_used, entry.used_at = clock, time.time()
        job = self._job(entry, n)
        self._prefetch(job, checked_only=True)
        job.done.set()
        return self.finish(job)

    def read_async(self, entry: CacheEntry, n: int, clock: int) -> Optional["DiskRead"]:
        """Start reading ``entry``'s first ``n`` tokens of KV: the reader thread reads the files
        of the parts holding them from the disk into the page cache (`KVOps.prefetch`, no MLX
        call there; each file's checksum checked) and `finish` loads them in the engine
        thread from memory. None when they are all still queued for the writer (`read` takes
        those arrays at once), and without ``max_pending_bytes`` (all I/O in the caller's
        thread). The entry's recency is set to ``clock`` now."""
        if self.max_pending_bytes is None:
            return None
        job = self._job(entry, n)
        if all(h is not None for h in job.hosts):
            return None
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="disk-tier-reader", daemon=True)
            self._reader.start()
        entry.last_used, entry.used_at = clock, time.time()
        self._reads.put(job)
        return job

    def finish(self, job: "DiskRead") -> tuple[object, list[CacheEntry]]:
        """``(KV holding the read's n tokens, [])`` for a read (`read`, or `read_async`'s,
        waited for if need be), or ``(None, the entries dropped)`` when it failed (logged; the
        caller tells the listener): every entry whose chain passes through the part that could
        not be read (a damaged file shared by several conversations fails them all), else the
        entry read, if it is still here. Engine thread."""
        job.done.wait()
        e = job.entry
        kv, err = None, job.error
        if err is None:
            try:  # queued arrays, or the files (from the page cache the reader filled, if it did)
                pieces = []
                for p, h, f in zip(job.parts, job.hosts, job.fetched):
                    job.bad = p
                    pieces.append(self.ops.from_host(h) if h is not None else
                                  self.ops.load_kv(str(p.path), prefetched=f))
                job.bad = None
                if len(pieces) == 1:
                    kv = pieces[0]
                    self.ops.trim(kv, job.parts[0].end - job.n)
                else:  # one KV of the chain's tokens, as rule 7's segments are joined in memory
                    kv = self.ops.join([(self.ops.kv_parts(x), b - a)
                                        for x, (_, a, b) in zip(pieces, _spans(job.parts, job.n))], job.n)
            except Exception as x:
                err = x
        if err is None:
            e.hits += 1
            self.reads += 1
            self.read_tokens += job.n
            return kv, []
        self.failures += 1
        bad = job.bad if job.bad is not None and self._parts.get(job.bad.id) is job.bad else None
        gone = [x for x in self._entries.values() if bad in self._tails[x.id].chain()] if bad is not None else \
            [e] if self._entries.get(e.id) is e else []
        for x in gone:
            self._drop(x)
        log.warning("disk tier: could not read %s (%d tokens): %s; the prompt is prefilled instead%s",
                    bad.path.name if bad is not None else ", ".join(p.path.name for p in job.parts), len(e), err,
                    f"; {len(gone)} entries using that file dropped" if len(gone) > 1 else "")
        return None, gone

    def _job(self, entry: CacheEntry, n: int) -> "DiskRead":
        parts = [p for p in self._tails[entry.id].chain() if p.start < n]
        with self._cond:
            hosts = [self._pending.get(p.id) for p in parts]
        # Every read checks each file against the checksum taken as it was written (or kept at
        # the last stop): a file damaged while the backend runs must cost a prefill, not serve
        # wrong KV that the next saves would extend (helper-56: answers of garbage, no warning).
        return DiskRead(entry, n, parts, hosts, [self._sums.get(p.id) for p in parts])

    def _prefetch(self, job: "DiskRead", checked_only: bool = False) -> None:
        """Read ``job``'s files through the page cache (with ``checked_only``, only those with a
        checksum to check) and check their checksums (the reader thread's step; `read`
        runs it inline). Errors go in ``job.error``."""
        try:
            for i, (p, host, checksum) in enumerate(zip(job.parts, job.hosts, job.checksums)):
                if host is not None or (checked_only and checksum is None):
                    continue
                job.bad = p
                digest = self.ops.prefetch(str(p.path))
                job.fetched[i] = True
                if checksum is not None and digest != checksum:
                    raise ValueError(f"{p.path.name} is damaged: its checksum differs from the one taken when it was written")
            job.bad = None
        except Exception as e:  # OSError: removed meanwhile, unreadable
            job.error = e

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            self._prefetch(job)
            job.done.set()

    def reap(self) -> list[CacheEntry]:
        """Remove the entries whose chain has a part whose background write failed; returns
        them for the listener."""
        with self._cond:
            lost, self._lost = self._lost, []
            full, self._full = self._full, None
        ids = {i for i, _ in lost}
        out = [e for e in self._entries.values() if any(p.id in ids for p in self._tails[e.id].chain())]
        for e in out:
            self._drop(e)
        self.spills -= len({origin for _, origin in lost})  # counted when queued; never on disk (helper-55)
        if full is not None:  # after the drops: the budget comes down to what is really on disk
            self._disk_full(full)
        return out

    def clear(self) -> list[CacheEntry]:
        """Remove every entry; returns them for the listener."""
        out = list(self._entries.values())
        for e in out:
            self._drop(e)
        return out

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write ended; False if ``timeout`` (s) passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 600.0) -> None:
        """At the backend's stop (the gateways stopped routing here): stop the reader and the
        writer (waiting up to ``timeout`` s for its queue), then with ``settings`` keep the tier
        for the next start (`checkpoint`); without, remove its files. No listener: the backend
        withdrew from Redis."""
        flushed = self.flush(timeout)
        for q, t in ((self._reads, self._reader), (self._queue, self._writer)):
            if t is not None:
                q.put(None)
        if self._writer is not None:
            with self._cond:
                self._pending.clear()  # after a timed-out flush: not written, not kept
                self.pending_bytes = 0
        for t in (self._reader, self._writer):
            if t is not None:
                t.join(timeout=60)
        if self.settings is not None:
            if not flushed:
                log.warning("disk tier: its writer did not finish in %.0f s: the entries it had not written "
                            "are not kept", timeout)
            self._keep_at_stop()
            return
        n = len(self._entries)
        for e in list(self._entries.values()):
            self._drop(e)
        if n:
            log.info("disk tier: %d entries removed from %s at stop", n, self.directory)

    # -- across restarts -------------------------------------------------------
    def checkpoint(self) -> bool:
        """Write the manifest of the entries on disk now (the engine calls it at quiet moments
        and `close` at the stop), so the next start adopts them even after a kill. Nothing when
        the tier did not change since the last one, when it has no settings, or while a tier
        an earlier run kept under other settings is still there untouched (it stays until this
        run writes its own entries). Returns True when a manifest was written. Raises OSError
        (a full disk: `close` makes room and tries again)."""
        if self.settings is None or self._foreign is not None or self._version == self._checkpointed:
            return False
        self._write_manifest()
        self._checkpointed = self._version
        return True

    def _keep_at_stop(self) -> None:
        """`checkpoint` at the stop; on a full disk, drop the least recently used entries (a
        tenth at a time) until the manifest fits rather than lose every one (helper-53)."""
        for _ in range(6):
            try:
                if self.checkpoint() or self._foreign is not None or self._version == self._checkpointed:
                    if self._entries:
                        log.info("disk tier: %d entries (%s of KV) kept in %s for the next start",
                                 len(self._entries), size_text(self.nbytes), self.directory)
                    return
            except OSError as e:
                order = sorted(self._entries.values(), key=lambda x: x.last_used)
                if not order:
                    break
                for x in order[:max(1, len(order) // 10)]:
                    self._drop(x)
                self._named = set()  # their files go now: the space is what the manifest needs
                self._delete_doomed()
                log.warning("disk tier: could not write its manifest in %s (%s): dropped its oldest entries to "
                            "make room, %d left", self.directory, e, len(self._entries))
        log.warning("disk tier: its %d entries in %s are not kept (no manifest could be written); the next "
                    "start removes them", len(self._entries), self.directory)

    def _write_manifest(self) -> None:
        """The manifest and a token file beside the tier's files: files flushed first, the
        token file under a new name, the manifest written aside and renamed into place last,
        so a kill at any point leaves the previous manifest or this one, each whole."""
        from . import persist

        # Written parts only: one still queued (or whose write failed) has no whole file yet.
        with self._cond:
            skip = {i for i, _ in self._lost} | set(self._pending)
        order, parts = [], {}
        for e in sorted(self._entries.values(), key=lambda e: e.last_used):
            chain = self._tails[e.id].chain()
            if any(p.id in skip for p in chain):
                continue
            order.append(e)
            for p in chain:  # parents before children
                parts.setdefault(p.id, p)
        for p in parts.values():  # the manifest must not outlive its files
            if p.id in self._synced:
                continue
            if p.id in self._sums:  # written with `write_host`: its checksum was taken as it was written
                _fsync(p.path)
            else:  # written in mlx-lm's format: read it once now
                self._sums[p.id] = persist._seal(p.path)
            self._synced.add(p.id)
        names = {p.path.name for p in parts.values()}
        part_records = [*(r for r in self._left["parts"] if r["file"] not in names),  # left out by this run's budget
                        *({"file": p.path.name, "start": p.start, "end": p.end, "nbytes": p.nbytes,
                           "parent": p.parent.path.name if p.parent is not None else None, "whole": p.whole,
                           "checksum": self._sums[p.id], **self._file_size(p)} for p in parts.values())]
        records = [*self._left["entries"],  # an earlier run's entries this run's budget left out, still on disk
                   *({"part": self._tails[e.id].path.name, "tokens": len(e), "nbytes": e.nbytes,
                      "cache_type": e.cache_type, "prompt_tokens": e.prompt_tokens, "hits": e.hits,
                      "used_at": e.used_at, "ids": e.tokens} for e in order)]
        name = f"tokens-{next(self._files)}.npz"
        tmp = self.directory / (MANIFEST + ".tmp")
        try:
            np.savez(self.directory / name, **{r["part"]: r["ids"] for r in records})
            manifest = {
                "format": FORMAT, "fingerprint": persist.fingerprint(self.settings), "settings": self.settings,
                "saved_at": time.time(), "tokens_file": name, "tokens_checksum": persist._seal(self.directory / name),
                "parts": part_records, "entries": [{k: v for k, v in r.items() if k != "ids"} for r in records],
            }
            tmp.write_text(json.dumps(manifest))
            persist._seal(tmp)
            tmp.rename(self.directory / MANIFEST)
        except OSError:  # a full disk: no half-written file left beside the previous manifest
            _unlink(self.directory / name)
            _unlink(tmp)
            raise
        persist._fsync_dir(self.directory)
        old, self._tokens_file = self._tokens_file, name
        if old:
            _unlink(self.directory / old)
        self._named = {r["file"] for r in part_records}
        self._delete_doomed()

    def _file_size(self, p: _Part) -> dict:
        """``{"size": bytes of p's file}`` (flushed: final) for its manifest record: a file cut
        short is then found at the next start by its size, before any read (helper-58). Empty
        when the file cannot be read now (removed under the running backend: its first read
        drops the entries using it; the manifest must still be written)."""
        size = self._sizes.get(p.id)
        if size is None:
            try:
                size = self._sizes[p.id] = p.path.stat().st_size
            except OSError:
                return {}
        return {"size": size}

    def _delete_doomed(self) -> None:
        """Delete the released parts' files that no manifest on disk names any more."""
        for f in [f for f in self._doomed if f.name not in self._named]:
            _unlink(f)
            del self._doomed[f]

    @property
    def doomed_bytes(self) -> int:
        """Bytes of released parts' files kept until the next checkpoint."""
        return sum(self._doomed.values())

    def _make_room(self, now: bool = False) -> None:
        """Released files wait for the next checkpoint (quiet moments); past a tenth of the
        budget (or ``now``: the disk is full) a checkpoint is written now, so a busy backend's
        disk stays near its budget."""
        if not self._doomed or (not now and self.doomed_bytes <= self.max_bytes // 10):
            return
        try:
            self.checkpoint()
        except OSError as e:  # a full disk: space first; a kill before the next checkpoint then loses more
            log.warning("disk tier: could not write its manifest in %s (%s): files it names are deleted anyway",
                        self.directory, e)
            self._named = set()
            self._delete_doomed()

    def _adopt(self) -> Optional[tuple]:
        """At start, what an earlier run left in the directory (`checkpoint`):

        * a manifest under this run's settings: the newest entries whose chains fit the budget
          are adopted, in least recently used order (ids below 0, apart from the memory
          cache's); those the budget leaves out stay on disk, and in the manifest, until this
          run writes its first entry; files the manifest does not name (written after the
          last checkpoint of a run that was killed) are removed. A format 1 manifest (one
          whole file per entry, before parts) is read as chains of one part;
        * a manifest under other settings (or unreadable): nothing is adopted and nothing
          removed until this run writes its first entry, as `backend.persist` keeps a save
          under other settings until the run saves its own;
        * tier files and no manifest: removed.

        Returns (entries, tokens, bytes, note) or None when nothing was adopted."""
        from . import persist

        mpath = self.directory / MANIFEST
        files = {f.name: f for f in self.directory.glob(f"{_PREFIX}*")}
        self._files = itertools.count(1 + max((_number(n) for n in files), default=0))
        manifest, note = None, ""
        try:
            if mpath.exists():
                manifest = json.loads(mpath.read_text())
                tokens_file = self.directory / manifest.get("tokens_file", "tokens.npz")
                if self.settings is None:
                    note, manifest = "this run keeps no tier (no KV settings)", None
                elif manifest.get("format") not in (1, FORMAT):
                    note, manifest = f"format {manifest.get('format')}, not {FORMAT}", None
                elif manifest.get("fingerprint") != persist.fingerprint(self.settings):
                    note = "kept under other settings: " + persist._differences(manifest.get("settings") or {},
                                                                                self.settings)
                    manifest = None
                elif persist._digest(tokens_file) != manifest.get("tokens_checksum"):
                    note, manifest = f"{tokens_file.name} is damaged", None
                else:
                    part_recs, entry_recs = _records(manifest)
        except (OSError, ValueError, KeyError, TypeError) as e:
            note, manifest = f"unreadable manifest: {e}", None
        if manifest is None:
            if mpath.exists():  # kept by a clean stop, for other settings: left as it is for now
                self._foreign = note
                self._stale = [*files.values(), mpath, *self.directory.glob("tokens*.npz")]
                log.warning("disk tier: the %d files kept in %s are not used (%s); they stay until this run "
                            "writes its own entries", len(files), self.directory, note)
            else:
                for f in [*files.values(), *self.directory.glob("tokens*.npz")]:
                    _unlink(f)
                if files:
                    log.warning("disk tier: %d files without a manifest in %s removed (a run stopped before "
                                "it kept them)", len(files), self.directory)
            return None
        self._tokens_file = tokens_file.name

        unusable: dict[str, str] = {}  # file -> why, for the files the manifest names that cannot serve

        def usable(name):
            if name not in unusable:
                r = part_recs.get(name)
                size = files[name].stat().st_size if r is not None and "size" in r and name in files else None
                why = ("not in the manifest" if r is None else "missing" if name not in files else
                       f"{size:,} bytes where {int(r['size']):,} were written"
                       if size is not None and size != r["size"] else "")
                unusable[name] = why
            return not unusable[name]

        def chain(name):  # a part's chain of records, root first; None if a file or record is missing
            out = []
            while name is not None:
                if not usable(name):
                    return None
                r = part_recs[name]
                out.append(r)
                name = r["parent"]
            return out[::-1]

        room, keep, kept_parts, left, lost = self.max_bytes, [], {}, [], 0
        for m in reversed(entry_recs):  # newest first
            ch = chain(m["part"])
            if ch is None:  # a file removed or cut short after that manifest was written
                lost += 1
                continue
            add = sum(r["nbytes"] for r in ch if r["file"] not in kept_parts)
            if add <= room:
                keep.append(m)
                kept_parts.update((r["file"], r) for r in ch)
                room -= add
            else:
                left.append((m, ch))
        try:
            with np.load(tokens_file) as z:
                ids = {m["part"]: np.asarray(z[m["part"]], dtype=np.int32) for m in [*keep, *(m for m, _ in left)]}
        except (OSError, ValueError, KeyError) as e:
            log.warning("disk tier: the entries kept in %s are not used (unreadable %s: %s); they stay until this "
                        "run writes its own entries", self.directory, tokens_file.name, e)
            self._foreign, self._stale = str(e), [*files.values(), mpath, tokens_file]
            return None
        left_parts = {r["file"]: r for _, ch in left for r in ch}
        unused = [f for name, f in files.items() if name not in kept_parts and name not in left_parts]
        for f in unused:
            _unlink(f)
        if unused:
            log.info("disk tier: removed %d files of %s that no usable entry of its manifest needs (written after "
                     "the last checkpoint of a run that did not stop cleanly, or under an entry missing a file)",
                     len(unused), self.directory)
        self._named = set(kept_parts) | set(left_parts)
        for f in self.directory.glob("tokens*.npz"):  # a checkpoint's, cut short before its rename
            if f.name != tokens_file.name:
                _unlink(f)
        self._left = {"parts": list(left_parts.values()),
                      "entries": [{**m, "ids": ids[m["part"]]} for m, _ in reversed(left)]}  # least recently used first
        self._stale = [self.directory / n for n in left_parts if n not in kept_parts]
        made: dict[str, _Part] = {}
        for name, r in sorted(kept_parts.items(), key=lambda kv: kv[1]["start"]):  # parents first
            parent = made[r["parent"]] if r["parent"] is not None else None
            p = _Part(next(self._part_ids), int(r["start"]), int(r["end"]), int(r["nbytes"]), parent,
                      self.directory / name, whole=bool(r["whole"]))
            if parent is not None:
                parent.refs += 1
            made[name] = p
            self._parts[p.id] = p
            self._sums[p.id] = r["checksum"]
            if "size" in r:
                self._sizes[p.id] = int(r["size"])
            self._synced.add(p.id)
            self.nbytes += p.nbytes
        new_ids = itertools.count(-1, -1)
        for i, m in enumerate(reversed(keep)):  # least recently used first: the LRU order survives
            tail = made[m["part"]]
            e = CacheEntry(tokens=ids[m["part"]], kv=None, nbytes=int(m["nbytes"]), cache_type=m["cache_type"],
                           trimmable=True, id=next(new_ids), last_used=-len(keep) + i, used_at=float(m["used_at"]),
                           hits=int(m["hits"]), prompt_tokens=int(m["prompt_tokens"]), on_disk=True)
            tail.refs += 1
            self._entries[e.id] = e
            self._index.add(e.id, e.tokens)
            self._tails[e.id] = tail
        self._checkpointed = self._version  # the manifest on disk names exactly these (and the left ones)
        if lost:
            bad = sorted((n, why) for n, why in unusable.items() if why)
            log.warning("disk tier: %d entries kept in %s not adopted: %s%s; their prompts are prefilled when "
                        "they come back", lost, self.directory, "; ".join(f"{n} {why}" for n, why in bad[:3]),
                        f" (and {len(bad) - 3} more files)" if len(bad) > 3 else "")
        out = (len(self._entries), sum(len(e) for e in self._entries.values()), self.nbytes,
               f"{len(left)} left out by this run's budget (kept on disk until this run writes its own entries)"
               if left else "")
        log.info("disk tier: %d entries (%s tokens, %s of KV in %d files) adopted from %s, kept %s ago%s",
                 out[0], f"{out[1]:,}", size_text(out[2]), len(made), self.directory,
                 _age(time.time() - float(manifest.get("saved_at", 0))), f"; {out[3]}" if out[3] else "")
        return out

    def _clear_stale(self) -> None:
        """Before this run's first write: remove what an earlier run kept that this one does not
        use (entries under other settings, or left out by this run's budget)."""
        if not self._stale:
            return
        n = sum(1 for f in self._stale if f.name.startswith(_PREFIX) and f.exists())
        for f in self._stale:
            _unlink(f)
        log.warning("disk tier: removed %d files an earlier run kept in %s (%s) to make room for this run's",
                    n, self.directory, self._foreign or "left out by this run's budget")
        self._stale, self._left, self._foreign = [], {"parts": [], "entries": []}, None
        self._version += 1  # the manifest must stop naming them

    # -- write-behind --------------------------------------------------------
    def _write_behind(self, part: _Part, host) -> None:
        """Queue ``host`` (``part``'s KV) for the writer; wait while the copies queued exceed
        ``max_pending_bytes`` (one larger than that alone waits for its own write)."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="disk-tier-writer", daemon=True)
            self._writer.start()
        with self._cond:
            self._pending[part.id] = host
            self.pending_bytes += self.ops.host_nbytes(host)
            self._queue.put((part.id, part.origin, part.path))
            if self.pending_bytes > self.max_pending_bytes:
                self.write_waits += 1
                self._cond.wait_for(lambda: self.pending_bytes <= self.max_pending_bytes or not self._pending)

    def _unqueue(self, part_id: int):
        """Take ``part_id``'s host copy out of the queue (caller holds the lock); None if written."""
        host = self._pending.pop(part_id, None)
        if host is not None:
            self.pending_bytes -= self.ops.host_nbytes(host)
            self._cond.notify_all()
        return host

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            part_id, origin, path = item
            with self._cond:
                host = self._pending.get(part_id)
            if host is None:  # dropped before its turn
                continue
            err = None
            try:
                digest = self.ops.write_host(host, str(path)) or file_xxh3(path)
                os.chmod(path, 0o600)  # `write_host` makes it so; other ops' writes follow the umask
                _fsync(path)  # here, so a checkpoint in the engine thread need not wait for the disk
            except Exception as e:  # OSError: disk full, directory gone, ...
                err = e
            with self._cond:
                if self._unqueue(part_id) is None:
                    _unlink(path)  # dropped while it was written
                elif err is None:
                    self.write_bytes += self.ops.host_nbytes(host)
                    self._sums[part_id] = digest
                    self._synced.add(part_id)
                    self._version += 1  # a whole file now: the next checkpoint names it
                else:
                    _unlink(path)
                    self._lost.append((part_id, origin))
                    self.failures += 1
                    if getattr(err, "errno", None) == errno.ENOSPC:
                        self._full = err
                    log.warning("disk tier: could not write %s: %s; the entry is dropped", path, err)

    def _disk_full(self, err: Exception) -> None:
        """A write found the disk full: lower the budget to what the tier holds, so the next
        entries replace its oldest ones instead of failing one after another (helper-53: every
        write failed once the disk filled, the newest conversations dropped). For this run."""
        self._make_room(now=True)  # released files the last manifest still names go first
        if not self.nbytes:  # nothing to replace: the budget stays, writes are tried as space frees
            if not self._said_full:
                log.warning("disk tier: the disk of %s is full (%s) and the tier holds nothing yet: entries are "
                            "dropped until space frees", self.directory, err)
                self._said_full = True
        elif self.nbytes < self.max_bytes:
            log.warning("disk tier: the disk of %s is full (%s): its budget lowered from %s to %s for this "
                        "run, so new entries replace its oldest", self.directory, err, size_text(self.max_bytes),
                        size_text(self.nbytes))
            self.max_bytes = self.nbytes

    def _drop(self, e: CacheEntry) -> None:
        self._entries.pop(e.id)
        self._index.remove(e.id, e.tokens)
        self._version += 1
        self._release(self._tails.pop(e.id))

    def _release(self, part: Optional[_Part]) -> None:
        """Drop one reference to ``part``; delete it, and so on up its chain, when none is left."""
        while part is not None:
            part.refs -= 1
            if part.refs > 0:
                return
            self._parts.pop(part.id, None)
            self.nbytes -= part.nbytes
            if part.path.name in self._named:  # deleted at the next checkpoint (`_write_manifest`)
                self._doomed[part.path] = part.nbytes
            self._synced.discard(part.id)
            self._sizes.pop(part.id, None)
            self._version += 1
            with self._cond:
                self._unqueue(part.id)  # a write under way finds it gone and removes its file
                self._sums.pop(part.id, None)
            if part.path.name not in self._named:
                _unlink(part.path)
            part = part.parent


class DiskRead:
    """A disk-tier read (`DiskTier.read_async`, `DiskTier.read`) of an entry's first ``n``
    tokens: ``parts`` holds them (root first), ``hosts`` the queued arrays of those whose write
    had not ended (else None), ``checksums`` the files' (None: not known yet), ``fetched`` those
    read through the page cache already. ``done`` is set once the files were read, or
    ``error`` says why they could not be."""

    __slots__ = ("entry", "n", "parts", "hosts", "checksums", "fetched", "error", "done", "bad")

    def __init__(self, entry: CacheEntry, n: int, parts: list, hosts: list, checksums: list):
        self.entry, self.n, self.parts, self.hosts, self.checksums = entry, n, parts, hosts, checksums
        self.fetched = [False] * len(parts)
        self.error = None
        self.bad = None  # the part a failed read stopped at
        self.done = threading.Event()


def _spans(chain: list[_Part], n: int) -> list[tuple[_Part, int, int]]:
    """``(part, start, end)`` per part of ``chain`` (root first): the tokens ``[start, end)``
    a chain of ``n`` tokens uses of each, up to where the next part starts (a chain may
    branch off inside a part, `DiskTier._reusable`) and at most ``n``."""
    ends = [p.start for p in chain[1:]] + [n]
    return [(p, p.start, min(e, p.end, n)) for p, e in zip(chain, ends) if p.start < n]


def _records(manifest: dict) -> tuple[dict, list]:
    """A manifest's parts (file name -> record) and entries (least recently used first). A
    format 1 manifest (session 33: one whole file per entry) gives one part per entry."""
    if manifest.get("format") == 1:
        parts = {m["file"]: {"file": m["file"], "start": 0, "end": int(m["tokens"]), "nbytes": int(m["nbytes"]),
                             "parent": None, "whole": True, "checksum": m["checksum"]} for m in manifest["entries"]}
        return parts, [{**{k: v for k, v in m.items() if k not in ("file", "checksum")}, "part": m["file"]}
                       for m in manifest["entries"]]
    return {r["file"]: r for r in manifest["parts"]}, list(manifest["entries"])


def _number(name: str) -> int:
    """n of a ``tier-<n>.safetensors`` file name (0 for another name)."""
    core = name[len(_PREFIX):-len(_SUFFIX)] if name.endswith(_SUFFIX) else ""
    return int(core) if core.isdigit() else 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else (f"{seconds / 60:.0f} min" if seconds < 7200
                                                     else f"{seconds / 3600:.1f} h")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # the budget counts files we know of; a stray one is only disk
        log.warning("disk tier: could not remove %s: %s", path, err)
