"""Every shipped config loads, and flags override it."""

import argparse
import json
from pathlib import Path

import pytest

from mlxgw import config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"demo.toml", "single-mac.toml", "multi-model.toml", "multi-mac.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = config.load(str(path))
    if path.name == "demo.toml":  # no name and no path: the offline demo model, what command 1 serves
        assert [(m.name, m.path, m.backends) for m in cfg.models] == [("", "", 2)]
    else:
        assert cfg.models and all(m.name and m.path and m.backends >= 1 for m in cfg.models)
    ports = [p for m in cfg.models for p in range(m.port, m.port + m.backends)]
    assert len(ports) == len(set(ports)) and cfg.port not in ports


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_configs_keep_the_measured_routing_defaults(path):
    # A shipped example once pinned load_weight 0 after the measured default moved on,
    # so everyone who copied it got requests piling onto prefix owners.
    from gateway.route import RoutingConfig

    cfg = config.load(str(path))
    assert {k: v for k, v in cfg.routing.items() if v != getattr(RoutingConfig(), k, v)} == {}


def test_flags_override_file():
    cfg = config.load(str(CONFIGS[0]))
    args = argparse.Namespace(model="/tmp/m", served_name="x", backends=5, port=9000, redis_url=None,
                              host=None, namespace=None, block_size=None, backend_port=None,
                              cache_bytes="1GB", cache_entries=None)
    cfg = config.apply_flags(cfg, args)
    m = cfg.models[0]
    assert (cfg.port, m.path, m.name, m.backends, m.cache_bytes) == (9000, "/tmp/m", "x", 5, "1GB")


