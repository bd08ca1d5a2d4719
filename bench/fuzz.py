"""Fuzz the gateway's request parsing and dialect translation with hypothesis.

Generated requests (broken bytes, truncated JSON, valid bodies with fields
replaced by wrong types, NaN/Infinity, 2**70, lone surrogates, deep nesting,
garbage messages and tools) go to the gateway app running in this process,
over real HTTP (aiohttp's test server), with a real redis-server and one real
mlx-lm backend (tiny demo model) behind it, so the requests that pass
validation are really generated and answered.

Pass criteria, per request: no 5xx, an error body in the endpoint's JSON shape
for every 4xx, no ``server_error`` event inside a 200 stream; at the end, no
ERROR logged by the gateway, the backend alive and the gateway healthy.

    python bench/fuzz.py --examples 10000

prints the count of requests sent and their statuses. ``tests/test_fuzz.py``
runs a short version in the default test run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PATHS = ["/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/messages"]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "n", "stream", "stream_options", "stop", "seed", "logit_bias", "logprobs", "top_logprobs", "user",
               "tools", "tool_choice", "response_format", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "chat_template_kwargs", "prompt", "_mlxgw", "system", "prompt_cache_key"]

# Scalars that break parsers: NaN, infinities, ints beyond 64 bits, lone surrogates, control characters.
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["\ud800", "\udfff", "\x00", "<|im_end|>", "{{ 7*7 }}", "{% for x in range(10**9) %}",
                     "user", "assistant", "tool", "system", "demo-tiny", "text", "function"]),
)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)


@st.composite
def message(draw):
    m = {"role": draw(st.sampled_from(["user", "assistant", "system", "tool", "developer", "wizard"])),
         "content": draw(st.one_of(st.text(max_size=60), st.just(None),
                                   st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                   "text": st.text(max_size=20)}), max_size=3),
                                   JSON_VALUES))}
    if draw(st.booleans()):
        key = draw(st.sampled_from(["tool_calls", "name", "tool_call_id", "content", "role"]))
        m[key] = draw(st.one_of(JSON_VALUES, st.just([{"id": "c1", "type": "function",
                                                       "function": {"name": "f", "arguments": "{\"a\": 1}"}}])))
    return m


def base_body(path: str) -> dict:
    if path == "/v1/completions":
        return {"model": "demo-tiny", "prompt": "hello there", "max_tokens": 2}
    if path == "/v1/messages":
        return {"model": "demo-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@st.composite
def json_request(draw):
    path = draw(st.sampled_from(PATHS))
    body = base_body(path)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "set", "delete", "messages", "tools", "bounded"]))
        if op == "set":
            body[draw(st.one_of(st.sampled_from(CHAT_FIELDS), st.text(max_size=8)))] = draw(JSON_VALUES)
        elif op == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif op == "messages":
            body["messages"] = draw(st.lists(message(), max_size=5))
        elif op == "tools":
            body["tools"] = draw(st.lists(st.one_of(
                JSON_VALUES,
                st.fixed_dictionaries({"type": st.just("function"),
                                       "function": st.fixed_dictionaries({"name": st.text(max_size=10),
                                                                          "parameters": JSON_VALUES})})),
                max_size=3))
        else:  # well-typed but extreme values of the sampling fields
            f = draw(st.sampled_from(["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
                                      "repetition_penalty", "stop", "logit_bias", "n", "stream"]))
            body[f] = draw(st.one_of(st.integers(-3, 16), st.floats(-1, 3), st.booleans(),
                                     st.lists(st.text(max_size=3), max_size=20),
                                     st.dictionaries(st.text(st.characters(categories=["Nd"]), min_size=1, max_size=7),
                                                     st.floats(-200, 200), max_size=3)))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) and body["max_tokens"] > 16:
        body["max_tokens"] = 16  # keep accepted requests short: this test is about parsing, not generation
    raw = json.dumps(body, allow_nan=True).encode()
    return path, raw


@st.composite
def raw_request(draw):
    path = draw(st.sampled_from(PATHS))
    good = json.dumps(base_body(path)).encode()
    kind = draw(st.sampled_from(["bytes", "truncate", "flip", "nest", "array", "utf8"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=200))
    elif kind == "truncate":
        raw = good[: draw(st.integers(0, len(good) - 1))]
    elif kind == "flip":
        i = draw(st.integers(0, len(good) - 1))
        raw = good[:i] + bytes([draw(st.integers(0, 255))]) + good[i + 1:]
    elif kind == "nest":
        d = draw(st.integers(50, 5000))
        raw = good[:-1] + b',"x":' + b"[" * d + b"]" * d + b"}"
    elif kind == "array":
        raw = b"[" + good + b"]"
    else:
        raw = good[:-2] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + good[-2:]
    return path, raw


REQUESTS = st.tuples(st.one_of(json_request(), json_request(), raw_request()),
                     st.sampled_from(["application/json", "text/plain", "application/x-msgpack", None]))


class ErrorCount(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(self.format(record))


def run_fuzz(redis_url: str, namespace: str, model_path: str, examples: int, derandomize: bool = False,
             block_size: int = 16) -> dict:
    """Send ``examples`` generated requests at an in-process gateway on ``redis_url``/``namespace``.

    A backend for ``demo-tiny`` must already be registered there. Returns
    ``{"requests": n, "statuses": Counter, "seconds": s, "errors_logged": [...]}``.

    Raises:
        AssertionError (via hypothesis, with the shrunk failing request): a
            5xx, a malformed error body, or an error inside a stream.
    """
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.app import GatewayConfig, make_app

    cfg = GatewayConfig(redis_url=redis_url, namespace=namespace, block_size=block_size, lookup_deadline=2.0,
                        models={"demo-tiny": model_path})
    errors = ErrorCount()
    logging.getLogger("mlxgw").addHandler(errors)
    loop = asyncio.new_event_loop()
    client = TestClient(TestServer(make_app(cfg)), loop=loop)
    loop.run_until_complete(client.start_server())
    statuses: Counter = Counter()

    async def one(path: str, raw: bytes, ctype) -> tuple[int, bytes]:
        headers = {"Content-Type": ctype} if ctype else {}
        async with client.post(path, data=raw, headers=headers) as r:
            return r.status, await r.read()

    async def wait_for_backend():
        for _ in range(100):
            async with client.get("/health") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError("the in-process gateway never saw a backend")

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(REQUESTS)
    def check(req):
        (path, raw), ctype = req
        status, body = loop.run_until_complete(one(path, raw, ctype))
        statuses[status] += 1
        assert status < 500, f"{status} for {path} {raw[:300]!r}: {body[:300]!r}"
        if status >= 400:
            err = json.loads(body)
            if path.startswith("/v1/messages") and err.get("type") == "error":
                assert isinstance(err["error"]["message"], str)
            else:
                assert isinstance(err["error"]["message"], str) and err["error"]["type"]
        elif b'"server_error"' in body:
            raise AssertionError(f"server error inside a {status} answer for {raw[:300]!r}: {body[:300]!r}")

    t0 = time.time()
    try:
        loop.run_until_complete(wait_for_backend())
        check()
        loop.run_until_complete(wait_for_backend())  # still healthy, backend still registered
    finally:
        logging.getLogger("mlxgw").removeHandler(errors)
        loop.run_until_complete(client.close())
        loop.close()
    return {"requests": sum(statuses.values()), "statuses": statuses, "seconds": time.time() - t0,
            "errors_logged": errors.records}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=10_000)
    p.add_argument("--seed", action="store_true", help="derandomize (same requests every run)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from mlxgw.demo_model import ensure_demo_model
    from mlxgw.harness import RedisServer, Stack

    model = str(ensure_demo_model("tiny"))
    redis = RedisServer().start()
    stack = Stack(redis.url, model)
    try:
        b = stack.add_backend("b0")
        stack.wait()
        res = run_fuzz(redis.url, stack.namespace, model, args.examples, derandomize=args.seed)
        alive = b.proc.poll() is None
    finally:
        stack.stop()
        redis.cleanup()
    st_txt = ", ".join(f"{k}: {v}" for k, v in sorted(res["statuses"].items()))
    n5 = sum(v for k, v in res["statuses"].items() if k >= 500)
    print(f"fuzz: {res['requests']} requests in {res['seconds']:.0f}s; statuses {st_txt}; 5xx: {n5}; "
          f"gateway errors logged: {len(res['errors_logged'])}; backend alive: {alive}")
    return 0 if n5 == 0 and not res["errors_logged"] and alive else 1


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    sys.exit(main())
