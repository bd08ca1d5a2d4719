"""``mlxgw serve``: config + flags -> Redis -> N backends per model -> gateway -> supervise.

Backends and the gateway are child processes (``python -m mlxgw backend`` /
``gateway``). A crashed backend is restarted with exponential backoff and
registers itself under a new epoch. Ctrl-C / SIGTERM stops everything.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import config as config_mod
from .stopping import EMBEDDED_REDIS_ENV, PARENT_ENV, stop_signals
from .util import (local_base_url, namespace_arg, non_empty_arg, non_negative_float, parse_bytes, port_arg, positive_int, redact_url, redis_url_arg, serve_token_file,
                   serve_url_file, share_or_off_arg, size_arg, size_text)

#: Seconds serve waits for a backend with a --cache-dir to stop: it writes its prompt cache
#: first (at most `backend.engine.SAVE_SECONDS`), then exits.
SAVE_STOP_SECONDS = 660.0

log = logging.getLogger("mlxgw.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("With a --config of several [[models]] tables, the model, cache and backend flags (--model ... "
                "--pin-by-reference) set the first table's values; the others keep their own.")
    p.add_argument("--config", help="TOML config file (flags override it)")
    p.add_argument("--model", type=non_empty_arg, help="model path or repo id (default: the offline demo model)")
    p.add_argument("--served-name", type=non_empty_arg, help="model name clients use (default: the dir name)")
    p.add_argument("--backends", type=positive_int, help="backend processes for the model (default 2)")
    p.add_argument("--engine", choices=config_mod.ENGINES,
                   help="mlx (default): the model computes; sim: simulated backends, the model's tokenizer and "
                        "timing of an Apple Silicon Mac, no weights (docs/sim.md)")
    p.add_argument("--redis-url", type=redis_url_arg, help="Redis URL; default: start a private embedded redis-server")
    p.add_argument("--redis-port", type=port_arg, help="the embedded redis-server's port (default: a free one)")
    p.add_argument("--host", type=non_empty_arg, help="gateway listen address (default 127.0.0.1; :: is IPv6 only, 0.0.0.0 IPv4 only (asyncio's binding, as nginx's [::]))")
    p.add_argument("--port", type=port_arg, help="gateway port (default 8000)")
    p.add_argument("--backend-port", type=port_arg, help="first backend port (default 8100)")
    p.add_argument("--cache-bytes", type=size_arg,
                   help="prompt-cache budget per backend, e.g. 512MB, 512M or 2GB (binary units: 1GB = 2**30 bytes; "
                        "default 2GB)")
    p.add_argument("--cache-entries", type=positive_int, help="prompt-cache entries per backend (default 64)")
    from backend.cache import LAYOUTS

    p.add_argument("--cache-layout", choices=LAYOUTS,
                   help="shared (default): a prefix several cached prompts share is held once; whole: one copy "
                        "per entry, as mlx-lm (docs/cache-policy.md, rule 7)")
    p.add_argument("--cache-dir", help="keep the prompt caches across restarts of serve: each backend saves its "
                                        "cache under DIR/<model>-<i> at stop and restores it at start "
                                        "(docs/cache-policy.md, 'Across restarts'); default: not kept")
    p.add_argument("--cache-save-interval", type=non_negative_float,
                   help="with --cache-dir: also save while idle (no request for 30 s), at most every this many "
                        "seconds (default 600; 0: only at stop)")
    p.add_argument("--disk-cache-bytes", type=size_arg,
                   help="with --cache-dir: each backend writes prompt-cache entries its memory budget evicts "
                        "to DIR/<model>-<i>/tier, up to this many bytes (e.g. 100GB), and reads one back "
                        "when a prompt's longest cached prefix is there (docs/cache-policy.md, rule 8); "
                        "default: no disk tier")
    p.add_argument("--decode-concurrency", type=positive_int,
                   help="decode slots per backend: answers generated at once (default 16; "
                        "docs/cache-policy.md, 'Decode slots')")
    p.add_argument("--max-inflight-share", type=share_or_off_arg,
                   help="opt-in: each backend admits a request only while the KV in flight plus its prompt's stays "
                        "within this share of --cache-bytes (docs/cache-policy.md, 'Admission by memory'); 0: off")
    p.add_argument("--pin-by-reference", action=argparse.BooleanOptionalAction, default=None,
                   help="opt-in: waiting requests hold their cache hits as references, not copies "
                        "(docs/cache-policy.md, 'Pins by reference'; shared layout only)")
    p.add_argument("--block-size", type=positive_int, help="tokens per block (default 64; gateway and backends must match)")
    p.add_argument("--namespace", type=namespace_arg, help="Redis key namespace (default mlxgw)")
    p.add_argument("--no-memory-check", action="store_true", help="skip the memory estimate")
    from gateway.route import POLICIES

    p.add_argument("--routing-policy", choices=POLICIES,
                   help="default cache_aware; other routing settings: [routing] in the config (docs/routing.md)")
    p.add_argument("--keepalive", type=non_negative_float, help="seconds of stream silence before an SSE keep-alive (default 5; 0: off; "
                   "the backends' prefill progress comments still pass)")
    from gateway.main import add_security_arguments

    add_security_arguments(p, defaults=False)


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict
    health_url: str
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    answered_at: float = 0.0  # time.time() its health URL last answered (any status), or it started
    url: str = ""  # a backend's: the URL it registers (`backend.main.advertised_url`), for the summary
    probe_at: float = 0.0  # when `watch` asks it next


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound at ``host``, in the host's own address family (helper-68:
    an IPv4 socket could never bind ``::``, so `serve --host ::` always said the port was in use)."""
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except (OSError, UnicodeError):
        return True  # a host that does not resolve: the gateway's own bind says so
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def available_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def weights_bytes(model_path: str) -> int:
    """Bytes of the model's safetensors files (0 if not a local directory)."""
    p = Path(model_path).expanduser()
    if not p.is_dir():
        return 0
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def check_memory(models: list[config_mod.ModelConfig]) -> Optional[str]:
    """An error message when N copies of the weights (plus 20%) exceed available memory."""
    models = [m for m in models if m.loads_weights]
    need = sum(int(weights_bytes(m.path) * 1.2) * m.backends for m in models)
    have = available_memory_bytes()
    if need > have:
        detail = ", ".join(f"{m.name}: {m.backends} x {weights_bytes(m.path) / 2**30:.2f} GiB" for m in models)
        return (f"not enough memory: the backends need about {need / 2**30:.1f} GiB of weights ({detail}) "
                f"but {have / 2**30:.1f} GiB is available; use fewer --backends or a smaller model")
    return None


