"""The prompt cache's disk tier (cache rule 8, ``--disk-cache-bytes``, backend.disktier)."""

import errno
import json
import logging
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from backend import sim
from backend.cache import PromptCache
from backend.disktier import BRANCH_SHARE, MAX_CHAIN, DiskTier
from mlxgw.httpget import get_json, post
from texts import words


class Owners:
    """A listener keeping what the reporter keeps: how many saved entries hold each prompt,
    plus the order of events (to check a spill never lets a prompt's blocks go in between)."""

    def __init__(self):
        self.held: Counter = Counter()
        self.gaps = 0  # a prompt that went to zero holders and came back (blocks left Redis)
        self.gone: set = set()

    def on_saved(self, e):
        k = tuple(e.tokens.tolist())
        if k in self.gone:
            self.gaps += 1
            self.gone.discard(k)
        self.held[k] += 1

    def on_evicted(self, e):
        k = tuple(e.tokens.tolist())
        self.held[k] -= 1
        assert self.held[k] >= 0, "evicted more than saved"
        if self.held[k] == 0:
            del self.held[k]
            self.gone.add(k)


BPT = 10  # sim KV bytes per token


def _cache(tmp_path, layout, memory_tokens=700, disk_tokens=10_000, pending=None, timing=None, settings=None,
           max_chain=MAX_CHAIN, branch_share=BRANCH_SHARE, **kw):
    ops = sim.SimKVOps(timing or sim.SimTiming(kv_bytes_per_token=BPT))
    disk = DiskTier(tmp_path / "tier", disk_tokens * BPT, ops, max_pending_bytes=pending, settings=settings,
                    max_chain=max_chain, branch_share=branch_share)
    owners = Owners()
    c = PromptCache(max_entries=10, max_bytes=memory_tokens * BPT, layout=layout, share_min_tokens=16,
                    min_hit_tokens=32, listener=owners, ops=ops, disk=disk, **kw)
    return c, disk, owners


def _conv(k: int, n: int = 300) -> list[int]:
    return list(range(10_000 * (k + 1), 10_000 * (k + 1) + n))


def _save(c, toks):
    return c.insert(toks, sim.SimKV(len(toks), c.ops.timing), "assistant", prompt_len=len(toks))


def _keys(entries):
    return sorted(tuple(e.tokens.tolist()) for e in entries)


@pytest.mark.parametrize("layout, pending", [("shared", None), ("whole", None), ("shared", 10**9)])
def test_an_evicted_entry_goes_to_disk_and_comes_back_on_its_next_turn(tmp_path, layout, pending):
    c, disk, owners = _cache(tmp_path, layout, pending=pending)
    a, b, d = _conv(0), _conv(1), _conv(2)
    for t in (a, b, d):  # room for two 300-token entries: a is evicted, to disk
        _save(c, t)
    assert disk.flush(5)
    assert _keys(c.entries()) == _keys([c.get(i) for i in (2, 3)]) and len(c) == 2
    assert [len(e) for e in disk.entries()] == [300] and disk.entries()[0].tokens.tolist() == a
    assert (c.evictions, disk.spills, disk.nbytes) == (1, 1, 300 * BPT)
    assert [p.name for p in (tmp_path / "tier").iterdir()] == ["tier-1.safetensors"]
    # Every prompt is still held by someone (memory or disk): its blocks stay owned.
    assert set(owners.held) == {tuple(a), tuple(b), tuple(d)} and owners.gaps == 0

    turn = a + [7] * 40
    hit = c.fetch(turn)  # a's next turn: read back from disk, not prefilled
    assert hit.reused == 300 and c.ops.nbytes(hit.kv) == 300 * BPT and c.get(hit.entry_id) is None
    assert (disk.reads, disk.read_tokens, len(c), len(disk)) == (1, 300, 2, 1)  # nothing moved
    # The turn's own save extends a, in memory; a stays on disk (the start of the turn's chain
    # there later); b (now the least recently used) goes to disk for the turn's room.
    _save(c, turn)
    assert disk.flush(5)
    assert _keys(c.entries()) == sorted([tuple(turn), tuple(d)])
    assert _keys(disk.entries()) == sorted([tuple(a), tuple(b)]) and len(list((tmp_path / "tier").iterdir())) == 2
    assert set(owners.held) == {tuple(a), tuple(turn), tuple(b), tuple(d)} and owners.gaps == 0
    assert c.nbytes == 640 * BPT and disk.nbytes == 600 * BPT and disk.write_bytes == 600 * BPT
    # The turn evicted in turn: only its 40 new tokens are written, in a part after a's; it
    # replaces a (its tokens start with a's whole prompt).
    _save(c, _conv(3))
    _save(c, _conv(4))
    assert disk.flush(5) and tuple(turn) in _keys(disk.entries()) and tuple(a) not in _keys(disk.entries())
    (t,) = [e for e in disk.entries() if len(e) == 340]
    assert [(s, e) for s, e, _ in disk.parts(t)] == [(0, 300), (300, 340)]
    assert disk.write_bytes == (600 + 40 + 300) * BPT  # a, b, the turn's 40 tokens, d
    assert set(owners.held) >= {tuple(turn), tuple(b), tuple(d)} and tuple(a) not in owners.held
    assert owners.gaps == 0
    hit = c.fetch(turn + [1])  # read back from its two files, all 340 tokens
    assert hit.reused == 340 and c.ops.nbytes(hit.kv) == 340 * BPT


def test_a_prompt_served_as_well_from_memory_reads_nothing(tmp_path):
    c, disk, _ = _cache(tmp_path, "shared", memory_tokens=450)  # the system prompt once, two tails
    system = list(range(50, 250))
    _save(c, system + _conv(0, 100))
    _save(c, system + _conv(1, 100))
    _save(c, system + _conv(2, 100))  # the first conversation to disk
    assert len(disk) == 1
    # A new conversation on the system prompt: memory serves the 200 shared tokens as well as
    # the disk would (the disk entry shares the same 200): no read.
    hit = c.fetch(system + _conv(3, 50))
    assert hit.reused == 200 and disk.reads == 0 and len(disk) == 1
    # Less than share_min_tokens (16) more on disk than in memory: no read either.
    hit = c.fetch(system + _conv(0, 10) + [1])
    assert hit.reused == 200 and disk.reads == 0


def test_a_save_that_extends_a_disk_entry_replaces_it_on_disk_writing_only_its_new_tokens(tmp_path):
    c, disk, owners = _cache(tmp_path, "shared")
    a = _conv(0)
    for t in (a, _conv(1), _conv(2)):
        _save(c, t)
    assert _keys(disk.entries()) == [tuple(a)]
    # a's conversation went on elsewhere (computed again, say); its longer save covers the disk entry.
    _save(c, a + [5] * 100)  # 400 tokens: b, now the least recently used, goes to disk for room
    assert _keys(disk.entries()) == sorted([tuple(a), tuple(_conv(1))])
    for k in (3, 4):  # the longer one evicted too: it continues a on disk
        _save(c, _conv(k))
    assert _keys(disk.entries()) == sorted([tuple(a + [5] * 100), tuple(_conv(1)), tuple(_conv(2))])
    long = next(e for e in disk.entries() if len(e) == 400)
    assert [(s, e, f) for s, e, f in disk.parts(long)] == [(0, 300, "tier-1.safetensors"), (300, 400, "tier-4.safetensors")]
    assert disk.nbytes == (400 + 300 + 300) * BPT == disk.write_bytes
    assert tuple(a) not in owners.held and tuple(a + [5] * 100) in owners.held and owners.gaps == 0


def test_the_disk_budget_evicts_its_least_recently_used_entry(tmp_path):
    c, disk, owners = _cache(tmp_path, "whole", memory_tokens=300, disk_tokens=650)
    convs = [_conv(k) for k in range(4)]
    for t in convs:  # memory holds one: three go to disk, which holds two
        _save(c, t)
    assert _keys(c.entries()) == [tuple(convs[3])]
    assert _keys(disk.entries()) == sorted([tuple(convs[1]), tuple(convs[2])])
    assert (disk.spills, disk.evictions, disk.nbytes) == (3, 1, 600 * BPT)
    assert tuple(convs[0]) not in owners.held  # dropped from disk: its blocks leave Redis
    assert len(list((tmp_path / "tier").iterdir())) == 2
    assert c.fetch(convs[0] + [1]).reused == 0


