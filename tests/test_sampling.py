"""Sampling options mlx_lm.server applies and we used to accept and drop: logprobs and
top_logprobs (OpenAI's chat and legacy shapes), presence/frequency penalties with their
context sizes, XTC. Each checked against the demo model run in this process, through a real
gateway and backend."""

import json

import mlx.core as mx
import openai
import pytest
from mlx_lm import load

from backend.render import TokenText
from mlxgw.harness import Stack
from mlxgw.httpget import post
from texts import words


@pytest.fixture(scope="module")
def model(demo_model):
    return load(demo_model)


def _logprobs(model, ids: list[int], processed=None) -> mx.array:
    """The next token's log-softmax after ``ids``, of the logits ``processed`` returns."""
    m, _ = model
    logits = m(mx.array([ids]))[0, -1].astype(mx.float32)
    if processed is not None:
        logits = processed(logits)
    return logits - mx.logsumexp(logits)


def _top(lp: mx.array, n: int) -> list[tuple[int, float]]:
    order = mx.argsort(-lp).tolist()[:n]
    return [(i, lp[i].item()) for i in order]


def _prompt(model, seed: int) -> list[int]:
    return model[1].encode(words(40, seed=seed), add_special_tokens=False)


def _completion(stack1, **body) -> dict:
    status, _, raw = post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "temperature": 0, "ignore_eos": True, **body})
    assert status == 200, raw
    return json.loads(raw)


def test_legacy_logprobs_are_the_models(stack1, model):
    ids = _prompt(model, 1)
    text = TokenText(model[1])
    got = _completion(stack1, prompt=ids, max_tokens=3, logprobs=3)["choices"][0]
    lp = got["logprobs"]
    top = _top(_logprobs(model, ids), 3)
    # Greedy: the first token is the likeliest one, with the model's own logprob.
    assert lp["tokens"][0] == text(top[0][0])[0]
    assert lp["token_logprobs"][0] == pytest.approx(top[0][1], abs=2e-3)
    assert lp["top_logprobs"][0] == pytest.approx({text(i)[0]: v for i, v in top}, abs=2e-3)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(alts) <= 4 and lp["tokens"][k] in alts for k, alts in enumerate(lp["top_logprobs"]))
    # The answer is its tokens' text, but for the leading space mlx-lm's detokenizer drops; the
    # offsets index the answer (helper-78: one character off after such a first token).
    joined = "".join(lp["tokens"])
    assert got["text"] in (joined, joined[1:])
    lengths = [len(t) for t in lp["tokens"]]
    lengths[0] -= len(joined) - len(got["text"])
    assert lp["text_offset"] == [0, lengths[0], lengths[0] + lengths[1]]
    assert all(got["text"][o:].startswith(t.lstrip() if k == 0 else t)
               for k, (o, t) in enumerate(zip(lp["text_offset"], lp["tokens"])))

    # An answer whose first token starts with a space: the text lacks it, the offsets follow the text.
    spaced = next((p for p in (_prompt(model, k) for k in range(20, 80))
                   if text(mx.argmax(_logprobs(model, p)).item())[0].startswith(" ")), None)
    assert spaced is not None, "no prompt of 60 whose answer starts with a space"
    sp = _completion(stack1, prompt=spaced, max_tokens=3, logprobs=0)["choices"][0]
    assert sp["logprobs"]["tokens"][0].startswith(" ") and not sp["text"].startswith(" ")
    assert sp["logprobs"]["text_offset"][1] == len(sp["logprobs"]["tokens"][0]) - 1
    assert all(sp["text"][o:].startswith(t.lstrip() if k == 0 else t)
               for k, (o, t) in enumerate(zip(sp["logprobs"]["text_offset"], sp["logprobs"]["tokens"])))

    # logprobs 0: the sampled token alone at each position; none asked: null
    zero = _completion(stack1, prompt=ids, max_tokens=2, logprobs=0)["choices"][0]["logprobs"]
    assert zero["tokens"] == lp["tokens"][:2]
    assert [list(a) for a in zero["top_logprobs"]] == [[t] for t in lp["tokens"][:2]]
    assert _completion(stack1, prompt=ids, max_tokens=2)["choices"][0]["logprobs"] is None
    # mlx_lm.server's form (helper-78: a 400 "must be an integer"): a boolean, top_logprobs the count
    as_bool = _completion(stack1, prompt=ids, max_tokens=3, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]
    assert as_bool["tokens"] == lp["tokens"] and [list(a) for a in as_bool["top_logprobs"]] == [list(a) for a in
                                                                                               lp["top_logprobs"]]
    assert as_bool["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=2e-3)
    as_bool = _completion(stack1, prompt=ids, max_tokens=2, logprobs=True, top_logprobs=-1)["choices"][0]["logprobs"]
    assert as_bool["tokens"] == zero["tokens"] and [list(a) for a in as_bool["top_logprobs"]] == [[t] for t in
                                                                                                 zero["tokens"]]
    assert _completion(stack1, prompt=ids, max_tokens=2, logprobs=False)["choices"][0]["logprobs"] is None
    status, _, raw = post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "prompt": ids, "max_tokens": 2, "top_logprobs": 3})
    assert status == 400 and json.loads(raw)["error"]["param"] == "top_logprobs"  # as on chat (was ignored)