def budget_warning(models: list[config_mod.ModelConfig], total_memory: Optional[int] = None) -> Optional[str]:
    """A warning when every backend's weights (plus 20%) and full prompt-cache budget
    (``cache_bytes``, which the KV in flight shares) exceed this machine's memory (bytes;
    default: psutil's total): the budgets would then never bind, and the machine swaps or the
    backends are killed first (helper-62: `--cache-bytes 1TB` started silently). A warning, not
    an error, since a cache fills its budget only under enough traffic."""
    models = [m for m in models if m.loads_weights]
    if total_memory is None:
        import psutil

        total_memory = int(psutil.virtual_memory().total)
    weights = [weights_bytes(m.path) for m in models]
    need = sum((int(w * 1.2) + parse_bytes(m.cache_bytes)) * m.backends for m, w in zip(models, weights))
    if need <= total_memory:
        return None

    def what(m, w: int) -> str:  # a hub id not downloaded yet has no local size
        return f"{w / 2**30:.2f} GiB of weights" if w or Path(m.path).expanduser().is_dir() else "weights not downloaded yet"

    detail = ", ".join(f"{m.name or 'demo'}: {m.backends} x ({what(m, w)} + {size_text(parse_bytes(m.cache_bytes))} cache)"
                       for m, w in zip(models, weights))
    return (f"the backends' weights and prompt-cache budgets add up to {need / 2**30:.1f} GiB ({detail}), more "
            f"than this machine's {total_memory / 2**30:.1f} GiB: memory, not --cache-bytes, will bound the caches; "
            "lower --cache-bytes or --backends")