def test_an_unreadable_disk_entry_costs_only_its_prefill(tmp_path, caplog):
    c, disk, owners = _cache(tmp_path, "shared")
    a = _conv(0)
    for t in (a, _conv(1), _conv(2)):
        _save(c, t)
    (tmp_path / "tier" / "tier-1.safetensors").unlink()
    hit = c.fetch(a + [1])
    assert hit.reused == 0 and len(disk) == 0 and disk.failures == 1 and disk.reads == 0
    assert tuple(a) not in owners.held  # not owned any more: no gateway sends it here for it
    assert "could not read" in caplog.text and "prefilled instead" in caplog.text


def test_a_failed_write_drops_the_entry_as_without_a_tier(tmp_path):
    c, disk, owners = _cache(tmp_path, "shared")
    (tmp_path / "tier").rmdir()
    (tmp_path / "tier").write_text("")  # not a directory any more: every write fails
    for t in (_conv(0), _conv(1), _conv(2)):
        _save(c, t)
    assert len(disk) == 0 and disk.failures == 1 and len(c) == 2
    assert tuple(_conv(0)) not in owners.held


def test_the_tier_is_owner_only_whatever_the_umask_or_the_directory_was(tmp_path):
    import stat

    (tmp_path / "tier").mkdir(mode=0o755)
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    for k in range(4):
        _save(c, _conv(k))
    disk.close()  # kept: manifest and tokens too
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700
    files = list((tmp_path / "tier").iterdir())
    assert len(files) == 4 and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}, files


def test_a_new_tier_empties_its_directory_and_clear_removes_files(tmp_path):
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "tier-9.safetensors").write_text("{}")
    (tmp_path / "tier" / "notes.txt").write_text("mine")
    c, disk, owners = _cache(tmp_path, "shared")
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["notes.txt"]  # only its own files
    for t in (_conv(0), _conv(1), _conv(2)):
        _save(c, t)
    c.clear()
    assert len(disk) == 0 and not owners.held
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["notes.txt"]


def test_writes_go_behind_the_eviction_and_a_prompt_back_early_takes_the_host_copy(tmp_path):
    """Write-behind: an eviction does not wait for the disk (the engine thread goes on
    decoding); a prompt whose entry is still being written gets it from the host copy, and
    the file the writer then finishes is removed."""
    timing = sim.SimTiming(kv_bytes_per_token=BPT, disk_write_rate=3000 * BPT)  # 300 tokens: 0.1 s
    c, disk, owners = _cache(tmp_path, "shared", pending=10**9, timing=timing)
    a = _conv(0)
    t0 = time.monotonic()
    for t in (a, _conv(1), _conv(2)):
        _save(c, t)
    assert time.monotonic() - t0 < 0.08 and disk.pending_bytes == 300 * BPT  # queued, not written
    hit = c.fetch(a + [1])
    assert hit.reused == 300 and disk.reads == 1 and disk.failures == 0 and disk.pending_bytes == 300 * BPT
    _save(c, a + [1])  # the turn's save covers a, which stays on disk: b goes there for its room
    assert disk.flush(5) and disk.pending_bytes == 0
    assert _keys(disk.entries()) == sorted([tuple(a), tuple(_conv(1))])
    assert [p.name for p in sorted((tmp_path / "tier").iterdir())] == ["tier-1.safetensors", "tier-2.safetensors"]
    assert set(owners.held) == {tuple(a), tuple(a + [1]), tuple(_conv(1)), tuple(_conv(2))} and owners.gaps == 0
    # A part dropped while its write is under way: the writer removes the file it wrote.
    slow = sim.SimTiming(kv_bytes_per_token=BPT, disk_write_rate=1000 * BPT)  # 300 tokens: 0.3 s
    c2, disk2, _ = _cache(tmp_path / "2", "whole", memory_tokens=300, pending=10**9, timing=slow)
    _save(c2, _conv(5))
    _save(c2, _conv(6))  # conversation 5 to disk, written behind
    time.sleep(0.05)  # the writer is inside the write
    (e5,) = disk2.entries()
    disk2.drop(e5)
    assert disk2.flush(5) and list((tmp_path / "2" / "tier").iterdir()) == [] and disk2.nbytes == 0


def test_an_eviction_waits_for_the_writer_past_max_pending_bytes(tmp_path):
    timing = sim.SimTiming(kv_bytes_per_token=BPT, disk_write_rate=3000 * BPT)
    c, disk, _ = _cache(tmp_path, "shared", memory_tokens=300, pending=400 * BPT, timing=timing)
    t0 = time.monotonic()
    for k in range(3):  # two 300-token copies queued would be 600 tokens' bytes, over 400
        _save(c, _conv(k))
    assert time.monotonic() - t0 >= 0.09 and disk.write_waits == 1 and disk.pending_bytes <= 400 * BPT
    assert disk.flush(5) and len(list((tmp_path / "tier").iterdir())) == 2


def test_a_failed_background_write_drops_the_entry_at_the_next_lookup(tmp_path, caplog):
    c, disk, owners = _cache(tmp_path, "shared", pending=10**9)
    (tmp_path / "tier").rmdir()
    (tmp_path / "tier").write_text("")  # every write fails
    for t in (_conv(0), _conv(1), _conv(2)):
        _save(c, t)
    assert disk.flush(5) and disk.failures == 1 and len(disk) == 1  # not reaped yet
    assert c.fetch(_conv(0) + [1]).reused == 0  # its prefix is gone: prefilled
    assert len(disk) == 0 and tuple(_conv(0)) not in owners.held
    assert disk.spills == 0  # never on disk: not a spill (helper-55 saw failed writes counted)
    assert "could not write" in caplog.text


SETTINGS = {"model_files": "abcd", "engine": "sim", "layout": "shared"}


def _kept(tmp_path, n=5, pending=10**9):
    """A tier holding conversations 0 .. n-3 (memory keeps the last two), kept at a clean stop
    (written behind, or with ``pending`` None in the caller's thread)."""
    c, disk, _ = _cache(tmp_path, "shared", pending=pending, settings=SETTINGS)
    for k in range(n):
        _save(c, _conv(k))
    disk.close()
    return c


