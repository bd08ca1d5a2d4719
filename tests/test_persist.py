"""The prompt cache across restarts (``--cache-dir``, backend.persist)."""

import subprocess
import sys
import time

import numpy as np
import pytest
import redis

from backend import persist, sim
from backend.cache import PromptCache
from mlxgw import schema
from mlxgw.httpget import get_json, post
from texts import words


FP = {"model_files": "abcd", "engine": "sim", "layout": "shared"}


def _sim_cache(**kw) -> PromptCache:
    ops = sim.SimKVOps(sim.SimTiming())
    return PromptCache(**{"max_entries": 10, "layout": "shared", "share_min_tokens": 16, "ops": ops,
                          "min_hit_tokens": 32, **kw})


def _filled() -> tuple[PromptCache, list[int]]:
    """Four conversations on one 300-token system prompt (rule 7 holds it once), used in order."""
    c = _sim_cache()
    system = list(range(100, 400))
    for k in range(4):
        toks = system + list(range(1000 * k, 1000 * k + 50 + k))
        c.insert(toks, sim.SimKV(len(toks), c.ops.timing), "assistant", prompt_len=len(toks) - 5)
    return c, system


def test_save_and_restore_keep_entries_segments_bytes_and_lru_order(tmp_path):
    c, system = _filled()
    bpt = c.ops.timing.nbytes(1)
    assert len(c) == 4 and c.nbytes == (300 + 50 + 51 + 52 + 53) * bpt  # the system prompt once
    out = persist.save(c, tmp_path, FP)
    assert (out.entries, out.tokens, out.nbytes) == (4, 1406, c.nbytes)
    snap = tmp_path / "snapshot"
    assert sorted(p.name for p in snap.iterdir()) == ["manifest.json"] + [f"seg-{i}.safetensors" for i in range(5)] + [
        "tokens.npz"]

    r = _sim_cache()
    got = persist.restore(r, tmp_path, FP)
    assert (got.entries, got.tokens, got.nbytes, got.left) == (4, 1406, c.nbytes, 0)
    assert r.nbytes == c.nbytes  # shared on disk and in memory: 300 + four tails, not 4 x 350
    assert [e.tokens.tolist() for e in r.entries()] == [e.tokens.tolist() for e in c.entries()]
    assert [e.prompt_tokens for e in r.entries()] == [345, 346, 347, 348]
    hit = r.fetch(system + list(range(2000, 2060)))
    assert (hit.reused, len(r.get(hit.entry_id))) == (352, 352)  # the third conversation, whole
    # The LRU order survived: with one entry too many, the oldest (the first conversation) goes.
    r.insert(system + [7] * 40, sim.SimKV(340, r.ops.timing), "assistant")
    r.trim_to(max_entries=4)
    assert sorted(len(e) for e in r.entries()) == [340, 351, 352, 353]

    # A later save replaces the earlier one whole.
    persist.save(r, tmp_path, FP)
    again = _sim_cache()
    assert persist.restore(again, tmp_path, FP).entries == 4
    assert sorted(len(e) for e in again.entries()) == [340, 351, 352, 353]


def test_restore_keeps_the_newest_entries_within_this_runs_budgets(tmp_path):
    c, _ = _filled()
    persist.save(c, tmp_path, FP)
    bpt = c.ops.timing.nbytes(1)
    small = _sim_cache(max_entries=2)
    got = persist.restore(small, tmp_path, FP)
    assert (got.entries, got.left) == (2, 2)
    assert [len(e) for e in small.entries()] == [352, 353] and small.nbytes == (300 + 52 + 53) * bpt
    # Bytes for the shared prompt and one tail: the newest conversation only.
    tight = _sim_cache(max_bytes=(300 + 53) * bpt)
    got = persist.restore(tight, tmp_path, FP)
    assert (got.entries, got.left) == (1, 3) and [len(e) for e in tight.entries()] == [353]