def test_chat_logprobs_streamed_and_not(stack1, model):
    client = openai.OpenAI(base_url=stack1.gateway.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": words(30, seed=2)}]
    kw = dict(model="demo-tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens == 6
    for e in entries:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        # greedy: the sampled token is the likeliest
        assert (e.token, e.bytes) == (e.top_logprobs[0].token, e.top_logprobs[0].bytes)
        assert e.logprob == e.top_logprobs[0].logprob <= 0
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    joined = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    assert full.choices[0].message.content in (joined, joined[1:])

    streamed, content = [], ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
    assert content == full.choices[0].message.content
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=2e-3)

    plain = client.chat.completions.create(model="demo-tiny", messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_responses_logprobs_are_the_chats(stack1):
    """The Responses API's output text logprobs (``include: ["message.output_text.logprobs"]``,
    ``top_logprobs``) are the chat endpoint's for the same conversation, streamed and not; without
    the include there are none, as OpenAI answers (they were never produced: ``[]``)."""
    client = openai.OpenAI(base_url=stack1.gateway.url + "/v1", api_key="unused", max_retries=0)
    text = words(30, seed=5)
    chat = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": text}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    want = [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in chat.choices[0].logprobs.content]
    kw = dict(model="demo-tiny", input=text, max_output_tokens=5, temperature=0, top_logprobs=2,
              extra_body={"ignore_eos": True})

    def rows(entries):
        return [(e.token, pytest.approx(e.logprob, abs=2e-3), e.bytes,
                 [(t.token, pytest.approx(t.logprob, abs=2e-3)) for t in e.top_logprobs]) for e in entries]

    full = client.responses.create(include=["message.output_text.logprobs"], **kw)
    part = full.output[0].content[0]
    assert part.text == chat.choices[0].message.content and len(want) == 5
    assert rows(part.logprobs) == want and full.top_logprobs == 2

    deltas, done, final = [], None, None
    for ev in client.responses.create(include=["message.output_text.logprobs"], stream=True, **kw):
        if ev.type == "response.output_text.delta":
            deltas += ev.logprobs
        elif ev.type == "response.output_text.done":
            done = ev.logprobs
        elif ev.type == "response.incomplete":  # max_output_tokens ended it
            final = ev.response.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in deltas] == [(e.token, e.logprob) for e in done]
    assert rows(final) == want and [e.token for e in done] == [w[0] for w in want]

    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # no include: none
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(include=["message.output_text.logprobs"], **{**kw, "top_logprobs": 21})
    assert err.value.body["param"] == "top_logprobs"


def test_output_text_logprobs_leave_out_reasoning_and_tool_call_tokens():
    """Beside reasoning or a tool call, the output text gets its own tokens' entries (found by
    their bytes), in a whole answer and in a chunk."""
    from gateway.dialects.base import text_entries

    def entry(s):
        return {"token": s, "logprob": -1.0, "bytes": list(s.encode()), "top_logprobs": []}

    toks = ["<think>", "I", " think", "</think>", "\n\n", "I", " said", "<tool_call>", "{}", "</tool_call>"]
    entries = [entry(t) for t in toks]
    got = text_entries(entries, "I said", reasoning="I think", calls=True)
    assert [e["token"] for e in got] == ["I", " said"] and got[0] is entries[5]
    assert [e["token"] for e in text_entries(entries[:7], "I said", reasoning="I think")] == ["I", " said"]
    assert [e["token"] for e in text_entries(entries[5:], "I said", calls=True)] == ["I", " said"]
    # a token split across the text's edge is the text's too; alone, content has them all
    assert [e["token"] for e in text_entries([entry("ab"), entry("c<tool")], "bc", calls=True)] == ["ab", "c<tool"]
    assert text_entries(entries[5:7], " said") == entries[5:7]
    assert text_entries(None, "x") is None


def test_streamed_logprobs_keep_pace_with_the_text(stack1, model):
    """A chunk carries the entries of the tokens whose text it completes: text held back while it
    could start a stop string holds back its tokens' entries (helper-79: entries ran ahead of the
    text, '' with [' Load'], then 'L' with ['.a'])."""
    status, _, raw = post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "prompt": _prompt(model, 11), "max_tokens": 10, "temperature": 0,
                           "ignore_eos": True, "logprobs": 0, "stop": ["\u0001 never written"], "stream": True})
    assert status == 200
    steps, text, toks = [], "", []
    for ln in raw.decode().splitlines():
        if ln.startswith("data: {"):
            for ch in json.loads(ln[6:])["choices"]:
                text += ch["text"]
                toks += (ch["logprobs"] or {}).get("tokens", [])
                steps.append((text, "".join(toks)))
    joined = steps[-1][1]
    trim = joined[:1] == " " and not text.startswith(" ")  # the detokenizer drops the answer's leading space
    assert len(toks) == 10 and text == (joined[1:] if trim else joined)
    held = 0
    for t, j in steps:
        j = j[1:] if trim and j else j
        assert t.startswith(j), (t, j)  # never an entry before its text
        held = max(held, len(t) - len(j))
    assert held < 30  # and not all at the end


