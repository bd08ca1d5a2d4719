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
