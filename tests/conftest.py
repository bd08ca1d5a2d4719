"""Session fixtures: a real redis-server and the demo model built offline."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Tests never touch the user's cache dir: `mlxgw serve` leaves its Redis URL there for
# `mlxgw status` and removes it on stop, so a test serve once took over (then deleted) a
# live serve's file. Built demo models are linked in, not rebuilt.
_user_cache = Path(os.environ.get("MLXGW_CACHE_DIR") or "~/.cache/mlxgw").expanduser()
_test_cache = Path(tempfile.mkdtemp(prefix="mlxgw-test-cache-"))
for _d in _user_cache.glob("demo-*-v*"):
    if _d.is_dir():
        (_test_cache / _d.name).symlink_to(_d.resolve(), target_is_directory=True)
os.environ["MLXGW_CACHE_DIR"] = str(_test_cache)
atexit.register(shutil.rmtree, _test_cache, ignore_errors=True)

from mlxgw.harness import RedisServer, Stack  # noqa: E402
from mlxgw.rlimit import guard_mlx_lm_import  # noqa: E402

# The test process imports mlx-lm (demo model, in-process backend tests); keep the
# open-files limits the harness's children inherit as the shell gave them.
guard_mlx_lm_import()


# The modules that take longest (seconds of test time, session 48's full run at -n 3), run
# first: pytest-xdist hands each test process a whole module (--dist loadscope) in collection
# order (scripts/test.sh passes --no-loadscope-reorder; its default orders them by test count),
# so none of them starts last beside idle processes. Measured: no gain beyond noise in one
# comparison (632 against 629 s): the two cores are busy ~97% of the run either way.
LONGEST_FIRST = ("test_faults", "test_cache_policy", "test_registry_faults", "test_redis_faults", "test_load",
                 "test_launcher", "test_disk_tier", "test_security", "test_top", "test_routing", "test_pending",
                 "test_persist", "test_dialects", "test_compat", "test_sampling")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: file order within a rank
    items.sort(key=lambda item: rank.get(getattr(getattr(item, "module", None), "__name__", ""), len(rank)))


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
def stack1(redis_server, demo_model):
    """One backend and one gateway on the session Redis, shared by a test module."""
    s = Stack(redis_server.url, demo_model)
    try:  # a failed start must not leave its processes running
        s.add_backend("b0")
        s.add_gateway()
        s.wait()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stack2(redis_server, demo_model):
    """Two backends and one gateway on the session Redis, shared by a test module."""
    s = Stack(redis_server.url, demo_model)
    try:  # a failed start must not leave its processes running
        s.add_backend("b0")
        s.add_backend("b1")
        s.add_gateway()
        s.wait()
        yield s
    finally:
        s.stop()