def test_stop_string_ends_the_logprobs_too(stack1, model):
    """Tokens the engine made after a stop string matched are not part of the answer."""
    ids = _prompt(model, 3)
    first = _completion(stack1, prompt=ids, max_tokens=8, logprobs=0)["choices"][0]
    toks = first["logprobs"]["tokens"]
    stop = toks[3].strip() or toks[3]
    cut = next(k for k, t in enumerate(toks) if stop in t)
    for _ in range(4):  # the engine may make a token past the stop before its cancel lands: not counted
        out = _completion(stack1, prompt=ids, max_tokens=8, logprobs=0, stop=[stop])
        got = out["choices"][0]
        assert got["finish_reason"] == "stop"
        assert got["logprobs"]["tokens"] == toks[:cut + 1]
        # helper-78: completion_tokens was 10 or 11 at random for 10 tokens of answer
        assert out["usage"]["completion_tokens"] == cut + 1
    status, _, raw = post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                           "stop": [stop], "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    assert status == 200 and chunks[-1]["usage"]["completion_tokens"] == cut + 1


def _greedy(model, ids: list[int], n: int, penalise=None) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``ids`` and their logprobs, ``penalise(logits, context)``
    applied to each step's logits (the context: prompt and tokens generated so far)."""
    ids, out, lps = list(ids), [], []
    for _ in range(n):
        lp = _logprobs(model, ids, (lambda x: penalise(x, ids)) if penalise else None)
        t = mx.argmax(lp).item()
        out.append(t)
        lps.append(lp[t].item())
        ids.append(t)
    return out, lps


@pytest.mark.parametrize("field, penalty", [("presence", 1.5), ("frequency", 0.75)])
def test_penalties_are_applied_over_their_context(stack1, model, field, penalty):
    """presence/frequency_penalty subtract from the logits of the ids among the last n tokens
    (prompt and answer; mlx-lm's processors: once per id, or once per occurrence),
    n = ``*_context_size``. The answer and its logprobs are those of greedy decoding with the
    penalty worked out here; the prompt is one whose unpenalised answer differs."""
    n = 6

    def penalise(logits, context):
        window = context[-n:]
        for i in (set(window) if field == "presence" else window):
            logits[i] -= penalty
        return logits

    for seed in range(10, 30):  # a prompt the penalty changes (the demo model often repeats itself)
        ids = _prompt(model, seed)
        want, want_lps = _greedy(model, ids, 8, penalise)
        if want != _greedy(model, ids, 8)[0]:
            break
    else:
        raise AssertionError("no prompt of 20 whose greedy answer the penalty changes")
    got = _completion(stack1, prompt=ids, max_tokens=8, logprobs=0,
                      **{f"{field}_penalty": penalty, f"{field}_context_size": n})["choices"][0]["logprobs"]
    text = TokenText(model[1])
    assert got["tokens"] == [text(t)[0] for t in want]
    assert got["token_logprobs"] == pytest.approx(want_lps, abs=2e-3)