def test_unknown_keys_are_errors(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[gateway]\nprot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        config.load(str(p))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    config.validate(config.load(str(path)))


BAD = [  # (toml, message): each once reached a traceback, a child's argparse dump or a hang
    ('[[models]]\nname = "a"\nbackends = "two"\n', "backends must be an integer, not 'two'"),
    ('[[models]]\nname = "a"\nport = "9110"\n', "port must be an integer, not '9110'"),
    ('[[models]]\nname = "a"\ncache_bytes = "lots"\n', "cache_bytes: 'lots' is not a size"),
    ('[[models]]\nname = "a"\ncache_bytes = "-1GB"\n', "cache_bytes: '-1GB' must be more than 0 bytes"),
    ('[[models]]\nname = "a"\ncache_bytes = 0\n', "cache_bytes: 0 must be more than 0 bytes"),
    ('[gateway]\nmax_body_bytes = "0MB"\n', "max_body_bytes: '0MB' must be more than 0 bytes"),
    ('[[models]]\nname = "a"\nbackends = 0\n', "backends must be at least 1, not 0"),
    ('[[models]]\nname = "a"\nmin_hit_tokens = "x"\n', "min_hit_tokens must be an integer"),
    ('[routing]\nload_weight = "high"\n', "[routing]: load_weight must be a number, not 'high'"),
    ('[gateway]\nkeepalive = true\n', "keepalive must be a number, not True"),
    ('[[models]]\nname = "a"\n[[models]]\nname = "a"\nport = 8200\n', "two models are named 'a'"),
    # helper-69: both served the demo model; backends started, then the gateway refused the name twice
    ('[[models]]\nbackends = 1\n[[models]]\nbackends = 1\nport = 8200\n', "two models are named 'demo-tiny'"),
    ('[[models]]\npath = "/m/x"\n[[models]]\npath = "/n/x/"\nport = 8200\n', "two models are named 'x'"),
    ('[[models]]\nname = "a"\n[[models]]\nname = "b"\n', "(8100-8101) and [[models]] b backend ports (8100-8101) overlap"),
    ('[gateway]\nport = 8101\n', "[gateway] port (8101-8101) and [[models]] demo backend ports (8100-8101) overlap"),
    ('[[models]]\nname = "a"\nport = 65535\n', "65535-65536 is outside 1-65535"),
    ('[redis]\nurl = ""\n', "[redis] url is empty"),
    ('[gateway]\nblock_size = -3\n', "[gateway]: block_size must be at least 1, not -3"),
    ('[[models]]\nname = "a"\ncache_entries = 0\n', "[[models]] a: cache_entries must be at least 1, not 0"),
    ('[[models]]\nname = "a"\ndecode_concurrency = 0\n', "[[models]] a: decode_concurrency must be at least 1, not 0"),
    ('[routing]\nload_weight = -0.5\n', "[routing]: load_weight must be at least 0, not -0.5"),
    ('[gateway]\nrate_limit_rpm = -1\n', "[gateway]: rate_limit_rpm must be at least 0, not -1"),
    ('[[models]]\nname = "a"\ncache_dir = 5\n', "[[models]] a: cache_dir must be a string, not 5"),
    ('[gateway]\ndrain_seconds = -1\n', "[gateway]: drain_seconds must be at least 0, not -1"),
    ('[redis]\nnamespace = ""\n', "[redis]: the Redis key namespace is empty"),
    ('[redis]\nnamespace = "a*"\n', "[redis]: the Redis key namespace must be 1-64 letters"),
]


@pytest.mark.parametrize("toml,message", BAD, ids=[m for _, m in BAD])
def test_bad_values_are_config_errors(tmp_path, toml, message):
    p = tmp_path / "bad.toml"
    p.write_text(toml)
    with pytest.raises(ValueError) as e:
        config.validate(config.load(str(p)))
    assert message in str(e.value)


def test_an_unusable_cache_dir_is_a_config_error(tmp_path):
    """Caught before anything starts (helper-50: each backend failed after Redis started and the
    models loaded, with a bare errno line that did not name --cache-dir)."""
    (tmp_path / "a-file").write_text("")
    for d, says in ((tmp_path / "a-file", "not a directory"), (tmp_path / "a-file" / "kv", "Not a directory")):
        cfg = config.ServeConfig(models=[config.ModelConfig(name="a", cache_dir=str(d))])
        with pytest.raises(ValueError, match=f"cache_dir {d} cannot be used: {says}"):
            config.validate(cfg)
    cfg = config.ServeConfig(models=[config.ModelConfig(name="a", cache_dir=str(tmp_path / "new" / "kv"))])
    config.validate(cfg)
    assert (tmp_path / "new" / "kv").is_dir() and (tmp_path / "new" / "kv").stat().st_mode & 0o777 == 0o700


def test_serve_exits_2_on_a_bad_value(tmp_path, capsys):
    import subprocess
    import sys

    p = tmp_path / "bad.toml"
    p.write_text(BAD[0][0])
    # (argv, what stderr must say): each exits 2 with that line and no traceback.
    cases = [
        (["serve", "--config", str(p)], f"config: {p} [[models]] a: backends must be an integer"),
        (["serve", "--backends", "0"], "argument --backends: must be at least 1, not 0"),
        (["serve", "--block-size", "0"], "argument --block-size: must be at least 1, not 0"),
        (["serve", "--cache-bytes=-5GB"], "'-5GB' must be more than 0 bytes"),
        (["backend", "--cache-bytes=-1GB", "--redis-url", "redis://127.0.0.1:1/0"],
         "argument --cache-bytes: '-1GB' must be more than 0 bytes"),
        # accepted and silently without effect before (helper-61)
        (["backend", "--pin-by-reference", "--cache-layout", "whole", "--redis-url", "redis://127.0.0.1:1/0"],
         "--pin-by-reference needs --cache-layout shared"),
        (["serve", "--pin-by-reference", "--cache-layout", "whole"],
         "--pin-by-reference needs --cache-layout shared"),
    ]
    # Each size flag is refused by argparse under its own name (serve's used to be reported as
    # "[[models]] demo cache_bytes", a config-file section the user never wrote).
    cases += [([cmd, f"{flag}={value}"], f"argument {flag}: {says}")
              for cmd, flag, value, says in (("serve", "--cache-bytes", "lots", "'lots' is not a size"),
                                             ("serve", "--max-body-bytes", "0", "'0' must be more than 0 bytes"),
                                             ("gateway", "--max-body-bytes", "0M", "'0M' must be more than 0 bytes"))]
    # their own flag: refused by argparse, not at the first request
    cases += [([cmd, flag, "0"], f"{flag}: must be at least 1, not 0")
              for cmd, flag in (("gateway", "--block-size"), ("backend", "--block-size"),
                                ("backend", "--decode-concurrency"))]
    # NaN passed every later check (a NaN rate limit or body timeout turned the limit off), and
    # `mlxgw top` ended in a traceback or blamed Redis (helper-62)
    cases += [([cmd, flag, value], f"argument {flag}: must be a finite number")
              for cmd, flag, value in (("gateway", "--keepalive", "nan"), ("serve", "--body-timeout", "nan"),
                                       ("gateway", "--rate-limit-rpm", "inf"), ("top", "--interval", "nan"),
                                       ("top", "--interval", "-1"), ("backend", "--request-timeout", "nan"))]
    cases += [([cmd, "--events", "-1"], "argument --events: must be at least 0, not -1") for cmd in ("top", "status")]
    # integer flags: a gateway port of 70000 ended in bind()'s traceback, --max-retries -1 sent
    # every request nowhere (503), --backends 0 blamed a "[[models]] demo" table nobody wrote
    cases += [([cmd, flag, value], f"argument {flag}: {says}")
              for cmd, flag, value, says in (("gateway", "--port", "70000", "must be from 1 to 65535, not 70000"),
                                             ("backend", "--port", "-1", "must be at least 1, not -1"),
                                             ("serve", "--backend-port", "65536", "must be from 1 to 65535"),
                                             ("gateway", "--max-retries", "-1", "must be at least 0, not -1"),
                                             ("gateway", "--balance-abs-tokens", "-5", "must be at least 0"),
                                             ("backend", "--cache-entries", "0", "must be at least 1, not 0"),
                                             ("backend", "--min-hit-tokens", "x", "'x' is not an integer"),
                                             ("top", "--iterations", "-1", "must be at least 0, not -1"))]
    # a Redis URL without a scheme ended the gateway and status in redis-py's traceback (helper-65)
    cases += [([cmd, "--redis-url", url], f"argument --redis-url: must be a redis://, rediss:// or unix:// URL "
                                          f"(e.g. redis://127.0.0.1:6379/0), not {shown}")
              for cmd, url, shown in (("gateway", "127.0.0.1:6379", "'127.0.0.1:6379'"),
                                      ("status", "notaurl", "'notaurl'"), ("backend", "foo://bar", "'foo://bar'"),
                                      ("serve", ":secret@host:6379", "the value given"))]
    # helper-66: heartbeats every 0 s wrote to Redis ~12,000 times a second; a TTL under the
    # interval made the backend leave and rejoin the registry every heartbeat
    # (helper-68: the limits said in the flag's words, by argparse, not "at least 0" nor a log line later)
    cases += [(["backend", "--heartbeat-interval", "0"],
               "argument --heartbeat-interval: must be a finite number of seconds from 0.1 to 300, not 0"),
              (["backend", "--heartbeat-interval", "nan"],
               "argument --heartbeat-interval: must be a finite number of seconds from 0.1 to 300, not nan"),
              (["backend", "--heartbeat-ttl", "1e30"],
               "argument --heartbeat-ttl: must be a finite number of seconds from 0.2 to 600, not 1e30"),
              (["backend", "--heartbeat-ttl", "1", "--heartbeat-interval", "5"],
               "--heartbeat-ttl 1 is under two --heartbeat-interval (5 s): the registry record would expire")]
    # helper-66: redis-py's traceback on a port that is not one (a database neither)
    cases += [([cmd, "--redis-url", url], f"argument --redis-url: {says}")
              for cmd, url, says in (
                  ("status", "redis://:pw@127.0.0.1:notaport/0", "the port of the value given is not a number"),
                  ("gateway", "redis://127.0.0.1:99999/0", "the port of 'redis://127.0.0.1:99999/0' is not a number"),
                  ("backend", "redis://127.0.0.1:6379/abc", "the database of 'redis://127.0.0.1:6379/abc' must be a "
                                                            "number (e.g. /0), not 'abc'"))]
    # helper-66: an empty value silently meant the flag's default; a model name given twice, the last
    cases += [([cmd, flag, ""], f"argument {flag}: is empty (leave the flag out for its default)")
              for cmd, flag in (("backend", "--id"), ("backend", "--url"), ("backend", "--model"),
                                ("serve", "--model"), ("serve", "--served-name"))]
    cases += [(["demo-model", ""], "argument dir: is empty (leave the flag out for its default)"),
              (["gateway", "--model", "=/m"], "argument --model: must be PATH or NAME=PATH, both non-empty, not '=/m'"),
              (["gateway", "--model", "a=/m", "--model", "a=/n"], "bad setting: --model: the name 'a' is given twice")]
    # helper-66: any --log-level was taken (and meant info)
    cases += [(["--log-level", "bogus", "status"], "--log-level (or MLXGW_LOG_LEVEL) must be one of debug, info, "
                                                   "warning, error, critical, not 'bogus'")]
    # an empty URL (an unset variable) is not "the default"
    cases += [([cmd, "--redis-url", ""], "--redis-url (or MLXGW_REDIS_URL) is empty")
              for cmd in ("serve", "gateway", "status")]
    # an empty namespace was taken (keys starting with ':'); a glob one would reach others' keys
    cases += [([cmd, "--namespace", ns], "argument --namespace: the Redis key namespace " + (
                  f"must be 1-64 letters, digits or _ . : / - (no spaces, braces or glob characters), not {ns!r}"
                  if ns else "is empty"))
              for cmd, ns in (("serve", ""), ("gateway", "a b"), ("backend", "x*"), ("status", "{m}"), ("top", ""))]
    # helper-66: a file value a flag overrides was not checked (it failed once the flag was dropped)
    p2 = tmp_path / "overridden.toml"
    p2.write_text('[gateway]\nport = "x"\n')
    cases += [(["serve", "--config", str(p2), "--port", "9000"],
               f"config: {p2} [gateway]: port must be an integer, not 'x'")]
    # The command line's own errors (argparse's) are checked in this process: ~40 interpreter
    # start-ups took 26 s of the test run. The rest run the real command, all at once.
    from mlxgw.cli import main

    by_parser = [(argv, says) for argv, says in cases if says.startswith(("argument ", "--redis-url (or", "--log-level (or"))]
    for argv, says in by_parser:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err, (argv, err)
    rest = [c for c in cases if c not in by_parser]
    procs = [subprocess.Popen([sys.executable, "-m", "mlxgw", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv, _ in rest]
    for (argv, says), proc in zip(rest, procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and says in err and "Traceback" not in err, (argv, err)
    assert len(by_parser) >= 25 and len(rest) >= 6


def test_a_malformed_redis_url_in_the_environment_is_named_as_the_environment(monkeypatch, capsys):
    """helper-69: MLXGW_REDIS_URL=127.0.0.1:6379 was refused as `argument --redis-url`, a flag
    nobody gave. The flag still overrides the variable (then the flag's URL is used)."""
    from mlxgw.cli import main

    monkeypatch.setenv("MLXGW_REDIS_URL", "127.0.0.1:6379")
    for cmd in ("gateway", "backend", "status", "top"):
        with pytest.raises(SystemExit) as e:
            main([cmd])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.splitlines()[-1] == (
            "mlxgw: error: the environment's MLXGW_REDIS_URL must be a redis://, rediss:// or unix:// URL (e.g. "
            "redis://127.0.0.1:6379/0), not '127.0.0.1:6379' (--redis-url overrides it)"), (cmd, err)
    # the flag given: the variable is not read, so not blamed (Redis at port 1 does not answer: exit 4)
    assert main(["status", "--redis-url", "redis://127.0.0.1:1/0"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("Redis unreachable at redis://127.0.0.1:1/0") and "MLXGW_REDIS_URL" not in err, err
    # --json with a URL given: no hint, so null (it was "")
    assert main(["status", "--json", "--redis-url", "redis://127.0.0.1:1/0"]) == 4
    out = json.loads(capsys.readouterr().out)["error"]
    assert (out["type"], out["redis_url"], out["hint"]) == ("redis_unreachable", "redis://127.0.0.1:1/0", None), out


def test_status_into_a_closed_pipe_is_no_traceback():
    """helper-70: `mlxgw status --json | head -c 10` ended in a BrokenPipeError traceback. Its
    stdout here is a pipe whose reader is already gone (status --json writes its JSON error there)."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "mlxgw", "status", "--json", "--redis-url", "redis://127.0.0.1:1/0"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.stderr.startswith("Redis unreachable at redis://127.0.0.1:1/0"), p.stderr


def test_demo_model_into_a_bad_directory_says_why_without_a_traceback(tmp_path, capsys):
    """`mlxgw demo-model /proc/nope` ended in tempfile's traceback (helper-65)."""
    from mlxgw.cli import main

    (tmp_path / "afile").write_text("x")
    for target, says in ((tmp_path / "afile" / "m", f"File exists ({tmp_path / 'afile'})"), (tmp_path, "already exists")):
        assert main(["demo-model", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"mlxgw demo-model: cannot build into {target}: ") and says in err, err
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no temporary directory left


def test_demo_model_into_a_directory_holding_it_keeps_it(tmp_path, capsys):
    """helper-69: `mlxgw demo-model DIR` a second time failed `already exists`; it keeps the
    model there, as the cache's build does. Another variant's directory is still refused."""
    from mlxgw.cli import main

    out = tmp_path / "m"
    assert main(["demo-model", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["demo-model", str(out)]) == 0
    got = capsys.readouterr()
    assert got.out == f"{out}\n" and got.err == f"mlxgw demo-model: {out} already holds the demo model 'tiny'; kept\n"
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert main(["demo-model", str(out), "--variant", "bench"]) == 1
    assert f"cannot build into {out}: " in capsys.readouterr().err


def test_ctrl_c_while_a_command_starts_is_no_traceback(demo_model):
    """helper-66: Ctrl-C on a starting `mlxgw serve` printed a gateway child's KeyboardInterrupt
    traceback (it was importing and loading its tokenizers). A SIGINT 0.3 s in, well before a
    gateway installs its own handlers, ends it with 130 and one line."""
    import subprocess
    import sys

    from mlxgw.harness import free_port

    # SIGINT's default handler: a test run started in the background (CI's) ignores SIGINT, and
    # its children inherit that.
    code = ("import os, signal, sys\nfrom mlxgw.cli import main\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGINT))\n"
            "signal.setitimer(signal.ITIMER_REAL, 0.3)\n"
            f"sys.exit(main(['gateway', '--model', 'demo-tiny={demo_model}', '--port', '{free_port()}', "
            "'--redis-url', 'redis://127.0.0.1:1/0']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and r.stderr.strip().splitlines()[-1] == "mlxgw: interrupted", r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_redacted_urls_hide_the_password_and_keep_the_rest():
    """Logs and errors show Redis URLs with ``***`` for the password; an IPv6 host lost its
    brackets (``@::1:8620``, helper-66)."""
    from mlxgw.util import redact_url

    assert redact_url("redis://:pw@[::1]:8620/0") == "redis://:***@[::1]:8620/0"
    assert redact_url("redis://user:pw@host:6379/2") == "redis://user:***@host:6379/2"
    assert redact_url("rediss://:p%40ss@h/0") == "rediss://:***@h/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("redis://:pw@h:notaport/0") == "redis://:***@h:notaport/0"


def test_only_a_backend_imports_mlx_lm():
    """The CLI used to build every command's arguments, the backend's among them, so
    `mlxgw status`, `mlxgw --help` and a flag error imported mlx-lm (about 1.3 s of a 2.2 s
    `mlxgw status` here) without using it. (A running gateway imports it to load its
    tokenizer; its argument parsing no longer does.)"""
    import subprocess
    import sys

    code = ("import sys\nfrom mlxgw.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('imported', 'mlx_lm' in sys.modules, 'mlx.core' in sys.modules)")
    cases = [(["--help"], False), (["status", "--help"], False), (["top", "--help"], False),
             (["serve", "--help"], False), (["gateway", "--help"], False), (["--log-level", "debug", "gateway", "--help"], False),
             (["demo-model", "--help"], False), (["backend", "--help"], True)]
    for args, imported in cases:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.stdout.splitlines()[-1] == f"imported {imported} {imported}", (args, r.stdout[-300:], r.stderr[-300:])
        assert "usage: mlxgw" in r.stdout, args


def test_serve_passes_routing_and_keepalive_to_the_gateway(tmp_path):
    from mlxgw import launcher

    p = tmp_path / "c.toml"
    p.write_text('[routing]\nbalance_abs_tokens = 4096\n[gateway]\nkeepalive = 2.5\ndrain_seconds = 30\n')
    cfg = config.load(str(p))
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cfg = config.apply_flags(cfg, parser.parse_args(["--routing-policy", "least_loaded"]))
    assert cfg.routing == {"balance_abs_tokens": 4096, "policy": "least_loaded"} and cfg.keepalive == 2.5
    flags = launcher.gateway_security_flags(cfg)
    assert flags[flags.index("--keepalive") + 1] == "2.5"
    # serve took --drain-seconds and passed the gateway none: the flag over the file, else 8
    assert flags[flags.index("--drain-seconds") + 1] == "30"
    cfg = config.apply_flags(cfg, parser.parse_args(["--drain-seconds", "1.5"]))
    flags = launcher.gateway_security_flags(cfg)
    assert flags[flags.index("--drain-seconds") + 1] == "1.5"
    flags = launcher.gateway_security_flags(config.apply_flags(config.ServeConfig(), parser.parse_args([])))
    assert flags[flags.index("--drain-seconds") + 1] == "8.0"
    with pytest.raises(ValueError, match="policy must be one of"):
        (tmp_path / "d.toml").write_text('[routing]\npolicy = "random"\n')
        config.load(str(tmp_path / "d.toml"))


def test_serve_passes_boolean_routing_keys_as_switches_the_gateway_takes(tmp_path):
    """A `[routing]` boolean became `--heartbeat-load True`, which the gateway's parser refuses
    (it exited 2 at every start of serve); now a switch, and nothing for a default."""
    from gateway.main import add_arguments
    from mlxgw import launcher

    p = tmp_path / "c.toml"
    p.write_text('[routing]\nheartbeat_load = true\nseed_empty = false\nshort_claims = false\nload_weight = 0.1\n')
    cfg = config.load(str(p))
    flags = launcher.routing_flags(cfg.routing)
    assert flags == ["--heartbeat-load", "--no-seed-empty", "--load-weight", "0.1"]
    gw = argparse.ArgumentParser()
    add_arguments(gw)
    args = gw.parse_args(["--model", "m=/x", *flags])
    assert (args.heartbeat_load, args.seed_empty, args.short_claims, args.load_weight) == (True, False, False, 0.1)
    assert launcher.routing_flags({"policy": "round_robin", "seed_empty": True}) == ["--routing-policy", "round_robin"]


def test_serve_passes_every_shared_gateway_flag_on():
    """Each gateway flag `mlxgw serve` also takes reaches the gateway's command line (serve
    took --drain-seconds and passed none on until session 39)."""
    from gateway.main import add_security_arguments
    from mlxgw import launcher

    shared = argparse.ArgumentParser()
    add_security_arguments(shared)
    flags = [a.option_strings[0] for a in shared._actions if a.option_strings and a.dest != "help"]
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    argv = ["--api-key-file", "/k", "--allow-unauthenticated", "--max-in-flight", "7", "--max-connections", "9",
            "--max-concurrent-per-key", "3", "--rate-limit-rpm", "11", "--rate-burst", "4", "--max-messages", "5",
            "--max-answer-tokens", "8", "--max-body-bytes", "2MiB", "--body-timeout", "6", "--drain-seconds", "13", "--write-timeout", "12",
            "--keepalive", "2"]
    assert sorted(f for f in argv if f.startswith("--") and f != "--keepalive") == sorted(flags)  # all of them
    out = launcher.gateway_security_flags(config.apply_flags(config.ServeConfig(), parser.parse_args(argv)))
    given = {f: (v if not v.startswith("--") else None) for f, v in zip(argv, argv[1:] + ["--"]) if f.startswith("--")}
    for f, v in given.items():
        assert f in out, f
        if v is not None:
            got = out[out.index(f) + 1]
            assert got == v or (v.isdigit() and float(got) == float(v)) or (v, got) == ("2MiB", "2097152"), (f, got)


def test_the_embedded_redis_port_can_be_chosen(tmp_path):
    """helper-69, -76, -77: serve's embedded Redis took a free port and nothing could pin it:
    `[redis] port` / `--redis-port`, for the embedded Redis only."""
    p = tmp_path / "c.toml"
    p.write_text("[redis]\nport = 6390\n")
    cfg = config.load(str(p))
    assert cfg.redis_port == 6390 and cfg.redis_url is None
    config.validate(cfg)
    for text, says in (('[redis]\nport = 6390\nurl = "redis://h:6379/0"\n', "the URL names the port"),
                       ("[redis]\nport = 70000\n", "must be a port number"),
                       ("[gateway]\nport = 6390\n[redis]\nport = 6390\n", "overlap")):
        p.write_text(text)
        with pytest.raises(ValueError, match=says):
            config.validate(config.load(str(p)))


def test_serve_passes_the_backends_listen_address(tmp_path):
    """helper-76: serve's backends listened on loopback only, so a gateway on another Mac could
    not reach them (configs/multi-mac.toml): `[[models]] host`, loopback by default."""
    from mlxgw import launcher

    assert launcher.backend_model_flags(config.ModelConfig())[:2] == ["--host", "127.0.0.1"]
    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nhost = "0.0.0.0"\n')
    assert launcher.backend_model_flags(config.load(str(p)).models[0])[:2] == ["--host", "0.0.0.0"]
    multi = config.load(str(Path(__file__).parent.parent / "configs" / "multi-mac.toml"))
    assert multi.models[0].host == "0.0.0.0"
    p.write_text('[[models]]\nname = "m"\nhost = " "\n')
    with pytest.raises(ValueError, match="host must be an address to listen on"):
        config.load(str(p))


def test_serve_passes_prefill_settings_to_the_backends(tmp_path):
    from mlxgw import launcher

    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nprefill_concurrency = 1\nprefill_order = "step-beside"\n'
                 'decode_concurrency = 12\n')
    flags = launcher.backend_model_flags(config.load(str(p)).models[0])
    assert flags[flags.index("--prefill-concurrency") + 1] == "1"
    assert flags[flags.index("--decode-concurrency") + 1] == "12"
    assert flags[flags.index("--prefill-order") + 1] == "step-beside"
    default = launcher.backend_model_flags(config.ModelConfig())
    from backend.engine import DEFAULT_PREFILL_ORDER
    assert default[default.index("--prefill-order") + 1] == DEFAULT_PREFILL_ORDER == "step-beside"
    (tmp_path / "d.toml").write_text('[[models]]\nprefill_order = "lifo"\n')
    with pytest.raises(ValueError, match="prefill_order must be one of fifo, shorter-beside, step-beside"):
        config.load(str(tmp_path / "d.toml"))


def test_default_temperature_reaches_the_backends_and_samples(tmp_path, make_stack):
    """helper-71: a request without `temperature` was always greedy (mlx_lm.server's default),
    where the OpenAI and Anthropic APIs sample at 1.0, which agent tools sending none expect.
    `[[models]] default_temperature` (backend `--default-temperature`) sets it; 0 stays the default."""
    from mlxgw import launcher
    from mlxgw.httpget import post

    flags = launcher.backend_model_flags(config.ModelConfig())
    assert "--default-temperature" not in flags and flags[flags.index("--request-timeout") + 1] == "600.0"
    p = tmp_path / "c.toml"
    # helper-73: request_timeout could not be set under serve either
    p.write_text('[[models]]\nname = "m"\ndefault_temperature = 1.5\nrequest_timeout = 30\n')
    cfg = config.load(str(p))
    config.validate(cfg)
    flags = launcher.backend_model_flags(cfg.models[0])
    assert flags[flags.index("--default-temperature") + 1] == "1.5"
    assert flags[flags.index("--request-timeout") + 1] == "30"
    for bad, why in (("2.5", "from 0 to 2"), ("nan", "finite"), ("-1", "at least 0"), ('"hot"', "must be a number")):
        p.write_text(f'[[models]]\ndefault_temperature = {bad}\n')
        with pytest.raises(ValueError, match=why):
            config.validate(config.load(str(p)))
    # sampling_defaults: the model's generation_config.json by default (backend.server.sampling_defaults)
    assert flags[flags.index("--sampling-defaults") + 1] == "model"
    p.write_text('[[models]]\nsampling_defaults = "none"\n')
    cfg = config.load(str(p))
    config.validate(cfg)
    none_flags = launcher.backend_model_flags(cfg.models[0])
    assert none_flags[none_flags.index("--sampling-defaults") + 1] == "none"
    p.write_text('[[models]]\nsampling_defaults = "greedy"\n')
    with pytest.raises(ValueError, match='sampling_defaults must be "model" or "none"'):
        config.validate(config.load(str(p)))
    s = make_stack()
    # --request-timeout 0 is no limit (it timed every request out at once)
    b = s.add_backend("b0", None, "--default-temperature", "1.5", "--request-timeout", "0")
    b.wait_healthy()

    def answers(**extra):
        return {json.loads(post(b.url + "/v1/completions", {"model": "demo-tiny", "prompt": "once upon a time",
                                                            "max_tokens": 8, **extra})[2])["choices"][0]["text"]
                for _ in range(4)}

    assert len(answers()) > 1  # sampled at 1.5
    assert len(answers(temperature=0)) == 1  # a given temperature is kept: greedy


def test_serve_passes_the_opt_in_admission_and_pin_settings(tmp_path):
    """``max_inflight_share`` / ``pin_by_reference`` per model, or serve's flags, reach each backend's
    command line (only `mlxgw backend` had them: a serve user could not turn them on); off by default."""
    from mlxgw import launcher

    flags = launcher.backend_model_flags(config.ModelConfig())
    assert "--max-inflight-share" not in flags and "--no-pin-by-reference" in flags
    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nmax_inflight_share = 0.8\npin_by_reference = true\n')
    cfg = config.load(str(p))
    config.validate(cfg)
    flags = launcher.backend_model_flags(cfg.models[0])
    assert flags[flags.index("--max-inflight-share") + 1] == "0.8" and "--pin-by-reference" in flags
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(["--max-inflight-share", "0.5",
                                                                      "--pin-by-reference"]))
    flags = launcher.backend_model_flags(cfg.models[0])
    assert flags[flags.index("--max-inflight-share") + 1] == "0.5" and "--pin-by-reference" in flags
    for bad, why in (("1.5", "at most 1"), ('"x"', "must be a number"), ("-0.1", "at least 0"),
                     ("nan", "finite"), ("inf", "finite")):  # NaN passed every comparison (helper-61)
        p.write_text(f'[[models]]\nmax_inflight_share = {bad}\n')
        with pytest.raises(ValueError, match=why):
            config.validate(config.load(str(p)))
    for bad in ("2", "nan", "-0.1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-inflight-share", bad])
    # Flags turn off what a config turned on: 0 is off, as in the config (it was refused), and --no-pin-by-reference.
    p.write_text('[[models]]\nmax_inflight_share = 0.8\npin_by_reference = true\n')
    cfg = config.apply_flags(config.load(str(p)), parser.parse_args(["--max-inflight-share", "0", "--no-pin-by-reference"]))
    flags = launcher.backend_model_flags(cfg.models[0])
    assert "--max-inflight-share" not in flags and "--no-pin-by-reference" in flags
    from backend import main as backend_main

    bp = argparse.ArgumentParser()
    backend_main.add_arguments(bp)
    assert bp.parse_args(["--max-inflight-share", "0"]).max_inflight_share == 0.0
    # Pins by reference hold the shared layout's segments: with whole entries the setting is refused.
    p.write_text('[[models]]\ncache_layout = "whole"\npin_by_reference = true\n')
    with pytest.raises(ValueError, match="pin_by_reference needs cache_layout"):
        config.validate(config.load(str(p)))


def test_serve_cache_layout_flag_reaches_the_backends(tmp_path):
    """`mlxgw serve --cache-layout whole` (a trial found only `mlxgw backend` had the flag)."""
    from mlxgw import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(["--cache-layout", "whole"]))
    flags = launcher.backend_model_flags(cfg.models[0])
    assert flags[flags.index("--cache-layout") + 1] == "whole"
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args([]))
    flags = launcher.backend_model_flags(cfg.models[0])
    assert flags[flags.index("--cache-layout") + 1] == "shared"
    assert flags[flags.index("--decode-concurrency") + 1] == "16"
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(["--decode-concurrency", "12"]))
    flags = launcher.backend_model_flags(cfg.models[0])
    assert flags[flags.index("--decode-concurrency") + 1] == "12"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cache-layout", "bogus"])


def test_serve_engine_sim_starts_simulated_backends_and_checks_no_weights(tmp_path):
    """`mlxgw serve --engine sim` / ``[[models]] engine = "sim"`` (helper-90): every backend of
    the model runs the simulated engine, which loads no weights, so the memory check and the
    budget warning leave it out; ``mlx`` stays the default and anything else is a config error."""
    from backend.main import add_arguments as backend_arguments
    from mlxgw import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    bp = argparse.ArgumentParser()
    backend_arguments(bp)

    def engine_of(cfg):
        return bp.parse_args(["--model", "m", *launcher.backend_model_flags(cfg.models[0])]).engine

    assert engine_of(config.apply_flags(config.ServeConfig(), parser.parse_args([]))) == "mlx"
    sim = config.apply_flags(config.ServeConfig(), parser.parse_args(["--engine", "sim", "--cache-bytes", "1TB"]))
    assert engine_of(sim) == "sim"
    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nengine = "sim"\n')
    assert engine_of(config.load(str(p))) == "sim"
    # Weights of 1 TiB (a file that size, sparse) on each of 2 backends: refused for mlx, not for sim
    model = tmp_path / "big"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(2**40)
    sim.models[0].path = str(model)
    assert launcher.check_memory(sim.models) is None and launcher.budget_warning(sim.models) is None
    sim.models[0].engine = "mlx"
    assert "not enough memory" in launcher.check_memory(sim.models)
    assert "1024.00 GiB of weights" in launcher.budget_warning(sim.models)
    p.write_text('[[models]]\nname = "m"\nengine = "cuda"\n')
    with pytest.raises(ValueError, match="engine must be one of mlx, sim, not 'cuda'"):
        config.load(str(p))
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "cuda"])


def test_serve_cache_dir_gives_each_backend_a_directory_of_its_own(tmp_path):
    """`mlxgw serve --cache-dir DIR` / ``[[models]] cache_dir``: backend i of model M keeps its
    prompt cache in DIR/M-i (two backends may not share one: backend.persist.CacheDirLock)."""
    from mlxgw import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(["--cache-dir", str(tmp_path / "kv"),
                                                                       "--served-name", "demo"]))
    m = cfg.models[0]
    assert launcher.backend_cache_dir_flags(m, 1) == ["--cache-dir", str(tmp_path / "kv" / "demo-1"),
                                                     "--cache-save-interval", "600"]
    assert launcher.backend_cache_dir_flags(config.ModelConfig(name="demo"), 0) == []  # not kept by default
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(["--cache-dir", "/kv", "--cache-save-interval",
                                                                       "0"]))
    assert launcher.backend_cache_dir_flags(cfg.models[0], 0)[-2:] == ["--cache-save-interval", "0"]
    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\ncache_dir = "~/kv"\ncache_save_interval = 60\n')
    flags = launcher.backend_cache_dir_flags(config.load(str(p)).models[0], 0)
    assert flags == ["--cache-dir", str(Path("~/kv").expanduser().resolve() / "m-0"), "--cache-save-interval", "60"]