def _names(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tier").iterdir())


@pytest.mark.parametrize("pending", [10**9, None])
def test_a_clean_stop_keeps_the_tier_and_the_next_start_adopts_it(tmp_path, pending):
    _kept(tmp_path, pending=pending)
    assert _names(tmp_path) == ["manifest.json", "tier-1.safetensors", "tier-2.safetensors", "tier-3.safetensors",
                                "tokens-4.npz"]
    c, disk, owners = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    assert disk.adopted == (3, 900, 900 * BPT, "")
    assert [e.tokens.tolist() for e in disk.entries()] == [_conv(0), _conv(1), _conv(2)]  # LRU order kept
    c.announce_disk()
    assert set(owners.held) == {tuple(_conv(k)) for k in range(3)}  # published like any save
    hit = c.fetch(_conv(1) + [1])
    assert hit.reused == 300 and disk.reads == 1  # read back, its checksum checked
    for k in (7, 8, 9):  # memory holds two: conv 7 goes to disk, in a file with a new name
        _save(c, _conv(k))
    assert disk.flush(5) and len(disk) == 4 and [n for n in _names(tmp_path) if n.startswith("tier-")] == [
        "tier-1.safetensors", "tier-2.safetensors", "tier-3.safetensors", "tier-4.safetensors"]


def test_a_quiet_moments_checkpoint_survives_a_kill(tmp_path):
    """The engine checkpoints the tier at quiet moments: a backend killed afterwards (no
    `close`) comes back with the entries of that checkpoint; files written after it, which no
    manifest names, are removed (helper-53: a killed backend lost its whole tier)."""
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    for k in range(4):
        _save(c, _conv(k))
    assert disk.flush(5) and disk.checkpoint() and not disk.checkpoint()  # nothing new: not written again
    _save(c, _conv(4))  # conversation 2 to disk after the checkpoint
    assert disk.flush(5) and len(disk) == 3
    c2, disk2, _ = _cache(tmp_path, "shared", settings=SETTINGS)  # the kill: the first tier never closed
    assert [e.tokens.tolist() for e in disk2.entries()] == [_conv(0), _conv(1)]
    assert [n for n in _names(tmp_path) if n.startswith("tier-")] == ["tier-1.safetensors", "tier-2.safetensors"]


def test_a_tier_kept_under_other_settings_stays_until_this_run_writes(tmp_path, caplog):
    """As a memory save under other settings stays until the run saves its own (helper-53: one
    start with another setting deleted the whole tier)."""
    _kept(tmp_path)
    before = _names(tmp_path)
    c, disk, _ = _cache(tmp_path, "shared", settings={**SETTINGS, "engine": "mlx"})
    assert disk.adopted is None and len(disk) == 0
    assert "not used (kept under other settings: the engine (saved sim, now mlx))" in caplog.text
    disk.close()  # a run that wrote nothing: the earlier tier is untouched, manifest and all
    assert _names(tmp_path) == before
    c, disk, _ = _cache(tmp_path, "shared", settings={**SETTINGS, "engine": "mlx"})
    for k in range(3):  # its first write removes the earlier tier first
        _save(c, _conv(10 + k))
    assert "removed 3 files an earlier run kept" in caplog.text
    assert [n for n in _names(tmp_path) if n.startswith("tier-")] == ["tier-4.safetensors"]
    assert "manifest.json" not in _names(tmp_path)
    # Tier files and no manifest (a run killed before any checkpoint): removed at start.
    c2, disk2, _ = _cache(tmp_path, "shared", settings=SETTINGS)
    assert disk2.adopted is None and _names(tmp_path) == []


def test_a_smaller_budget_leaves_the_rest_on_disk_until_it_writes(tmp_path, caplog):
    _kept(tmp_path)
    c, disk, _ = _cache(tmp_path, "shared", disk_tokens=650, pending=10**9, settings=SETTINGS)
    assert disk.adopted == (2, 600, 600 * BPT, "1 left out by this run's budget (kept on disk until this run "
                                               "writes its own entries)")
    assert [e.tokens.tolist() for e in disk.entries()] == [_conv(1), _conv(2)]
    disk.close()  # wrote nothing: the next run with the whole budget has all three back
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    assert disk.adopted[0] == 3
    disk.close()
    c, disk, _ = _cache(tmp_path, "shared", disk_tokens=650, pending=10**9, settings=SETTINGS)
    c.announce_disk()
    for k in range(3):  # a write: the left-out entry goes first
        _save(c, _conv(10 + k))
    assert disk.flush(5) and "removed 1 files an earlier run kept" in caplog.text
    assert not (tmp_path / "tier" / "tier-1.safetensors").exists()


def test_a_damaged_kept_file_costs_its_prefill(tmp_path, caplog):
    _kept(tmp_path)
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    c.announce_disk()
    for name in ("tier-2.safetensors", "tier-3.safetensors"):
        f = tmp_path / "tier" / name
        f.write_text(f.read_text().replace("300", "999"))  # same length, other bytes
    assert c.fetch(_conv(1) + [1]).reused == 0 and disk.failures == 1 and len(disk) == 2  # read here
    hit = c.fetch(_conv(2) + [1], defer=True)  # read by the reader thread
    assert hit.read.done.wait(5) and c.finish_read(hit).reused == 0 and disk.failures == 2 and len(disk) == 1
    assert "checksum differs" in caplog.text


@pytest.mark.parametrize("pending", [10**9, None])
def test_a_kept_file_removed_or_cut_short_is_named_at_the_start(tmp_path, caplog, pending):
    """A file of the tier deleted or truncated while the backend was down: the start leaves out
    the entries using it and says which file and why (helper-58: a deleted file was dropped
    with an INFO line, and a truncated one was adopted to fail at its first read as "damaged")."""
    _kept(tmp_path, pending=pending)
    (tmp_path / "tier" / "tier-1.safetensors").unlink()
    with open(tmp_path / "tier" / "tier-2.safetensors", "r+b") as f:
        size = f.seek(0, 2)
        f.truncate(10)
    caplog.set_level(logging.INFO)
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    assert disk.adopted == (1, 300, 300 * BPT, "") and disk.entries()[0].tokens.tolist() == _conv(2)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.startswith("disk tier: 2 entries kept in ") and "not adopted: tier-1.safetensors missing; " \
        f"tier-2.safetensors 10 bytes where {size:,} were written; their prompts are prefilled" in warning, warning
    assert c.fetch(_conv(2) + [1]).reused == 300 and disk.failures == 0


def test_a_checkpoint_is_written_when_a_file_was_removed_under_the_running_tier(tmp_path):
    """The manifest records each file's size; one removed while the backend runs (before the
    checkpoint that would take its size) is recorded without one, and the checkpoint is still
    written (a failing stat would fail every checkpoint after it)."""
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    for k in range(4):
        _save(c, _conv(k))
    assert disk.flush(5)
    (tmp_path / "tier" / "tier-1.safetensors").unlink()
    assert disk.checkpoint()
    parts = {p["file"]: p for p in json.loads((tmp_path / "tier" / "manifest.json").read_text())["parts"]}
    assert "size" not in parts["tier-1.safetensors"]
    assert parts["tier-2.safetensors"]["size"] == (tmp_path / "tier" / "tier-2.safetensors").stat().st_size > 0


class FullDiskOps(sim.SimKVOps):
    """Sim ops whose writes fail with ENOSPC while ``full`` (a disk filling up)."""

    full = False

    def save_parts(self, parts, path):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        super().save_parts(parts, path)

    save_kv = write_host = save_parts


@pytest.mark.parametrize("pending", [10**9, None])
def test_a_full_disk_makes_new_entries_replace_the_oldest(tmp_path, caplog, pending):
    """helper-53: once the disk filled, every later write failed and the newest conversations
    were the ones dropped; now the budget comes down to what the tier holds, so a new entry
    replaces the oldest."""
    ops = FullDiskOps(sim.SimTiming(kv_bytes_per_token=BPT))
    disk = DiskTier(tmp_path / "tier", 10_000 * BPT, ops, max_pending_bytes=pending)
    c = PromptCache(max_entries=10, max_bytes=700 * BPT, layout="shared", share_min_tokens=16, min_hit_tokens=32,
                    ops=ops, disk=disk)
    for k in range(4):
        _save(c, _conv(k))
    assert disk.flush(5) and len(disk) == 2
    ops.full = True
    _save(c, _conv(4))  # this write fails: the disk is full
    assert disk.flush(5) and disk.failures == 1
    c.fetch([1, 2, 3])  # the next lookup reaps a background failure
    assert "disk tier: the disk of" in caplog.text and disk.max_bytes == 600 * BPT
    ops.full = False
    _save(c, _conv(5))  # evicts the oldest on disk to make room, and is written
    assert disk.flush(5) and [e.tokens.tolist() for e in disk.entries()] == [_conv(1), _conv(3)]


def test_sim_disk_reads_take_the_modelled_time(tmp_path):
    timing = sim.SimTiming(kv_bytes_per_token=1_000_000, disk_read_rate=1e9, disk_write_rate=2e9)
    ops = sim.SimKVOps(timing)
    t0 = time.monotonic()
    ops.save_kv(sim.SimKV(100, timing), str(tmp_path / "x"))  # 100 MB at 2 GB/s: 50 ms
    t1 = time.monotonic()
    assert ops.load_kv(str(tmp_path / "x")).n == 100  # at 1 GB/s: 100 ms
    t2 = time.monotonic()
    assert 0.05 <= t1 - t0 < 0.5 and 0.1 <= t2 - t1 < 0.6


def _chat(url: str, text: str) -> dict:
    status, _, raw = post(url + "/v1/chat/completions", {
        "model": "demo-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
        "temperature": 0})
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("layout", ["shared", "whole"])
def test_a_real_backend_reads_an_evicted_prompt_back_with_the_right_kv(make_stack, redis_server, tmp_path, layout):
    """A real mlx-lm backend whose memory holds one conversation: the one evicted to disk is
    still owned in Redis, its next request reuses it from disk, and the greedy answer from the
    KV read back equals the one computed from scratch."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "0.5MB", "--cache-layout", layout,
                      "--disk-cache-dir", str(tmp_path / "tier"), "--disk-cache-bytes", "64MB")
    s.wait()
    # An empty tier is a tier: its budget shows before anything was spilled (it read 0, helper-53).
    assert get_json(b.url + "/health")["disk_budget_bytes"] == 64 << 20
    first = [_chat(b.url, words(300, seed=80 + k)) for k in range(3)]
    health = get_json(b.url + "/health")
    assert health["disk_spills"] >= 1 and health["disk_entries"] >= 1, {k: v for k, v in health.items() if "cache" in k or "disk" in k or "kv" in k}
    assert health["disk_bytes"] > 0 and health["disk_budget_bytes"] == 64 << 20
    again = _chat(b.url, words(300, seed=80))
    prompt = first[0]["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert again["choices"][0]["message"]["content"] == first[0]["choices"][0]["message"]["content"]
    health = get_json(b.url + "/health")
    assert health["disk_reads"] == 1 and health["disk_read_tokens"] == prompt - 1, health
    metrics = urllib.request.urlopen(b.url + "/metrics", timeout=10).read().decode()
    assert 'mlxgw:disk_cache_reads_total{model_name="demo-tiny"} 1.0' in metrics
    assert f'mlxgw:disk_cache_read_tokens_total{{model_name="demo-tiny"}} {health["disk_read_tokens"]}.0' in metrics
    # `mlxgw status` shows the tier (from the registry record, after the next heartbeat). The
    # tier's size as /health says it now: the repeat's own save may spill another entry after the
    # read above (a full run on a loaded machine saw 0.8 MiB in status against the earlier figure).
    deadline = time.time() + 10
    while True:
        health = get_json(b.url + "/health")
        out = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--redis-url", redis_server.url,
                              "--namespace", s.namespace], capture_output=True, text=True, timeout=60)
        # The table's row, not any line holding "b0": the random namespace (t + 8 hex digits)
        # holds it in ~3% of runs, and the first line names it (two CI failures, session 47).
        row = next((ln for ln in out.stdout.splitlines() if ln.lstrip("│| ").startswith("b0 ")), "")
        if f"{health['disk_bytes'] / 2**20:.1f} / 1 " in row or time.time() > deadline:
            break
        time.sleep(0.3)
    assert "disk MiB / reads" in out.stdout and f"{health['disk_bytes'] / 2**20:.1f} / 1 " in row, out.stdout
    assert "tier=disk" in out.stdout  # a spill's event says where the entry went (helper-54: left out)
    # A clean stop keeps the tier (memory held conversation 0's repeat; 1 and 2 are on disk); the
    # backend restarted, in the other cache layout (the tier's chains do not depend on it),
    # adopts it and serves both from it, with the right KV.
    b.stop()
    log = b.log_path.read_text()
    assert ("entries (" in log or "1 entry (" in log) and "kept in " in log
    assert (tmp_path / "tier" / "manifest.json").exists()
    i = b.cmd.index("--cache-layout")
    b.cmd[i + 1] = other = {"shared": "whole", "whole": "shared"}[layout]
    b.start(s.env())
    b.wait_healthy()
    log = b.log_path.read_text()
    assert "adopted from" in log and f"{other} layout" in log.split("adopted from")[1], log[-3000:]
    # 1 and 2, and 0: the repeat of 0 read it from disk, and it stays there while the repeat's own
    # save is in memory (the start of that one's chain on disk, had it been evicted).
    assert get_json(b.url + "/health")["disk_entries"] == 3
    for k in (1, 2):
        again = _chat(b.url, words(300, seed=80 + k))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first[k]["usage"]["prompt_tokens"] - 1
        assert again["choices"][0]["message"]["content"] == first[k]["choices"][0]["message"]["content"]
    assert get_json(b.url + "/health")["disk_reads"] == 2


def _turns(url: str, texts: list, answers: list) -> dict:
    """One chat turn: ``texts`` are the user messages so far, ``answers`` the assistant's."""
    msgs = []
    for i, t in enumerate(texts):
        msgs.append({"role": "user", "content": t})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    status, _, raw = post(url + "/v1/chat/completions", {"model": "demo-tiny", "messages": msgs, "max_tokens": 8,
                                                         "temperature": 0})
    assert status == 200, raw
    return json.loads(raw)


def test_a_real_backend_extends_a_chain_on_disk_turn_after_turn_with_the_right_kv(make_stack, tmp_path):
    """A real mlx-lm backend with memory for about one conversation: one conversation's turns,
    each pushed to disk by two others before the next comes, are read back from a chain of
    files that grows by each turn's new tokens (mlx arrays written by the host path, cut at
    token positions, joined on the read). Every turn's cached tokens and greedy answer equal a
    reference backend's that kept everything in memory."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "0.5MB", "--cache-layout", "whole",
                      "--disk-cache-dir", str(tmp_path / "tier"), "--disk-cache-bytes", "64MB")
    ref = s.add_backend("ref", None, "--cache-bytes", "256MB")
    s.wait()
    texts, answers, other = [], [], 0
    for turn in range(4):
        texts.append(words(300 if turn == 0 else 60, seed=200 + turn))
        got, want = _turns(b.url, texts, answers), _turns(ref.url, texts, answers)
        assert got["usage"] == want["usage"], turn  # the same tokens reused from disk as from memory
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], turn
        answers.append(got["choices"][0]["message"]["content"])
        for _ in range(2):  # two other conversations push this one to disk
            other += 1
            _chat(b.url, words(300, seed=900 + other))
    health = get_json(b.url + "/health")
    assert health["disk_reads"] >= 3 and health["disk_failures"] == 0, health
    tier = get_json(b.url + "/internal/cache")["disk"]
    assert max(len(e["parts"]) for e in tier) >= 4, tier  # this conversation's chain
    b.stop()
    m = json.loads((tmp_path / "tier" / "manifest.json").read_text())
    parent = {p["file"]: p["parent"] for p in m["parts"]}

    def depth(f):
        return 0 if f is None else 1 + depth(parent[f])

    assert max(depth(e["part"]) for e in m["entries"]) >= 4, m  # prompt parts and answer parts, turn by turn
    held = sum(p["nbytes"] for p in m["parts"])
    per_token = held / sum(p["end"] - p["start"] for p in m["parts"])
    assert held == health["disk_bytes"]
    # Written beyond what is held: only the answers' tails the next turns re-rendered otherwise
    # (whole files rewrote the conversation every turn: over 1,000 tokens more here).
    assert health["disk_write_bytes"] - held <= 100 * per_token, (health, per_token)


def test_a_real_backend_shares_a_part_on_disk_with_a_conversation_branching_inside_it(make_stack, tmp_path):
    """A real mlx-lm backend, whole layout (no segment cuts), memory for about one conversation:
    two conversations opening with the same 300 words go to disk; the second's chain branches
    off inside the first's prompt part (the shared words held once, in the first's file), and
    each next turn, read back through that file, has the cached tokens and greedy answer of a
    reference backend that kept everything in memory."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "0.5MB", "--cache-layout", "whole",
                      "--disk-cache-dir", str(tmp_path / "tier"), "--disk-cache-bytes", "64MB")
    ref = s.add_backend("ref", None, "--cache-bytes", "256MB")
    s.wait()
    opening = words(300, seed=300)
    texts = [[opening + " " + words(40, seed=310 + k)] for k in range(2)]
    answers: list = [[], []]
    for k in range(2):
        got, want = _turns(b.url, texts[k], answers[k]), _turns(ref.url, texts[k], answers[k])
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], k
        answers[k].append(got["choices"][0]["message"]["content"])
    _chat(b.url, words(300, seed=950))  # pushes the second conversation to disk too
    cache = get_json(b.url + "/internal/cache")
    first, second = sorted(cache["disk"], key=lambda e: e["parts"][0][1], reverse=True)
    # The first: its prompt part, then its answer's; the second uses the first file's opening.
    assert len(first["parts"]) == 2 and first["parts"][0][0] == 0 and len(second["parts"]) == 3, cache["disk"]
    branch = second["parts"][0][1]
    assert 300 < branch < first["parts"][0][1] and second["parts"][1][0] == branch, cache["disk"]
    assert second["parts"][0][2] == first["parts"][0][2] != second["parts"][1][2]  # one file, named under both
    assert cache["disk_nbytes"] < first["nbytes"] + second["nbytes"], cache  # that file counted once
    for k in (1, 0):
        texts[k].append(words(20, seed=320 + k))
        got, want = _turns(b.url, texts[k], answers[k]), _turns(ref.url, texts[k], answers[k])
        assert got["usage"] == want["usage"], k  # the same tokens reused from disk as from memory
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], k
    health = get_json(b.url + "/health")
    assert health["disk_reads"] == 2 and health["disk_failures"] == 0, health


