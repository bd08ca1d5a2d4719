"""Real processes for tests and benchmarks: redis-server, mlxgw backends and gateways.

Nothing here is mocked: each piece is the same command a user runs
(``python -m mlxgw backend|gateway``), logging to ``LOG_DIR``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import redis
from . import httpget as http

LOG_DIR = Path(os.environ.get("MLXGW_TEST_LOGS", Path.cwd() / "test-output"))


_given: set[int] = set()  # ports free_port handed out in this process
PORT_RETRIES = 3  # moves to a new port a server on a port chosen here may make (`Proc.restart_if_port_lost`)


def _port_slice() -> range:
    """This process's share of the loopback ports tests and benchmarks give servers.

    Below the OS's ephemeral range (Linux: ip_local_port_range, 32768 up by
    default; macOS: 49152 up), so no outgoing connection's local port takes a
    server's port between its probe and its bind, or while a launcher restarts
    a killed backend on it (CI once failed on "address already in use"); split
    by pytest-xdist worker, so two test processes never hand out the same port.
    """
    low, high = 20000, 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    if high - low < 100 * count:  # an unusual ephemeral range: fall back to the whole of it
        return range(1024, 65536)
    width = (high - low) // count
    return range(low + index * width, low + (index + 1) * width)


_cursor: list[int] = []  # next port to try in this process's slice


def free_port() -> int:
    """A loopback port nobody listens on, never one this process was given before,
    from this process's slice (`_port_slice`).

    The probe socket is closed before the caller's server binds, so another
    program may still bind it meanwhile (`Proc.restart_if_port_lost` moves then).

    Raises:
        RuntimeError: every port of the slice was given or is in use.
    """
    ports = _port_slice()
    if not _cursor or _cursor[0] not in ports:
        _cursor[:] = [ports.start + (os.getpid() * 7919) % len(ports)]  # a different start per run
    for _ in range(len(ports)):
        port = _cursor[0]
        _cursor[0] = port + 1 if port + 1 < ports.stop else ports.start
        if port in _given:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _given.add(port)
        return port
    raise RuntimeError("no free loopback port this process was not given before")


def free_port_run(n: int, avoid: tuple = ()) -> int:
    """The first of ``n`` consecutive free loopback ports (for launchers that
    number their backends from a base port)."""
    for _ in range(200):
        base = free_port()
        ports = range(base, base + n)
        if any(p in avoid or p > 65535 or (p != base and p in _given) for p in ports):
            continue
        try:
            socks = []
            for p in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            _given.update(ports)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) end this process as Ctrl-C does, through its
    ``finally`` blocks, so a benchmark stopped that way stops the redis-server, backends and
    gateways it started instead of leaving them running (Python's default SIGTERM ends the
    process at once). Call from a script's main thread."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


class RedisServer:
    """A private redis-server on a free loopback port (no persistence)."""

    def __init__(self, port: Optional[int] = None):
        self.port_retries = 0 if port else PORT_RETRIES  # only a port chosen here moves
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="mlxgw-test-redis-")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        exe = shutil.which("redis-server")
        assert exe, "redis-server is required (the test command installs it)"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=2)
        for _ in range(200):
            try:
                # Ours, not another server that took the port first (then ours exits).
                if int(client.info("server")["process_id"]) == self.proc.pid:
                    self.port_retries = 0  # a restart keeps this port (clients know it now)
                    return self
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError):
                pass
            if self.proc.poll() is not None:
                if self.port_retries <= 0:
                    break
                self.port_retries -= 1  # lost its port before binding (see `Proc.restart_if_port_lost`)
                self.port = free_port()
                return self.start()
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    port: int
    log_path: Path
    proc: Optional[subprocess.Popen] = None
    port_retries: int = 0  # times it may move to a new free port if another process took its port first
    cwd: Optional[str] = None  # working directory; with ``python -m`` it is also the first import path
    preexec_fn: Optional[Callable[[], None]] = None  # run in the child before exec (e.g. set its rlimits)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._env = env
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                     preexec_fn=self.preexec_fn)
        return self

    def restart_if_port_lost(self) -> bool:
        """Restart on a new free port if the process exited because its port was taken.

        `free_port` closes its probe socket before the child binds, and other
        processes' sockets (outgoing connections' source ports too) draw from
        the same ephemeral range, so one can take the port in between. Only for
        ports the harness chose (``port_retries``); the servers exit with 3 when
        they cannot listen. True if restarted.
        """
        if self.port_retries <= 0 or self.proc is None or self.proc.poll() != 3:
            return False
        if "address already in use" not in self.tail(5):
            return False
        self.port_retries -= 1
        i = self.cmd.index("--port") + 1
        self.port = free_port()
        self.cmd[i] = str(self.port)
        self.start(self._env)
        return True

    def wait_healthy(self, timeout: float = 120.0, status: int = 200) -> None:
        """Wait until ``/health`` answers ``status`` (a gateway that knows it cannot serve answers
        503). Raises RuntimeError if the process exits or ``timeout`` seconds pass first."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                if self.restart_if_port_lost():
                    continue
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log_path}\n" + self.tail())
            if http.get_status(self.url + "/health") == status:
                self.port_retries = 0  # a restart keeps this port (clients know it now)
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy after {timeout}s\n" + self.tail())

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass
class Stack:
    """Backends + gateway of one model on one Redis, under a private namespace."""

    redis_url: str
    model_path: str
    model_name: str = "demo-tiny"
    namespace: str = field(default_factory=lambda: "t" + uuid.uuid4().hex[:8])
    backends: list[Proc] = field(default_factory=list)
    gateways: list[Proc] = field(default_factory=list)
    block_size: int = 16
    env_extra: dict = field(default_factory=dict)
    # Tests wait up to 2 s on a lookup so a loaded CI box never falls back to load routing by
    # chance; benchmarks pass None: the gateway's own default, what a deployment runs.
    lookup_deadline_ms: Optional[float] = 2000.0

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLXGW_INTERNAL")}
        env.update({"PYTHONUNBUFFERED": "1", **self.env_extra})
        return env

    def add_backend(self, backend_id: Optional[str] = None, port: Optional[int] = None, *extra: str, start=True,
                    cwd: Optional[str] = None) -> Proc:
        """Start a backend in ``cwd`` (default: this process's; see `add_gateway`)."""
        retries = 0 if port else PORT_RETRIES
        port = port or free_port()
        bid = backend_id or f"b{len(self.backends)}"
        cmd = [sys.executable, "-m", "mlxgw", "backend", "--model", self.model_path, "--served-name", self.model_name,
               "--port", str(port), "--id", bid, "--redis-url", self.redis_url, "--namespace", self.namespace,
               "--block-size", str(self.block_size), "--heartbeat-interval", "0.5", "--heartbeat-ttl", "2",
               "--min-hit-tokens", "64", *extra]
        p = Proc(bid, cmd, port, LOG_DIR / f"{self.namespace}-{bid}.log", port_retries=retries, cwd=cwd)
        self.backends.append(p)
        if start:
            p.start(self.env())
        return p

    def add_gateway(self, *extra: str, port: Optional[int] = None, cwd: Optional[str] = None, start=True) -> Proc:
        """Start a gateway in ``cwd`` (default: this process's); ``python -m`` imports from there first."""
        retries = 0 if port else PORT_RETRIES
        port = port or free_port()
        name = f"gw{len(self.gateways)}"
        cmd = [sys.executable, "-m", "mlxgw", "gateway", "--model", f"{self.model_name}={self.model_path}",
               "--port", str(port), "--redis-url", self.redis_url, "--namespace", self.namespace,
               "--block-size", str(self.block_size),
               *(["--lookup-deadline-ms", f"{self.lookup_deadline_ms:g}"] if self.lookup_deadline_ms is not None else []),
               *extra]
        p = Proc(name, cmd, port, LOG_DIR / f"{self.namespace}-{name}.log", port_retries=retries, cwd=cwd)
        self.gateways.append(p)
        if start:
            p.start(self.env())
        return p

    def wait(self) -> "Stack":
        for p in self.backends + self.gateways:
            if p.proc is not None and (p.proc.poll() is None or p.restart_if_port_lost()):
                p.wait_healthy()
        # Gateways see backends through the registry refresh (1 s).
        deadline = time.time() + 15
        want = {b.name for b in self.backends if b.proc and b.proc.poll() is None and self._serves_model(b)}
        for g in self.gateways:
            seen: set = set()
            while time.time() < deadline:
                body = http.get_json(g.url + "/health") or {}
                seen = set((body.get("backends") or {}).get(self.model_name, []))
                # Listed as ready: a registry refresh from before a backend was ready lists it
                # `starting` (backend_up 0 in a test's first scrape, CI at 1071335).
                seen -= set((body.get("starting") or {}).get(self.model_name, []))
                if seen >= want:
                    break
                time.sleep(0.1)
            else:  # a test that left some backend out on purpose; 15 s of its run went here
                with open(LOG_DIR / "stack-wait-timeouts.log", "a") as f:
                    f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {g.name} never listed "
                            f"{sorted(want - seen)}\n")
        return self

    def _serves_model(self, p: Proc) -> bool:
        """Whether backend ``p`` serves this stack's model (the last --served-name of its command)."""
        names = [p.cmd[i + 1] for i, a in enumerate(p.cmd[:-1]) if a == "--served-name"]
        return not names or names[-1] == self.model_name

    @property
    def gateway(self) -> Proc:
        return self.gateways[0]

    def stop(self) -> None:
        for p in self.gateways + self.backends:
            p.stop()