def test_serve_disk_cache_bytes_gives_each_backend_a_disk_tier_under_its_cache_dir(tmp_path):
    """`mlxgw serve --disk-cache-bytes` / ``[[models]] disk_cache_bytes`` (cache rule 8): passed to
    each backend, whose tier goes in its own ``--cache-dir``; without a cache_dir, a config error."""
    from mlxgw import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(
        ["--cache-dir", str(tmp_path / "kv"), "--served-name", "demo", "--disk-cache-bytes", "100GB"]))
    config.validate(cfg)
    assert launcher.backend_cache_dir_flags(cfg.models[0], 1) == [
        "--cache-dir", str(tmp_path / "kv" / "demo-1"), "--cache-save-interval", "600", "--disk-cache-bytes", "100GB"]
    cfg = config.apply_flags(config.ServeConfig(), parser.parse_args(["--disk-cache-bytes", "100GB"]))
    with pytest.raises(ValueError, match=r"disk_cache_bytes \(--disk-cache-bytes\) needs cache_dir \(--cache-dir\)"):
        config.validate(cfg)
    p = tmp_path / "n.toml"  # a number of bytes, as cache_bytes takes (helper-53: refused)
    p.write_text(f'[[models]]\nname = "m"\ncache_dir = "{tmp_path}"\ndisk_cache_bytes = 1073741824\n')
    cfg = config.load(str(p))
    config.validate(cfg)
    assert launcher.backend_cache_dir_flags(cfg.models[0], 0)[-2:] == ["--disk-cache-bytes", "1073741824"]
    cfg = config.ServeConfig(models=[config.ModelConfig(name="a", cache_dir=str(tmp_path), disk_cache_bytes="lots")])
    with pytest.raises(ValueError, match="a disk_cache_bytes: "):
        config.validate(cfg)
    with pytest.raises(SystemExit):
        parser.parse_args(["--disk-cache-bytes", "-1GB"])


