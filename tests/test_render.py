"""Answer rendering on the backend (backend/render.py) with mlx-lm's own text
state machine and tool parser, on the demo model's real tokenizer: reasoning is
separated as mlx-lm separates it, tool calls are parsed, stop strings are cut."""

import json
import re

import pytest

from backend.render import AnswerBuilder


@pytest.fixture(scope="module")
def tok(demo_model):
    from gateway.tokenize import load_model_info

    t = load_model_info("demo-tiny", demo_model).tokenizer
    assert t.has_thinking and t.has_tool_calling
    return t


def run(builder, pieces, final="stop"):
    content, reasoning, calls = "", "", []
    for i, p in enumerate(pieces):
        out = builder.feed(p, final if i == len(pieces) - 1 else None)
        content, reasoning, calls = content + out.content, reasoning + out.reasoning, calls + out.tool_calls
    return content, reasoning, calls


def test_reasoning_is_separated_from_content(tok):
    b = AnswerBuilder(tok, None, [], streaming=True)
    content, reasoning, calls = run(b, ["<think>", "I should", " say hi", "</think>", "Hello", " there", ""])
    assert (content.strip(), reasoning.strip(), calls) == ("Hello there", "I should say hi", [])


def test_reasoning_goes_out_under_both_names():
    """mlx_lm.server and vLLM name it ``reasoning``, DeepSeek's API ``reasoning_content`` (helper-78:
    a client moving from mlx_lm.server found only the second)."""
    from backend.render import OpenAIRenderer, Piece

    r = OpenAIRenderer("chat", "m", stream=True)
    delta = r.chunk(Piece(reasoning="why"))["choices"][0]["delta"]
    assert delta["reasoning"] == delta["reasoning_content"] == "why"
    msg = OpenAIRenderer("chat", "m", stream=False).full("hi", "why", [], "stop", {})["choices"][0]["message"]
    assert (msg["content"], msg["reasoning"], msg["reasoning_content"]) == ("hi", "why", "why")


def test_reasoning_opened_by_the_template(tok):
    b = AnswerBuilder(tok, None, [], streaming=False, initial_state="reasoning")
    content, reasoning, _ = run(b, ["thinking", " more", "</think>", "done", ""])
    assert (content.strip(), reasoning.strip()) == ("done", "thinking more")


def test_tool_call_is_parsed_and_never_shown_as_text(tok):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    b = AnswerBuilder(tok, tools, [], streaming=True)
    content, _, calls = run(b, ["<tool_call>", '\n{"name": "read_file", ', '"arguments": {"path": "a.py"}}\n',
                                "</tool_call>", ""])
    assert content.strip() == "" and len(calls) == 1
    call = calls[0]
    assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"]) == {"path": "a.py"}
    assert b.made_tool_call
    # OpenAI's id form, not mlx-lm's bare UUID.
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]), call["id"]


@pytest.mark.parametrize("one_call", [False, True])
def test_parallel_tool_calls_false_ends_the_answer_at_its_first_call(tok, one_call):
    """``parallel_tool_calls: false`` (Anthropic's ``disable_parallel_tool_use``) was accepted and
    not applied: an answer with two calls returned both. Now the first call ends the answer: later
    text and calls are dropped, text held back before the call (a stop string's hold) is kept, and
    the builder says so (``ended``) so the server stops generating."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    b = AnswerBuilder(tok, tools, ["STOP"], streaming=True, one_call=one_call)
    pieces = ["Let me ", "see.", "<tool_call>", '\n{"name": "a", "arguments": {}}\n', "</tool_call>", "\nand ",
              "<tool_call>", '\n{"name": "b", "arguments": {}}\n', "</tool_call>", " done"]
    content, _, calls = run(b, pieces + [""], final="cancelled" if one_call else "stop")
    if one_call:
        assert [c["function"]["name"] for c in calls] == ["a"]
        assert content == "Let me see."
        assert b.ended and b.finish_reason("cancelled") == "tool_calls" and b.finish_reason("length") == "tool_calls"
    else:
        assert [c["function"]["name"] for c in calls] == ["a", "b"]
        assert content == "Let me see.\nand  done"
        assert not b.ended and b.finish_reason("stop") == "tool_calls"


def test_a_tool_call_id_the_model_wrote_is_kept():
    """Kimi K2 writes its own call ids and its template renders them back next turn, so the
    backend keeps them (mlx-lm's real kimi_k2 parser); calls without one get ``call_<hex>``."""
    from mlx_lm.tool_parsers import kimi_k2, json_tools

    from backend.render import _with_call_ids

    text = ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}'
            "<|tool_call_end|>")
    (call,) = _with_call_ids(kimi_k2.parse_tool_call)(text, None)
    assert (call["id"], call["name"], call["arguments"]) == ("functions.get_weather:0", "get_weather", {"city": "Oslo"})
    call = _with_call_ids(json_tools.parse_tool_call)('{"name": "f", "arguments": {}}', None)
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["name"] == "f"