def as_flags(message: str) -> str:
    """A config error in the flags' terms, for a serve started without --config: ``[[models]]
    demo: cache_dir /x cannot be used`` becomes ``--cache-dir /x cannot be used`` (helper-64: the
    error named a table nobody wrote). Names that are not a setting are left as they are."""
    import re
    from dataclasses import fields

    known = {f.name for f in fields(config_mod.ModelConfig)} | {f.name for f in fields(config_mod.ServeConfig)}

    def flag(m):
        return f"--{m.group(1).replace('_', '-')}" if m.group(1) in known else m.group(0)

    message = message.replace("disk_cache_bytes (--disk-cache-bytes) needs cache_dir (--cache-dir)",
                              "disk_cache_bytes needs --cache-dir")  # named as a flag below, once
    message = message.replace('needs cache_layout = "shared"', "needs --cache-layout shared")
    message = re.sub(r"\[\[models\]\] [^:\s]+ backend ports", "the backend ports (--backend-port, --backends)",
                     message)
    return re.sub(r"\[(?:\[models\]\] [^:\s]+|gateway\]):? (\w+)", flag, message)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except Exception:
        return False


def run(args: argparse.Namespace) -> int:
    """Start and supervise the whole stack; returns the exit code."""
    try:
        cfg = config_mod.load(args.config) if args.config else config_mod.ServeConfig()
    except (OSError, ValueError) as e:
        log.error("config: %s", e)
        return 2
    cfg = config_mod.apply_flags(cfg, args)
    try:
        config_mod.validate(cfg)
    except ValueError as e:
        log.error("config: %s", e if args.config else as_flags(str(e)))
        return 2
    from gateway.auth import AuthConfigError, check_exposure, read_keys

    try:  # refuse before starting anything
        check_exposure(cfg.host, read_keys(cfg.api_key_file), cfg.allow_unauthenticated)
    except AuthConfigError as e:
        log.error("%s", e)
        return 6
    for m in cfg.models:
        m.name = config_mod.served_name(m)
        if not m.path:
            from .demo_model import demo_model_dir, ensure_demo_model

            if not demo_model_dir("tiny").exists():
                print("building the demo model (once)...", file=sys.stderr)
            else:
                print(f"using the demo model built earlier: {demo_model_dir('tiny')}", file=sys.stderr)
            m.path = str(ensure_demo_model("tiny"))
        from backend.main import looks_loadable

        if not looks_loadable(m.path):
            log.error("model path %s does not exist", m.path)
            return 2
    err = check_cache_dirs(cfg.models)
    if err:
        log.error("%s", err)
        return 2
    if not args.no_memory_check:
        err = check_memory(cfg.models)
        if err:
            log.error("%s", err)
            return 5
        warning = budget_warning(cfg.models)
        if warning:
            log.warning("%s", warning)
    ports = [(cfg.host, cfg.port)] + [(m.host, p) for m in cfg.models for p in range(m.port, m.port + m.backends)]
    if cfg.redis_port is not None and not cfg.redis_url:
        ports.append(("127.0.0.1", cfg.redis_port))
    for host, p in ports:
        if not port_free(host, p):
            log.error("port %d is in use; pick another with --port / --backend-port%s", p,
                      " / --redis-port" if p == cfg.redis_port else "")
            return 3

    embedded = None
    redis_url = cfg.redis_url
    if not redis_url:
        from .redis_embed import EmbeddedRedis

        try:
            embedded = EmbeddedRedis(port=cfg.redis_port).start()
        except FileNotFoundError as e:
            log.error("%s", e)
            return 4
        redis_url = embedded.url
    else:
        from .redis_client import connect, redis_problem

        from . import schema

        try:
            # A key read, not PING alone: a Redis Cluster node answers PING and MOVED (or
            # CLUSTERDOWN) for the keys (helper-77: serve then waited for its backends forever)
            connect(redis_url, 2.0).smembers(schema.models_key(cfg.namespace))
        except Exception as e:
            log.error("%s", redis_problem(redis_url, e))
            return 4

    token = os.environ.get("MLXGW_INTERNAL_TOKEN") or secrets.token_hex(16)
    # Children stop when this process is gone (mlxgw.stopping); the gateway then also stops the
    # embedded Redis, which nobody else would.
    env = {**os.environ, "MLXGW_REDIS_URL": redis_url, "MLXGW_INTERNAL_TOKEN": token, PARENT_ENV: str(os.getpid())}
    py = [sys.executable, "-m", "mlxgw"]
    from backend.main import advertised_url

    children: list[Child] = []
    for m in cfg.models:
        for i in range(m.backends):
            port = m.port + i
            cmd = py + ["backend", "--model", m.path, "--served-name", m.name, "--port", str(port),
                        "--id", f"{m.name}-{i}", "--namespace", cfg.namespace, "--block-size", str(cfg.block_size),
                        *backend_model_flags(m), *backend_cache_dir_flags(m, i)]
            # The URL it registers, not the loopback address serve probes it at (helper-77: a
            # backend on 0.0.0.0 registered this machine's network address, the summary said 127.0.0.1)
            children.append(Child(f"{m.name}-{i}", cmd, env, f"{local_base_url(m.host, port)}/health",
                                  url=advertised_url(m.host, port, redis_url)[0]))
    gw_cmd = py + ["gateway", "--host", cfg.host, "--port", str(cfg.port), "--namespace", cfg.namespace,
                   "--block-size", str(cfg.block_size)]
    gw_cmd += routing_flags(cfg.routing)
    for m in cfg.models:
        gw_cmd += ["--model", f"{m.name}={m.path}"]
    gw_cmd += gateway_security_flags(cfg)
    gw_env = {**env, EMBEDDED_REDIS_ENV: "1"} if embedded is not None else env
    gateway = Child("gateway", gw_cmd, gw_env, f"{local_base_url(cfg.host, cfg.port)}/health")

    stopping = False
    stops = 0  # stop signals taken; the 2nd and 3rd hurry the teardown (`_hurry`)
    tearing_down = False

    def _stop(*_):
        nonlocal stopping, stops
        stopping = True
        stops += 1
        if tearing_down and stops > 1:
            _hurry(stops, gateway, children)

    for sig in stop_signals():  # SIGHUP too (a closed terminal), unless started under nohup
        signal.signal(sig, _stop)
    previous = ("", "")  # the URL and token another serve left for `mlxgw status` and joiners, put back at stop
    try:
        for c in children:
            _spawn(c)
        if not _wait_ready(children, lambda: stopping, "the backends (each loads the model)"):
            return 1 if not stopping else 0
        _spawn(gateway)
        if not _wait_ready([gateway], lambda: stopping, "the gateway (loads the tokenizers)"):
            return 1 if not stopping else 0
        f = serve_url_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        t = serve_token_file()
        previous = (f.read_text().strip() if f.exists() else "", t.read_text().strip() if t.exists() else "")
        _write_url(redis_url, token)
        _summary(cfg, redis_url, embedded is not None, children)
        watch(children + [gateway], lambda: stopping, redis=embedded)
        return 0
    finally:
        tearing_down = True
        for c in [gateway] + children:
            if c.proc and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        if stops > 1:  # signalled again before the teardown began
            _hurry(stops, gateway, children)
        elif stops == 1 and cfg.drain_seconds > 0 and gateway.proc and gateway.proc.poll() is None:
            print(f"mlxgw: stopping; answers in flight get up to {cfg.drain_seconds:g} s to finish (Ctrl-C again "
                  "to end them now)", file=sys.stderr)
        # A backend with --cache-dir writes its prompt cache before it exits (backend.engine.SAVE_SECONDS).
        grace = SAVE_STOP_SECONDS if any(m.cache_dir for m in cfg.models) else 10
        for c in [gateway] + children:
            if c.proc:
                try:
                    # The gateway's drain (its answers in flight, then their ends) comes first
                    # (serve took --drain-seconds and did not pass it on until session 39).
                    c.proc.wait(max(grace, cfg.drain_seconds + 2) if c is gateway else grace)
                except subprocess.TimeoutExpired:
                    # Said, not silent (helper-67): a backend killed here may not have saved its cache.
                    log.warning("%s did not stop in time after SIGTERM; killing it", c.name)
                    c.proc.kill()
        if embedded:
            embedded.stop()
        _forget_url(redis_url, *previous, token=token)
        print("mlxgw stopped.", file=sys.stderr)