@pytest.mark.parametrize("flags, says", [
    (["--disk-cache-bytes", "1GB"], "--disk-cache-bytes needs a directory: --disk-cache-dir, or --cache-dir"),
    (["--disk-cache-dir", "{tmp}/t"], "--disk-cache-dir needs --disk-cache-bytes"),
    (["--disk-branch-share", "0.3"], "--disk-branch-share needs --disk-cache-bytes"),
    (["--disk-chain-parts", "4"], "--disk-chain-parts needs --disk-cache-bytes"),
    (["--disk-cache-dir", "{tmp}/kv", "--cache-dir", "{tmp}/kv", "--disk-cache-bytes", "1GB"],
     "--disk-cache-dir must differ from --cache-dir"),
    (["--disk-cache-dir", "{tmp}/t", "--disk-cache-bytes", "1GB", "--disk-write-queue-bytes", "lots"],
     "--disk-write-queue-bytes: 'lots' is not a size"),
    (["--disk-cache-dir", "{tmp}/t", "--disk-cache-bytes", "1.5"],
     "--disk-cache-bytes: '1.5' is a fraction of a byte (a unit is missing)"),
    (["--disk-cache-dir", "{tmp}/t", "--disk-cache-bytes", "-5MB"],  # argparse said "expected one argument"
     "--disk-cache-bytes: '-5MB' must be more than 0 bytes"),
    (["--disk-cache-dir", "{tmp}/t", "--disk-cache-bytes", "1GB", "--disk-branch-share", "0"],
     "--disk-branch-share: must be more than 0 and at most 1, not 0"),
])
def test_disk_tier_flags_that_cannot_work_stop_the_backend_with_the_reason(tmp_path, flags, says):
    r = subprocess.run([sys.executable, "-m", "mlxgw", "backend", *[f.format(tmp=tmp_path) for f in flags]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]


def test_an_entry_larger_than_memory_goes_straight_to_disk(tmp_path):
    c, disk, owners = _cache(tmp_path, "shared", memory_tokens=250)
    big = _conv(0)  # 300 tokens: over the whole memory budget
    assert c.insert(big, sim.SimKV(300, c.ops.timing), "user", prompt_len=300) is None
    assert len(c) == 0 and _keys(disk.entries()) == [tuple(big)] and tuple(big) in owners.held
    hit = c.fetch(big + [1])  # served from disk all the same (the request holds its KV, not the cache)
    assert hit.reused == 300 and disk.reads == 1 and len(c) == 0 and len(disk) == 1


def test_a_deferred_read_runs_beside_the_engine_thread(tmp_path):
    """``fetch(defer=True)`` (the engine's pin on arrival): the read happens in the tier's reader
    thread, the hit completes with `finish_read`; a file gone meanwhile makes a miss."""
    timing = sim.SimTiming(kv_bytes_per_token=BPT, disk_read_rate=3000 * BPT)  # 300 tokens: 0.1 s
    c, disk, owners = _cache(tmp_path, "shared", timing=timing, pending=10**9)
    for t in (_conv(0), _conv(1), _conv(2), _conv(3)):  # 0 and 1 on disk
        _save(c, t)
    assert disk.flush(5)  # written: a read of a copy still queued would take the copy
    t0 = time.monotonic()
    hit = c.fetch(_conv(0) + [1], defer=True)
    assert time.monotonic() - t0 < 0.05 and hit.kv is None and hit.reused == 300 and not hit.read.done.is_set()
    assert hit.read.done.wait(5) and time.monotonic() - t0 >= 0.09
    done = c.finish_read(hit)
    assert done.reused == 300 and c.ops.nbytes(done.kv) == 300 * BPT and disk.reads == 1
    (tmp_path / "tier" / "tier-2.safetensors").unlink()  # conversation 1's file, gone behind the tier's back
    hit = c.fetch(_conv(1) + [1], defer=True)
    assert hit.reused == 300 and hit.read.done.wait(5) and isinstance(hit.read.error, FileNotFoundError)
    done = c.finish_read(hit)  # a miss: the entry dropped, its prefix no longer owned
    assert done.reused == 0 and done.kv is None and tuple(_conv(1)) not in owners.held and len(disk) == 1
    assert disk.failures == 1 and disk.reads == 1


def test_without_a_write_queue_reads_are_in_the_callers_thread_too(tmp_path):
    c, disk, _ = _cache(tmp_path, "shared")  # max_pending_bytes None (--disk-write-queue-bytes 0)
    for t in (_conv(0), _conv(1), _conv(2)):
        _save(c, t)
    hit = c.fetch(_conv(0) + [1], defer=True)
    assert hit.read is None and hit.reused == 300 and c.ops.nbytes(hit.kv) == 300 * BPT and disk.reads == 1


def test_a_killed_backend_comes_back_with_its_tier_as_of_the_last_quiet_moment(make_stack, tmp_path):
    """helper-53: a SIGKILLed backend lost its whole tier (a manifest was written only at a clean
    stop); the engine now checkpoints it when idle."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "0.5MB", "--disk-cache-dir", str(tmp_path / "tier"),
                      "--disk-cache-bytes", "64MB")
    s.wait()
    first = [_chat(b.url, words(300, seed=90 + k)) for k in range(3)]
    assert get_json(b.url + "/health")["disk_entries"] == 2
    deadline = time.time() + 15  # a quiet moment: the checkpoint comes within DISK_CHECKPOINT_SECONDS
    while not (tmp_path / "tier" / "manifest.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    b.kill()
    b.start(s.env())
    b.wait_healthy()
    assert get_json(b.url + "/health")["disk_entries"] == 2 and "adopted from" in b.log_path.read_text()
    again = _chat(b.url, words(300, seed=90))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first[0]["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == first[0]["choices"][0]["message"]["content"]


def test_a_turn_that_continues_a_disk_entrys_prompt_replaces_it(tmp_path):
    """Rule 3 on disk: a turn that reused a disk entry's whole prompt replaces it when it is
    written there in turn, even when its prompt re-renders the generated tail differently
    (helper-53: copies piled up on disk); the entry's prompt part is the start of its chain, the
    generated tail's part is deleted."""
    c, disk, owners = _cache(tmp_path, "shared")
    a = _conv(0)
    c.insert(a + [1, 2, 3], sim.SimKV(303, c.ops.timing), "assistant", prompt_len=300)  # 3 generated tokens
    for k in (1, 2):
        _save(c, _conv(k))
    (d,) = disk.entries()
    assert d.tokens.tolist() == a + [1, 2, 3] and [(s, e) for s, e, _ in disk.parts(d)] == [(0, 300), (300, 303)]
    turn = a + [9, 9] + [5] * 40  # the template renders the answer as other tokens
    hit = c.fetch(turn)
    assert hit.reused == 300 and hit.entry_id == d.id
    c.insert(turn, sim.SimKV(len(turn), c.ops.timing), "assistant", reused_from=hit.entry_id, reused=300,
             prompt_len=len(turn))
    assert d.id in {e.id for e in disk.entries()}  # until the turn goes to disk itself
    for k in (3, 4):
        _save(c, _conv(k))
    assert d.id not in {e.id for e in disk.entries()} and tuple(a + [1, 2, 3]) not in owners.held
    (t,) = [e for e in disk.entries() if len(e) == len(turn)]
    assert [s_e[:2] for s_e in disk.parts(t)] == [(0, 300), (300, 342)] and owners.gaps == 0
    assert disk.nbytes == sum(len(e) for e in disk.entries()) * BPT  # the 3 generated tokens' part is gone


def test_an_unusable_memory_save_leaves_the_disk_tier(make_stack, tmp_path):
    """helper-54: a restart whose memory save could not be restored (damaged, other layout)
    cleared the disk tier it had just adopted."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-bytes", "0.5MB", "--cache-dir", str(tmp_path / "kv"),
                      "--disk-cache-bytes", "64MB")
    s.wait()
    first = [_chat(b.url, words(300, seed=95 + k)) for k in range(3)]
    b.stop()
    (tmp_path / "kv" / "snapshot" / "manifest.json").write_text("{garbage")
    b.start(s.env())
    b.wait_healthy()
    log = b.log_path.read_text()
    assert "not restored" in log and "adopted from" in log
    assert get_json(b.url + "/health")["disk_entries"] == 2
    again = _chat(b.url, words(300, seed=96))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first[1]["usage"]["prompt_tokens"] - 1


def test_a_full_disk_with_an_empty_tier_keeps_its_budget(tmp_path, caplog):
    """helper-54: the first failed write on a full disk lowered an empty tier's budget to 0, and
    the tier stayed off after space freed."""
    ops = FullDiskOps(sim.SimTiming(kv_bytes_per_token=BPT))
    ops.full = True
    disk = DiskTier(tmp_path / "tier", 10_000 * BPT, ops)
    c = PromptCache(max_entries=10, max_bytes=700 * BPT, layout="shared", share_min_tokens=16, min_hit_tokens=32,
                    ops=ops, disk=disk)
    for k in range(3):
        _save(c, _conv(k))
    assert disk.failures == 1 and disk.max_bytes == 10_000 * BPT and "holds nothing yet" in caplog.text
    ops.full = False
    _save(c, _conv(3))
    assert [e.tokens.tolist() for e in disk.entries()] == [_conv(1)]


def test_size_text_picks_a_unit_people_read():
    from mlxgw.util import size_text

    assert [size_text(n) for n in (512, 1536, 64 << 20, 3 * 2**29, 2**40)] == [
        "512 B", "1.5 KiB", "64.0 MiB", "1.5 GiB", "1.0 TiB"]


# -- chains of parts (session 34): only what the tier does not hold is written ---------------

@pytest.mark.parametrize("max_chain", [MAX_CHAIN, 4, 1])
def test_an_agent_conversation_evicted_every_turn_writes_each_turn_once(tmp_path, max_chain):
    """The agent's loop at a tight memory budget: each turn reads the conversation back from
    disk, grows it, and is evicted again. Whole-entry files (``max_chain`` 1, session 33) wrote
    the whole conversation every turn (O(turns^2) bytes on the SSD); a chain writes each turn's
    new tokens once, and the conversation stays one entry; a chain at ``max_chain`` parts
    starts over with a whole file."""
    c, disk, owners = _cache(tmp_path, "whole", memory_tokens=800, disk_tokens=100_000, max_chain=max_chain)
    conv, other = _conv(0, 200), 0
    _save(c, conv)
    for turn in range(8):
        for _ in range(2):  # two other conversations push this one out of memory
            other += 1
            _save(c, _conv(100 + other, 400))
        assert all(e.tokens[0] != conv[0] for e in c.entries())
        nxt = conv + [turn] * 50
        hit = c.fetch(nxt)
        assert hit.reused == len(conv) and c.get(hit.entry_id) is None  # from disk, all of it
        conv = nxt
        _save(c, conv)
    mine = [e for e in disk.entries() if e.tokens[0] == conv[0]]
    assert len(mine) == 1 and len(mine[0]) == 550  # the turn before the last, on disk; one entry
    others = sum(len(e) for e in disk.entries()) - 550
    if max_chain == MAX_CHAIN:
        assert [(s, e) for s, e, _ in disk.parts(mine[0])] == [(0, 200)] + [(200 + 50 * k, 250 + 50 * k) for k in range(7)]
        assert disk.write_bytes == (550 + others) * BPT  # each token written once
    elif max_chain == 4:  # 4 parts (turns 0-3), then a whole file of 400 and three parts more
        assert [(s, e) for s, e, _ in disk.parts(mine[0])] == [(0, 400), (400, 450), (450, 500), (500, 550)]
        assert disk.write_bytes == (350 + 400 + 150 + others) * BPT
    else:  # every turn wrote the conversation again: 200 + 250 + ... + 550 tokens
        assert [(s, e) for s, e, _ in disk.parts(mine[0])] == [(0, 550)]
        assert disk.write_bytes == (sum(range(200, 551, 50)) + others) * BPT
    assert owners.gaps == 0 and tuple(conv[:550]) in owners.held and tuple(conv[:500]) not in owners.held


def test_conversations_on_one_system_prompt_hold_it_once_on_disk(tmp_path):
    """Rule 7's memory chain is cut where conversations branched: each piece becomes a part, so
    the second conversation on a system prompt writes only its own tokens; the disk budget
    counts the system prompt once, and dropping one conversation frees only its own part."""
    c, disk, owners = _cache(tmp_path, "shared", memory_tokens=450, disk_tokens=450)
    system = list(range(50, 250))
    a, b = system + _conv(0, 100), system + _conv(1, 100)
    for t in (a, b, system + _conv(2, 100)):  # memory holds the system prompt once and two tails
        _save(c, t)
    (da,) = disk.entries()
    assert [p[:2] for p in disk.parts(da)] == [(0, 200), (200, 300)] and disk.write_bytes == 300 * BPT
    _save(c, system + _conv(3, 100))  # b to disk: its system prompt is there already
    db = next(e for e in disk.entries() if e.tokens.tolist() == b)
    assert [p[:2] for p in disk.parts(db)] == [(0, 200), (200, 300)] and disk.parts(db)[0] == disk.parts(da)[0]
    assert disk.nbytes == 400 * BPT and disk.write_bytes == 400 * BPT and da.nbytes == db.nbytes == 300 * BPT
    _save(c, system + _conv(4, 100))  # c to disk: 450 tokens' budget, a (least recently used) makes room
    assert _keys(disk.entries()) == sorted([tuple(b), tuple(system + _conv(2, 100))])
    assert disk.nbytes == 400 * BPT and disk.evictions == 1 and tuple(a) not in owners.held
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["tier-1.safetensors", "tier-3.safetensors",
                                                                      "tier-4.safetensors"]
    # A prompt on b's conversation that memory does not serve past the system prompt: from disk.
    hit = c.fetch(b[:250] + [7])
    assert hit.reused == 250 and disk.read_tokens == 250 and owners.gaps == 0


@pytest.mark.parametrize("pending", [None, 10**9])
def test_a_conversation_branching_inside_a_part_on_disk_shares_that_part(tmp_path, pending):
    """The whole layout cuts no segments, so a conversation goes to disk as one part. A second
    conversation on its 200-token system prompt branches off inside that part: it writes only
    its own 100 tokens and reads the first 200 of the other's file (the read joins 200 + 100
    tokens); the file outlives its first entry while the second uses it, and across a restart.
    A conversation sharing less than half of a part writes its own copy (the part's unshared
    tail, kept for it, would weigh more than the write saved)."""
    c, disk, owners = _cache(tmp_path, "whole", memory_tokens=350, pending=pending, settings=SETTINGS)
    system = list(range(50, 250))
    a, b = system + _conv(0, 100), system + _conv(1, 100)
    for t in (a, b, _conv(2)):  # memory holds one: a, then b, go to disk
        _save(c, t)
    assert disk.flush(5)
    da, db = (next(e for e in disk.entries() if e.tokens.tolist() == t) for t in (a, b))
    assert [p[:2] for p in disk.parts(da)] == [(0, 300)]
    assert [p[:2] for p in disk.parts(db)] == [(0, 200), (200, 300)] and disk.parts(db)[0][2] == disk.parts(da)[0][2]
    assert disk.write_bytes == disk.nbytes == 400 * BPT and db.nbytes == 400 * BPT  # b's chain: both files
    hit = c.fetch(b + [1], defer=True)
    if pending:  # the reader thread reads both files (the first whole); without a queue, all inline
        assert [(p.start, p.end) for p in hit.read.parts] == [(0, 300), (200, 300)]
        hit = c.finish_read(hit)  # the sim's join checks the pieces: 200 tokens of the first file, 100 of the second
    assert hit.reused == 300 and c.ops.nbytes(hit.kv) == 300 * BPT and disk.read_tokens == 300
    disk.drop(da)  # a leaves the tier: its file stays under b
    assert len(_names(tmp_path)) == 2 and disk.nbytes == 400 * BPT
    assert c.fetch(b + [2]).reused == 300
    # Shares 100 tokens of b's 200-token first part, 100 of a's: too little of either to use.
    d = system[:100] + _conv(3, 200)
    _save(c, d)
    _save(c, _conv(4))
    dd = next(e for e in disk.entries() if e.tokens.tolist() == d)
    assert [p[:2] for p in disk.parts(dd)] == [(0, 300)] and disk.parts(dd)[0][2] not in {x[2] for x in disk.parts(db)}
    disk.close()
    c, disk, owners = _cache(tmp_path, "whole", memory_tokens=350, pending=10**9, settings=SETTINGS)
    assert disk.adopted[:3] == (len(disk), sum(len(e) for e in disk.entries()), disk.nbytes)
    db = next(e for e in disk.entries() if e.tokens.tolist() == b)
    assert [p[:2] for p in disk.parts(db)] == [(0, 200), (200, 300)]
    assert c.fetch(b + [3]).reused == 300 and disk.failures == 0


def test_branching_inside_a_part_follows_the_shared_fraction_asked(tmp_path):
    """``--disk-branch-share``: 1 branches only at a part's end (each conversation its own copy
    here), 0.3 inside a part a third of which is shared."""
    system = list(range(50, 150))
    for share, b_parts, written in ((1.0, [(0, 300)], 600), (0.3, [(0, 100), (100, 300)], 500)):
        c, disk, _ = _cache(tmp_path / str(share), "whole", memory_tokens=350, branch_share=share)
        a, b = system + _conv(0, 200), system + _conv(1, 200)
        for t in (a, b, _conv(2)):
            _save(c, t)
        db = next(e for e in disk.entries() if e.tokens.tolist() == b)
        assert [p[:2] for p in disk.parts(db)] == b_parts and disk.write_bytes == written * BPT, share
        assert c.fetch(b + [1]).reused == 300


def test_a_deferred_read_reads_only_the_parts_holding_the_prompts_prefix(tmp_path):
    c, disk, _ = _cache(tmp_path, "whole", memory_tokens=400, pending=10**9)
    a = _conv(0)
    c.insert(a + [1] * 60, sim.SimKV(360, c.ops.timing), "assistant", prompt_len=300)  # parts [0, 300), [300, 360)
    _save(c, _conv(1))
    assert disk.flush(5) and [p[:2] for p in disk.parts(disk.entries()[0])] == [(0, 300), (300, 360)]
    hit = c.fetch(a + [2] * 10, defer=True)  # re-rendered tail: only the prompt's part is read
    assert hit.read is not None and [(p.start, p.end) for p in hit.read.parts] == [(0, 300)]
    hit = c.finish_read(hit)
    assert hit.reused == 300 and c.ops.nbytes(hit.kv) == 300 * BPT
    hit = c.fetch(a + [1] * 60 + [3], defer=True)  # the whole entry: both parts, joined
    assert [(p.start, p.end) for p in hit.read.parts] == [(0, 300), (300, 360)]
    assert c.ops.nbytes(c.finish_read(hit).kv) == 360 * BPT


class FailingFileOps(sim.SimKVOps):
    """Sim ops whose (slow) writes of the files named in ``fail`` end in an I/O error."""

    fail: set = set()

    def save_parts(self, parts, path):
        super().save_parts(parts, path)
        if Path(path).name in self.fail:
            raise OSError(errno.EIO, "Input/output error", path)

    write_host = save_parts


def test_a_failed_write_of_a_part_drops_every_entry_built_on_it(tmp_path, caplog):
    """A part still being written is already the start of later chains (the next turn, read back
    from its queued arrays, extends it): when its write fails, they all go, at the next lookup."""
    ops = FailingFileOps(sim.SimTiming(kv_bytes_per_token=BPT, disk_write_rate=1000 * BPT))  # 300 tokens: 0.3 s
    ops.fail = {"tier-1.safetensors"}
    disk = DiskTier(tmp_path / "tier", 10_000 * BPT, ops, max_pending_bytes=10**9)
    owners = Owners()
    c = PromptCache(max_entries=10, max_bytes=300 * BPT, layout="whole", share_min_tokens=16, min_hit_tokens=32,
                    listener=owners, ops=ops, disk=disk)
    a, turn = _conv(0), _conv(0) + [1] * 20
    _save(c, a)
    _save(c, _conv(1))  # a to disk: tier-1, written behind (and failing)
    hit = c.fetch(turn)
    assert hit.reused == 300 and disk.reads == 1 and disk.pending_bytes == 300 * BPT  # from the queued arrays
    c.insert(turn, sim.SimKV(320, ops.timing), "assistant", prompt_len=320)  # over memory: straight to disk
    (t,) = disk.entries()  # it replaced a on disk, its chain starting with a's part
    assert [p[:2] for p in disk.parts(t)] == [(0, 300), (300, 320)] and disk.spills == 2
    assert disk.flush(5) and disk.failures == 1 and len(disk) == 1  # not reaped yet
    assert c.fetch(turn + [2]).reused == 0 and len(disk) == 0 and disk.nbytes == 0
    assert tuple(turn) not in owners.held and tuple(a) not in owners.held and owners.gaps == 0
    assert disk.spills == 1  # a's never reached the disk: not a spill; the turn's part did
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == []
    assert "could not write" in caplog.text


@pytest.mark.parametrize("pending", [10**9, None])
def test_chains_are_kept_and_adopted_across_a_restart(tmp_path, pending):
    c, disk, _ = _cache(tmp_path, "shared", memory_tokens=450, pending=pending, settings=SETTINGS)
    system = list(range(50, 250))
    convs = [system + _conv(k, 100) for k in range(4)]
    for t in convs:
        _save(c, t)
    assert disk.flush(5) and len(disk) == 2 and disk.nbytes == 400 * BPT
    disk.close()
    c, disk, owners = _cache(tmp_path, "shared", memory_tokens=450, pending=10**9, settings=SETTINGS)
    assert disk.adopted == (2, 600, 400 * BPT, "")  # 600 tokens in 400 tokens' bytes: the system prompt once
    c.announce_disk()
    assert set(owners.held) == {tuple(convs[0]), tuple(convs[1])}
    hit = c.fetch(convs[1] + [1])
    assert hit.reused == 300 and disk.reads == 1  # both parts read back, their checksums checked
    # A smaller budget: the newest entry and its parts adopted, the rest left on disk until a write.
    disk.close()
    c, disk, _ = _cache(tmp_path, "shared", memory_tokens=450, disk_tokens=350, settings=SETTINGS)
    assert disk.adopted[:3] == (1, 300, 300 * BPT) and disk.entries()[0].tokens.tolist() == convs[1]
    assert len([n for n in _names(tmp_path) if n.startswith("tier-")]) == 3


def test_a_tier_kept_by_the_format_before_chains_is_adopted(tmp_path):
    """Session 33's manifest (format 1: one whole file per entry) is read as chains of one part."""
    _kept(tmp_path)
    m = json.loads((tmp_path / "tier" / "manifest.json").read_text())
    parts = {p["file"]: p for p in m["parts"]}
    old = {**m, "format": 1, "entries": [
        {"file": e["part"], "checksum": parts[e["part"]]["checksum"], **{k: v for k, v in e.items() if k != "part"}}
        for e in m["entries"]]}
    del old["parts"]
    (tmp_path / "tier" / "manifest.json").write_text(json.dumps(old))
    c, disk, _ = _cache(tmp_path, "shared", pending=10**9, settings=SETTINGS)
    assert disk.adopted == (3, 900, 900 * BPT, "")
    assert c.fetch(_conv(1) + [1]).reused == 300 and disk.reads == 1