def test_text_stop_string_is_cut_across_pieces(tok):
    b = AnswerBuilder(tok, None, ["END"], streaming=True)
    content, _, _ = run(b, ["one two E", "N", "D three"], final=None)
    assert content == "one two " and b.stopped


def test_stop_strings_count_only_past_min_tokens(tok):
    """vLLM's min_tokens: a stop string written within the first tokens stays text, even while
    it is still held back when the checks begin; one written after them ends the answer."""
    b = AnswerBuilder(tok, None, ["\n", "ENDING"], streaming=True, min_tokens=1)
    out = [b.feed("a\nb", token=1), b.feed("c", token=2)]
    assert not b.stopped
    out.append(b.feed("\nd", token=3))
    assert "".join(p.content for p in out) == "a\nbc" and b.stop_reason == "\n"
    kept = AnswerBuilder(tok, None, ["ENDING"], streaming=True, include_stop=True)
    assert run(kept, ["xEND", "INGy"], final=None)[0] == "xENDING" and kept.stopped


def test_unparsable_tool_call_comes_back_as_text_not_as_a_call(tok):
    """A block the parser cannot read is returned verbatim as content, markers included, and
    makes no tool-call answer: mlx-lm's formatter drops it (mlx-lm issue 1307), and the answer
    used to end with finish_reason "tool_calls" and no call in it (README trial, session 23)."""
    b = AnswerBuilder(tok, None, [], streaming=False)
    content, _, calls = run(b, ["hello ", "<tool_call>", "not json", "</tool_call>", " bye", ""])
    assert (content, calls, b.made_tool_call, b.unparsed_calls) == (
        "hello <tool_call>not json</tool_call> bye", [], False, 1)
    assert b.finish_reason("stop") == "stop"


def test_tool_call_cut_off_by_the_length_limit_comes_back_as_text(tok):
    """A call cut off mid-JSON (max_tokens) has no end marker; its text is kept as the model
    wrote it (mlx-lm issue 905: the same cut used to drop the connection in mlx_lm.server)."""
    b = AnswerBuilder(tok, None, [], streaming=True)
    content, _, calls = run(b, ["<tool_call>", '\n{"name": "read_file", "argu'], final="length")
    assert (content, calls, b.finish_reason("length")) == ('<tool_call>\n{"name": "read_file", "argu', [],
                                                         "length")


def test_parsed_and_unparsed_calls_in_one_answer_keep_their_order(tok):
    """The good call is a call (streaming index 0), the bad one text between the answer's words."""
    b = AnswerBuilder(tok, None, [], streaming=True)
    content, _, calls = run(b, ["a ", "<tool_call>", '\n{"name": "f", "arguments": {}}\n', "</tool_call>", " b ",
                                "<tool_call>", "{oops", "</tool_call>", " c", ""])
    assert content == "a  b <tool_call>{oops</tool_call> c"
    assert [(c["function"]["name"], c["index"]) for c in calls] == [("f", 0)] and b.made_tool_call
    assert b.finish_reason("stop") == "tool_calls"