def _hurry(stops: int, gateway: Child, children: list[Child]) -> None:
    """serve's teardown, signalled again (helper-69: a second Ctrl-C during the drain was
    ignored without a word): the 2nd signal has the gateway end its drain now (a stop signal
    again: `gateway.proxy.Proxy.end_drain`); the 3rd kills every child, caches unsaved."""
    if stops == 2:
        print("mlxgw: stopping now: the gateway ends its answers in flight (the backends still save their "
              "caches; Ctrl-C once more to kill everything)", file=sys.stderr)
        if gateway.proc and gateway.proc.poll() is None:
            gateway.proc.send_signal(signal.SIGTERM)
    elif stops == 3:
        print("mlxgw: killing every process serve started", file=sys.stderr)
        for c in [gateway] + children:
            if c.proc and c.proc.poll() is None:
                c.proc.kill()


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")


def _write_url(redis_url: str, token: str = "") -> None:
    """Leave this serve's Redis URL (for ``mlxgw status``) and internal token (for a gateway or
    backend joining it by hand) in the user's cache dir, both readable only by the user."""
    _write_private(serve_url_file(), redis_url)
    if token:
        _write_private(serve_token_file(), token)


def _forget_url(redis_url: str, previous_url: str = "", previous_token: str = "", token: str = "") -> None:
    """Take back the Redis URL and token (``token``, when it left one) this serve left, unless
    another serve replaced them since: put back the ones it replaced if that Redis still
    answers (another serve of this user still runs: on another Redis, or on this one under
    another namespace, whose token helper-68 found removed), else remove the files."""
    f, t = serve_url_file(), serve_token_file()
    try:
        if f.read_text().strip() != redis_url or (token and t.exists() and t.read_text().strip() != token):
            return
        if previous_url and (previous_url, previous_token) != (redis_url, token) and _answers(previous_url):
            _write_url(previous_url, previous_token)
            if not previous_token:
                t.unlink(missing_ok=True)
        else:
            f.unlink()
            t.unlink(missing_ok=True)
    except OSError:
        pass


