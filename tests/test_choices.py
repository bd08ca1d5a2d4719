"""``n`` > 1: several choices of one prompt in one request (OpenAI's field, vLLM's seeding rule),
whole and streamed, through a real gateway and demo backend; the prompt computed once."""

import json
import time

import openai
import pytest

from mlxgw.httpget import post
from test_metrics import _scrape, _v
from texts import words


def _chat(stack, **body) -> dict:
    status, _, raw = post(stack.gateway.url + "/v1/chat/completions",
                          {"model": "demo-tiny", "temperature": 1.0, "ignore_eos": True, **body})
    assert status == 200, raw
    return json.loads(raw)


@pytest.fixture
def client(stack1):
    return openai.OpenAI(base_url=stack1.gateway.url + "/v1", api_key="unused", max_retries=0)


def test_n_choices_are_the_seeded_single_answers(stack1):
    """Choice i of a seeded request is the answer of the same request with ``n`` 1 and seed
    ``seed + i`` (vLLM's rule), so the choices differ and each is reproducible; one id, the
    prompt counted once in usage, every choice's tokens counted."""
    msgs = [{"role": "user", "content": words(30, seed=41)}]
    out = _chat(stack1, messages=msgs, n=3, seed=11, max_tokens=6)
    singles = [_chat(stack1, messages=msgs, seed=11 + i, max_tokens=6) for i in range(3)]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in out["choices"]] == [s["choices"][0]["message"]["content"] for s in singles]
    assert len({c["message"]["content"] for c in out["choices"]}) == 3
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
    assert out["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 18
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 18
    assert out["id"].startswith("chatcmpl-")


def test_n_choices_compute_the_prompt_once(stack1):
    """A cold prompt asked with ``n`` 3: the backend computes it once (the other choices wait
    for that prefill and reuse it, leaving one token each to compute); usage's cached_tokens is
    what the request found cached (the chat template's opening, from earlier requests), and the
    backend's counters count the request once."""
    from mlxgw.httpget import get_json

    b, m = stack1.backends[0].url, stack1.model_name
    _, before = _scrape(b)
    h0 = get_json(b + "/health")
    prompt = [{"role": "user", "content": words(200, seed=42)}]
    out = _chat(stack1, messages=prompt, n=3, max_tokens=2, temperature=0)
    _, after = _scrape(b)
    h1 = get_json(b + "/health")
    p = out["usage"]["prompt_tokens"]
    assert p > 150
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached < 40

    def delta(name):
        return _v(after, name, model_name=m) - _v(before, name, model_name=m)

    # The prompt computed once: the other two choices prefilled one token each.
    assert h1["prefill_tokens"] - h0["prefill_tokens"] == (p - cached) + 2
    assert h1["generated_tokens"] - h0["generated_tokens"] == 6
    # And the request counted once in the backend's own figures, as in its usage (helper-84: 3
    # requests, 2 of them hits, for one cold prompt).
    assert (h1["requests"] - h0["requests"], h1["prompt_tokens"] - h0["prompt_tokens"],
            h1["cached_tokens"] - h0["cached_tokens"]) == (1, p, cached)
    assert delta("mlxgw:prefix_cache_queries_total") == p
    assert delta("mlxgw:prefix_cache_hits_total") == cached
    assert delta("mlxgw:time_to_first_token_seconds_count") == 1
    assert delta("mlxgw:generation_tokens_total") == 6
    # Greedy: every choice is the same answer.
    assert len({c["message"]["content"] for c in out["choices"]}) == 1


def test_n_choices_on_completions(stack1):
    out = json.loads(post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "prompt": words(20, seed=43), "n": 2, "seed": 3, "max_tokens": 5,
                           "temperature": 1.0, "ignore_eos": True, "logprobs": 1})[2])
    one = json.loads(post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "prompt": words(20, seed=43), "seed": 4, "max_tokens": 5,
                           "temperature": 1.0, "ignore_eos": True, "logprobs": 1})[2])
    assert out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][1]["text"] == one["choices"][0]["text"]
    assert out["choices"][1]["logprobs"] == one["choices"][0]["logprobs"]
    assert [len(c["logprobs"]["tokens"]) for c in out["choices"]] == [5, 5]
    assert out["usage"]["completion_tokens"] == 10


