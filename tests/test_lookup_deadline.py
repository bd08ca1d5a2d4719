"""The lookup deadline counts only time the gateway's event loop kept up
(``gateway/index.py::LookupDeadline``), on a real Redis: a reply that waited
unread while the loop ran other requests' work is an answer, not a timeout;
a Redis that does not answer still ends the lookup after about one deadline,
and not much past ``SILENCE`` however busy the loop is."""

import asyncio
import signal
import threading
import time

import pytest

from gateway import index as index_module
from gateway.index import SILENCE, SILENT_DEADLINE, LookupDeadline, OwnershipIndex, RedisPulse
from mlxgw.harness import RedisServer

BLOCKS = ["00" * 8, "11" * 8]


# Keeps Redis busy for ARGV[1] microseconds (another client's slow command).
SPIN_LUA = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
return 1
"""


def _redis_busy_for(url: str, seconds: float) -> threading.Thread:
    """Start another client's slow script and return once Redis is running it."""
    import redis as redis_py

    c = redis_py.Redis.from_url(url)
    c.ping()
    th = threading.Thread(target=c.eval, args=(SPIN_LUA, 0, int(seconds * 1e6)), daemon=True)
    th.start()
    time.sleep(seconds / 4)  # the script has started: Redis answers nobody until it ends
    return th


def _keep_loop_busy(loop, seconds: float, turn: float = 0.02) -> None:
    """Other requests' work: ``turn`` seconds without yielding, every loop turn, for ``seconds``."""
    end = time.monotonic() + seconds

    def work():
        time.sleep(turn)
        if time.monotonic() < end:
            loop.call_soon(work)

    loop.call_soon(work)


@pytest.mark.parametrize("stretch", [True, False], ids=["lag-aware", "wall-clock"])
def test_a_reply_that_comes_while_the_loop_is_busy_is_an_answer(redis_server, monkeypatch, stretch):
    """The loop spends 20 ms a turn on other requests (a burst's tokenization) and Redis answers
    after ~30 ms: a wall-clock 10 ms deadline (``LATE_FRACTION`` infinite: no period is ever
    added) gives the lookup up on the first late turn; the lag-aware one reads the answer."""
    if not stretch:
        monkeypatch.setattr(index_module, "LATE_FRACTION", float("inf"))

    async def run():
        index = OwnershipIndex(redis_server.url, namespace="t-dl", deadline=0.01)
        await index.redis.ping()  # a pooled connection, as under traffic
        held = _redis_busy_for(redis_server.url, 0.04)
        _keep_loop_busy(asyncio.get_running_loop(), 0.2)
        found = await index.lookup("m", BLOCKS)
        held.join()
        counts = dict(index.lookups), index.lookups_stretched
        await index.close()
        return found, counts

    found, counts = asyncio.run(run())
    if stretch:
        assert found.status == "ok" and found.candidates == []
        assert counts == ({"ok": 1, "timeout": 0, "error": 0}, 1)
        assert 0.02 <= found.seconds < 0.25, found.seconds
    else:
        assert found.status == "timeout" and counts == ({"ok": 0, "timeout": 1, "error": 0}, 0)


def _with_stopped_redis(deadline: float, body):
    """``body(index)`` on a gateway index whose Redis answered a ping, then stopped (SIGSTOP)."""
    r = RedisServer().start()

    async def run():
        index = OwnershipIndex(r.url, namespace="t-dl", deadline=deadline)
        await index.redis.ping()
        r.proc.send_signal(signal.SIGSTOP)
        try:
            return await body(index)
        finally:
            r.proc.send_signal(signal.SIGCONT)
            await index.close()

    try:
        return asyncio.run(run())
    finally:
        r.cleanup()


def test_a_redis_that_does_not_answer_still_times_out_after_about_one_deadline():
    found = _with_stopped_redis(0.05, lambda index: index.lookup("m", BLOCKS))
    assert found.status == "timeout"
    # An idle loop: one 50 ms deadline (a late timer on a loaded CI box may add a period or two).
    assert 0.05 <= found.seconds < 0.25, found.seconds


def test_once_redis_is_silent_lookups_wait_only_the_silent_deadline():
    """A frozen Redis (SIGSTOP, swapping) cost every request the whole deadline; once lookups
    have waited ``SILENCE`` with no answer, later ones give up after ``SILENT_DEADLINE``."""
    async def body(index):
        first = await index.lookup("m", BLOCKS)
        await asyncio.sleep(SILENCE)
        later = [await index.lookup("m", BLOCKS) for _ in range(3)]
        return first, later

    first, later = _with_stopped_redis(0.05, body)
    assert first.status == "timeout" and 0.05 <= first.seconds < 0.25, first.seconds
    assert [x.status for x in later] == ["timeout"] * 3
    # Three whole deadlines would be >= 0.15 s; three silent ones about 0.03.
    assert all(x.seconds >= SILENT_DEADLINE for x in later) and sum(x.seconds for x in later) < 0.12, later


def test_a_busy_loop_and_a_silent_redis_end_soon_after_silence():
    """The loop stays busy (20 ms of work every turn, so every 10 ms timer runs late) and Redis
    never answers: after ``SILENCE`` (0.25 s) of lookups waiting with no answer a late timer
    no longer buys time, so the lookup gives up soon after, not at the socket timeout or never;
    the next one, Redis still silent, after its first period (a Redis that hangs in a burst costs
    the lookups then waiting about SILENCE, later ones one deadline)."""
    async def body(index):
        _keep_loop_busy(asyncio.get_running_loop(), 1.0)
        found = await index.lookup("m", BLOCKS)
        second = await index.lookup("m", BLOCKS)
        return found, second, index.lookups_stretched

    found, second, stretched = _with_stopped_redis(0.01, body)
    assert found.status == "timeout" and second.status == "timeout" and stretched == 1
    assert SILENCE <= found.seconds < SILENCE + 0.15, found.seconds
    # A few late turns of the busy loop, well short of a second SILENCE (a loaded CI run: 0.13 s).
    assert second.seconds < SILENCE * 0.8, second.seconds


def test_redis_answering_other_lookups_keeps_a_queued_one_waiting():
    """Redis answered another lookup during the period (a burst's replies come one after another):
    the queued one waits on, on an idle loop too; with no answer anywhere it ends after one period."""

    async def run(answering: bool):
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        loop.call_later(0.06, reply.set_result, "owned")  # this lookup's answer, 60 ms out
        pulse = RedisPulse()
        pulse.asked(loop.time())

        def others_answered():
            pulse.asked(loop.time())
            pulse.done(loop.time(), answered=True)
            if not reply.done():
                loop.call_later(0.005, others_answered)

        if answering:
            others_answered()
        t0 = loop.time()
        limit = LookupDeadline(0.01, pulse)
        try:
            async with limit:
                got = await reply
        except asyncio.TimeoutError:
            got = "timeout"
        return got, loop.time() - t0, limit.stretched

    got, seconds, stretched = asyncio.run(run(True))
    assert got == "owned" and 0.06 <= seconds < 0.2 and stretched >= 5
    got, seconds, stretched = asyncio.run(run(False))
    assert got == "timeout" and 0.01 <= seconds < 0.05  # one period (a loaded box may add one)
