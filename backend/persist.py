"""The prompt cache across restarts (``mlxgw backend --cache-dir``).

A restarted backend used to start cold: an agent's 30k-token conversation then
paid its whole prefill again on the next turn (tens of seconds to minutes on a
Mac), and every restart (a config change, an upgrade) cost that for each
conversation the backend held. With ``--cache-dir`` the backend writes its
prompt cache there when it stops cleanly (after draining, once the gateways
no longer route to it) and reads it back at start, before it registers: the
restored entries are published to Redis under the new epoch like any save,
so the gateways route their conversations back to it.

On disk (one directory per backend; `CacheDirLock` refuses a second backend):

* ``manifest.json``: format, fingerprint, and each entry (cache type, prompt
  length, last use, hits) and segment (token range, parent), least recently
  used first;
* ``tokens.npz``: each entry's token ids (int32);
* ``seg-N.safetensors``: rule 7's segments (backend.cache), each shared prefix
  once, as in memory; ``kv-N.safetensors``: whole-layout entries, in mlx-lm's
  ``save_prompt_cache`` format.

A save goes to a fresh directory, each file flushed and checksummed, renamed
into place at the end, so a stop cut short (SIGKILL, power) leaves the
previous save, never half of one. The engine also saves at quiet moments
(``--cache-save-interval``), so a crash loses only what changed since. The
fingerprint (`fingerprint`) covers the model files, the engine, the cache
layout and mlx-lm's version: a cache saved for other weights is never loaded
(KV is only valid for the weights that computed it). At start, the most
recently used entries that fit this run's ``--cache-entries`` and
``--cache-bytes`` are restored; a file that cannot be read costs the entries
whose KV it holds, a damaged manifest or token file the whole save: a cold
start with a warning, never a failed one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from mlxgw.util import count, size_text

from .cache import CACHE_TYPES, PromptCache, file_xxh3

log = logging.getLogger("mlxgw.backend")

FORMAT = 1
MANIFEST = "manifest.json"
# Model files whose bytes decide the KV: weights, config, tokenizer (ids) and templates.
_MODEL_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken")


def model_files(model_path: str) -> str:
    """16 hex digits: a digest of each model file's name, size and sampled bytes in the local
    directory ``model_path`` (the path itself for a hub id). A copied or re-downloaded model
    matches; other weights or another config (a fine-tune, another quantization, another
    variant under the same name) do not. Reads about 1 MiB per file (`_sample_digest`)."""
    h = hashlib.sha256()
    p = Path(model_path).expanduser()
    if p.is_dir():
        for f in sorted(p.iterdir()):
            if f.is_file() and f.suffix in _MODEL_SUFFIXES:
                h.update(f"{f.name}:{f.stat().st_size}:".encode() + _sample_digest(f) + b"\n")
    else:
        h.update(str(model_path).encode())
    return h.hexdigest()[:16]


def kv_settings(model_path: str, files: str | None = None, **settings) -> dict:
    """What decides the KV a cache holds: ``model_files`` (`model_files` of ``model_path``,
    or ``files`` when already computed) and ``settings`` (engine, layout, mlx-lm version, ...).
    Saved with the cache; a save is restored only into a run whose settings are equal
    (`fingerprint`)."""
    return {"model_files": files or model_files(model_path), **json.loads(json.dumps(settings, default=str))}


def _sample_digest(f: Path, samples: int = 16, chunk: int = 1 << 16) -> bytes:
    """A digest of ``samples`` chunks spread over the file (the whole file when it is small):
    a copied or re-downloaded model matches, other weights of the same shapes (a fine-tune)
    do not, and a start reads about 1 MiB per file, not the gigabytes of the weights."""
    size = f.stat().st_size
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        if size <= samples * chunk:
            h.update(fh.read())
        else:
            for k in range(samples):
                fh.seek((size - chunk) * k // (samples - 1))
                h.update(fh.read(chunk))
    return h.digest()


def fingerprint(settings: dict) -> str:
    """A hex digest of `kv_settings`: two runs agree only when the same weights would compute
    the same KV into the same layout."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def _differences(saved: dict, now: dict) -> str:
    """Which settings differ, for the log: "the cache layout (saved shared, now whole)"."""
    names = {"model_files": "the model files (weights, config or tokenizer)", "layout": "the cache layout",
             "mlx_lm": "mlx-lm's version", "engine": "the engine", "sim": "the sim's KV model"}
    out = []
    for k in sorted(set(saved) | set(now)):
        if saved.get(k) != now.get(k):
            what = names.get(k, k)
            out.append(what if k == "model_files" else f"{what} (saved {saved.get(k)}, now {now.get(k)})")
    return ", ".join(out) or "unknown settings"


