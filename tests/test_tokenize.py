"""The gateway tokenizes exactly as mlx-lm does (same ids, so block keys match)."""

import json

import pytest

from gateway.tokenize import load_model_info
from mlxgw.prompt import render_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You are terse. " * 50}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"temp": 21})},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": "And tomorrow? ünïcødé ✓"},
    ],
]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_gateway_ids_equal_mlx_lm(demo_model, i, tools):
    from mlx_lm import load

    _, mlx_tok = load(demo_model)
    info = load_model_info("demo-tiny", demo_model)
    msgs = CONVERSATIONS[i]
    ours = render_chat(info.tokenizer, msgs, tools)
    theirs = mlx_tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True)
    assert ours.token_ids == list(theirs)
    assert len(ours.token_ids) > 5


def test_system_tokens_is_the_system_prefix(demo_model):
    info = load_model_info("demo-tiny", demo_model)
    msgs = CONVERSATIONS[1]
    cp = render_chat(info.tokenizer, msgs)
    sys_only = render_chat(info.tokenizer, msgs[:1] + [{"role": "user", "content": "something else entirely"}])
    # The system part is shared with any conversation that has the same system prompt...
    assert cp.token_ids[: cp.system_tokens] == sys_only.token_ids[: cp.system_tokens]
    # ...and it is the whole rendered system message (50 repetitions are well over 100 tokens).
    assert cp.system_tokens > 100
    assert cp.system_tokens == sys_only.system_tokens  # depends on the system message only
    assert render_chat(info.tokenizer, CONVERSATIONS[0]).system_tokens == 0


def test_tools_without_a_system_message_count_as_the_system_prefix(demo_model):
    """Templates render tools in the system turn: with no system message, that block is what
    every conversation with those tools shares (it counted 0, so nothing protected it)."""
    info = load_model_info("demo-tiny", demo_model)
    a = render_chat(info.tokenizer, [{"role": "user", "content": "hello"}], TOOLS)
    b = render_chat(info.tokenizer, [{"role": "user", "content": "something else entirely"}], TOOLS)
    assert a.system_tokens == b.system_tokens > 50
    assert a.token_ids[: a.system_tokens] == b.token_ids[: a.system_tokens]
    assert a.token_ids[a.system_tokens] != b.token_ids[a.system_tokens]  # the user text starts right there
    text = info.tokenizer.decode(a.token_ids[: a.system_tokens])
    assert "get_weather" in text and "hello" not in text
    assert render_chat(info.tokenizer, [{"role": "user", "content": "hello"}]).system_tokens == 0


def test_developer_and_function_roles_render_like_system_and_tool(demo_model):
    """The demo's ChatML template drops roles it does not know; OpenAI's developer and
    (deprecated) function roles must still reach the prompt, as system and tool."""
    info = load_model_info("demo-tiny", demo_model)
    tok = info.tokenizer
    rule = "You are a very helpful pirate assistant."
    as_system = render_chat(tok, [{"role": "system", "content": rule}, {"role": "user", "content": "hi"}])
    as_developer = render_chat(tok, [{"role": "developer", "content": rule}, {"role": "user", "content": "hi"}])
    dropped = render_chat(tok, [{"role": "user", "content": "hi"}])
    assert as_developer.token_ids == as_system.token_ids != dropped.token_ids
    assert as_developer.system_tokens == as_system.system_tokens > 0
    result = {"role": "function", "name": "get_weather", "content": "21 degrees"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    head = [{"role": "user", "content": "Weather?"}, call]
    as_tool = render_chat(tok, head + [{"role": "tool", "name": "get_weather", "content": "21 degrees"}])
    assert render_chat(tok, head + [result]).token_ids == as_tool.token_ids != render_chat(tok, head).token_ids


def test_developer_role_kept_for_templates_that_name_it(demo_model):
    from mlxgw.prompt import template_roles

    info = load_model_info("demo-tiny", demo_model)
    msgs = [{"role": "developer", "content": "x"}]
    assert template_roles(info.tokenizer, msgs) == [{"role": "system", "content": "x"}]

    class Harmony:  # a template that renders developer messages itself (as gpt-oss's does)
        chat_template = "{% for m in messages %}{% if m.role == 'developer' %}...{% endif %}{% endfor %}"

    assert template_roles(Harmony(), msgs) is msgs


def test_reasoning_effort_is_the_templates_variable(demo_model):
    """OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) reach the chat
    template as its ``reasoning_effort`` variable, the one gpt-oss's template reads (helper-82:
    dropped unsaid); ``chat_template_kwargs`` names it first if it likes; other values are a 400."""
    import copy

    from gateway.dialects.responses import to_chat
    from mlxgw.protocol import RequestError, parse_openai

    info = load_model_info("demo-tiny", demo_model)
    tok = copy.copy(info.tokenizer)
    tok._tokenizer = copy.copy(info.tokenizer._tokenizer)
    tok._tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                    "|effort={{ reasoning_effort | default('unset') }}")

    def effort(body):
        pr = parse_openai({"messages": [{"role": "user", "content": "hi"}], **body}, "chat")
        return tok.decode(render_chat(tok, pr.messages, None, pr.template_kwargs).token_ids).split("|effort=")[1]

    assert effort({}) == "unset"
    assert effort({"reasoning_effort": "low"}) == "low"
    assert effort({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}) == "high"
    assert effort(to_chat({"model": "m", "input": "hi", "reasoning": {"effort": "minimal"}})) == "minimal"
    for body, param in (({"reasoning_effort": "max"}, "reasoning_effort"), ({"reasoning_effort": 2}, "reasoning_effort")):
        with pytest.raises(RequestError) as e:
            effort(body)
        assert e.value.param == param
    with pytest.raises(RequestError) as e:
        to_chat({"model": "m", "input": "hi", "reasoning": {"effort": "huge"}})
    assert e.value.param == "reasoning.effort"