def test_a_backend_started_by_hand_has_the_serve_defaults():
    """`mlxgw backend` on another Mac gets the cache budget the README states for `serve`
    (it had 4GB against serve's 2GB before session 28)."""
    from backend.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    d = p.parse_args([])
    m = config.ModelConfig()
    assert (d.cache_bytes, d.cache_entries, d.min_hit_tokens) == (m.cache_bytes, m.cache_entries, m.min_hit_tokens)
    assert d.cache_bytes == "2GB"
    assert (d.decode_concurrency, d.prefill_concurrency) == (m.decode_concurrency, m.prefill_concurrency) == (16, 2)


@pytest.mark.parametrize("text,n", [
    ("512MB", 512 << 20), ("512MiB", 512 << 20), ("512M", 512 << 20), ("512m", 512 << 20), ("2G", 2 << 30),
    ("1.5GiB", 3 << 29), ("4k", 4096), ("4KB", 4096), ("1T", 1 << 40), ("1000000", 1000000), ("100B", 100),
    (" 8 GB ", 8 << 30), (2048, 2048), ("-1GB", -(1 << 30)),
])
def test_sizes_take_single_letter_binary_units(text, n):
    from mlxgw.util import parse_bytes

    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["lots", "", "GB", "1X", "1 iB", "1.2.3M", "1MBB", float("nan"), True, None])