@dataclass
class Outcome:
    """What a save or a restore did: entries, tokens and bytes (KV) moved, seconds taken."""

    entries: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    left: int = 0  # restore: saved entries left out by this run's budgets (neither restored nor moved)
    to_disk: int = 0  # restore: saved entries the memory budgets left out, moved into the disk tier
    saved_at: float = 0.0  # restore: when the save was written (unix s)
    damaged: int = 0  # restore: entries left out because a file of theirs could not be read
    error: str = ""  # restore: the first such read error

    def describe(self) -> str:
        mib = self.nbytes / 2**20
        return (f"{count(self.entries, 'entry', 'entries')} ({self.tokens:,} tokens, {mib:.1f} MiB of KV) in "
                f"{self.seconds:.2f} s")


class CacheDirLock:
    """An exclusive lock on a cache directory for this process's lifetime (``flock``, POSIX:
    macOS and Linux), so two backends never write over each other's save.

    Raises:
        RuntimeError: another live process holds it (the message names the directory).
        OSError: the directory cannot be made or opened (a file, read-only, ...).
    """

    def __init__(self, directory: Path, flag: str = "--cache-dir"):
        import fcntl

        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory))
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # the saves hold prompts
        self.path = directory / ".lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise RuntimeError(f"{flag} {directory} is in use by another backend "
                               "(each backend needs a directory of its own)") from None

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


def _snapshot(directory: Path) -> Path:
    return directory / "snapshot"


def saved_bytes(directory: Path) -> int:
    """Bytes of the save under ``directory`` on disk (0 when there is none)."""
    snap = _snapshot(directory)
    if not (snap / MANIFEST).exists():
        return 0
    return sum(f.stat().st_size for f in snap.iterdir() if f.is_file())


def save(cache: PromptCache, directory: Path, settings: dict) -> Optional[Outcome]:
    """Write every entry of ``cache`` under ``directory`` (replacing the previous save at the
    end, atomically; files readable by their owner only: they hold the prompts). Run it on the
    thread that owns the cache (the engine thread: MLX arrays belong to its stream). An empty
    cache writes nothing (None): a run that cached nothing never replaces a save.

    Raises:
        OSError: a write failure, or less free space than the cache's KV (the new save is
            written beside the previous one); the previous save stays, no partial files.
    """
    t0 = time.time()
    if not len(cache):
        return None
    final = _snapshot(directory)
    tmp = directory / f"saving-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < cache.nbytes + (1 << 20):
        raise OSError(errno.ENOSPC, f"not enough free disk space for the save: it needs {size_text(cache.nbytes + (1 << 20))} "
                      f"({size_text(cache.nbytes)} of KV and 1 MiB for its other files), {size_text(free)} free")
    tmp.mkdir(mode=0o700, parents=True)
    try:
        _write(cache, tmp, settings)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk keeps no half save
        raise
    old = directory / f"replaced-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)
    return Outcome(len(cache), sum(len(e) for e in cache.entries()), cache.nbytes, time.time() - t0)


