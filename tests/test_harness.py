"""The test harness itself: a server that lost its port to another process moves to a new one.

`free_port` closes its probe socket before the child binds, so another process
(an outgoing connection's source port, say) can take the port in between; CI
saw a backend exit with "address already in use" that way.
"""

import socket

import pytest

from mlxgw.harness import RedisServer
from mlxgw.httpget import get_json


def test_a_server_whose_port_was_taken_restarts_on_a_new_one(make_stack):
    s = make_stack()
    s.add_backend("b0")  # a gateway is healthy once it sees a backend
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lost = taken.getsockname()[1]
        gw = s.add_gateway(port=lost)  # an explicit port: the harness does not move it by itself
        gw.proc.wait(60)
        assert gw.proc.returncode == 3 and "address already in use" in gw.tail(5)
        assert gw.restart_if_port_lost() is False  # explicit ports are the caller's
        gw.port_retries = 1  # as for a port the harness chose
        assert gw.restart_if_port_lost() is True
        s.wait()
        assert gw.port != lost and gw.cmd[gw.cmd.index("--port") + 1] == str(gw.port)
        health = get_json(gw.url + "/health")  # served from its new port, with b0 behind it
        assert health["status"] == "ok" and health["backends"]["demo-tiny"] == ["b0"]
        assert gw.port_retries == 0


def test_a_redis_server_whose_port_was_taken_moves_to_a_new_one(redis_server):
    other = redis_server.port  # another redis-server answers there: PING alone would be fooled
    r = RedisServer(port=other)
    r.port_retries = 1  # as for a port the harness chose
    try:
        r.start()
        assert r.port != other
        assert int(r.client().info("server")["process_id"]) == r.proc.pid != int(redis_server.client().info("server")["process_id"])
        assert r.port_retries == 0
    finally:
        r.cleanup()
    with socket.socket() as taken:  # an explicit port stays put and fails clearly
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = RedisServer(port=taken.getsockname()[1])
        try:
            with pytest.raises(RuntimeError, match="did not start on port"):
                r.start()
        finally:
            r.cleanup()


def test_free_port_never_gives_a_port_twice():
    from mlxgw.harness import free_port, free_port_run

    # Each probe socket is closed before the caller binds, so the OS offers ports again:
    # 1,000 plain probes over Linux's ~28,000 ephemeral ports repeat one ~18 times on average.
    ports = [free_port() for _ in range(1000)]
    base = free_port_run(3)
    assert len(set(ports)) == 1000 and not {base, base + 1, base + 2} & set(ports)
    assert free_port() not in {base, base + 1, base + 2}


def test_free_ports_lie_below_the_ephemeral_range_one_slice_per_test_process(monkeypatch):
    """An outgoing connection's local port comes from the ephemeral range: a server port chosen
    there could be taken between its probe and its bind, or while a launcher restarts a killed
    backend on it (CI's "address already in use" in test_launcher)."""
    from mlxgw.harness import _port_slice, free_port

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except OSError:  # macOS: 49152 up
        ephemeral_low = 49152
    assert all(20000 <= free_port() < ephemeral_low for _ in range(50))
    slices = []
    for w in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{w}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        slices.append(set(_port_slice()))
    assert all(len(x) >= 1000 for x in slices)
    assert not (slices[0] & slices[1]) and not (slices[1] & slices[2]) and not (slices[0] & slices[2])
    assert max(max(x) for x in slices) < ephemeral_low


def test_a_benchmark_stopped_by_sigterm_stops_its_redis_server(tmp_path):
    """`exit_on_sigterm` (every bench script's first call) turns SIGTERM into SystemExit, so the
    script's ``finally`` stops what it started; with Python's default a killed replay left its
    redis-server running (session 37)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "redis.pid"
    code = ("import sys, time\n"
            "from mlxgw.harness import RedisServer, exit_on_sigterm\n"
            "exit_on_sigterm()\n"
            "r = RedisServer().start()\n"
            "try:\n"
            f"    open({str(pid_file)!r}, 'w').write(str(r.proc.pid))\n"
            "    time.sleep(60)\n"
            "finally:\n"
            "    r.cleanup()\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    redis_pid = int(pid_file.read_text())
    os.kill(redis_pid, 0)  # running
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):  # stopped and reaped by its parent's cleanup
        os.kill(redis_pid, 0)