def test_an_unreadable_part_drops_every_entry_whose_chain_uses_it(tmp_path, caplog):
    """One damaged file under several conversations: the first read that fails on it drops them
    all (each would cost its own failed read later), and no entry on other files."""
    c, disk, owners = _cache(tmp_path, "shared", memory_tokens=450)
    system = list(range(50, 250))
    convs = [system + _conv(k, 100) for k in range(5)]
    for t in convs:  # 0, 1 and 2 go to disk, sharing the system prompt's part (tier-1)
        _save(c, t)
    solo = _conv(9, 300)
    c2 = c.insert(solo, sim.SimKV(300, c.ops.timing), "assistant", prompt_len=300)
    assert c2 is not None
    for k in (5, 6):  # solo to disk too, in files of its own
        _save(c, system + _conv(k, 100))
    assert len(disk) >= 4 and all(disk.parts(e)[0][2] == "tier-1.safetensors"
                                  for e in disk.entries() if e.tokens[0] == 50)
    (tmp_path / "tier" / "tier-1.safetensors").unlink()
    hit = c.fetch(convs[1] + [1])
    assert hit.reused < 300 and disk.failures == 1
    assert all(e.tokens[0] != 50 for e in disk.entries())  # every chain through tier-1: gone
    assert [e.tokens.tolist() for e in disk.entries()] == [solo]
    assert all(tuple(t) not in owners.held for t in convs[:3]) and tuple(solo) in owners.held
    assert "entries using that file dropped" in caplog.text
    assert c.fetch(solo + [1]).reused == 300  # the other files still serve