def _write(cache: PromptCache, tmp: Path, settings: dict) -> None:
    entries = sorted(cache.entries(), key=lambda e: e.last_used)
    segs, index = [], {}
    for e in entries:
        if e.seg is not None:
            for s in e.seg.chain():  # root first: a parent is always numbered before its children
                if id(s) not in index:
                    index[id(s)] = len(segs)
                    segs.append(s)
    seg_meta, sums = [], {}
    for i, s in enumerate(segs):
        cache.ops.save_parts(s.parts, str(tmp / f"seg-{i}.safetensors"))
        sums[f"seg-{i}.safetensors"] = _seal(tmp / f"seg-{i}.safetensors")
        seg_meta.append({"start": s.start, "end": s.end, "nbytes": s.nbytes,
                         "parent": None if s.parent is None else index[id(s.parent)]})
    np.savez(tmp / "tokens.npz", **{f"e{i}": e.tokens for i, e in enumerate(entries)})
    sums["tokens.npz"] = _seal(tmp / "tokens.npz")
    ent_meta = []
    for i, e in enumerate(entries):
        m = {"cache_type": e.cache_type, "tokens": len(e), "prompt_tokens": e.prompt_tokens, "hits": e.hits,
             "used_at": e.used_at, "branches": list(e.branches), "nbytes": e.nbytes}
        if e.seg is not None:
            m["seg"] = index[id(e.seg)]
        else:
            m["kv"] = f"kv-{i}.safetensors"
            cache.ops.save_kv(e.kv, str(tmp / m["kv"]))
            sums[m["kv"]] = _seal(tmp / m["kv"])
        ent_meta.append(m)
    manifest = {"format": FORMAT, "fingerprint": fingerprint(settings), "settings": settings,
                "saved_at": time.time(), "layout": cache.layout,
                "segments": seg_meta, "entries": ent_meta, "checksums": sums}
    (tmp / MANIFEST).write_text(json.dumps(manifest))  # last: a save without it is incomplete
    _seal(tmp / MANIFEST)
    _fsync_dir(tmp)


def _digest(path: Path, flush: bool = False) -> str:
    """xxh3-128 of the file's bytes; with ``flush``, make it owner-only (it holds prompts'
    token ids or KV, whatever the umask made it) and ``fsync`` it first (then read back from
    the page cache)."""
    if flush:
        fd = os.open(path, os.O_RDWR)
        try:
            os.fchmod(fd, 0o600)
            os.fsync(fd)
        finally:
            os.close(fd)
    return file_xxh3(path)


def _seal(path: Path) -> str:
    """Flush ``path`` to the disk and return its checksum: a restore reads only files whose
    bytes are the ones written (helper-52: zeroed KV of the right size loaded silently and
    changed answers)."""
    return _digest(path, flush=True)


def _check(snap: Path, name: str, sums: dict) -> Path:
    """``snap / name``, after its checksum matched the manifest's (saves that predate checksums
    have none). Raises ValueError for a damaged file."""
    path = snap / name
    if name in sums and _digest(path) != sums[name]:
        raise ValueError(f"{name} is damaged (its checksum differs from the one saved)")
    return path