def _answers(url: str) -> bool:
    import redis

    from .redis_client import connect

    try:
        return bool(connect(url, 1.0).ping())
    except redis.RedisError:
        return False


def backend_model_flags(m: config_mod.ModelConfig) -> list[str]:
    """The backend flags of one ``[[models]]`` table's listen address, cache and prefill settings."""
    return ["--host", m.host, "--cache-bytes", str(m.cache_bytes), "--cache-entries", str(m.cache_entries),
            "--min-hit-tokens", str(m.min_hit_tokens), "--min-shared-tokens", str(m.min_shared_tokens),
            "--prefill-save" if m.prefill_save else "--no-prefill-save",
            "--prefill-concurrency", str(m.prefill_concurrency), "--prefill-order", m.prefill_order,
            "--decode-concurrency", str(m.decode_concurrency),
            "--cache-layout", m.cache_layout,
            "--pin-by-reference" if m.pin_by_reference else "--no-pin-by-reference",
            *(["--max-inflight-share", str(m.max_inflight_share)] if m.max_inflight_share else []),
            *(["--default-temperature", str(m.default_temperature)] if m.default_temperature is not None else []),
            "--sampling-defaults", m.sampling_defaults,
            "--request-timeout", str(m.request_timeout), "--engine", m.engine]


def check_cache_dirs(models: list[config_mod.ModelConfig]) -> Optional[str]:
    """Before anything starts: an error when a backend's ``--cache-dir`` is held by a running
    backend (another serve on the same ``cache_dir``: it would fail once the models loaded);
    a warning for each save no backend of this run restores (``--backends`` lowered), which
    keeps its disk until removed."""
    from backend.persist import CacheDirLock, saved_bytes

    for m in models:
        if not m.cache_dir:
            continue
        root = Path(m.cache_dir).expanduser().resolve()
        for i in range(m.backends):
            try:
                CacheDirLock(root / f"{m.name}-{i}").release()
            except (RuntimeError, OSError) as e:
                return f"{m.name}: {e}"
        for d in sorted(root.glob(f"{m.name}-*")):
            tail = d.name[len(m.name) + 1:]
            size = saved_bytes(d) if tail.isdigit() and int(tail) >= m.backends else 0
            if size:
                log.warning("%s holds a saved prompt cache (%.1f MiB) that no backend of this run restores "
                            "(%d backends of %s); remove it, or run with --backends %d to use it", d,
                            size / 2**20, m.backends, m.name, int(tail) + 1)
    return None