def test_a_kill_after_a_turn_continued_a_chain_keeps_the_tier_of_the_last_checkpoint(tmp_path):
    """helper-56: a chain continued after the last checkpoint released the old entry's answer
    part, whose file was deleted at once; a kill then left a manifest naming a missing file and
    the next start lost that entry and every part under it. Files the manifest on disk names
    now stay until the next checkpoint stops naming them."""
    c, disk, _ = _cache(tmp_path, "whole", memory_tokens=300, settings=SETTINGS)
    a = _conv(0)
    c.insert(a, sim.SimKV(300, c.ops.timing), "assistant", prompt_len=280)  # parts [0, 280), [280, 300)
    _save(c, _conv(1))  # a to disk
    assert disk.checkpoint()
    turn = a[:280] + [7] * 70  # the next turn: the answer re-rendered, then the new message
    hit = c.fetch(turn)
    assert hit.reused == 280
    c.insert(turn, sim.SimKV(350, c.ops.timing), "assistant", prompt_len=350)  # over memory: to disk
    (t,) = disk.entries()
    assert [p[:2] for p in disk.parts(t)] == [(0, 280), (280, 350)]  # a replaced, its prompt part reused
    assert (tmp_path / "tier" / "tier-2.safetensors").exists() and disk.doomed_bytes == 20 * BPT
    shutil.copytree(tmp_path / "tier", tmp_path / "killed" / "tier")  # the directory as a kill leaves it
    c2, disk2, _ = _cache(tmp_path / "killed", "whole", memory_tokens=300, settings=SETTINGS)
    assert [e.tokens.tolist() for e in disk2.entries()] == [a]  # the tier as of the checkpoint, whole
    assert c2.fetch(a + [1]).reused == 300
    assert disk.checkpoint() and not (tmp_path / "tier" / "tier-2.safetensors").exists()  # named no more
    assert disk.doomed_bytes == 0


