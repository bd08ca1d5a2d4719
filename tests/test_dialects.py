"""Acceptance (issue 6): chat with tools, Anthropic Messages and OpenAI Responses through
the running stack, driven by the official openai and anthropic SDKs."""

import json
import re
import time

import anthropic
import http.client
from urllib.parse import urlsplit
import openai
import pytest

from texts import words

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False},
}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
ANTHROPIC_TOOLS = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}, {"type": "web_search_preview"}]


@pytest.fixture(scope="module")
def stack(stack2):
    return stack2


def _oai(stack):
    return openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key="unused", max_retries=0)


def _ant(stack, **kw):
    return anthropic.Anthropic(base_url=stack.gateway.url, api_key="unused", max_retries=0, **kw)


def _health(stack):
    from mlxgw.httpget import get_json

    return get_json(stack.gateway.url + "/health")


def test_chat_forced_tool_call_not_streamed(stack):
    c = _oai(stack).chat.completions.create(
        model="demo-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64)
    ch = c.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id), call.id
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert 0 <= c.usage.prompt_tokens_details.cached_tokens <= c.usage.prompt_tokens - 1  # present, honest


def test_chat_forced_tool_call_streamed_deltas(stack):
    chunks = list(_oai(stack).chat.completions.create(
        model="demo-tiny", messages=[{"role": "user", "content": "Weather?"}], tools=CHAT_TOOLS,
        tool_choice="required", max_tokens=64, stream=True, stream_options={"include_usage": True}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert all("<tool_call>" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    args = json.loads("".join(d.function.arguments for d in rest))
    assert args["city"] in ("Paris", "Oslo")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert 0 <= last.usage.prompt_tokens_details.cached_tokens <= last.usage.prompt_tokens - 1


def test_anthropic_messages_streamed_and_not(stack):
    client = _ant(stack)
    system = [{"type": "text", "text": words(300, seed=41)}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    raw = client.messages.with_raw_response.create(model="demo-tiny", max_tokens=8, system=system, messages=msgs,
                                                   extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    m = raw.parse()
    prompt = int(raw.headers["x-mlxgw-prompt-tokens"])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    assert m.content[0].type == "text" and m.content[0].text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt

    # Turn 2 streamed: the reused prefix is cache_read_input_tokens, not input_tokens.
    msgs += [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": "and then?"}]
    with client.messages.stream(model="demo-tiny", max_tokens=8, system=system, messages=msgs) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].type == "text" and final.content[0].text
    assert final.usage.output_tokens == 8
    assert final.usage.cache_read_input_tokens >= prompt - stack.block_size
    assert final.usage.input_tokens > 0 and final.usage.input_tokens < 40


def test_anthropic_stop_sequence_is_reported(stack):
    """A stop sequence ends the answer with stop_reason "stop_sequence" and names it, as
    Anthropic's API does (it said end_turn and null before session 22). The demo model is
    greedy, so the stop is taken from its own unstopped answer."""
    client = _ant(stack)
    msgs = [{"role": "user", "content": "go on"}]
    text = client.messages.create(model="demo-tiny", max_tokens=12, messages=msgs).content[0].text
    stop = text[4:8]
    before = text[: text.index(stop)]
    m = client.messages.create(model="demo-tiny", max_tokens=12, messages=msgs, stop_sequences=["\x00none", stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop), m
    assert "".join(b.text for b in m.content) == before
    with client.messages.stream(model="demo-tiny", max_tokens=12, messages=msgs, stop_sequences=[stop]) as st:
        final = st.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop), final
    assert "".join(b.text for b in final.content) == before
    # Without a matching stop sequence: no stop_sequence.
    m = client.messages.create(model="demo-tiny", max_tokens=12, messages=msgs, stop_sequences=["\x00none"])
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)


def test_anthropic_tool_use_round_trip(stack):
    client = _ant(stack)
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    m = client.messages.create(model="demo-tiny", max_tokens=64, messages=msgs, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", use.id), use.id

    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    with client.messages.stream(model="demo-tiny", max_tokens=8, messages=msgs, tools=ANTHROPIC_TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.cache_read_input_tokens > 0

    # Streamed forced call: input_json_delta pieces assemble into the input.
    with client.messages.stream(model="demo-tiny", max_tokens=64, messages=msgs[:1], tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any"}) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        final = s.get_final_message()
    assert "input_json_delta" in deltas
    assert final.stop_reason == "tool_use" and final.content[-1].input["city"] in ("Paris", "Oslo")
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", final.content[-1].id), final.content[-1].id


def test_count_tokens_is_the_real_prompt(stack, demo_model):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(__import__("pathlib").Path(demo_model))
    system, user = words(50, seed=3), "count me"
    n = _ant(stack).messages.count_tokens(model="demo-tiny", system=system,
                                          messages=[{"role": "user", "content": user}], tools=ANTHROPIC_TOOLS)
    want = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                   tools=CHAT_TOOLS, add_generation_prompt=True)
    assert n.input_tokens == len(want)


def test_anthropic_tool_result_error_reaches_the_prompt(stack, demo_model):
    """helper-71: `is_error` was dropped, so a failed tool read like a successful one. Chat
    templates have no such flag: the result text says so, as the model's prompt shows."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(__import__("pathlib").Path(demo_model))
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Oslo"}}]}

    def count(**extra):
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "city not found", **extra}
        return _ant(stack).messages.count_tokens(model="demo-tiny", tools=ANTHROPIC_TOOLS, messages=[
            {"role": "user", "content": "Weather?"}, call, {"role": "user", "content": [result]}]).input_tokens

    def want(text):
        return len(tok.apply_chat_template([
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": text}], tools=CHAT_TOOLS, add_generation_prompt=True))

    assert count() == count(is_error=False) == want("city not found")
    assert count(is_error=True) == want("Error: city not found") > count()
    with pytest.raises(anthropic.BadRequestError) as e:
        count(is_error="yes")
    assert e.value.body["error"]["message"] == "'messages[2].content[0].is_error' must be a boolean"


def test_anthropic_length_stop_at_the_context_is_model_context_window_exceeded(stack):
    """helper-71: a max_tokens the gateway lowered to the context left ended with stop_reason
    `max_tokens` after 20 of the 100 tokens asked; Anthropic's API says
    `model_context_window_exceeded` then. A max_tokens of the client's own is still `max_tokens`."""
    client = _ant(stack)
    n_words, prompt = 4000, 0
    for _ in range(6):  # a prompt within a few tokens of the 8192-token context
        msgs = [{"role": "user", "content": words(n_words, seed=71)}]
        prompt = client.messages.count_tokens(model="demo-tiny", messages=msgs).input_tokens
        if 8150 <= prompt <= 8180:
            break
        n_words = max(1, n_words + (8165 - prompt) * n_words // prompt)
    assert 8150 <= prompt <= 8180, prompt
    capped = client.messages.create(model="demo-tiny", max_tokens=100, messages=msgs)
    left = 8192 - prompt
    assert capped.usage.output_tokens <= left
    # a length stop here is the context's; an end-of-turn before it stays end_turn
    assert (capped.stop_reason == "model_context_window_exceeded") == (capped.usage.output_tokens == left), capped
    assert capped.stop_reason in ("model_context_window_exceeded", "end_turn"), capped
    own = client.messages.create(model="demo-tiny", max_tokens=1, messages=msgs)
    assert (own.stop_reason, own.usage.output_tokens) == ("max_tokens", 1), own


def test_anthropic_prefill_is_continued(stack, demo_model):
    """A trailing assistant message is Anthropic's prefill: the reply continues it, so the prompt
    ends inside that turn (transformers' ``continue_final_message``). It was closed as a turn of
    its own and a new assistant turn opened, so the prefill steered nothing (helper-60)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(__import__("pathlib").Path(demo_model))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(want).endswith("The answer is")
    r = _ant(stack).messages.create(model="demo-tiny", max_tokens=2, messages=msgs)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(want)  # input_tokens excludes cache reads
    assert _ant(stack).messages.count_tokens(model="demo-tiny", messages=msgs).input_tokens == len(want)
    # A final assistant turn of tool calls only is no prefill: a new turn opens after it.
    calls = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]}]
    n = _ant(stack).messages.count_tokens(model="demo-tiny", messages=calls, tools=ANTHROPIC_TOOLS).input_tokens
    oai = [calls[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function",
           "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]}]
    assert n == len(tok.apply_chat_template(oai, tools=CHAT_TOOLS, add_generation_prompt=True))


def test_client_turn_flags_are_honoured(stack, demo_model):
    """``add_generation_prompt`` in ``chat_template_kwargs`` and vLLM's top-level
    ``continue_final_message`` reach the template. The client's ``add_generation_prompt`` was
    dropped (a new assistant turn was always opened), so a client rendering a raw continuation
    got one more turn header than it asked for."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(__import__("pathlib").Path(demo_model))
    msgs = [{"role": "user", "content": words(30, seed=91)}]
    closed = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert len(closed) < len(tok.apply_chat_template(msgs, add_generation_prompt=True))
    r = _oai(stack).chat.completions.create(model="demo-tiny", messages=msgs, max_tokens=1,
                                            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.usage.prompt_tokens == len(closed)
    prefill = msgs + [{"role": "assistant", "content": "The answer is"}]
    want = tok.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    r = _oai(stack).chat.completions.create(model="demo-tiny", messages=prefill, max_tokens=1,
                                            extra_body={"continue_final_message": True})
    assert r.usage.prompt_tokens == len(want)


def test_same_conversation_in_three_dialects_shares_one_prefix(stack):
    """Three turns (text, a tool call and its result) in each dialect: same tokens, backend and cache."""
    oai, ant = _oai(stack), _ant(stack)
    system, u1, a1, u2 = words(600, seed=77), words(20, seed=78), "Noted.", "Weather in Paris?"
    drift0 = _health(stack)["prefix_drift"]

    def chat(turn):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": u1}]
        if turn >= 2:
            msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        if turn >= 3:
            msgs += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        raw = oai.chat.completions.with_raw_response.create(model="demo-tiny", messages=msgs, tools=CHAT_TOOLS,
                                                            max_tokens=4)
        u = raw.parse().usage
        return raw.headers, u.prompt_tokens, u.prompt_tokens_details.cached_tokens

    def messages(turn):
        msgs = [{"role": "user", "content": u1}]
        if turn >= 2:
            msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        if turn >= 3:
            msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}]
        raw = ant.messages.with_raw_response.create(model="demo-tiny", max_tokens=4, system=system, messages=msgs,
                                                    tools=ANTHROPIC_TOOLS)
        u = raw.parse().usage
        return raw.headers, u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens

    def responses(turn):
        items = [{"role": "user", "content": u1}]
        if turn >= 2:
            items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": a1}]},
                      {"role": "user", "content": [{"type": "input_text", "text": u2}]}]
        if turn >= 3:
            items += [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                      {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
        raw = oai.responses.with_raw_response.create(model="demo-tiny", instructions=system, input=items,
                                                     tools=RESPONSES_TOOLS, max_output_tokens=4)
        u = raw.parse().usage
        return raw.headers, u.input_tokens, u.input_tokens_details.cached_tokens

    backends, prev = set(), 0
    for turn in (1, 2, 3):
        results = [f(turn) for f in (chat, messages, responses)]
        prompts = {p for _, p, _ in results}
        assert len(prompts) == 1, f"turn {turn}: dialects rendered different prompts {prompts}"
        (prompt,) = prompts
        for i, (headers, p, cached) in enumerate(results):
            backends.add(headers["x-mlxgw-backend"])
            assert int(headers["x-mlxgw-prompt-tokens"]) == prompt
            if i == 0:  # first time this prompt is seen: the previous turn's prompt is reused
                assert (cached >= prev - stack.block_size) if turn > 1 else cached < 20, (turn, results)
            else:  # the same prompt again from another dialect: all but one token reused
                assert cached == prompt - 1
                assert int(headers["x-mlxgw-matched-tokens"]) >= prompt - stack.block_size
        assert prompt > prev
        prev = prompt
    assert len(backends) == 1
    assert _health(stack)["prefix_drift"] == drift0


def test_responses_stream_and_function_call(stack):
    client = _oai(stack)
    events = list(client.responses.create(model="demo-tiny", input="hello", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.incomplete"  # max_output_tokens reached
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert done.output[0].content[0].text == text and text
    # The item max_output_tokens cut is incomplete too (OpenAI's Responses API does so),
    # in the final response and in its output_item.done event.
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert [it.status for it in done.output] == ["incomplete"]
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    full = client.responses.create(model="demo-tiny", input="hello", max_output_tokens=6)
    assert full.status == "incomplete" and [it.status for it in full.output] == ["incomplete"]
    whole = client.responses.create(model="demo-tiny", input="Weather?", tools=RESPONSES_TOOLS, max_output_tokens=64,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert whole.status == "completed" and [it.status for it in whole.output] == ["completed"]
    (fc,) = whole.output
    assert re.fullmatch(r"call_[0-9a-f]{24}", fc.call_id) and re.fullmatch(r"fc_[0-9a-f]{24}", fc.id), fc
    assert done.usage.output_tokens == 6
    assert 0 <= done.usage.input_tokens_details.cached_tokens <= done.usage.input_tokens - 1
    # The SDK's own model, strictly: cache_write_tokens is a required field (it was missing).
    from openai.types.responses import Response

    for r in (done, full, whole):
        assert Response.model_validate(r.to_dict()).usage.input_tokens_details.cache_write_tokens == 0

    with client.responses.stream(model="demo-tiny", input="Weather?", tools=RESPONSES_TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.delta" in kinds
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")


PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}


def test_responses_custom_tools_are_offered_and_their_calls_come_back_as_custom_calls(stack):
    """helper-71: a `custom` (freeform) tool, Codex's apply_patch, was dropped from the prompt, and
    forcing it gave an ordinary message. It is offered as a function of one string `input`, and its
    call comes back as a `custom_tool_call` item, streamed or not; its items go back in as input.
    (The demo model's free strings never end, so the call itself comes from a forced chat call
    whose `input` is bounded, the backend's real answer, through the dialect's transform.)"""
    from openai.types.responses import Response

    from gateway.dialects.responses import ResponsesTransform
    from mlxgw.httpget import post

    client = _oai(stack)
    bare = client.responses.create(model="demo-tiny", input="Fix it", max_output_tokens=1)
    offered = client.responses.create(model="demo-tiny", input="Fix it", max_output_tokens=1, tools=[PATCH_TOOL])
    assert offered.usage.input_tokens > bare.usage.input_tokens + 10, (offered.usage, bare.usage)
    forced = client.responses.create(model="demo-tiny", input="Fix it", tools=[PATCH_TOOL], max_output_tokens=20,
                                     tool_choice={"type": "custom", "name": "apply_patch"})
    assert forced.output[0].content[0].text.startswith('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "')
    patch = "*** Begin Patch\n*** End Patch"
    chat = {"model": "demo-tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Fix it"}],
            "tools": [{"type": "function", "function": {"name": "apply_patch", "parameters": {
                "type": "object", "properties": {"input": {"type": "string", "enum": [patch]}}, "required": ["input"]}}}],
            "tool_choice": {"type": "function", "function": {"name": "apply_patch"}}}
    request = {"model": "demo-tiny", "tools": [PATCH_TOOL]}
    status, _, body = post(stack.gateway.url + "/v1/chat/completions", chat)
    assert status == 200, body
    whole = Response.model_validate(ResponsesTransform(False, "demo-tiny", request).convert_full(json.loads(body)))
    (call,) = whole.output
    assert (call.type, call.name, call.input, whole.status) == ("custom_tool_call", "apply_patch", patch,
                                                                "completed"), whole.output
    assert re.fullmatch(r"ctc_[0-9a-f]{24}", call.id) and call.call_id.startswith("call_"), call
    status, headers, raw = post(stack.gateway.url + "/v1/chat/completions", {**chat, "stream": True})
    assert status == 200
    t = ResponsesTransform(True, "demo-tiny", request)
    t.begin(200, headers, {})
    events = [json.loads(ln[6:]) for ln in (t.feed(raw) + t.end()).decode().splitlines() if ln.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[-5:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                          "response.custom_tool_call_input.done", "response.output_item.done",
                          "response.completed"], kinds
    assert events[-4]["delta"] == events[-3]["input"] == patch
    (scall,) = Response.model_validate(events[-1]["response"]).output
    assert (scall.type, scall.input) == ("custom_tool_call", patch)
    # The call and its output, sent back as input items, are the conversation's next turn.
    turn2 = client.responses.create(model="demo-tiny", tools=[PATCH_TOOL], max_output_tokens=1, input=[
        {"type": "message", "role": "user", "content": "Fix it"},
        {"type": "custom_tool_call", "call_id": scall.call_id, "name": "apply_patch", "input": scall.input},
        {"type": "custom_tool_call_output", "call_id": scall.call_id, "output": "Done!"}])
    assert turn2.status == "incomplete" and turn2.usage.input_tokens > offered.usage.input_tokens + 10


def test_errors_in_each_dialect(stack):
    with pytest.raises(anthropic.NotFoundError) as e:
        _ant(stack).messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    body = dict(e.value.body)
    rid = body.pop("request_id")  # in the body and the header, as Anthropic's API (helper-71: none)
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": "the model 'nope' does not exist"}}
    assert len(rid) == 32 and e.value.request_id == rid
    with pytest.raises(openai.NotFoundError) as oe:
        _oai(stack).chat.completions.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert len(oe.value.request_id) == 32
    with pytest.raises(anthropic.BadRequestError) as e:
        _ant(stack).messages.create(model="demo-tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                    tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "missing"})
    # Raised by the backend in OpenAI form, normalized by the gateway.
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "missing" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        _ant(stack).messages.create(model="demo-tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _oai(stack).responses.create(model="demo-tiny", input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "unsupported_parameter"
    for kw, param in (({"conversation": "conv_1"}, "conversation"), ({"background": True}, "background"),
                      ({"extra_body": {"n": 2}}, "n")):  # chat's n: a response has one output
        with pytest.raises(openai.BadRequestError) as e:  # ignored, or answered at once, before (helper-71)
            _oai(stack).responses.create(model="demo-tiny", input="x", **kw)
        assert (e.value.body["param"], e.value.body["code"]) == (param, "unsupported_parameter"), e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # the error names the Responses field, not ours
        _oai(stack).responses.create(model="demo-tiny", input="x", max_output_tokens="x")
    assert e.value.body["param"] == "max_output_tokens"
    assert e.value.body["message"] == "'max_output_tokens' must be an integer"
    with pytest.raises(openai.BadRequestError) as e:  # named `response_format` before (helper-71)
        _oai(stack).responses.create(model="demo-tiny", input="x", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})
    assert e.value.body["param"] == "text.format", e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # named `messages` before (helper-60)
        _oai(stack).responses.create(model="demo-tiny", input=words(9000, seed=5))
    assert (e.value.body["param"], e.value.body["code"]) == ("input", "context_length_exceeded")
    conn = http.client.HTTPConnection(urlsplit(stack.gateway.url).netloc, timeout=30)
    conn.request("POST", "/v1/messages", body=b"{not json", headers={"x-api-key": "k"})
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["type"] == "error"


def test_models_give_the_context_and_answers_the_sdks_request_id(stack):
    """helper-71: the context length was in no model listing (agents assume 200k and never
    compact in time), the Anthropic SDK got OpenAI's shape, and both SDKs' `_request_id` was None."""
    (m,) = _oai(stack).models.list().data
    assert (m.id, m.model_extra["max_model_len"]) == ("demo-tiny", 8192), m
    page = _ant(stack).models.list()
    (a,) = page.data
    assert (a.type, a.id, a.display_name, a.max_input_tokens, page.has_more) == ("model", "demo-tiny", "demo-tiny",
                                                                                  8191, False), a
    assert _ant(stack).models.retrieve("demo-tiny").max_input_tokens == 8191
    r = _oai(stack).chat.completions.with_raw_response.create(
        model="demo-tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    rid = r.headers["X-Mlxgw-Request-Id"]
    assert len(rid) == 32 and r.parse()._request_id == rid
    msg = _ant(stack).messages.create(model="demo-tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert len(msg._request_id) == 32, msg._request_id


def test_response_format_json_schema_and_json_object(stack):
    """The openai SDK's structured outputs: the answer is JSON of the schema (constrained
    decoding; the demo model's random weights alone would write gibberish)."""
    from typing import Literal

    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Oslo"]
        sunny: bool

    msgs = [{"role": "user", "content": "Weather in Paris, as JSON?"}]
    c = _oai(stack).chat.completions.parse(model="demo-tiny", messages=msgs, response_format=Weather, max_tokens=64)
    assert c.choices[0].finish_reason == "stop"
    assert isinstance(c.choices[0].message.parsed, Weather)
    assert c.choices[0].message.content == c.choices[0].message.parsed.model_dump_json().replace(",", ", ").replace(
        ":", ": ")  # compact JSON with the model's usual separators
    r = _oai(stack).responses.parse(model="demo-tiny", input="Weather in Oslo?", text_format=Weather,
                                    max_output_tokens=64)
    assert isinstance(r.output_parsed, Weather) and r.text.format.type == "json_schema"
    for stream in (False, True):
        out = _oai(stack).chat.completions.create(model="demo-tiny", messages=msgs, max_tokens=48, stream=stream,
                                                  response_format={"type": "json_object"})
        text = "".join(ch.choices[0].delta.content or "" for ch in out if ch.choices) if stream else \
            out.choices[0].message.content
        assert text.startswith("{"), text
        if not stream and out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


USER = {"role": "user", "content": "x"}
MALFORMED = [  # (path, body, param): each once crashed the conversion (500) or was silently accepted
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": []}]}]},
     "messages[1].content[0].text"),
    ("/v1/messages", {"system": [{"type": "text", "text": 5}], "messages": [USER]}, "system[0].text"),
    ("/v1/messages", {"system": [5, "x"], "messages": [USER]}, "system[0]"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": 5}]}]}]},
     "messages[0].content[0].content[0].text"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}]},
     "messages[0].content[0].tool_use_id"),
    ("/v1/messages", {"messages": [USER], "stop_sequences": [5]}, "stop_sequences"),
    ("/v1/messages", {"messages": [USER], "tools": [{"name": "f", "input_schema": "zz"}]}, "tools[0].input_schema"),
    ("/v1/messages", {"messages": [USER], "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ("/v1/messages", {"messages": [USER], "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text"),
    ("/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c1",
                                  "output": [{"type": "input_text", "text": 5}]}]}, "input[0].output[0].text"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name"),
    ("/v1/responses", {"input": "x", "tool_choice": "required", "tools": [{"type": "web_search_preview"}]},
     "tool_choice"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format.schema"),
    # Session 22's SDK trial: each was answered 200.
    ("/v1/messages", {"messages": [USER], "tools": [{"name": "f", "input_schema": {"type": "string"}}],
                      "tool_choice": {"type": "tool", "name": "f"}}, "tools[0].input_schema"),
    ("/v1/messages", {"messages": [USER], "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ("/v1/messages", {"messages": [USER], "temperature": 3}, "temperature"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ("/v1/messages", {"messages": [USER], "metadata": "x"}, "metadata"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input[0].output"),
    ("/v1/responses", {"input": "x", "store": "x"}, "store"),
    # helper-60: named 'stop', 'None' ("block type 'None'", "tool_choice names 'None'").
    ("/v1/messages", {"messages": [USER], "stop_sequences": ["x"] * 17}, "stop_sequences"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages[0].content[0].type"),
    # helper-66: a 500 with a traceback (unhashable type), and a 200 that ignored it
    ("/v1/messages", {"messages": [USER], "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": []}}, "tool_choice.type"),
    ("/v1/messages", {"messages": [USER], "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": {}}}, "tool_choice.type"),
    ("/v1/responses", {"input": "x", "tool_choice": {"type": []}}, "tool_choice"),
    # helper-68: named text.format for a text that was no object; include unchecked; a chat tool's
    # shape told only that the name was missing
    ("/v1/responses", {"input": "x", "text": "x"}, "text"),
    ("/v1/responses", {"input": "x", "include": "x"}, "include"),
    ("/v1/responses", {"input": "x", "include": [5]}, "include"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]"),
]


@pytest.mark.parametrize("path,body,param", MALFORMED, ids=[m[2] + " " + m[0] for m in MALFORMED])
def test_malformed_dialect_bodies_get_a_400_naming_the_clients_field(stack, path, body, param):
    from mlxgw.httpget import post

    status, _, raw = post(stack.gateway.url + path, {"model": "demo-tiny", "max_tokens": 4, **body})
    err = json.loads(raw)
    assert status == 400, raw
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert f"'{param}'" in err["error"]["message"], err  # Anthropic errors have no param field
    else:
        assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error", err
        if "item_reference" in json.dumps(body):
            assert err["error"]["code"] == "unsupported_parameter"


def test_billing_header_stripped_and_drift_counted(stack):
    client = _ant(stack)
    body = words(200, seed=55)

    def system(cch):
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch={cch};"},
                {"type": "text", "text": body}]

    msgs = [{"role": "user", "content": "hi"}]
    n_plain = client.messages.count_tokens(model="demo-tiny", system=body, messages=msgs).input_tokens
    assert client.messages.count_tokens(model="demo-tiny", system=system("a1b2"), messages=msgs).input_tokens == n_plain
    m1 = client.messages.create(model="demo-tiny", max_tokens=4, system=system("a1b2"), messages=msgs)
    m2 = client.messages.create(model="demo-tiny", max_tokens=4, system=system("ffff"), messages=msgs)
    assert m1.usage.cache_read_input_tokens < 20  # at most the ChatML opening other prompts share
    assert m2.usage.cache_read_input_tokens == n_plain - 1

    # A date in the system prompt re-rendered on the next turn: counted as drift at its token.
    drift0 = _health(stack)["prefix_drift"]
    hist = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"}]
    client.messages.create(model="demo-tiny", max_tokens=2, system="Today is 2025-01-01. " + body,
                           messages=hist + [{"role": "user", "content": "q2"}])
    client.messages.create(model="demo-tiny", max_tokens=2, system="Today is 2025-01-02. " + body,
                           messages=hist + [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                                            {"role": "user", "content": "q3"}])
    assert _health(stack)["prefix_drift"] == drift0 + 1
    assert "prefix drift model=demo-tiny" in stack.gateway.tail(200)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_prefill_progress_reaches_every_dialects_stream(stack, path):
    """The backend's `: keepalive done/total` comments (one per 512-token prefill step) used to
    reach Anthropic and Responses streams as bare `: keepalive` lines: the progress was lost."""
    prompt = words(1500, seed=91 if path == "/v1/messages" else 92)  # several prefill steps
    body = {"model": "demo-tiny", "max_tokens": 2, "stream": True}
    body.update({"messages": [{"role": "user", "content": prompt}]} if path == "/v1/messages" else {"input": prompt})
    conn = http.client.HTTPConnection(urlsplit(stack.gateway.url).netloc, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    total = int(r.getheader("x-mlxgw-prompt-tokens"))
    text = r.read().decode()
    conn.close()
    progress = [tuple(map(int, m)) for m in re.findall(r"^: keepalive (\d+)/(\d+)$", text, re.M)]
    assert len(progress) >= 2 and {t for _, t in progress} == {total}, text[:500]
    assert [d for d, _ in progress] == sorted(d for d, _ in progress) and progress[-1][0] == total


def test_long_prefill_stream_sends_keepalives_before_first_token(redis_server, demo_model):
    """One 8192-token prefill step, so only the gateway's own keep-alives (every 0.25 s here) can fill it."""
    from mlxgw.harness import Stack

    s = Stack(redis_server.url, demo_model)
    try:
        s.add_backend("b0", None, "--prefill-step-size", "8192")
        s.add_gateway("--keepalive", "0.25")
        s.wait()
        body = {"model": "demo-tiny", "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": words(3000, seed=9)}]}
        lines, t0 = [], time.monotonic()
        conn = http.client.HTTPConnection(urlsplit(s.gateway.url).netloc, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.getheader("content-type").startswith("text/event-stream")
        assert r.getheader("cache-control") == "no-cache" and r.getheader("x-accel-buffering") == "no"
        prompt = int(r.getheader("x-mlxgw-prompt-tokens"))
        while True:
            line = r.readline().decode().strip()
            if line:
                lines.append((time.monotonic() - t0, line))
            if line.startswith("data:"):
                break
        conn.close()
        first_data = lines[-1][0]
        before = [(t, ln) for t, ln in lines[:-1] if ln.startswith(":")]
        assert prompt > 4500  # about 5 s of prefill in one step on a 2-core CPU
        assert first_data > 1.0, f"prefill took {first_data:.2f}s: too short to test keep-alives"
        assert len(before) >= 3
        gaps = [b - a for (a, _), (b, _) in zip([(0.0, "")] + before, before + [lines[-1]])]
        assert max(gaps) < 1.0, f"silence of {max(gaps):.2f}s before the first token"
    finally:
        s.stop()


def test_one_tool_call_asked_in_each_dialect_reaches_the_backend():
    """Anthropic's ``tool_choice.disable_parallel_tool_use`` and the Responses API's
    ``parallel_tool_calls: false`` become the chat request's ``parallel_tool_calls: false``
    (the backend then ends the answer at its first call: test_render); they were dropped."""
    from gateway.dialects import anthropic as a, responses as r
    from mlxgw.protocol import RequestError

    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    msgs = [{"role": "user", "content": "hi"}]
    one = a.to_chat({"model": "m", "max_tokens": 4, "messages": msgs, "tools": tools,
                     "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    assert one["parallel_tool_calls"] is False and one["tool_choice"] == "auto"
    assert "parallel_tool_calls" not in a.to_chat({"model": "m", "max_tokens": 4, "messages": msgs, "tools": tools,
                                                   "tool_choice": {"type": "auto"}})
    with pytest.raises(RequestError) as e:
        a.to_chat({"model": "m", "max_tokens": 4, "messages": msgs, "tools": tools,
                   "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}})
    assert e.value.param == "tool_choice.disable_parallel_tool_use"
    assert r.to_chat({"model": "m", "input": "hi", "parallel_tool_calls": False})["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in r.to_chat({"model": "m", "input": "hi", "parallel_tool_calls": True})


def test_anthropic_output_format_is_a_json_answer(stack2):
    """Anthropic's structured outputs (``output_format`` json_schema) were ignored: the demo model's
    random weights answered gibberish; now the answer is JSON of the schema (helper-79)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    client = anthropic.Anthropic(base_url=stack2.gateway.url, api_key="unused", max_retries=0)
    msg = client.messages.create(model="demo-tiny", max_tokens=30, messages=[{"role": "user", "content": "hi"}],
                                 extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(msg.content[0].text)["ok"], bool) and msg.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="demo-tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"output_format": {"type": "json_schema"}})


TIME = {"name": "get_time", "description": "Current local time in a city",  # an enum: the demo model ends its string
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Lima"]}}, "required": ["city"],
                       "additionalProperties": False}}


def test_allowed_tools_forces_a_call_among_them_with_every_tool_in_the_prompt(stack):
    """helper-92: OpenAI's ``allowed_tools`` tool_choice got a 400 naming a field the request did
    not have, from the backend after routing. ``required`` forces a call to one of the listed
    tools while the prompt keeps them all (its cached prefix); ``auto`` forces nothing."""
    from mlxgw.httpget import post

    client = _oai(stack)
    tools = CHAT_TOOLS + [{"type": "function", "function": TIME}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    only_time = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    forced = client.chat.completions.create(model="demo-tiny", messages=msgs, tools=tools, tool_choice=only_time,
                                            max_tokens=64)
    (call,) = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    assert json.loads(call.function.arguments)["city"] in ("Rome", "Lima")
    free = client.chat.completions.create(model="demo-tiny", messages=msgs, tools=tools, max_tokens=2, tool_choice={
        "type": "allowed_tools", "allowed_tools": {**only_time["allowed_tools"], "mode": "auto"}})
    assert free.usage.prompt_tokens == forced.usage.prompt_tokens  # every tool rendered either way
    # The Responses API's flat form; a built-in tool in the list is left out.
    r = client.responses.create(model="demo-tiny", input="Weather in Paris?", max_output_tokens=64,
                                tools=RESPONSES_TOOLS + [{"type": "function", **TIME}],
                                tool_choice={"type": "allowed_tools", "mode": "required", "tools": [
                                    {"type": "web_search_preview"}, {"type": "function", "name": "get_time"}]})
    (fc,) = r.output
    assert fc.type == "function_call" and fc.name == "get_time"
    # Refused by the gateway before a backend is chosen, naming the field at fault.
    bad = [({"type": "custom", "custom": {"name": "get_time"}}, "tool_choice.type"),
           ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
               {"type": "function", "function": {"name": "missing"}}]}}, "tool_choice.allowed_tools.tools[0]"),
           ({"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": only_time["allowed_tools"]["tools"]}},
            "tool_choice.allowed_tools.mode"),
           ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice.allowed_tools.tools")]
    for tc, param in bad:
        status, headers, raw = post(stack.gateway.url + "/v1/chat/completions",
                                    {"model": "demo-tiny", "messages": msgs, "tools": tools, "tool_choice": tc})
        err = json.loads(raw)["error"]
        assert (status, err["param"], err["type"]) == (400, param, "invalid_request_error"), raw
        assert "x-mlxgw-backend" not in {k.lower() for k in headers}, headers
    status, _, raw = post(stack.gateway.url + "/v1/responses", {"model": "demo-tiny", "input": "x", "tools": RESPONSES_TOOLS,
                          "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search_preview"}]}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice.tools", raw
    for tc, param in (({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "nope"}]},
                       "tool_choice.tools[0]"),
                      ({"type": "allowed_tools", "mode": "any", "tools": []}, "tool_choice.mode")):
        status, _, raw = post(stack.gateway.url + "/v1/responses",
                              {"model": "demo-tiny", "input": "x", "tools": RESPONSES_TOOLS, "tool_choice": tc})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw  # the client's own field
    # helper-93: a typo'd type was taken for a built-in tool (answered unforced, 200), a function
    # named as a custom tool was forced, and chat given the flat form blamed its mode.
    time_tool = {"type": "function", **TIME}
    for tc, param in (({"type": "fucntion", "name": "get_time"}, "tool_choice.type"),
                      ({"type": "custom", "name": "get_time"}, "tool_choice.type"),
                      ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "custom", "name": "get_time"}]},
                       "tool_choice.tools[0].type")):
        status, headers, raw = post(stack.gateway.url + "/v1/responses",
                                    {"model": "demo-tiny", "input": "x", "tools": [time_tool], "tool_choice": tc})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
        assert "x-mlxgw-backend" not in {k.lower() for k in headers}, headers
    ok = client.responses.create(model="demo-tiny", input="x", max_output_tokens=2, tools=RESPONSES_TOOLS,
                                 tool_choice={"type": "web_search_preview"})  # a built-in tool it has: not forced
    assert ok.status == "incomplete" and ok.output[0].type == "message"
    status, _, raw = post(stack.gateway.url + "/v1/chat/completions", {"model": "demo-tiny", "messages": msgs, "tools": tools,
                          "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice.allowed_tools", raw
