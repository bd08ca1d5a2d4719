"""An embedded, private ``redis-server`` for when no Redis URL is given.

Binds to loopback only, with a random password, no persistence, in a temp
dir; stopped (and the dir removed) at exit.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time

INSTALL_HINT = (
    "redis-server not found. Install it (macOS: `brew install redis`; "
    "Debian/Ubuntu: `sudo apt-get install redis-server`) or pass --redis-url."
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server child process.

    Raises (from `start`):
        FileNotFoundError: no ``redis-server`` on PATH (message says how to install).
        RuntimeError: it did not answer PING within ``timeout`` seconds.
    """

    def __init__(self, port: int | None = None, password: str | None = None):
        self.port = port or free_port()
        self.password = password if password is not None else secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.dir = tempfile.mkdtemp(prefix="mlxgw-redis-")
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.dir, "--protected-mode", "yes"]
        if self.password:
            cmd += ["--requirepass", self.password]
        # Own session: a terminal Ctrl-C reaches the backends first, and the
        # launcher stops Redis last, after they withdrew their ownership.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis

        from .redis_client import connect

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            try:
                connect(self.url, 0.5).ping()
                return self
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("embedded redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