def test_n_choices_streamed_through_the_sdk(stack1, client):
    """Streamed, each choice's chunks carry its index: the first its role, the last its
    finish_reason; the texts are the whole answer's; one usage chunk with every choice's tokens."""
    msgs = [{"role": "user", "content": words(30, seed=44)}]
    whole = _chat(stack1, messages=msgs, n=3, seed=21, max_tokens=7)
    stream = client.chat.completions.create(model="demo-tiny", messages=msgs, n=3, seed=21, max_tokens=7,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, roles, finish, usage, ids, chunks = {}, {}, {}, [], set(), []
    for chunk in stream:
        chunks.append(chunk)
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert [text[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert len(ids) == 1
    assert len(usage) == 1 and usage[0].completion_tokens == 21
    # Every choice's role chunk first, in index order (the engine may start them in any order;
    # the SDK's stream helper indexes its choices list by arrival, helper-83).
    assert [(c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content or "")
            for c in chunks[:3]] == [(0, "assistant", ""), (1, "assistant", ""), (2, "assistant", "")]


def test_the_sdks_stream_helper_takes_many_choices(stack1, client):
    """openai's ``chat.completions.stream`` helper (IndexError when a choice's first chunk came
    before a lower index's, helper-83) assembles every choice, each the whole answer's."""
    msgs = [{"role": "user", "content": words(12, seed=51)}]
    whole = _chat(stack1, messages=msgs, n=8, seed=31, max_tokens=4)
    with client.chat.completions.stream(model="demo-tiny", messages=msgs, n=8, seed=31, max_tokens=4,
                                        temperature=1.0, extra_body={"ignore_eos": True}) as s:
        for _ in s:  # its events (get_final_completion refuses a length stop: it parses the answer)
            pass
        final = s.current_completion_snapshot
    assert [c.message.content for c in final.choices] == [c["message"]["content"] for c in whole["choices"]]


def test_n_above_openais_bound_is_a_400(stack1):
    status, _, raw = post(stack1.gateway.url + "/v1/chat/completions",
                          {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "n": 129})
    err = json.loads(raw)["error"]
    assert (status, err["param"]) == (400, "n"), raw
    assert "<= 128" in err["message"]


def test_a_request_counts_its_choices_as_decodes_in_the_gateways_load(stack1, redis_server):
    """The gateway's published load (what it and other gateways route on) counts a request
    with ``n`` 3 as three running decodes on its backend while it streams; the client leaving
    stops all three on the backend."""
    from mlxgw import schema

    keys, r = schema.Keys(stack1.namespace, stack1.model_name), redis_server.client()
    client = openai.OpenAI(base_url=stack1.gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": words(20, seed=45)}],
                                            n=3, max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
    seen = None
    try:
        for _ in stream:  # the answer runs; the gateway publishes every 0.1 s
            loads = [v for gid in r.zrange(keys.gateways, 0, -1) for v in r.hgetall(keys.gateway_load(gid)).values()]
            if loads:
                seen = loads[0]
                if seen.startswith("3:"):
                    break
            time.sleep(0.01)
    finally:
        stream.close()
    assert seen is not None and seen.split(":")[0] == "3", seen
    deadline, running = time.time() + 15, None
    while time.time() < deadline:
        _, vals = _scrape(stack1.backends[0].url)
        running = _v(vals, "mlxgw:num_requests_running", model_name=stack1.model_name)
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0


def _completion(stack, **body) -> dict:
    status, _, raw = post(stack.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "temperature": 1.0, "ignore_eos": True, **body})
    assert status == 200, raw
    return json.loads(raw)


def test_a_completions_batch_answers_each_prompt(stack1):
    """OpenAI's batch on /v1/completions: ``prompt`` as several strings or token arrays, each
    answered with ``n`` choices at indexes ``p * n + j``; each the answer the prompt gets alone
    (same seed rule); usage sums the prompts and answers."""
    texts = [words(15, seed=46), words(25, seed=47)]
    ids = [11, 12, 13, 14, 15, 16]
    out = _completion(stack1, prompt=[texts[0], texts[1]], n=2, seed=5, max_tokens=4)
    alone = [_completion(stack1, prompt=t, n=2, seed=5, max_tokens=4) for t in texts]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 16
    mixed = _completion(stack1, prompt=[ids, texts[0]], max_tokens=3, temperature=0, return_token_ids=True)
    assert [c["prompt_token_ids"] for c in mixed["choices"]][0] == ids
    assert mixed["choices"][1]["text"] == _completion(stack1, prompt=texts[0], max_tokens=3,
                                                      temperature=0)["choices"][0]["text"]
    assert mixed["usage"]["prompt_tokens"] == len(ids) + alone[0]["usage"]["prompt_tokens"]


def test_a_completions_batch_streams_every_prompts_choices(stack1, client):
    texts = [words(15, seed=48), words(15, seed=49), words(15, seed=50)]
    whole = _completion(stack1, prompt=texts, seed=9, max_tokens=5)
    stream = client.completions.create(model="demo-tiny", prompt=texts, seed=9, max_tokens=5, temperature=1.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    text, finish, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [text[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == whole["usage"]["prompt_tokens"] and usage.completion_tokens == 15


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": ["ok", ""]}, "prompt[1]", "'prompt[1]' must not be empty"),
    ({"prompt": ["ok", [1, 10**9]]}, "prompt[1]", "'prompt[1]' holds token ids outside the vocabulary (0..3071)"),
    ({"prompt": ["ok", 5]}, "prompt", "'prompt' must be a non-empty string or array of token ids"),
    ({"prompt": ["ok"] * 33, "n": 4}, "prompt", "33 prompts x n=4 is 132 choices; at most 128 per request"),
    ({"prompt": ["ok", "word " * 9000]}, "prompt[1]", None),
])
def test_bad_batches_are_400s_naming_the_prompt(stack1, body, param, message):
    status, _, raw = post(stack1.gateway.url + "/v1/completions", {"model": "demo-tiny", "max_tokens": 2, **body})
    err = json.loads(raw)["error"]
    assert (status, err["param"]) == (400, param), raw
    if message is not None:
        assert err["message"] == message
    else:
        assert err["code"] == "context_length_exceeded"


def test_spare_choices_never_evict_other_conversations(make_stack):
    """The choices after the first are saved only into free space (the first's entry holds the
    prompt they share): in a full cache an ``n`` 4 request evicts nothing of the three
    conversations cached before it (helper-83: n=64 evicted 64 entries)."""
    from mlxgw.httpget import get_json

    s = make_stack()
    b0 = s.add_backend("b0", None, "--cache-entries", "4")
    s.wait()

    def ask(prompt, **kw):
        status, _, raw = post(b0.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw})
        assert status == 200, raw
        return json.loads(raw)

    convs = [[100 + 7 * k + i % 50 for i in range(100)] for k in range(3)]
    for c in convs:
        ask(c)
    skipped = get_json(b0.url + "/health")["abandoned_saves_skipped"]
    out = ask([900 + i % 40 for i in range(100)], n=4, temperature=1.0, ignore_eos=True)
    assert len(out["choices"]) == 4
    assert get_json(b0.url + "/health")["abandoned_saves_skipped"] == skipped + 3
    assert [ask(c)["usage"]["prompt_tokens_details"]["cached_tokens"] for c in convs] == [99, 99, 99]


def test_streamed_choices_open_with_the_first_token_not_before(make_stack):
    """The role chunks of an ``n`` > 1 stream go out with its first token, after the prefill's
    progress comments: a gateway reads the first data event as the prefill's end (TTFT, queued
    prefill tokens in its load)."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--prefill-step-size", "64")
    s.wait()
    status, _, raw = post(b0.url + "/v1/completions", {"prompt": words(300, seed=52), "max_tokens": 2, "n": 2,
                                                       "stream": True})
    assert status == 200, raw
    lines = [ln for ln in raw.decode().split("\n") if ln]
    progress = [i for i, ln in enumerate(lines) if ln.startswith(": keepalive")]
    data = [i for i, ln in enumerate(lines) if ln.startswith("data: {")]
    # The prompt's progress comes first; a second choice's own last progress comment may follow the
    # first token on a loaded machine (CI at stop 59 saw one), which says nothing of the role chunks.
    assert len([i for i in progress if i < data[0]]) >= 3, lines[:16]
    assert [json.loads(lines[i][6:])["choices"][0]["index"] for i in data[:2]] == [0, 1]


def test_choices_failing_before_their_first_token_are_retried_elsewhere(make_stack):
    """A stream of ``n`` choices whose batch fails before any token sent no data yet (its role
    chunks go out with the first token), so the gateway gives it whole to another backend."""
    s = make_stack()
    b0 = s.add_backend("b0", None, "--engine", "sim", "--sim-fail-after", "1")
    s.add_backend("b1", None, "--engine", "sim")
    s.add_gateway()
    s.wait()
    prompt = list(range(100, 400))
    status, _, raw = post(b0.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200, raw  # b0 now owns the prompt; its next batch step fails (--sim-fail-after)
    time.sleep(1.0)  # its save reaches Redis
    status, headers, raw = post(s.gateway.url + "/v1/completions",
                                {"model": s.model_name, "prompt": prompt + [7], "max_tokens": 3, "n": 2,
                                 "stream": True})
    assert status == 200, raw
    assert headers["X-Mlxgw-Backend"] == "b0"  # routed to the owner, which failed
    events = [json.loads(ln[6:]) for ln in raw.decode().split("\n") if ln.startswith("data: {")]
    assert not any("error" in e for e in events), events
    assert sorted(c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]) == ["length"] * 2
