"""The token-id segment cache returns exactly the plain tokenization's ids.

`gateway.segcache.SegmentEncoder` splits rendered chat text at added tokens and
caches each piece's ids; these tests compare it with the plain path
(``apply_chat_template(tokenize=True)``, i.e. transformers' own call) on
generated conversations, on a growing agent conversation, under eviction, and
show the tokenizers where per-piece encoding is wrong and the cache refuses.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.segcache import BYTES_PER_ID, SegmentEncoder, unsupported_reason
from gateway.tokenize import Tokenizers, load_model_info
from mlxgw.prompt import render_chat
from texts import words

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city ✓",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
]
#: Text pieces chosen for their edges: whitespace runs at both ends, CRLF, lone
#: combining marks (NFC), emoji, CJK, added tokens inside message text.
EDGES = ["", " ", "  ", "\n", "\n\n", " \n", "\r\n", "\t", "\u00a0", "e\u0301", "\u0301", "👩‍💻", "中文字符",
         "ünïcødé", "<|im_end|>", "<|im_start|>user\n", "<tool_call>", "</think>", "<|im_end", "|>", "<", "'s",
         "123456", "a.b,c", "```py\nx = 1\n```", "\\n", "{\"a\": 1}"]

piece = st.one_of(
    st.sampled_from(EDGES),
    st.text(max_size=40),
    st.builds(words, st.integers(1, 60), st.integers(0, 10**6)),
)
content = st.lists(piece, max_size=8).map("".join)
long_content = st.builds(words, st.integers(1500, 3000), st.integers(0, 100))


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(content)})
    for turn in range(draw(st.integers(1, 5))):
        msgs.append({"role": "user", "content": draw(st.one_of(content, long_content) if turn == 0 else content)})
        kind = draw(st.sampled_from(["text", "tool", "none"]))
        if kind == "text":
            msgs.append({"role": "assistant", "content": draw(content)})
        elif kind == "tool":
            args = {"city": draw(content)}
            msgs.append({"role": "assistant", "content": draw(content), "tool_calls": [
                {"id": f"c{turn}", "type": "function", "function": {"name": "get_weather", "arguments": args}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{turn}", "content": json.dumps({"r": draw(content)})})
            msgs.append({"role": "assistant", "content": draw(content)})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": draw(content)})
    tools = draw(st.sampled_from([None, TOOLS, TOOLS[:1]]))
    return msgs, tools


@pytest.fixture(scope="module")
def info(demo_model):
    return load_model_info("demo-tiny", demo_model)


def test_demo_tokenizer_is_supported(info):
    assert unsupported_reason(info.tokenizer._tokenizer) is None
    assert isinstance(info.segments, SegmentEncoder)


def test_generated_conversations_equal_plain_path(info):
    tok = info.tokenizer
    shared = SegmentEncoder(tok._tokenizer)  # warm across examples: pieces come back from the cache
    tiny = SegmentEncoder(tok._tokenizer, max_bytes=4096)  # evicts all the time
    seen = {"n": 0, "long": 0, "injected": 0}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(conversations())
    def check(conv):
        msgs, tools = conv
        plain = render_chat(tok, msgs, tools)
        for enc in (shared, tiny, shared):  # the second `shared` call is all hits
            cached = render_chat(tok, msgs, tools, encode=enc.encode)
            assert cached.token_ids == plain.token_ids
            assert cached.system_tokens == plain.system_tokens
        seen["n"] += 1
        seen["long"] += len(plain.token_ids) > 2000
        seen["injected"] += any("<|im_end|>" in m["content"] for m in msgs)

    check()
    assert seen["n"] == 250
    assert seen["long"] >= 10 and seen["injected"] >= 10, seen  # the edge cases did come up
    assert shared.hits > 0 and shared.misses > 0
    assert tiny.bytes <= 4096


def _agent_turns(n_turns: int):
    msgs = [{"role": "system", "content": "You are a coding agent.\n" + words(400, 1)}]
    for t in range(n_turns):
        msgs.append({"role": "user", "content": words(300, 10 + t)})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"t{t}", "type": "function", "function": {"name": "run", "arguments": {"cmd": f"ls {t}"}}}]})
        msgs.append({"role": "tool", "tool_call_id": f"t{t}", "content": words(200, 1000 + t)})
        yield list(msgs)
        msgs.append({"role": "assistant", "content": words(50, 2000 + t)})


def test_growing_conversation_tokenizes_only_new_messages(info):
    tok = info.tokenizer
    enc = SegmentEncoder(tok._tokenizer)
    prev_len = 0
    for i, msgs in enumerate(_agent_turns(12)):
        plain = render_chat(tok, msgs, TOOLS)
        before = enc.stats()
        cached = render_chat(tok, msgs, TOOLS, encode=enc.encode)
        after = enc.stats()
        assert cached.token_ids == plain.token_ids
        new_tokens = after["miss_tokens"] - before["miss_tokens"]
        if i == 0:
            assert new_tokens >= len(plain.token_ids) - 200  # cold: nearly everything is tokenized
        else:
            # Only the messages added since the last turn (assistant reply, user
            # message, tool call and result) plus short role headers are new.
            grown = len(plain.token_ids) - prev_len
            assert 0 < new_tokens <= grown
            assert after["hit_tokens"] - before["hit_tokens"] >= prev_len - 300
        prev_len = len(plain.token_ids)
    assert prev_len > 5000


def test_lru_is_bounded_in_bytes_and_evicts_oldest(info):
    hf = info.tokenizer._tokenizer
    enc = SegmentEncoder(hf, max_bytes=20_000)
    texts = [f"<|im_start|>user\n{words(100, i)}<|im_end|>\n" for i in range(30)]
    for t in texts:
        assert enc.encode(t) == hf(t, add_special_tokens=False)["input_ids"]
        assert enc.bytes <= 20_000
    first = "user\n" + words(100, 0)  # the piece between <|im_start|> and <|im_end|>
    last = "user\n" + words(100, 29)
    assert first not in enc._lru  # evicted, least recently used
    assert last in enc._lru
    assert enc.bytes == sum(sys.getsizeof(k) + BYTES_PER_ID * len(v) for k, v in enc._lru.items())
    # A piece larger than the whole budget is encoded but never kept.
    huge = "<|im_start|>" + words(5000, 7)
    assert enc.encode(huge) == hf(huge, add_special_tokens=False)["input_ids"]
    assert words(5000, 7) not in enc._lru


def test_gateway_tokenizers_use_the_cache(demo_model):
    toks = Tokenizers(segment_cache_bytes=1 << 20)
    info = toks.add("demo-tiny", demo_model)
    msgs = [{"role": "system", "content": words(200, 3)}, {"role": "user", "content": words(500, 4)}]
    plain = render_chat(info.tokenizer, msgs)
    cp = asyncio.run(toks.render_chat(info, msgs, None, None))
    assert cp.token_ids == plain.token_ids and cp.system_tokens == plain.system_tokens
    assert info.segments.stats()["hit_tokens"] > 0  # the system probe reused the system piece
    assert Tokenizers(segment_cache_bytes=0).add("x", demo_model).segments is None


# -- tokenizers for which per-piece encoding is wrong -------------------------

CORPUS = ["hello world this is a test of the tokenizer", "another line with words and more words"] * 50


def _metaspace(scheme: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _lstrip() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("make,text,reason", [
    # prepend_scheme="first": "world" after </s> gets no "▁" in place, but would alone.
    (lambda: _metaspace("first"), "hello</s>world <s> this", "prepend_scheme"),
    # lstrip: <mask> swallows the space before it; a naive split leaves it in "hello ".
    (_lstrip, "hello <mask> world", "lstrip"),
])
def test_unsafe_tokenizers_are_refused(make, text, reason):
    hf = make()
    assert reason in unsupported_reason(hf)
    assert SegmentEncoder.create(hf) is None
    # The refusal is needed: forcing the per-piece path gives different ids.
    assert SegmentEncoder(hf).encode(text) != hf(text, add_special_tokens=False)["input_ids"]


def test_metaspace_always_is_safe():
    hf = _metaspace("always")  # every piece gets "▁", in place and alone
    assert unsupported_reason(hf) is None
    text = "hello</s>world <s> this  and more words</s>"
    assert SegmentEncoder(hf).encode(text) == hf(text, add_special_tokens=False)["input_ids"]
