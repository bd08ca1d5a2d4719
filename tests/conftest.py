"""Session fixtures: a real redis-server and the demo model built offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mlxgw.harness import RedisServer, Stack  # noqa: E402


@pytest.fixture(scope="session")
def redis_server():
    r = RedisServer().start()
    yield r
    r.cleanup()


@pytest.fixture(scope="session")
def demo_model() -> str:
    from mlxgw.demo_model import ensure_demo_model

    return str(ensure_demo_model("tiny"))


@pytest.fixture
def make_stack(redis_server, demo_model):
    """Factory of stacks on the session Redis; all stopped at test end."""
    stacks = []

    def make(**kw) -> Stack:
        s = Stack(redis_server.url, demo_model, **kw)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.stop()


@pytest.fixture(scope="module")
def stack2(redis_server, demo_model):
    """Two backends and one gateway on the session Redis, shared by a test module."""
    s = Stack(redis_server.url, demo_model)
    s.add_backend("b0")
    s.add_backend("b1")
    s.add_gateway()
    s.wait()
    yield s
    s.stop()