def test_sizes_that_are_not_sizes_are_refused(text):
    from mlxgw.util import parse_bytes

    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["1.5", "0.5B", "2.25 b", 1.5])
def test_a_fraction_of_a_byte_is_refused_not_rounded(text):
    """``--disk-cache-bytes 1.5`` meant 1.5 of some unit; it read as 1 byte (helper-57)."""
    from mlxgw.util import parse_bytes, positive_bytes

    with pytest.raises(ValueError, match="is a fraction of a byte"):
        parse_bytes(text)
    with pytest.raises(ValueError, match=r"fraction of a byte \(a unit is missing\) \(e\.g\. 2GB"):
        positive_bytes(text)
    assert parse_bytes("1.5K") == 1536 and parse_bytes("3.0") == 3 and parse_bytes(3.0) == 3


def test_a_cache_budget_that_cannot_bind_is_pointed_out():
    """``--cache-bytes 512`` is 512 bytes (a bare number counts bytes): it caches nothing,
    silently (helper-46); a budget above the machine's memory never binds."""
    from backend.main import budget_warnings

    assert budget_warnings("512", 512, total_memory=2**34) == [
        "--cache-bytes 512 is 512 bytes: too small to hold a prompt, so nothing will be cached (a size without a "
        "unit counts bytes; did you mean 512MB?)"]
    assert budget_warnings("10KB", 10240, total_memory=2**34) == [
        "--cache-bytes 10KB is 10240 bytes: too small to hold a prompt, so nothing will be cached"]
    assert budget_warnings("2TB", 2 << 40, total_memory=24 * 2**30) == [
        "--cache-bytes 2TB is more than this machine's memory (24.0 GiB): memory, not the budget, will bound the "
        "prompt cache"]
    assert budget_warnings("2GB", 2 << 30, total_memory=24 * 2**30) == []
    # With the model's KV size known, the threshold is 256 of its tokens (helper-56/57: the demo
    # model's 512 KB holds 1,000 tokens and was called too small).
    assert budget_warnings("0.5MB", 500_000, total_memory=2**34, kv_per_token=512) == []
    assert budget_warnings("100KB", 100_000, total_memory=2**34, kv_per_token=512) == [
        "--cache-bytes 100KB is 100000 bytes: less than 256 tokens of this model's KV (512 bytes a token), so next "
        "to nothing will be cached"]
    assert budget_warnings("64", 64, total_memory=2**34, kv_per_token=147456)[0].endswith("did you mean 64MB?)")


