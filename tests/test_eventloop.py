"""The gateway's event loop (mlxgw/eventloop.py): uvloop by default, asyncio's own on request."""

from __future__ import annotations

import asyncio
import json

import pytest

from mlxgw import eventloop
from tests.chat import ask


def test_auto_picks_uvloop_where_it_is_a_dependency_and_asyncio_picks_the_standard_loop():
    import uvloop

    assert eventloop.loop_factory("auto") == (uvloop.new_event_loop, "uvloop")
    assert eventloop.loop_factory("uvloop") == (uvloop.new_event_loop, "uvloop")
    assert eventloop.loop_factory("asyncio") == (None, "asyncio")
    with pytest.raises(ValueError, match="one of auto, uvloop, asyncio"):
        eventloop.loop_factory("trio")


def test_run_returns_the_coroutines_value_from_the_chosen_loop():
    async def which():
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__.split(".")[0], 42

    assert eventloop.run(which, eventloop.loop_factory("auto")[0]) == ("uvloop", 42)
    assert eventloop.run(which, None) == ("asyncio", 42)


def test_gateways_on_either_loop_say_which_and_route_a_repeated_prompt_to_its_cache(make_stack):
    """Two gateways on one backend, one per loop: each logs its loop, and a prompt first sent
    through one is matched and served from the backend's cache through the other."""
    st = make_stack(block_size=16)
    st.add_backend("b0", None, "--engine", "sim", "--sim-speed", "1e6")
    uv = st.add_gateway()
    std = st.add_gateway("--event-loop", "asyncio")
    st.wait()
    assert "event loop uvloop" in uv.log_path.read_text()
    assert "event loop asyncio" in std.log_path.read_text()
    text = "the event loop must not change routing " * 12
    for first, second in ((uv, std), (std, uv)):
        prompt = f"{first.name} first: {text}"
        status, h1, body = ask(first.url, prompt, max_tokens=2)
        assert status == 200, body
        assert json.loads(body)["usage"]["prompt_tokens"] > 64
        status, h2, body = ask(second.url, prompt, max_tokens=2)
        assert status == 200, body
        assert h2["X-Mlxgw-Backend"] == "b0"
        # The whole prompt but the block still open is owned; the backend reused it.
        assert int(h2["X-Mlxgw-Matched-Tokens"]) >= 64
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