def test_a_foreign_or_damaged_save_is_refused_and_leaves_the_cache_empty(tmp_path):
    c, _ = _filled()
    persist.save(c, tmp_path, FP)
    r = _sim_cache()
    with pytest.raises(ValueError, match=r"saved under other settings: the cache layout \(saved shared, now whole\), "
                                         r"the model files \(weights, config or tokenizer\)$"):
        persist.restore(r, tmp_path, {**FP, "layout": "whole", "model_files": "0123"})
    assert len(r) == 0 and r.nbytes == 0
    np.savez(tmp_path / "snapshot" / "tokens.npz", e0=np.arange(3), e1=np.arange(3), e2=np.arange(3),
             e3=np.arange(3))
    with pytest.raises(ValueError, match=r"tokens.npz is damaged \(its checksum differs from the one saved\)"):
        persist.restore(r, tmp_path, FP)
    assert len(r) == 0 and r.nbytes == 0
    # Bytes changed, size kept (helper-52: zeroed KV loaded silently and changed answers): the
    # checksum catches it, and only that file's entries are left out.
    persist.save(c, tmp_path, FP)
    seg = tmp_path / "snapshot" / "seg-3.safetensors"
    seg.write_text(seg.read_text().replace("52", "62"))  # the third conversation's 52-token tail
    got = persist.restore(r, tmp_path, FP)
    assert (got.entries, got.damaged) == (3, 1) and "seg-3.safetensors is damaged (its checksum" in got.error
    r = _sim_cache()
    (tmp_path / "snapshot" / "manifest.json").write_text('{"format": 1')
    with pytest.raises(ValueError, match=r"manifest.json is damaged \(JSONDecodeError"):
        persist.restore(r, tmp_path, FP)
    # A save cut short leaves its work directory beside the last complete save: ignored, removed.
    persist.save(c, tmp_path, FP)
    (tmp_path / "saving-123").mkdir()
    # An unreadable file costs only the entries whose KV it holds (helper-51: one truncated file
    # lost the whole save): seg-2 is the second conversation's own tail.
    (tmp_path / "snapshot" / "seg-2.safetensors").unlink()
    got = persist.restore(r, tmp_path, FP)
    assert (got.entries, got.damaged, got.left) == (3, 1, 0) and "seg-2.safetensors" in got.error
    assert sorted(len(e) for e in r.entries()) == [350, 352, 353] and not (tmp_path / "saving-123").exists()
    assert r.nbytes == (300 + 50 + 52 + 53) * c.ops.timing.nbytes(1)
    # seg-0 is the shared system prompt: every chain passes through it.
    (tmp_path / "snapshot" / "seg-0.safetensors").unlink()
    r = _sim_cache()
    got = persist.restore(r, tmp_path, FP)
    assert (got.entries, got.damaged) == (0, 4) and len(r) == 0 and r.nbytes == 0
    assert persist.restore(r, tmp_path / "never-saved", FP) is None


def test_a_failed_save_keeps_the_previous_one_and_no_partial_files(tmp_path):
    c, _ = _filled()
    persist.save(c, tmp_path, FP)
    c.insert(list(range(5000, 5400)), sim.SimKV(400, c.ops.timing), "assistant")

    class FullDisk(sim.SimKVOps):
        def save_parts(self, parts, path):
            if path.endswith("seg-3.safetensors"):
                raise OSError(28, "No space left on device")
            super().save_parts(parts, path)

    c.ops = FullDisk(c.ops.timing)
    with pytest.raises(OSError, match="No space left"):
        persist.save(c, tmp_path, FP)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot"]
    r = _sim_cache()
    assert persist.restore(r, tmp_path, FP).entries == 4 and 400 not in [len(e) for e in r.entries()]


@pytest.mark.parametrize("left", ["new save complete", "previous save moved aside"])
def test_a_stop_killed_between_the_renames_loses_no_save(tmp_path, left):
    """`save` moves the previous snapshot aside, then renames the new one into place: killed in
    between, the next start takes the complete one left (the new one when its manifest is there)."""
    c, _ = _filled()
    persist.save(c, tmp_path, FP)
    snap = tmp_path / "snapshot"
    if left == "new save complete":
        snap.rename(tmp_path / "saving-77")
        (tmp_path / "replaced-77").mkdir()  # the previous one, already partly removed
    else:
        snap.rename(tmp_path / "replaced-77")
        (tmp_path / "saving-77").mkdir()  # the new one, without its manifest: incomplete
    r = _sim_cache()
    assert persist.restore(r, tmp_path, FP).entries == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot"]