def test_the_kv_size_comes_from_the_models_config():
    from backend.main import model_kv_bytes_per_token
    from mlxgw.demo_model import ensure_demo_model

    cfg = json.loads((ensure_demo_model("tiny") / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = 4 if cfg.get("torch_dtype") == "float32" else 2
    assert model_kv_bytes_per_token(ensure_demo_model("tiny")) == 2 * cfg["num_hidden_layers"] * heads * dim * width
    assert model_kv_bytes_per_token("/no/such/model") is None


def test_serve_warns_when_the_cache_budgets_exceed_memory(tmp_path):
    """Weights plus every backend's prompt-cache budget above the machine's memory is a warning
    (helper-62: `--cache-bytes 1TB` started on a 23 GB machine without a word)."""
    from mlxgw import launcher

    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\0" * 1000)
    m = config.ModelConfig(name="m", path=str(d), backends=3, cache_bytes="1GB")
    assert launcher.budget_warning([m], total_memory=4 * 2**30) is None  # 3 x (1,200 B + 1 GiB)
    msg = launcher.budget_warning([m], total_memory=3 * 2**30)
    assert msg and "add up to 3.0 GiB" in msg and "m: 3 x (0.00 GiB of weights + 1.0 GiB cache)" in msg, msg


def test_serve_flag_errors_name_the_flags_not_a_config_table(tmp_path):
    """serve run with flags only said "[[models]] demo: cache_dir ... not a directory", naming a
    config table the user never wrote (helper-64); errors of a --config file keep its names."""
    import subprocess
    import sys

    from mlxgw.launcher import as_flags

    f = tmp_path / "file"
    f.write_text("x")
    r = subprocess.run([sys.executable, "-m", "mlxgw", "serve", "--cache-dir", str(f)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and f"config: --cache-dir {f} cannot be used" in r.stderr, r.stderr
    assert "[[models]]" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "mlxgw", "serve", "--port", "8100", "--backend-port", "8099"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config: --port (8100-8100) and the backend ports (--backend-port, --backends) " \
        "(8099-8100) overlap" in r.stderr, r.stderr
    assert as_flags("[[models]] a: backend_ports is odd") == "[[models]] a: backend_ports is odd"  # not a setting


def test_the_gateway_start_log_names_the_routing_settings_that_differ_from_the_defaults():
    """helper-94 could tell `seed_progress = true` (retired since) had reached the gateway only from `ps`: the
    start-up log's ``routing:`` line names each setting that is not the default."""
    from gateway.main import add_arguments, config_from_args, routing_changes
    from gateway.route import RoutingConfig

    assert routing_changes(RoutingConfig()) == []
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--no-prefill-progress", "--seed-beside", "--load-weight", "0.1", "--model", "m=/x"])
    assert routing_changes(config_from_args(args).routing) == ["load_weight=0.1", "seed_beside=True",
                                                               "prefill_progress=False"]


def test_a_retired_routing_setting_is_refused_with_what_replaced_it(tmp_path, capsys):
    """``seed_progress`` (session 52, opt-in) was retired in session 55: a config key or flag
    naming it stops the start with the reason, not as an unknown key or a silent no-op."""
    from gateway.main import add_arguments

    f = tmp_path / "c.toml"
    f.write_text("[routing]\nseed_progress = true\n")
    with pytest.raises(ValueError, match=r"\[routing\]: 'seed_progress' was retired: the queued figure now follows "
                                         r"each stream's prefill progress"):
        config.load(str(f))
    p = argparse.ArgumentParser(prog="mlxgw gateway")
    add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--seed-progress"])
    assert e.value.code == 2
    assert "--seed-progress was retired: the queued figure now follows each stream's prefill progress" in \
        capsys.readouterr().err