def test_xtc_excludes_the_top_choices(stack1, model):
    """XTC at probability 1 and threshold 0 removes every token but the least likely one, except
    the newline and end-of-sequence tokens it never removes (mlx-lm's ``apply_xtc``): the first
    token is one of those, where sampling from all 3,072 would almost never be."""
    ids = _prompt(model, 5)
    tok = model[1]
    lp = _logprobs(model, ids)
    keep = {mx.argmin(lp).item(), *tok.encode("\n", add_special_tokens=False), *tok.eos_token_ids}
    seen = set()
    for seed in range(3):
        got = _completion(stack1, prompt=ids, max_tokens=1, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.0,
                          seed=seed, logprobs=0)["choices"][0]["logprobs"]
        seen.add(got["tokens"][0])
    assert seen <= {TokenText(tok)(i)[0] for i in keep}, (seen, keep)


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # OpenAI's rule: only with logprobs true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_context_size": 0}, "frequency_context_size"),
    ({"xtc_threshold": 0.6}, "xtc_threshold"),  # mlx-lm's sampler raises above 0.5, inside the batch step
    ({"xtc_probability": 2}, "xtc_probability"),
    ({"top_logprobs": -2, "logprobs": True}, "top_logprobs"),
    ({"adapters": "my-lora"}, "adapters"),  # mlx_lm.server's; ignored, the answer came from another model
    ({"draft_model": "small"}, "draft_model"),
])
def test_bad_sampling_options_are_400(stack1, body, param):
    status, _, raw = post(stack1.gateway.url + "/v1/chat/completions",
                          {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param


def test_seed_makes_sampling_reproducible(stack1, model):
    """A ``seed`` draws the request's tokens from its own random stream (mlx_lm.server makes a
    seeded request reproducible by running it alone; we keep batching): the same seed gives the
    same answer, alone or beside another request, and another seed another answer."""
    import concurrent.futures

    ids = _prompt(model, 6)
    body = dict(prompt=ids, max_tokens=12, temperature=1.0)
    first = _completion(stack1, seed=7, **body)["choices"][0]["text"]
    assert _completion(stack1, seed=7, **body)["choices"][0]["text"] == first
    assert _completion(stack1, seed=8, **body)["choices"][0]["text"] != first
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(_completion, stack1, prompt=_prompt(model, 7), max_tokens=40, temperature=1.0)
        beside = pool.submit(_completion, stack1, seed=7, **body)
        assert beside.result()["choices"][0]["text"] == first
        assert other.result()["usage"]["completion_tokens"] == 40


def test_vllm_structured_outputs_constrain_the_answer(stack1):
    """vLLM's guided_json / guided_choice / guided_regex and its newer ``structured_outputs``
    object (clients written for vLLM send them) were ignored: the demo model's random weights
    answered gibberish. Now each constrains the answer as response_format does."""
    import re

    def answer(**extra):
        status, _, raw = post(stack1.gateway.url + "/v1/chat/completions",
                              {"model": "demo-tiny", "messages": [{"role": "user", "content": words(12, seed=8)}],
                               "max_tokens": 40, "temperature": 1.0, **extra})
        assert status == 200, raw
        out = json.loads(raw)["choices"][0]
        return out["message"]["content"], out["finish_reason"]

    for seed in range(3):
        assert answer(guided_choice=["yes", "no", "maybe later"], seed=seed) in (
            ("yes", "stop"), ("no", "stop"), ("maybe later", "stop"))
        text, reason = answer(guided_regex=r"[0-9]{3}-[a-z]{2}/x", seed=seed)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}/x", text) and reason == "stop", text
        text, _ = answer(structured_outputs={"choice": ["left", "right"]}, seed=seed)
        assert text in ("left", "right")
    # A bounded integer: an open one lets the random weights write digits until max_tokens (a
    # clean-clone run of session 44 read 42 of them, finish_reason length), as docs/api.md warns.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    for form in (schema, json.dumps(schema)):
        text, reason = answer(guided_json=form)
        assert reason == "stop" and list(json.loads(text)) == ["n"] and isinstance(json.loads(text)["n"], int), text
        assert 0 <= json.loads(text)["n"] <= 999, text


@pytest.mark.parametrize("body, param", [
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),  # llguidance's compile error, named
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),  # vLLM's GBNF: not our grammar language
    # a control token's text cannot be written as text: the answer stopped short (helper-79)
    ({"guided_regex": r"a<\|im_start\|>b"}, "guided_regex"),
    ({"guided_choice": ["x<|im_end|>y", "z"]}, "guided_choice"),
    ({"guided_regex": "<tool_call>.*"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs.choise"),  # a typo constrained nothing
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
])
def test_bad_structured_outputs_are_400(stack1, body, param):
    status, _, raw = post(stack1.gateway.url + "/v1/chat/completions",
                          {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param


def test_sampling_defaults_come_from_the_models_generation_config(tmp_path, redis_server, demo_model):
    """A request that sets no sampling got greedy decoding whatever the model's authors recommend
    (mlx_lm.server reads only the end-of-sequence ids in generation_config.json); vLLM applies the
    file's values, and so do we now, field by field; ``--sampling-defaults none`` keeps greedy and
    ``--default-temperature`` wins over the file."""
    from pathlib import Path

    model = tmp_path / "demo-tiny"
    model.mkdir()
    for f in Path(demo_model).iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    gc = json.loads((Path(demo_model) / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**gc, "temperature": 1.0, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.0, "min_p": "x"}))
    s = Stack(redis_server.url, str(model))
    try:
        b = s.add_backend("b0")
        plain = s.add_backend("b1", None, "--sampling-defaults", "none")
        hot = s.add_backend("b2", None, "--default-temperature", "0.5")
        for p in (b, plain, hot):
            p.wait_healthy()
        # greedy over the file keeps a penalty, which changes greedy answers too (helper-79: dropped)
        model2 = tmp_path / "penalised"
        model2.mkdir()
        for f in model.iterdir():
            (model2 / f.name).symlink_to(f.resolve()) if f.name != "generation_config.json" else None
        (model2 / "generation_config.json").write_text(json.dumps({**gc, "top_k": 20, "repetition_penalty": 1.5}))
        s2 = Stack(redis_server.url, str(model2), namespace=s.namespace + "x")
        cold = s2.add_backend("b3", None, "--default-temperature", "0")
        cold.wait_healthy()
        from mlxgw.httpget import get_json

        # repetition_penalty 1.0 is transformers' "none"; a min_p that is not a number is left out
        assert get_json(b.url + "/health")["sampling_defaults"] == {"temperature": 1.0, "top_p": 0.9, "top_k": 5}
        assert get_json(plain.url + "/health")["sampling_defaults"] == {}
        assert get_json(hot.url + "/health")["sampling_defaults"] == {"temperature": 0.5, "top_p": 0.9, "top_k": 5}
        assert get_json(cold.url + "/health")["sampling_defaults"] == {"temperature": 0.0, "repetition_penalty": 1.5}
        assert "min_p 'x' left out" in b.log_path.read_text()

        def text(p, **kw):
            status, _, raw = post(p.url + "/v1/completions", {"model": "demo-tiny", "prompt": words(30, seed=9),
                                                              "max_tokens": 12, "ignore_eos": True, **kw})
            assert status == 200, raw
            return json.loads(raw)["choices"][0]["text"]

        greedy = text(b, temperature=0)
        sampled = text(b, seed=4)
        assert sampled == text(b, seed=4, temperature=1.0, top_p=0.9, top_k=5) != greedy
        assert text(b, seed=4, top_k=1) == greedy  # a field the request sets wins, the rest still filled
        assert text(plain, seed=4) == greedy
        assert text(hot, seed=4) == text(hot, seed=4, temperature=0.5, top_p=0.9, top_k=5)
        assert text(cold) == text(cold, temperature=0, repetition_penalty=1.5)
    finally:
        s.stop()
        if "s2" in locals():
            s2.stop()


def _stream_text(stack1, **body) -> tuple[str, list[dict]]:
    status, _, raw = post(stack1.gateway.url + "/v1/completions",
                          {"model": "demo-tiny", "temperature": 0, "ignore_eos": True, "stream": True, **body})
    assert status == 200, raw
    chunks = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    return "".join(c["text"] for ch in chunks for c in ch["choices"]), chunks


def test_stop_token_ids_end_the_answer_with_the_token(stack1, model):
    """vLLM's ``stop_token_ids`` (dropped before: the answer ran on): the answer ends at the
    first of them generated, its text kept (not a special token), ``stop_reason`` its id."""
    ids = _prompt(model, 7)
    greedy, _ = _greedy(model, ids, 6)
    k = next(k for k in range(2, 6) if greedy[k] not in greedy[:k])
    want = _completion(stack1, prompt=ids, max_tokens=k + 1)["choices"][0]["text"]
    got = _completion(stack1, prompt=ids, max_tokens=6, stop_token_ids=[greedy[k]], logprobs=0)
    ch = got["choices"][0]
    assert (ch["text"], ch["finish_reason"], ch["stop_reason"]) == (want, "stop", greedy[k])
    assert len(ch["logprobs"]["tokens"]) == got["usage"]["completion_tokens"] == k + 1
    text, chunks = _stream_text(stack1, prompt=ids, max_tokens=6, stop_token_ids=[greedy[k]])
    assert text == want and chunks[-1]["choices"][0]["stop_reason"] == greedy[k]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(stack1, model):
    """vLLM's ``min_tokens``: a stop token is never sampled among the first ones (the model's
    next likeliest is), and a stop string written before them does not end the answer."""
    ids = _prompt(model, 8)
    greedy, _ = _greedy(model, ids, 1)
    second = _top(_logprobs(model, ids), 2)[1][0]
    got = _completion(stack1, prompt=ids, max_tokens=3, stop_token_ids=[greedy[0]], min_tokens=3,
                      return_tokens_as_token_ids=True, logprobs=0)["choices"][0]
    assert got["logprobs"]["tokens"][0] == f"token_id:{second}" and got["finish_reason"] == "length"
    # without min_tokens the same stop token ends the answer at once
    now = _completion(stack1, prompt=ids, max_tokens=3, stop_token_ids=[greedy[0]])["choices"][0]
    assert now["finish_reason"] == "stop" and now["stop_reason"] == greedy[0]

    full = _completion(stack1, prompt=ids, max_tokens=6, logprobs=0)["choices"][0]
    first = full["logprobs"]["tokens"][0].strip()
    assert first and full["text"].count(first) == 1, full  # a stop string only the first token writes
    assert _completion(stack1, prompt=ids, max_tokens=6, stop=[first])["choices"][0]["text"] == ""
    for stream in (False, True):
        body = dict(prompt=ids, max_tokens=6, stop=[first], min_tokens=1)
        text = _stream_text(stack1, **body)[0] if stream else _completion(stack1, **body)["choices"][0]["text"]
        assert text == full["text"], stream


def test_include_stop_str_in_output_keeps_the_stop_string(stack1, model):
    ids = _prompt(model, 9)
    full = _completion(stack1, prompt=ids, max_tokens=8)["choices"][0]["text"]
    stop = full[6:9]
    cut = full.index(stop)
    assert cut > 0
    assert _completion(stack1, prompt=ids, max_tokens=8, stop=[stop])["choices"][0]["text"] == full[:cut]
    for stream in (False, True):
        body = dict(prompt=ids, max_tokens=8, stop=[stop], include_stop_str_in_output=True)
        text = _stream_text(stack1, **body)[0] if stream else _completion(stack1, **body)["choices"][0]["text"]
        assert text == full[:cut + len(stop)], stream


def test_return_tokens_as_token_ids_names_the_ids(stack1, model):
    client = openai.OpenAI(base_url=stack1.gateway.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": words(20, seed=4)}]
    kw = dict(model="demo-tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
              extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    kw["extra_body"]["return_tokens_as_token_ids"] = True
    named = client.chat.completions.create(**kw).choices[0].logprobs.content
    text = TokenText(model[1])
    for p, n in zip(plain, named, strict=True):
        tid = int(n.token.removeprefix("token_id:"))
        assert n.token == f"token_id:{tid}" and text(tid)[0] == p.token and n.bytes == p.bytes
        assert n.top_logprobs[0].token == n.token


UNSUPPORTED = "unsupported_parameter"


@pytest.mark.parametrize("field,value,code", [
    ("min_tokens", 9, None), ("min_tokens", -1, None), ("stop_token_ids", [1, "2"], None),
    ("stop_token_ids", list(range(257)), None), ("stop_token_ids", [10**9], None),
    ("include_stop_str_in_output", "yes", None), ("use_beam_search", True, UNSUPPORTED),
    ("prompt_logprobs", 0, UNSUPPORTED), ("truncate_prompt_tokens", 100, UNSUPPORTED),
    # helper-80: accepted and ignored, each changing the answer or what it was asked to keep apart
    ("bad_words", "Brown", None), ("logits_processors", ["x"], UNSUPPORTED),
    ("vllm_xargs", {"a": 1}, UNSUPPORTED), ("prompt_embeds", "abc", UNSUPPORTED),
    ("return_token_ids", "yes", None), ("chat_template", "{{ messages[0].content }}", UNSUPPORTED),
    ("cache_salt", "alice", UNSUPPORTED), ("echo", True, UNSUPPORTED), ("best_of", 2, None),
    ("allowed_token_ids", [], None), ("allowed_token_ids", [10**9], None), ("skip_special_tokens", "no", None),
    ("include_reasoning", 1, None),
])
def test_vllm_fields_that_cannot_be_applied_are_400s(stack1, field, value, code):
    status, _, raw = post(stack1.gateway.url + "/v1/chat/completions",
                          {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                           field: value})
    err = json.loads(raw)["error"]
    assert (status, err["param"], err["code"]) == (400, field, code), raw


def _token_id(model, text: str) -> int:
    (tid,) = model[1].encode(text, add_special_tokens=False)
    return tid


def test_completions_text_is_the_raw_text(stack1, model):
    """helper-80: on /v1/completions a ``<think>`` the model wrote swallowed the rest of the text
    (reasoning taken out, with no field to put it in); the legacy answer is the text as written."""
    think = _token_id(model, "<think>")
    got = _completion(stack1, prompt=_prompt(model, 11), max_tokens=3, logit_bias={str(think): 100}, logprobs=0)
    ch = got["choices"][0]
    assert ch["text"] == "<think>" * 3 and ch["logprobs"]["tokens"] == ["<think>"] * 3, ch


def test_top_p_zero_keeps_only_the_likeliest_token(stack1, model):
    """OpenAI's meaning, the narrowest nucleus: greedy. mlx-lm reads 0 as no nucleus (helper-80:
    the most random answer for the most restrictive setting)."""
    ids = _prompt(model, 12)
    greedy = _completion(stack1, prompt=ids, max_tokens=8)["choices"][0]["text"]
    for seed in (1, 2):
        assert _completion(stack1, prompt=ids, max_tokens=8, temperature=1, top_p=0, seed=seed)["choices"][0][
            "text"] == greedy


def test_negative_seeds_are_their_own(stack1, model):
    """helper-80: seed -1 answered as seed 1 (Python's Random takes the absolute value)."""
    ids = _prompt(model, 13)

    def answer(seed):
        return _completion(stack1, prompt=ids, max_tokens=12, temperature=1, seed=seed)["choices"][0]["text"]

    minus = answer(-1)
    assert minus == answer(-1) and minus != answer(1)


def test_min_tokens_without_max_tokens_is_met(stack1, model):
    """helper-80: min_tokens 600 without max_tokens stopped at the 512-token default."""
    got = _completion(stack1, prompt=_prompt(model, 14), min_tokens=600)
    assert got["usage"]["completion_tokens"] == 600 and got["choices"][0]["finish_reason"] == "length"


def test_allowed_token_ids_are_all_that_is_sampled(stack1, model):
    ids, allowed = _prompt(model, 15), [_token_id(model, w) for w in (" the", " a", ".")]
    got = _completion(stack1, prompt=ids, max_tokens=12, temperature=1, seed=5, allowed_token_ids=allowed,
                      logprobs=0, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert {int(t.removeprefix("token_id:")) for t in got["tokens"]} <= set(allowed) and len(got["tokens"]) == 12
    # the offsets index the answer's text, not the "token_id:N" names
    plain = _completion(stack1, prompt=ids, max_tokens=12, temperature=1, seed=5, allowed_token_ids=allowed,
                        logprobs=0)["choices"][0]["logprobs"]
    assert got["text_offset"] == plain["text_offset"]


def test_continuous_usage_stats_count_every_chunk(stack1, model):
    _, chunks = _stream_text(stack1, prompt=_prompt(model, 16), max_tokens=6,
                             stream_options={"include_usage": True, "continuous_usage_stats": True})
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted == sorted(counted) and counted[-1] == 6 and len(counted) >= 6, counted
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)
    _, plain = _stream_text(stack1, prompt=_prompt(model, 16), max_tokens=6, stream_options={"include_usage": True})
    assert [c.get("usage") is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_include_reasoning_false_leaves_the_reasoning_out(stack1, model):
    think = _token_id(model, "<think>")
    body = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "logit_bias": {str(think): 100}}
    url = stack1.gateway.url + "/v1/chat/completions"
    msg = json.loads(post(url, body)[2])["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "<think>" * 3, msg
    msg = json.loads(post(url, {**body, "include_reasoning": False})[2])["choices"][0]["message"]
    assert "reasoning" not in msg and "reasoning_content" not in msg and msg["content"] == "", msg


def test_special_tokens_text_is_skipped_unless_asked_for(stack1, model):
    """vLLM's skip_special_tokens (default true): helper-80 read "<|im_end|><|im_end|>..." in an
    ignore_eos answer. The reasoning and tool-call markers stay text (mlx-lm parses by them)."""
    eos = model[1].eos_token_id
    body = dict(prompt=_prompt(model, 17), max_tokens=3, logit_bias={str(eos): 100}, logprobs=0)
    got = _completion(stack1, **body)["choices"][0]
    assert got["text"] == "" and got["logprobs"]["tokens"] == ["<|im_end|>"] * 3, got
    kept = _completion(stack1, skip_special_tokens=False, **body)["choices"][0]
    assert kept["text"] == "<|im_end|>" * 3, kept
    # A request with tools skips none, as vLLM's tool parsers ask (a format's calls may hold
    # special tokens); one without is skipped on chat too.
    chat = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    url = stack1.gateway.url + "/v1/chat/completions"
    assert json.loads(post(url, chat)[2])["choices"][0]["message"]["content"] == ""
    with_tools = json.loads(post(url, {**chat, "tools": [tool]})[2])["choices"][0]["message"]
    assert with_tools["content"] == "<|im_end|>" * 3, with_tools


def test_a_finished_choice_carries_stop_reason_null(stack1, model):
    """vLLM sends ``stop_reason: null`` when no stop string or token ended the answer (helper-80:
    the key was absent, and a client's ``choice["stop_reason"]`` raised KeyError)."""
    ch = _completion(stack1, prompt=_prompt(model, 18), max_tokens=2)["choices"][0]
    assert ch["finish_reason"] == "length" and ch["stop_reason"] is None
    _, chunks = _stream_text(stack1, prompt=_prompt(model, 18), max_tokens=2)
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and "stop_reason" in last and last["stop_reason"] is None
    assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1])


def test_min_tokens_past_the_context_left_is_what_fits(stack1, model):
    """The gateway lowers a max_tokens past the context to what is left; min_tokens goes down
    with it (the backend refuses a min_tokens above max_tokens)."""
    ids = (_prompt(model, 10) * 300)[:8190]  # 2 tokens of the 8192-token context left
    got = _completion(stack1, prompt=ids, max_tokens=10, min_tokens=8)
    assert (got["usage"]["completion_tokens"], got["choices"][0]["finish_reason"]) == (2, "length")


def test_responses_take_the_chat_sampling_fields(stack1):
    """vLLM's Responses endpoint takes its sampling extensions; they were dropped here, wrong
    values and all (helper-80: seed, top_k, stop, min_tokens...), and any include item passed."""
    client = openai.OpenAI(base_url=stack1.gateway.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="demo-tiny", input=words(20, seed=19), max_output_tokens=8, temperature=1)

    def text(**extra):
        return client.responses.create(**kw, extra_body={"ignore_eos": True, **extra}).output[0].content[0].text

    greedy = client.responses.create(**{**kw, "temperature": 0}, extra_body={"ignore_eos": True}).output[0]
    assert text(seed=3) == text(seed=3) != text(seed=4)
    assert text(top_k=1, seed=3) == greedy.content[0].text
    for extra, param in (({"seed": "x"}, "seed"), ({"min_tokens": -5}, "min_tokens"),
                         ({"cache_salt": "a"}, "cache_salt")):
        with pytest.raises(openai.BadRequestError) as err:
            text(**extra)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**kw, include=["bogus.thing"])
    assert err.value.body["param"] == "include[0]"


def test_bad_words_are_never_written(stack1, model):
    """vLLM's ``bad_words`` (refused before, ignored before that): a one-token word's token is
    never sampled (the model's next likeliest is), and a longer word's last token is masked
    where the answer ends with the rest of it, so the answer never holds the word."""
    ids = _prompt(model, 20)
    greedy, _ = _greedy(model, ids, 8)
    text = model[1].decode
    one = text([greedy[0]]).strip()
    (tid,) = model[1].encode(one, add_special_tokens=False) or (None,)
    assert tid is not None
    got = _completion(stack1, prompt=ids, max_tokens=1, bad_words=[one], logprobs=0,
                      return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["tokens"]
    banned = {tid, *model[1].encode(" " + one, add_special_tokens=False)[:1]}
    assert int(got[0].removeprefix("token_id:")) not in banned
    # a two-token word the greedy answer writes: banned, the answer goes around it
    plain = _completion(stack1, prompt=ids, max_tokens=8)["choices"][0]["text"]
    word = text(greedy[2:4]).strip()
    assert word and word in plain, (word, plain)
    assert word not in _completion(stack1, prompt=ids, max_tokens=8, bad_words=[word])["choices"][0]["text"]


def test_return_token_ids_gives_the_prompt_and_answer_ids(stack1, model):
    """vLLM's ``return_token_ids`` (for clients that must not tokenize the text back, RL agent
    loops): the answer's ids on its choice, the prompt's on the answer (chat) or the choice
    (completions); streamed, each chunk's ids and the prompt's on the first."""
    ids = _prompt(model, 21)
    greedy, _ = _greedy(model, ids, 5)
    got = _completion(stack1, prompt=ids, max_tokens=5, return_token_ids=True)["choices"][0]
    assert (got["token_ids"], got["prompt_token_ids"]) == (greedy, ids)
    _, chunks = _stream_text(stack1, prompt=ids, max_tokens=5, return_token_ids=True)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == greedy
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    # chat: the rendered prompt's ids at the top level, as the gateway tokenized it
    url = stack1.gateway.url + "/v1/chat/completions"
    chat = {"model": "demo-tiny", "messages": [{"role": "user", "content": words(20, seed=21)}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = json.loads(post(url, chat)[2])
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert len(whole["choices"][0]["token_ids"]) == whole["usage"]["completion_tokens"] == 4
    assert whole["prompt_token_ids"][:len(ids)] != ids  # the chat template's, not the raw text's
    raw = post(url, {**chat, "stream": True})[2].decode()
    streamed = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: {")]
    assert streamed[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert json.loads(post(url, {**chat, "return_token_ids": False})[2])["choices"][0].get("token_ids") is None


@pytest.mark.parametrize("extra", [{"guided_choice": ["yes", "no"]},
                                   {"response_format": {"type": "json_object"}},
                                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                    "tool_choice": "required"}])
def test_allowed_token_ids_beside_a_grammar_is_a_400(stack1, extra):
    """Two masks that may share no token: the answer broke the grammar it was promised
    (helper-83: guided_choice yes/no with two other ids allowed answered "!!!!!!!!!!")."""
    status, _, raw = post(stack1.gateway.url + "/v1/chat/completions",
                          {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                           "allowed_token_ids": [5, 6], **extra})
    err = json.loads(raw)["error"]
    assert (status, err["param"]) == (400, "allowed_token_ids"), raw
    assert "cannot be combined with structured outputs" in err["message"]


def test_one_token_bad_words_read_nothing_back():
    """A ``bad_words`` list of one-token words is a fixed mask: no sampled token is read back
    (each read is a sync in MLX's pipelined decode); a longer word reads them to match its start."""
    from backend.processors import BadWords

    logits = mx.zeros((1, 10))
    one = BadWords([[5], [7]])
    for step in range(3):
        out = one(mx.array([1, 2, 3 + step]), logits)
    assert (one.calls, one.generated) == (0, [])
    assert [i for i, v in enumerate(out[0].tolist()) if v == float("-inf")] == [5, 7]
    longer = BadWords([[4, 6]])
    longer(mx.array([1]), logits)
    out = longer(mx.array([1, 4]), logits)  # the answer so far ends with the word's first token
    assert longer.generated == [4]
    assert [i for i, v in enumerate(out[0].tolist()) if v == float("-inf")] == [6]