def test_fingerprint_follows_the_model_files_and_settings(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    a = persist.kv_settings(str(tmp_path), engine="mlx", layout="shared")
    assert set(a) == {"model_files", "engine", "layout"}
    assert persist.fingerprint(a) == persist.fingerprint(persist.kv_settings(str(tmp_path), engine="mlx",
                                                                             layout="shared"))
    assert persist.fingerprint(a) != persist.fingerprint({**a, "layout": "whole"})
    # A copy (new mtimes) or a re-download of the same files is the same model (helper-51: a `cp -r`
    # copy was taken for other weights) ...
    import shutil

    (tmp_path / "copy").mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(tmp_path / f, tmp_path / "copy" / f)
    assert persist.kv_settings(str(tmp_path / "copy"), engine="mlx", layout="shared") == a
    # ... other bytes of the same size (a fine-tune of the same shapes) are not, even in a large file.
    big = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    (tmp_path / "model.safetensors").write_bytes(big.tobytes())
    b = persist.kv_settings(str(tmp_path), engine="mlx", layout="shared")
    big[2 << 20] ^= 1  # one byte, in a sampled chunk (the middle of the file)
    big[(3 << 20) // 2: (3 << 20) // 2 + 8] ^= 1
    (tmp_path / "model.safetensors").write_bytes(big.tobytes())
    c = persist.kv_settings(str(tmp_path), engine="mlx", layout="shared")
    assert len({a["model_files"], b["model_files"], c["model_files"]}) == 3


def test_an_empty_cache_never_replaces_a_save_and_saves_are_private(tmp_path):
    import stat

    c, _ = _filled()
    lock = persist.CacheDirLock(tmp_path / "kv")
    persist.save(c, tmp_path / "kv", FP)
    assert persist.save(_sim_cache(), tmp_path / "kv", FP) is None  # a run that cached nothing
    assert persist.restore(_sim_cache(), tmp_path / "kv", FP).entries == 4
    # The saves hold the prompts (tokens.npz decodes to the text): the owner's only.
    for d in (tmp_path / "kv", tmp_path / "kv" / "snapshot"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = list((tmp_path / "kv" / "snapshot").iterdir())  # whatever the umask (helper-53: 0644)
    assert len(files) == 7 and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    lock.release()


def _chat(url: str, text: str, **kw) -> tuple[dict, dict]:
    status, h, raw = post(url + "/v1/chat/completions", {
        "model": "demo-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
        **kw})
    assert status == 200, raw
    import json

    return h, json.loads(raw)


@pytest.mark.parametrize("layout", ["shared", "whole"])
def test_a_restarted_backend_serves_its_saved_prompts_again(make_stack, tmp_path, layout):
    """A real mlx-lm backend: what it cached before a clean stop is cached after its restart,
    published to Redis (the gateway routes to it with the prefix matched) and holds the right
    KV (a greedy answer from the restored cache equals the one computed from scratch)."""
    s = make_stack()
    b = s.add_backend("b0", None, "--cache-dir", str(tmp_path / "kv"), "--cache-layout", layout)
    g = s.add_gateway()
    s.wait()
    text = words(300, seed=71)
    h, first = _chat(g.url, text)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    b.stop()
    log = b.log_path.read_text()
    assert "saved the prompt cache to " in log and ": 1 entry (" in log, log[-2000:]
    b.start(s.env())
    b.wait_healthy()
    log = b.log_path.read_text()
    assert "restored the prompt cache from " in log and ": 1 entry (" in log, log[-2000:]
    health = get_json(b.url + "/health")
    assert health["restored_entries"] == 1 and health["restored_tokens"] >= 300, health
    # The stream says what the new epoch holds: the restored entry's `saved` event under it
    # (there was none: a reader saw the stop's `cleared`, then nothing).
    rd, keys = redis.Redis.from_url(s.redis_url), schema.Keys(s.namespace, s.model_name)
    epoch = rd.hget(keys.backend("b0"), "epoch").decode()
    saved = evs = []
    for _ in range(50):
        evs = [schema.decode_event(f) for _, f in rd.xrange(keys.events)]
        saved = [e for e in evs if e["type"] == schema.EVENT_SAVED and e["epoch"] == epoch]
        if saved:
            break
        time.sleep(0.1)
    assert [e["data"]["tokens"] for e in saved] == [health["restored_tokens"]], evs[-5:]
    prompt = first["usage"]["prompt_tokens"]
    deadline = time.time() + 10
    while time.time() < deadline:  # the gateway sees the new epoch's blocks within a report
        h, again = _chat(g.url, text)
        if int(h["X-Mlxgw-Matched-Tokens"]) > 0:
            break
        time.sleep(0.2)
    assert int(h["X-Mlxgw-Matched-Tokens"]) == (prompt - 1) // s.block_size * s.block_size
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert get_json(b.url + "/internal/cache")["entries"][0]["tokens"] >= prompt


def test_two_backends_cannot_share_a_cache_dir_and_an_unusable_one_is_named(make_stack, tmp_path):
    s = make_stack()
    b = s.add_backend("b0", None, "--engine", "sim", "--cache-dir", str(tmp_path), "--cache-entries", "1")
    b.wait_healthy()
    (tmp_path / "a-file").write_text("")
    cases = [(tmp_path, f"--cache-dir {tmp_path} is in use by another backend"),
             (tmp_path / "a-file", f"--cache-dir {tmp_path / 'a-file'} cannot be used: Not a directory")]
    procs = [subprocess.Popen([sys.executable, "-m", "mlxgw", "backend", "--engine", "sim", "--model", s.model_path,
                               "--port", "1", "--redis-url", s.redis_url, "--cache-dir", str(d)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d, _ in cases]
    for (_, says), p in zip(cases, procs):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and says in err, err


def test_a_run_that_changed_nothing_keeps_the_save_whole(make_stack, tmp_path):
    """A run with a smaller budget restores only the newest entries; stopped without a new
    save or eviction, it leaves the save as it was (helper-51: it shrank the save for good)."""
    s = make_stack()
    b = s.add_backend("b0", None, "--engine", "sim", "--cache-dir", str(tmp_path))
    b.wait_healthy()
    for i in range(3):
        post(b.url + "/v1/completions", {"model": s.model_name, "prompt": [100 + i] * 200, "max_tokens": 1})
    b.stop()
    small = s.add_backend("b0", b.port, "--engine", "sim", "--cache-dir", str(tmp_path), "--cache-entries", "1")
    small.wait_healthy()
    small.stop()
    log = small.log_path.read_text()
    assert "restored the prompt cache from " in log and ": 1 entry (" in log and "saved " in log, log
    assert "2 older entries left out (over --cache-entries / --cache-bytes; " in log, log
    assert "prompt cache unchanged since it was restored: the save in " in log, log
    import json

    assert len(json.loads((tmp_path / "snapshot" / "manifest.json").read_text())["entries"]) == 3
    # A run that does change its cache replaces the save, and the entries its budget left out go:
    # said at its start and when its save drops them (helper-73: nothing said they would be lost).
    small = s.add_backend("b0", b.port, "--engine", "sim", "--cache-dir", str(tmp_path), "--cache-entries", "1")
    small.wait_healthy()
    post(small.url + "/v1/completions", {"model": s.model_name, "prompt": [200] * 200, "max_tokens": 1})
    small.stop()
    log = small.log_path.read_text()
    assert "2 older entries left out (over --cache-entries / --cache-bytes; they stay in the save until this run " \
           "saves its own, and are gone then)" in log, log
    assert ("this save replaced the one restored at start, whose 2 older entries this run's --cache-bytes / "
            "--cache-entries left out: they are gone now") in log, log
    assert len(json.loads((tmp_path / "snapshot" / "manifest.json").read_text())["entries"]) == 1


def test_serve_refuses_a_cache_dir_in_use_and_names_saves_it_leaves(tmp_path, caplog):
    from mlxgw import config, launcher

    m = config.ModelConfig(name="demo", backends=2, cache_dir=str(tmp_path))
    held = persist.CacheDirLock(tmp_path / "demo-1")  # another serve's backend
    assert launcher.check_cache_dirs([m]) == f"demo: --cache-dir {tmp_path / 'demo-1'} is in use by another " \
                                             "backend (each backend needs a directory of its own)"
    held.release()
    c, _ = _filled()
    persist.save(c, tmp_path / "demo-2", FP)  # a third backend's, from a run with --backends 3
    assert launcher.check_cache_dirs([m]) is None
    assert f"{tmp_path / 'demo-2'} holds a saved prompt cache" in caplog.text
    assert "run with --backends 3 to use it" in caplog.text


def test_an_idle_backend_saves_so_a_crash_keeps_the_cache(make_stack, tmp_path):
    """``--cache-save-interval``: once idle, a changed cache is saved (at most that often), so a
    backend killed outright (SIGKILL: no clean stop) gets it back at its restart."""
    s = make_stack()
    b = s.add_backend("b0", None, "--engine", "sim", "--cache-dir", str(tmp_path), "--cache-save-interval", "1")
    b.wait_healthy()
    for i in range(2):
        post(b.url + "/v1/completions", {"model": s.model_name, "prompt": [200 + i] * 300, "max_tokens": 1})
    last = time.time()
    deadline = time.time() + 15
    while time.time() < deadline and "saved the prompt cache to " not in b.log_path.read_text():
        time.sleep(0.02)
    # Not in the gap after an answer (helper-52: a save 46 ms after one held the next turn): only
    # once nothing ran for the quiet time (here the interval, 1 s, being shorter than 30 s).
    assert time.time() - last >= 0.7
    time.sleep(1.5)  # nothing changed since: no second save
    log = b.log_path.read_text()
    assert log.count("saving the prompt cache (2 entries, ") == 1 and " while idle" in log, log
    b.kill()
    b.start(s.env())
    b.wait_healthy()
    assert "restored the prompt cache from " in b.log_path.read_text()
    assert get_json(b.url + "/health")["restored_entries"] == 2


def test_the_first_idle_save_waits_for_the_quiet_not_the_interval(tmp_path, demo_model):
    """``--cache-save-interval`` spaces idle saves; a run's first one waits only for the quiet
    (it waited the interval from the start: a backend SIGKILLed in its first 10 minutes, idle
    for a minute, had saved nothing, helper-58)."""
    from backend import engine as engine_mod

    timing = sim.SimTiming()
    cache = PromptCache(max_entries=8, max_bytes=10**9, ops=sim.SimKVOps(timing))
    eng = sim.SimEngine(demo_model, cache, 10**9, timing, cache_dir=tmp_path, cache_settings=FP,
                        cache_save_interval=600)
    cache.insert(list(range(100, 400)), sim.SimKV(300, timing), "user", prompt_len=300)
    eng._save_when_idle()  # not quiet yet: nothing saved
    assert persist.restore(PromptCache(max_entries=8, max_bytes=10**9, ops=sim.SimKVOps(timing)), tmp_path, FP) is None
    eng._last_busy -= engine_mod.IDLE_SAVE_QUIET_SECONDS + 1
    eng._save_when_idle()
    restored = PromptCache(max_entries=8, max_bytes=10**9, ops=sim.SimKVOps(timing))
    assert persist.restore(restored, tmp_path, FP).entries == 1 and len(restored) == 1
    cache.insert(list(range(500, 800)), sim.SimKV(300, timing), "user", prompt_len=300)
    eng._save_when_idle()  # changed, quiet, but within the interval of that save: not saved again
    assert eng._saved_state != eng._cache_state()


@pytest.mark.parametrize("engine", [["--engine", "sim"], []], ids=["sim", "mlx"])
def test_a_smaller_restart_moves_what_it_leaves_out_into_the_disk_tier(make_stack, tmp_path, engine):
    """helper-73: with a disk tier, the saved entries a smaller --cache-entries leaves out of
    memory go into the tier at start (they were lost at the first save), owned in Redis once:
    the gateway routes a prompt of one back to this backend, which reads it from the tier."""
    s = make_stack()
    tier = ["--disk-cache-dir", str(tmp_path / "tier"), "--disk-cache-bytes", "64MB"]
    b = s.add_backend("b0", None, *engine, "--cache-dir", str(tmp_path / "save"), *tier)
    b.wait_healthy()
    for i in range(3):
        post(b.url + "/v1/completions", {"model": s.model_name, "prompt": [100 + i] * 200, "max_tokens": 1})
    b.stop()
    small = s.add_backend("b0", b.port, *engine, "--cache-dir", str(tmp_path / "save"), *tier, "--cache-entries", "1")
    s.add_gateway()
    s.wait()
    log = small.log_path.read_text()
    assert ": 1 entry (" in log and "; 2 older entries over --cache-entries / --cache-bytes moved into the disk " \
                                    "tier" in log and "left out" not in log, log
    health = get_json(small.url + "/health")
    assert (health["cache_entries"], health["disk_entries"]) == (1, 2), health
    st, h, body = post(s.gateway.url + "/v1/completions", {"model": s.model_name, "prompt": [100] * 200,
                                                           "max_tokens": 1})
    import json

    assert st == 200 and json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 199, body
    assert h["X-Mlxgw-Backend"] == "b0" and int(h["X-Mlxgw-Matched-Tokens"]) >= 128, h
    assert get_json(small.url + "/health")["disk_reads"] == 1
