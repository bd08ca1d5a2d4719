"""Load test (routing issue, acceptance 2): 200 concurrent streaming chat
requests over 3 backends with one backend killed in the middle. Every
request ends with an answer or a clean error; none hangs, none is dropped."""

import asyncio
import time
from collections import Counter

import openai

from texts import words


def test_200_streams_one_backend_killed(make_stack):
    s = make_stack()
    backends = [s.add_backend(f"b{i}") for i in range(3)]
    s.add_gateway()
    s.wait()
    client = openai.AsyncOpenAI(base_url=s.gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    outcome: Counter = Counter()
    started = asyncio.Event()
    first_tokens = 0

    async def one(i: int) -> str:
        nonlocal first_tokens
        try:
            stream = await client.chat.completions.create(
                model="demo-tiny", messages=[{"role": "user", "content": words(30, seed=i)}],
                max_tokens=24, stream=True, stream_options={"include_usage": True})
            finish, usage = None, None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None and finish is None:
                    first_tokens += 1
                    if first_tokens == 60:
                        started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    usage = chunk.usage
            return "answer" if finish and usage and usage.completion_tokens > 0 else "truncated"
        except openai.APIStatusError as e:  # a clean HTTP error with a JSON body
            return f"http_{e.status_code}"
        except openai.APIError as e:
            if isinstance(e, (openai.APIConnectionError, openai.APITimeoutError)):
                return "connection_error"  # not clean
            return "sse_error"  # the gateway's well-formed SSE error event

    async def kill_later():
        await asyncio.wait_for(started.wait(), 120)
        backends[1].kill()

    async def run():
        killer = asyncio.create_task(kill_later())
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 300)
        await killer
        return results

    t0 = time.time()
    results = asyncio.run(run())
    took = time.time() - t0
    outcome.update(results)
    print(f"\n200 streams, 3 backends, b1 killed after 60 first tokens: {dict(outcome)} in {took:.1f} s")
    assert len(results) == 200
    assert outcome["connection_error"] == 0 and outcome["truncated"] == 0
    assert set(outcome) <= {"answer", "sse_error", "http_503"}
    assert outcome["answer"] >= 120  # the two live backends answered the rest


def test_gateway_and_backend_raise_their_open_files_limit(make_stack):
    """A gateway holds two sockets per request in flight. macOS starts processes at a soft
    limit of 256 open files, and importing mlx-lm sets (2048, 4096) (mlx_lm/utils.py): a
    soak here ran out at ~1,000 requests in flight (accept() failing, asyncio logging it
    in a loop: a 109 MB log). Both processes now raise their soft limit to the hard one
    (`mlxgw.util.raise_open_files_limit`, up to 65536)."""
    import resource

    import psutil
    import pytest

    if not hasattr(psutil.Process, "rlimit"):
        pytest.skip("psutil cannot read another process's limits on this OS")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    s = make_stack()
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # what the children inherit
    try:
        b0 = s.add_backend("b0", None, "--engine", "sim")
        s.add_gateway()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    s.wait()
    for p in (s.gateway, b0):
        got_soft, got_hard = psutil.Process(p.proc.pid).rlimit(resource.RLIMIT_NOFILE)
        assert got_soft == min(65536, got_hard) and got_soft > 2048, (p.name, got_soft, got_hard)
    assert "open files limit raised from" in s.gateway.log_path.read_text()