def _fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable (POSIX; best effort where a directory cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _recover(directory: Path) -> None:
    """Tidy what a save cut short left: without a ``snapshot``, a stop killed between `save`'s
    two renames left the new save complete (its manifest is written last) or the previous one
    moved aside; either becomes the snapshot (the newest complete one first). Then the rest
    goes (a save without its manifest is incomplete)."""
    snap = _snapshot(directory)
    if not (snap / MANIFEST).exists():
        done = [d for d in directory.glob("saving-*") if (d / MANIFEST).exists()]
        done += [d for d in directory.glob("replaced-*") if (d / MANIFEST).exists()]
        if done:
            shutil.rmtree(snap, ignore_errors=True)
            done[0].rename(snap)
    for d in list(directory.glob("saving-*")) + list(directory.glob("replaced-*")):
        shutil.rmtree(d, ignore_errors=True)


def _chain(segs: list[dict], j: int) -> set[int]:
    """Segment ``j`` and its ancestors (indices into the manifest's segments)."""
    out = set()
    while j is not None:
        out.add(j)
        j = segs[j]["parent"]
    return out


def _choose(manifest: dict, max_entries: int, max_bytes: int) -> tuple[list[int], set[int]]:
    """The entries to restore (indices, least recently used first) and the segments they
    need: the most recently used ones that fit both budgets, shared segments counted once."""
    segs, ents = manifest["segments"], manifest["entries"]
    chosen: list[int] = []
    need: set[int] = set()
    total = 0
    for i in range(len(ents) - 1, -1, -1):
        if len(chosen) >= max_entries:
            break
        e = ents[i]
        chain = _chain(segs, e["seg"]) - need if "seg" in e else set()  # shared segments counted once
        add = sum(int(segs[j]["nbytes"]) for j in chain) if "seg" in e else int(e["nbytes"])
        if total + add > max_bytes:
            continue  # an older, smaller entry may still fit
        chosen.append(i)
        need |= chain
        total += add
    return chosen[::-1], need


def restore(cache: PromptCache, directory: Path, settings: dict) -> Optional[Outcome]:
    """Read the save under ``directory`` into ``cache`` (empty, before the backend registers:
    the listener publishes the restored blocks with the first report). None when there is no
    save. Every file is read before the cache is touched; one that cannot be read (or whose
    checksum differs) leaves out the entries whose KV it holds (`Outcome.damaged`).

    Raises:
        ValueError: a save of another format, model or layout (the message says which), or a
            damaged manifest or token file (the cache is left empty).
        OSError: the manifest or token file cannot be read.
    """
    t0 = time.time()
    _recover(directory)
    snap = _snapshot(directory)
    if not (snap / MANIFEST).exists():
        return None
    try:
        manifest = json.loads((snap / MANIFEST).read_text())
        manifest["segments"], manifest["entries"]  # noqa: B018 (present, or the save is damaged)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MANIFEST} is damaged ({type(e).__name__}: {e})") from None
    sums = manifest.get("checksums") or {}
    if manifest.get("format") != FORMAT:
        raise ValueError(f"saved in format {manifest.get('format')!r}, this version reads {FORMAT}")
    if manifest.get("fingerprint") != fingerprint(settings):
        raise ValueError(f"saved under other settings: {_differences(manifest.get('settings') or {}, settings)}")
    chosen, need = _choose(manifest, cache.max_entries, cache.max_bytes)
    tried = set(chosen)  # the rest may go into the disk tier (`_left_to_disk`)
    segs, ents = manifest["segments"], manifest["entries"]
    # A file that cannot be read (truncated, deleted) costs only the entries whose KV it holds.
    parts, bad, errors = {}, set(), []
    for j in sorted(need):  # parents first: a segment under a bad one is bad
        if segs[j]["parent"] in bad:
            bad.add(j)
            continue
        try:
            parts[j] = cache.ops.load_parts(str(_check(snap, f"seg-{j}.safetensors", sums)))
        except Exception as e:
            bad.add(j)
            errors.append(e)
    kvs = {}
    for i in chosen:
        if "kv" in ents[i]:
            try:
                kvs[i] = cache.ops.load_kv(str(_check(snap, ents[i]["kv"], sums)))
            except Exception as e:
                errors.append(e)
    readable = [i for i in chosen if ("seg" in ents[i] and ents[i]["seg"] not in bad) or i in kvs]
    damaged = len(chosen) - len(readable)
    chosen, need = readable, set().union(*(_chain(segs, ents[i]["seg"]) for i in readable if "seg" in ents[i]))
    path = _check(snap, "tokens.npz", sums)
    try:
        with np.load(path) as z:
            tokens = {i: z[f"e{i}"] for i in chosen}
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"tokens.npz is damaged ({e})") from None
    for i in chosen:  # checked before anything is attached: the cache stays empty on a bad save
        m = ents[i]
        ends = segs[m["seg"]]["end"] if "seg" in m else m["tokens"]
        if not (len(tokens[i]) == m["tokens"] == ends) or m["cache_type"] not in CACHE_TYPES:
            raise ValueError(f"{MANIFEST} is damaged: entry {i} does not match its KV ({len(tokens[i])} token ids, "
                             f"{m['tokens']} tokens, KV to {ends}, type {m['cache_type']!r})")
    built = {}
    for j in sorted(need):  # parents first (numbered first by `save`)
        m = segs[j]
        built[j] = cache.restore_segment(m["start"], m["end"], parts[j], built.get(m["parent"]))
    out = Outcome(left=len(ents) - len(chosen) - damaged, saved_at=float(manifest.get("saved_at", 0.0)),
                  damaged=damaged, error=f"{type(errors[0]).__name__}: {errors[0]}" if errors else "")
    for i in chosen:
        m = ents[i]
        e = cache.restore_entry(tokens[i], m["cache_type"], kv=kvs.get(i), seg=built.get(m.get("seg")),
                                prompt_tokens=int(m["prompt_tokens"]), used_at=float(m["used_at"]),
                                hits=int(m["hits"]), branches=m.get("branches"))
        out.entries += 1
        out.tokens += len(e)
    cache.trim_to()  # byte counts recomputed from the arrays: within budget, whatever the manifest said
    out.nbytes = cache.nbytes
    if cache.disk is not None and out.left:
        out.to_disk = _left_to_disk(cache, snap, manifest, tried, sums)
        out.left -= out.to_disk
    out.seconds = time.time() - t0
    return out