def backend_cache_dir_flags(m: config_mod.ModelConfig, i: int) -> list[str]:
    """``--cache-dir`` for backend ``i`` of ``m``: a directory of its own under ``m.cache_dir``."""
    if not m.cache_dir:
        return []
    return ["--cache-dir", str(Path(m.cache_dir).expanduser().resolve() / f"{m.name}-{i}"),
            "--cache-save-interval", f"{m.cache_save_interval:g}",
            *(["--disk-cache-bytes", str(m.disk_cache_bytes)] if m.disk_cache_bytes else [])]


def gateway_security_flags(cfg: config_mod.ServeConfig) -> list[str]:
    """The gateway flags for ``cfg``'s key and limit settings (keys travel by file or env, never argv)."""
    out = ["--max-concurrent-per-key", str(cfg.max_concurrent_per_key), "--rate-limit-rpm", str(cfg.rate_limit_rpm),
           "--rate-burst", str(cfg.rate_burst), "--max-messages", str(cfg.max_messages),
           "--max-answer-tokens", str(cfg.max_answer_tokens),
           "--max-body-bytes", str(cfg.max_body_bytes), "--body-timeout", str(cfg.body_timeout),
           "--write-timeout", str(cfg.write_timeout), "--keepalive", str(cfg.keepalive),
           "--drain-seconds", str(cfg.drain_seconds)]
    for k in ("max_in_flight", "max_connections"):  # left out: the gateway's default
        if getattr(cfg, k) is not None:
            out += ["--" + k.replace("_", "-"), str(getattr(cfg, k))]
    if cfg.api_key_file:
        out += ["--api-key-file", str(Path(cfg.api_key_file).expanduser().resolve())]
    if cfg.allow_unauthenticated:
        out.append("--allow-unauthenticated")
    return out


#: Seconds a running child may leave its health URL unanswered before `watch` kills it to
#: restart it (a hung process: SIGSTOP, a deadlock, swapping to a halt). Any answer counts,
#: a 503 while its model loads too; the backends answer /health off their engine thread.
HUNG_AFTER = 60.0
PROBE_EVERY = 5.0


def _hung(c: Child, hung_after: float) -> bool:
    """Probe ``c``'s health URL when due; True once it has not answered for ``hung_after`` s."""
    now = time.time()
    if not c.health_url or hung_after <= 0 or now < c.probe_at:
        return False
    c.probe_at = now + PROBE_EVERY
    try:
        with urllib.request.urlopen(c.health_url, timeout=1.0):
            c.answered_at = now
    except urllib.error.HTTPError:  # a 503 is an answer
        c.answered_at = now
    except Exception:
        pass
    return now - max(c.answered_at, c.started_at) > hung_after


