"""The token-id segment cache returns exactly the plain tokenization's ids.

`gateway.segcache.SegmentEncoder` splits rendered chat text at added tokens and
caches each piece's ids; these tests compare it with the plain path
(``apply_chat_template(tokenize=True)``, i.e. transformers' own call) on
generated conversations, on a growing agent conversation, under eviction, and
show the tokenizers where per-piece encoding is wrong and the cache refuses;
the same for cutting long uncached pieces into chunks.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from gateway.segcache import (BYTES_PER_ID, DEFAULT_CHUNK_CHARS, SegmentEncoder, chunking_unsupported_reason,
                              cut_points, special_affixes, unsupported_reason)
from gateway.tokenize import ModelInfo, Tokenizers, load_model_info
from mlxgw.prompt import encode_text, render_chat
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
    # Cuts every uncached piece of 32+ characters into up to 8 chunks: most cut sites get tried.
    chunky = SegmentEncoder(tok._tokenizer, max_bytes=4096, chunk_chars=16, max_chunks=8)
    seen = {"n": 0, "long": 0, "injected": 0}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(conversations())
    def check(conv):
        msgs, tools = conv
        plain = render_chat(tok, msgs, tools)
        for enc in (shared, tiny, chunky, shared):  # the second `shared` call is all hits
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
    # Cut pieces did come up, in the forced encoder and, for the 1,500+ word messages, the default one.
    assert chunky.chunked > 1000 and shared.chunked >= 10


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


def test_text_prompts_equal_plain_encode(demo_model):
    """/v1/completions prompts go through the segment cache (and its chunking) with the same ids."""
    toks = Tokenizers(segment_cache_bytes=1 << 20)
    info = toks.add("demo-tiny", demo_model)
    assert info.text_affixes == ([], [])  # the demo tokenizer adds no BOS/EOS to a text
    seen = {"n": 0, "long": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(st.one_of(content, long_content))
    def check(text):
        assert asyncio.run(toks.encode(info, text)) == encode_text(info.tokenizer, text)
        seen["n"] += 1
        seen["long"] += len(text) >= 2 * DEFAULT_CHUNK_CHARS

    check()
    assert seen["long"] >= 10 and info.segments.stats()["chunked"] >= 10


def test_text_prompt_affixes_of_a_bos_tokenizer():
    hf = _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    bos, eos = hf.convert_tokens_to_ids("<unk>"), hf.convert_tokens_to_ids("</s>")
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<unk> $A </s>", special_tokens=[("<unk>", bos), ("</s>", eos)])
    assert special_affixes(hf) == ([bos], [eos])
    info = ModelInfo("bos", "", hf, 4096, SegmentEncoder.create(hf), special_affixes(hf))
    for text in ["hello world", words(900, 3) + "</s> more words", " "]:
        ids = asyncio.run(Tokenizers().encode(info, text))
        assert ids == hf(text)["input_ids"] and ids[0] == bos and ids[-1] == eos


def test_cut_points_fall_on_spaces_between_letters():
    text = "ab cd 12 34 ef gh. ij kl"
    #       0123456789012345678901234
    assert cut_points(text, 2) == [14]  # from 12: "34 ef" (digit before) no, "ef gh" yes
    # Targets 6, 12, 18: 6 -> 14; 12 -> past the last cut, "gh. ij" no, 21; 18 -> nothing after 21.
    assert cut_points(text, 4) == [14, 21]
    assert cut_points("12 34 56 78", 4) == []  # no letters: nothing to cut
    assert cut_points("é ü", 2) == [1] and cut_points("a  b", 2) == []  # two spaces: no letter after the first
    long = "x " * 50_000 + "1 " * 50_000
    assert len(cut_points(long, 8)) == 3  # cuts only in the letter half


def test_long_cold_piece_is_tokenized_in_chunks(info):
    hf = info.tokenizer._tokenizer
    assert chunking_unsupported_reason(hf) is None
    assert info.segments.chunk_chars == DEFAULT_CHUNK_CHARS
    enc = SegmentEncoder(hf, max_chunks=4)
    text = f"<|im_start|>user\n{words(3000, 5)}<|im_end|>\n<|im_start|>assistant\n"
    assert enc.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert enc.stats()["chunked"] == 1  # the 3,000-word piece; "\n" and "assistant\n" go whole
    assert enc.encode(text) == hf(text, add_special_tokens=False)["input_ids"]  # now from the cache
    assert enc.stats()["chunked"] == 1 and enc.stats()["hits"] == 3


# -- tokenizers for which per-piece encoding is wrong -------------------------

CORPUS = ["hello world this is a test of the tokenizer", "another line with words and more words"] * 50


def _metaspace(scheme: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _bpe(pre, normalizer=None, added=()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS, with ``pre``, ``normalizer`` and ``added`` tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _lstrip() -> PreTrainedTokenizerFast:
    return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), added=[AddedToken("<mask>", lstrip=True)])


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


# -- tokenizers for which cutting inside a piece is wrong ---------------------

def test_gpt2_byte_level_tokenizer_chunks_safely():
    hf = _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    assert chunking_unsupported_reason(hf) is None
    enc = SegmentEncoder(hf, chunk_chars=8, max_chunks=16)
    for seed in range(20):
        text = words(200, seed) + "</s>" + " ".join(CORPUS[:3]) + "  it's x.y é\n" + words(50, seed + 99)
        assert enc.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert enc.chunked >= 20


# A regex that keeps a word's trailing space ("word |word"): a cut before the space moves it.
TRAILING_SPACE = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(r"\S+\s*"), behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)])


@pytest.mark.parametrize("make,reason", [
    (lambda: _bpe(TRAILING_SPACE), "probe"),
    (lambda: _metaspace("always"), "pre-tokenizer Metaspace"),
    (lambda: _bpe(pre_tokenizers.ByteLevel(use_regex=False)), "no pre-tokenizer regex"),
    (lambda: _bpe(pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="merged_with_previous"),
                                           pre_tokenizers.ByteLevel(use_regex=False)])), "Split (MergedWithPrevious)"),
    (lambda: _bpe(pre_tokenizers.ByteLevel(), normalizers.Strip()), "normalizer Strip"),
])
def test_chunking_is_refused_where_a_cut_changes_ids(make, reason):
    hf = make()
    assert reason in chunking_unsupported_reason(hf)
    assert SegmentEncoder.create(hf).chunk_chars == 0  # the segment cache stays, chunking is off
    if reason == "probe":  # the refusal is needed: forced cuts give different ids
        text = "hello world this is a test"
        forced = SegmentEncoder(hf, chunk_chars=4, max_chunks=4)
        assert forced.encode(text) != hf(text, add_special_tokens=False)["input_ids"]
        assert forced.chunked == 1