def _left_to_disk(cache: PromptCache, snap: Path, manifest: dict, tried: set[int], sums: dict) -> int:
    """Rule 8 at a restart with a smaller memory budget: the saved entries it left out go into
    the disk tier (helper-73: the next save dropped them), the most recently used first while
    the tier's budget holds them (each counted whole: shared parts are written once, so the
    tier may hold a few more), written least recently used first so the tier's LRU order is
    the save's. One entry's KV in memory at a time; an entry whose file cannot be read stays
    out. Returns the entries moved."""
    segs, ents = manifest["segments"], manifest["entries"]
    pick, total = [], 0
    for i in range(len(ents) - 1, -1, -1):
        if i in tried:  # restored, or damaged
            continue
        e = ents[i]
        size = sum(int(segs[j]["nbytes"]) for j in _chain(segs, e["seg"])) if "seg" in e else int(e["nbytes"])
        if total + size <= cache.disk.max_bytes:
            pick.append(i)
            total += size
    moved = 0
    try:
        z = np.load(_check(snap, "tokens.npz", sums))
    except (OSError, ValueError):
        return 0
    with z:
        for i in reversed(pick):
            m = ents[i]
            try:
                tokens = z[f"e{i}"]
                if "seg" in m:
                    chain = sorted(_chain(segs, m["seg"]), key=lambda j: segs[j]["start"])
                    pieces = [(cache.ops.load_parts(str(_check(snap, f"seg-{j}.safetensors", sums))),
                               segs[j]["end"] - segs[j]["start"]) for j in chain]
                    kv, cuts = cache.ops.join(pieces, int(m["tokens"])), [segs[j]["start"] for j in chain]
                else:
                    kv, cuts = cache.ops.load_kv(str(_check(snap, m["kv"], sums))), []
                if len(tokens) != int(m["tokens"]):
                    continue
            except Exception:  # a file that cannot be read: that entry stays out, as at any restore
                continue
            moved += cache.save_to_disk(tokens, kv, m["cache_type"], int(m["prompt_tokens"]), cuts=cuts,
                                        used_at=float(m["used_at"]), hits=int(m["hits"])) is not None
    return moved