def watch(children: list[Child], stopping, interval: float = 0.5, sleep=time.sleep, redis=None,
          hung_after: float = HUNG_AFTER) -> None:
    """Restart crashed children with exponential backoff (0.5 s doubling to 30 s, reset after
    60 s up) until ``stopping()`` is true; kill and restart one whose health URL has not
    answered for ``hung_after`` seconds (helper-64: a stopped backend left the registry and
    stayed so, the stack short of it, until someone acted).

    ``redis``: the embedded `mlxgw.redis_embed.EmbeddedRedis`, if any; when it dies it is
    started again on the same port and password, empty (it never persisted anything): the
    backends notice their lost records and register and re-publish their caches at their next
    heartbeat (1 s), and the gateways' lookups recover on their own. While Redis is down the
    gateways route on load; in the moment it is back but empty they answer 503 ``no_backend``
    with ``Retry-After: 1``.

    The stop check comes after every sleep, before any child is polled: a terminal's Ctrl-C
    reaches the children too, and a child that exited because of it is not a crash to
    restart (nor to log as one).
    """
    while not stopping():
        sleep(interval)
        if stopping():
            return
        if redis is not None and redis.proc is not None and redis.proc.poll() is not None:
            _restart_redis(redis)
        for c in children:
            if c.proc.poll() is None and _hung(c, hung_after):
                log.error("%s has not answered %s for %.0f s (hung or stopped); killing it to restart it",
                          c.name, c.health_url, hung_after)
                c.proc.kill()
                c.proc.wait(10)
            if c.proc.poll() is None or c.next_start == float("inf"):
                continue
            if c.proc.returncode in NOT_RESTARTED:
                # A setting to change (a duplicate id, a backend replaced by hand under its id):
                # restarting repeats it every 30 s for good (helper-64).
                log.error("%s exited with code %s (%s; its log above says why): not restarted",
                          c.name, c.proc.returncode, NOT_RESTARTED[c.proc.returncode])
                c.next_start = float("inf")
                continue
            if c.next_start == 0.0:
                if time.time() - c.started_at > 60:
                    c.restarts = 0  # it ran a while: reset the backoff
                delay = min(30.0, 0.5 * 2 ** c.restarts)
                log.warning("%s exited with code %s; restarting in %.1fs", c.name, c.proc.returncode, delay)
                c.next_start = time.time() + delay
            elif time.time() >= c.next_start:
                c.restarts += 1
                _spawn(c)


def routing_flags(routing: dict) -> list[str]:
    """``mlxgw gateway`` flags of a config's ``[routing]`` keys (`gateway.route.RoutingConfig`
    fields): ``--key-name value``, a switch for a boolean (``heartbeat_load = true`` is
    ``--heartbeat-load``, ``seed_empty = false`` ``--no-seed-empty``; one equal to the
    default adds nothing), and ``--routing-policy`` for ``policy``."""
    from gateway.route import RoutingConfig

    out: list[str] = []
    for k, v in routing.items():
        flag = "--routing-policy" if k == "policy" else "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v != getattr(RoutingConfig, k):
                out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


#: Exit codes of a child that a restart would not mend -> what they mean (`mlxgw backend` and
#: `mlxgw gateway`: 2 a setting, e.g. a live backend's --id, or one replaced under its id; 6 a
#: non-loopback address without keys or token).
NOT_RESTARTED = {2: "a setting to change", 6: "refused to listen without keys or token"}


def _restart_redis(redis) -> None:
    log.warning("embedded Redis exited with code %s; starting it again on port %d (empty: backends re-publish)",
                redis.proc.returncode, redis.port)
    redis.stop()  # removes its directory; the process is already reaped
    try:
        redis.start()
    except (OSError, RuntimeError) as e:  # the port taken meanwhile, ...: tried again next round
        log.error("could not restart the embedded Redis: %s", e)
    else:
        log.info("embedded Redis is back on port %d", redis.port)


def _spawn(c: Child) -> None:
    # The child starts with SIGINT ignored (kept through exec) until its own handlers are in:
    # a terminal's Ctrl-C reaches the whole process group, and one landing while a child's
    # interpreter started printed tracebacks ("Fatal Python error: init_import_site", helper-69)
    # or "mlxgw: interrupted" (helper-68). serve stops its children with SIGTERM.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        c.proc = subprocess.Popen(c.cmd, env=c.env)
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    c.started_at = time.time()
    c.next_start = 0.0