def test_a_file_damaged_while_the_backend_runs_costs_a_prefill_not_wrong_kv(tmp_path, caplog):
    """helper-56: only files adopted at start were checked, once; one damaged under a running
    backend served garbage KV (and the next saves extended it). Every read checks now."""
    c, disk, owners = _cache(tmp_path, "shared", pending=10**9)
    a = _conv(0)
    for t in (a, _conv(1), _conv(2)):
        _save(c, t)
    assert disk.flush(5) and c.fetch(a + [1]).reused == 300  # read once: fine
    f = tmp_path / "tier" / "tier-1.safetensors"
    f.write_text(f.read_text().replace("300", "301"))  # the sim's file: its token count changed
    hit = c.fetch(a + [1], defer=True)
    hit = c.finish_read(hit)
    assert hit.reused == 0 and disk.failures == 1 and len(disk) == 0 and tuple(a) not in owners.held
    assert "is damaged: its checksum differs" in caplog.text


def test_a_tier_directory_is_locked_however_it_was_named(tmp_path):
    """helper-56: a backend given another's <--cache-dir>/tier as its --disk-cache-dir ran beside
    it (only an explicit --disk-cache-dir was locked) and both wrote the same files."""
    from backend import persist

    held = persist.CacheDirLock(tmp_path / "cd" / "tier", flag="--disk-cache-dir")
    try:
        r = subprocess.run([sys.executable, "-m", "mlxgw", "backend", "--cache-dir", str(tmp_path / "cd"),
                            "--disk-cache-bytes", "1GB"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--cache-dir's disk tier" in r.stderr and "in use by another backend" in r.stderr, \
            r.stderr[-2000:]
    finally:
        held.release()


def test_a_full_disk_deletes_the_files_kept_for_the_last_manifest_first(tmp_path):
    ops = FullDiskOps(sim.SimTiming(kv_bytes_per_token=BPT))
    disk = DiskTier(tmp_path / "tier", 10_000 * BPT, ops, max_pending_bytes=None, settings=SETTINGS)
    c = PromptCache(max_entries=10, max_bytes=300 * BPT, layout="whole", share_min_tokens=16, min_hit_tokens=32,
                    ops=ops, disk=disk)
    a = _conv(0)
    c.insert(a, sim.SimKV(300, ops.timing), "assistant", prompt_len=280)
    _save(c, _conv(1))  # a to disk: tier-1 [0, 280), tier-2 [280, 300)
    assert disk.checkpoint()
    c.insert(a[:280] + [7] * 70, sim.SimKV(350, ops.timing), "assistant", prompt_len=350)  # continues a
    assert disk.doomed_bytes == 20 * BPT and (tmp_path / "tier" / "tier-2.safetensors").exists()
    ops.full = True
    _save(c, _conv(2))  # conv 1 to disk: no space
    assert disk.failures == 1 and disk.doomed_bytes == 0 and not (tmp_path / "tier" / "tier-2.safetensors").exists()


def test_a_restart_with_a_smaller_memory_budget_moves_the_entries_it_leaves_out_into_the_tier(tmp_path):
    """helper-73: restarted with a smaller --cache-entries / --cache-bytes, the saved entries
    left out of memory were lost at the next save though a disk tier had room: they go into
    the tier now, the most recently used first while it has room, in the save's LRU order,
    each one told to the listener once; a prompt of one of them is a disk hit."""
    from backend import persist

    fp = {"model_files": "abcd", "engine": "sim", "layout": "shared"}
    c, _, _ = _cache(tmp_path / "a", "shared", memory_tokens=10_000)
    system = list(range(100, 400))
    convs = [system + list(range(1000 * k, 1000 * k + 50 + k)) for k in range(4)]
    for t in convs:
        _save(c, t)
    persist.save(c, tmp_path / "save", fp)

    r, disk, owners = _cache(tmp_path / "b", "shared", memory_tokens=10_000)
    r.max_entries = 1
    got = persist.restore(r, tmp_path / "save", fp)
    assert (got.entries, got.to_disk, got.left) == (1, 3, 0)
    assert _keys(r.entries()) == _keys([c.get(c.entries()[-1].id)])  # the newest in memory
    assert [e.tokens.tolist() for e in sorted(disk.entries(), key=lambda e: e.last_used)] == convs[:3]
    assert disk.nbytes == (300 + 50 + 51 + 52) * BPT  # the system prompt written once: cut at its segment
    assert owners.held == Counter({tuple(t): 1 for t in convs}) and owners.gaps == 0
    hit = r.fetch(convs[0] + [7, 8, 9])
    assert (hit.reused, hit.entry_len) == (350, 350)

    # A tier with room for two of the three: the two most recently used go, the oldest stays out.
    r2, disk2, _ = _cache(tmp_path / "c", "shared", memory_tokens=10_000, disk_tokens=2 * 352)
    r2.max_entries = 1
    got = persist.restore(r2, tmp_path / "save", fp)
    assert (got.entries, got.to_disk, got.left) == (1, 2, 1)
    assert sorted(e.tokens.tolist() for e in disk2.entries()) == convs[1:3]