def _wait_ready(children: list[Child], stopping, what: str, timeout: float = 600.0) -> bool:
    """Wait until every child answers its health URL; a progress line names ``what`` is starting
    (rewritten in place on a terminal, a log line every 5 s otherwise). False: a child exited,
    ``stopping()`` became true, or ``timeout`` seconds passed."""
    t0 = time.time()
    pending = {c.name: c for c in children}
    last = ""
    logged = time.time()
    while pending and time.time() - t0 < timeout:
        if stopping():
            return False
        for name, c in list(pending.items()):
            if c.proc.poll() is not None:
                log.error("%s exited during start-up with code %s", name, c.proc.returncode)
                return False
            if _healthy(c.health_url):
                del pending[name]
        msg = f"starting {what}: {len(children) - len(pending)}/{len(children)} ready ({time.time() - t0:.0f}s)"
        if msg != last and sys.stderr.isatty():
            print("\r" + msg, end="", file=sys.stderr, flush=True)
            last = msg
        elif pending and not sys.stderr.isatty() and time.time() - logged >= 5:  # now and then when not a terminal
            log.info("%s; waiting for %s", msg, ", ".join(sorted(pending)))
            logged = time.time()
        time.sleep(0.2)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return not pending


def _keys_summary(cfg) -> str:
    from gateway.auth import read_keys

    n = len(read_keys(cfg.api_key_file))
    return f"required ({n} configured)" if n else "not required (see docs/security.md)"


def _cli() -> str:
    """How to run ``mlxgw`` from a shell: the venv's script by path (the venv is
    rarely activated), else ``python -m mlxgw``."""
    script = Path(sys.executable).parent / "mlxgw"
    return str(script) if script.exists() else f"{sys.executable} -m mlxgw"


def _slots(m: config_mod.ModelConfig) -> str:
    sim = "" if m.loads_weights else ", simulated: docs/sim.md"
    return f"{m.name}: {m.decode_concurrency} decode slots each{sim}"


def _summary(cfg, redis_url: str, embedded: bool, children: list[Child]) -> None:
    base = local_base_url(cfg.host, cfg.port)
    # helper-69: a serve under --namespace printed recipes that looked under the default one
    ns = f" --namespace {cfg.namespace}" if cfg.namespace != config_mod.schema.DEFAULT_NAMESPACE else ""
    lines = [
        "",
        "mlxgw is ready",
        f"  endpoint   {base}/v1   (OpenAI-compatible)",
        f"  anthropic  {base}   (Anthropic SDK base URL: the SDK adds /v1)",
        f"  models     {', '.join(m.name for m in cfg.models)}",
        f"  backends   {', '.join(c.name + ' ' + c.url for c in children)}"
        f"   ({', '.join(_slots(m) for m in cfg.models)})",
        f"  redis      {redact_url(redis_url)}{' (embedded)' if embedded else ''}",
        f"  dashboard  {base}/dashboard   metrics  {base}/metrics",
        f"  api keys   {_keys_summary(cfg)}",
        f"  status     {_cli()} status{ns} | {_cli()} top{ns}   (read the Redis URL from {serve_url_file()})",
        f"  join       MLXGW_INTERNAL_TOKEN=$(cat {serve_token_file()}) MLXGW_REDIS_URL=$(cat {serve_url_file()}) "
        f"{_cli()} backend|gateway{ns} ...   (README, Commands)",
        "  stop       Ctrl-C" + ("   (the backends save their prompt caches first)"
                                  if any(m.cache_dir for m in cfg.models) else ""),
    ]
    for m in cfg.models:
        if m.cache_dir:
            where = Path(m.cache_dir).expanduser().resolve()
            lines.insert(-1, f"  kv kept    {m.name}: prompt caches saved at stop and when idle, restored at start, in {where}/"
                             f"{m.name}-<i>   (docs/cache-policy.md, 'Across restarts')")
        if m.disk_cache_bytes:
            lines.insert(-1, f"  disk tier  {m.name}: up to {size_text(parse_bytes(m.disk_cache_bytes))} of evicted "
                             f"entries per backend in {where}/{m.name}-<i>/tier, kept at stop   "
                             "(docs/cache-policy.md, rule 8)")
    from backend.main import budget_warnings, model_kv_bytes_per_token

    for m in cfg.models:  # each backend logged them above, among its start-up lines
        kv = model_kv_bytes_per_token(m.path) if m.path and m.loads_weights else None  # as the backend says
        lines += [f"  warning    {m.name}: {w}" for w in budget_warnings(str(m.cache_bytes), parse_bytes(m.cache_bytes),
                                                                           kv_per_token=kv)]
    print("\n".join(lines + [""]), file=sys.stderr, flush=True)
