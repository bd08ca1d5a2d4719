"""Turn an engine's token stream into OpenAI chat/completions answers.

Reasoning and tool-call text are separated with mlx-lm's own
``TextStateMachine`` and tool parser (``ToolCallFormatter``), as
``mlx_lm.server`` does; text stop sequences are matched on the decoded text
(a stop string can tokenize differently from how it was generated), and a
match cancels generation, which still saves the prompt cache.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

from mlxgw.protocol import CALL_ID_PREFIX, new_id

log = logging.getLogger("mlxgw.backend.render")


@dataclass
class Piece:
    """What one step of generation adds to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)


def _with_call_ids(parser):
    """Wrap an mlx-lm tool parser so each parsed call without an id gets one in OpenAI's
    form, ``call_`` and 24 hex digits.

    mlx-lm's formatter names a call the model gave no id with a bare UUID; clients and
    logs expect OpenAI's prefix, and the gateway's Anthropic dialect turns ``call_`` into
    ``toolu_``. An id the model wrote itself (Kimi K2's ``functions.name:0``) is kept: its
    chat template renders it back next turn, so replacing it would change the prompt.
    """
    if parser is None:
        return None

    def parse(text, tools):
        parsed = parser(text, tools)
        for tc in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(tc, dict) and not tc.get("id"):
                tc["id"] = new_id(CALL_ID_PREFIX)
        return parsed
    return parse


class AnswerBuilder:
    """Stateful decoder of generated text into content, reasoning and tool calls.

    Args:
        tokenizer: mlx-lm ``TokenizerWrapper``.
        tools: the request's tools (for the tool parser).
        stop: text stop sequences.
        streaming: tool calls get an ``index`` when streaming.
        initial_state: ``"normal"`` or ``"reasoning"``.
        one_call: the request's ``parallel_tool_calls`` is false: the answer ends with its first
            tool call (what follows is dropped and `ended` says to stop generating).
        min_tokens: vLLM's: no stop string ends the answer before its token ``min_tokens + 1``
            (a stop string written sooner stays text), as vLLM checks them.
        include_stop: vLLM's ``include_stop_str_in_output``: the stop string that ended the
            answer is its last text.
        stop_token_ids: the request's stop tokens: the one that ended the answer is its
            ``stop_reason`` (vLLM's), as a stop string's text is.
        raw: the text as generated, no reasoning or tool calls taken out of it: the legacy
            completions endpoint's answer, which has no field for them (vLLM parses neither
            there; helper-80: a ``<think>`` the model wrote swallowed the rest of the text).
    """

    def __init__(self, tokenizer, tools, stop: list[str], streaming: bool, initial_state="normal",
                 one_call: bool = False, min_tokens: int = 0, include_stop: bool = False, stop_token_ids=(),
                 raw: bool = False):
        self.raw = raw
        self.sm = make_text_state_machine(tokenizer, [])
        self.state = self.sm.make_state(initial_state)
        self.prev = initial_state
        self.formatter = ToolCallFormatter(_with_call_ids(tokenizer.tool_parser), tools, streaming)
        self.call_start = tokenizer.tool_call_start or ""
        self.call_end = tokenizer.tool_call_end or ""
        self.unparsed_calls = 0  # tool-call blocks returned as text (metric mlxgw:tool_calls_unparsed)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=0)
        self.buf = ""  # normal text held back while it could start a stop string
        self.tool_text = ""
        self.made_tool_call = False
        self.stopped = False
        self.one_call = one_call
        self.call_made = False  # with ``one_call``: the call is made, the answer is over
        # The stop sequence that ended the answer; set only with ``stopped``, so the finish
        # reason is then always "stop".
        self.stop_string: Optional[str] = None
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tokens = 0  # tokens fed
        self.last_token: Optional[int] = None
        self.no_stop_before = 0  # characters of ``buf`` no stop string may end in (before min_tokens)
        self.stop_token: Optional[int] = None  # the stop token that ended the answer (`finish_reason`)

    @property
    def stop_reason(self):
        """vLLM's ``stop_reason``: the stop string or stop token id that ended the answer, else None."""
        return self.stop_string if self.stop_string is not None else self.stop_token

    @property
    def held(self) -> int:
        """Characters fed and not yet out: text that may start a stop string or a marker
        (mlx-lm's state machine buffer), and an open tool call's text."""
        return len(self.state[3] or "") + len(self.buf) + len(self.tool_text)

    @property
    def ended(self) -> bool:
        """The answer is complete (a stop string, or the one call ``one_call`` allows): the
        server cancels the rest of the generation, which still saves the prompt cache."""
        return self.stopped or self.call_made

    def feed(self, text: str, final: Optional[str] = None, token: Optional[int] = None) -> Piece:
        """Consume decoded text; ``final`` is the engine's finish reason when ending; ``token``
        the generated token the text is of (None for an end event)."""
        out = Piece()
        if self.call_made:
            return out
        if token is not None and not self.stopped:
            self.tokens += 1
            self.last_token = token
        if self.raw:
            segments = [("normal", text)]
        elif final == "stop":
            self.state, _ = TextStateMachine.discard(self.state)
            segments = [(self.state[0], "")]
        else:
            self.state, segments = TextStateMachine.split(self.state, text)
            if final is not None:
                self.state, flushed, cur = TextStateMachine.flush(self.state)
                segments.append((cur, flushed))
        for st, t in segments:
            if st == "reasoning":
                out.reasoning += t
            elif st == "tool":
                self.tool_text += t
            elif st == "normal":
                if self.prev == "tool":
                    out.tool_calls += self._parse_call(closed=True)
                    if self.one_call and out.tool_calls:
                        break  # the answer ends with this call: nothing after it counts
                self.buf += t
            self.prev = st
        if final is not None and self.prev == "tool" and self.tool_text:
            out.tool_calls += self._parse_call(closed=False)
        # Only a call that parsed makes a tool-call answer: mlx_lm.server answered
        # finish_reason "tool_calls" with no call in it (Anthropic: stop_reason "tool_use"
        # without a tool_use block).
        self.made_tool_call = self.made_tool_call or bool(out.tool_calls)
        if self.one_call and out.tool_calls:
            # parallel_tool_calls false (Anthropic: disable_parallel_tool_use): at most one call,
            # as OpenAI's API answers; the text before it stays, held-back text included.
            out.tool_calls = out.tool_calls[:1]
            self.call_made = True
        out.content = self._release(final is not None or self.call_made)
        return out

    def _parse_call(self, closed: bool) -> list:
        """Parse the tool-call block just ended into OpenAI ``tool_calls`` items.

        A block the parser cannot read (invalid JSON, cut off by ``max_tokens``, an
        unknown dialect) goes back into the content verbatim, with its start marker and,
        if the model wrote it, its end marker: mlx-lm's formatter drops such text with a
        warning, so the client saw an empty answer (mlx-lm issue 1307); vLLM's parsers
        return the model's text as content instead. Any parser exception counts as
        unparsable: several of mlx-lm's raise KeyError or IndexError on odd input
        (mlx-lm issue 905, PR 899), which would otherwise end the request.
        """
        text, self.tool_text = self.tool_text, ""
        try:
            calls = self.formatter([text])
        except Exception as e:  # noqa: BLE001 - any parser failure means "not a call"
            log.warning("tool call not parsed (%s: %s); returned as text", type(e).__name__, e)
            calls = []
        if not calls:
            self.unparsed_calls += 1
            self.buf += self.call_start + text + (self.call_end if closed else "")
        return calls

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        checking = not self.min_tokens or self.tokens > self.min_tokens  # vLLM: past min_tokens only
        if checking:
            for s in self.stop:
                # A match must end in text fed since the checks began.
                i = self.buf.find(s, max(0, self.no_stop_before - len(s) + 1))
                if i >= 0:
                    self.stopped, self.stop_string = True, s
                    end = i + len(s) if self.include_stop else i
                    text, self.buf = self.buf[:end], ""
                    return text
        if final or self.hold == 0:
            text, self.buf = self.buf, ""
        else:
            keep = self.hold - 1
            if len(self.buf) <= keep:
                text = ""
            else:
                text, self.buf = self.buf[:-keep] if keep else self.buf, self.buf[-keep:] if keep else ""
        # What is still held of the text fed before the checks began stays out of reach.
        self.no_stop_before = max(0, self.no_stop_before - len(text)) if checking else len(self.buf)
        return text

    def finish_reason(self, engine_reason: str) -> str:
        if self.stopped:
            return "stop"
        if engine_reason == "stop" and self.last_token in self.stop_token_ids:
            self.stop_token = self.last_token
        if self.call_made:  # the one call allowed is complete, whatever ended the generation
            return "tool_calls"
        if engine_reason in ("stop", "cancelled") and self.made_tool_call:
            return "tool_calls"
        return "length" if engine_reason == "length" else "stop"


class TokenText:
    """One token's text and UTF-8 bytes, as OpenAI's logprobs entries give them (``token``,
    ``bytes``), worked out once per token id.

    The bytes come from the vocabulary the way mlx-lm's streaming detokenizer reads it (GPT-2
    byte-level BPE, SentencePiece with byte tokens ``<0xNN>``; other tokenizers decode the id
    alone), so a token holding part of a character has its own bytes, and its text the
    replacement character, as OpenAI's and vLLM's do.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        detok = getattr(tokenizer, "_detokenizer", None)
        self._map = getattr(detok, "tokenmap", None)
        self._bpe = isinstance(detok, BPEStreamingDetokenizer)
        self._spm = isinstance(detok, SPMStreamingDetokenizer)
        # mlx-lm's BPE and (by default) SentencePiece detokenizers drop the space an answer's
        # first text starts with, so the answer's text is one character shorter than its tokens'.
        self.trims_leading_space = self._bpe or (self._spm and getattr(detok, "trim_space", False))
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._lookup(token)
        return got

    def _lookup(self, token: int) -> tuple[str, bytes]:
        if self._map is not None and token < len(self._map) and (self._bpe or self._spm):
            v = self._map[token]
            if self._bpe:
                dec = _byte_decoder()
                raw = b"".join(bytes([dec[c]]) if c in dec else c.encode("utf-8") for c in v)
            else:
                raw = v.replace("\u2581".encode("utf-8"), b" ")
        else:
            raw = self.tokenizer.decode([token]).encode("utf-8")
        return raw.decode("utf-8", "replace"), raw


class TokenIdNames:
    """A `TokenText` whose tokens are named ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``,
    for clients that read ids back); the bytes stay the token's own."""

    trims_leading_space = False  # a name is not the answer's text

    def __init__(self, text: TokenText):
        self.text = text

    def __call__(self, token: int) -> tuple[str, bytes]:
        return f"token_id:{token}", self.text(token)[1]


@functools.lru_cache(maxsize=8)
def token_text(tokenizer) -> TokenText:
    """The `TokenText` of ``tokenizer`` (one per loaded model)."""
    return TokenText(tokenizer)


class OpenAIRenderer:
    """Builds OpenAI JSON objects for one answer (chat or text completion).

    ``logprobs`` is the request's: None for none, else how many alternatives each token lists;
    the answer's ``logprobs`` then come from the engine's token events (`GenEvent.logprob`,
    ``top``) in OpenAI's chat shape (``content``: ``token``, ``logprob``, ``bytes``,
    ``top_logprobs``) or its legacy completions shape (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``).
    """

    def __init__(self, kind: str, model: str, stream: bool, logprobs: Optional[int] = None, tokenizer=None,
                 id_names: bool = False, reasoning: bool = True, index: int = 0,
                 same_as: Optional["OpenAIRenderer"] = None):
        """``index``: the choice this renderer's objects carry (of a request's ``n``);
        ``same_as``: the renderer of the request's first choice, whose ``id`` and ``created``
        every choice's objects share."""
        self.kind = kind
        self.index = index
        self.reasoning = reasoning  # vLLM's include_reasoning: false leaves the reasoning text out
        self.id_names = id_names  # vLLM's return_tokens_as_token_ids: tokens named "token_id:N"
        self.model = model
        self.stream = stream
        self.logprobs = logprobs
        self._text = token_text(tokenizer) if logprobs is not None else None
        self._offset = 0  # characters of answer the legacy ``text_offset`` has counted
        self.id = same_as.id if same_as else ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = same_as.created if same_as else int(time.time())
        if kind == "chat":
            self.object = "chat.completion.chunk" if stream else "chat.completion"
        else:
            self.object = "text_completion"

    def _base(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def _logprobs(self, events) -> Optional[dict]:
        """The ``logprobs`` of a choice holding ``events``' tokens; None when the request asked
        for none (or, in a stream, for a chunk with no token of its own)."""
        if self.logprobs is None or (self.stream and not events):
            return None
        text = TokenIdNames(self._text) if self.id_names else self._text
        if self.kind == "chat":
            def item(tok, lp):
                s, b = text(tok)
                return {"token": s, "logprob": lp, "bytes": list(b)}
            return {"content": [dict(item(ev.token, ev.logprob), top_logprobs=[item(t, v) for t, v in ev.top or ()])
                                for ev in events], "refusal": None}
        # Legacy completions: each position's alternatives as {text: logprob}, the sampled token
        # always among them (OpenAI: up to logprobs + 1 entries).
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ev in events:
            s = text(ev.token)[0]
            out["tokens"].append(s)
            out["token_logprobs"].append(ev.logprob)
            alts = {text(t)[0]: v for t, v in ev.top or ()}
            alts.setdefault(s, ev.logprob)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(self._offset)
            s = self._text(ev.token)[0]  # its text, whatever its name (helper-80: "token_id:N" counted)
            if self._offset == 0 and self._text.trims_leading_space and s.startswith(" "):
                s = s[1:]  # offsets index the answer's text, which starts without that space
            self._offset += len(s)
        return out

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    @staticmethod
    def _choice(choice: dict, stop_reason) -> list[dict]:
        # vLLM's extension: the stop string (or stop token id) that ended the answer (Anthropic's
        # stop_sequence is made from it); null when none did, on the choice that finishes, as vLLM
        # sends it (helper-80: absent, and a client's choice["stop_reason"] raised KeyError).
        if stop_reason is not None or choice.get("finish_reason") is not None:
            choice["stop_reason"] = stop_reason
        return [choice]

    def chunk(self, piece: Piece, finish_reason: Optional[str] = None, first: bool = False,
              stop_reason: Optional[str] = None, lps=()) -> dict:
        """One stream chunk; ``lps``: the token events whose logprobs it carries."""
        out = self._base()
        if self.kind == "chat":
            delta = {}
            if first:
                delta["role"] = "assistant"
            if piece.content:
                delta["content"] = piece.content
            if piece.reasoning and self.reasoning:
                # Both names: mlx_lm.server (0.32) and vLLM write ``reasoning``, DeepSeek's API and
                # the clients written for it (and for vLLM before) read ``reasoning_content``.
                delta["reasoning"] = delta["reasoning_content"] = piece.reasoning
            if piece.tool_calls:
                delta["tool_calls"] = piece.tool_calls
            out["choices"] = self._choice({"index": self.index, "delta": delta, "finish_reason": finish_reason,
                                           "logprobs": self._logprobs(lps)}, stop_reason)
        else:
            out["choices"] = self._choice({"index": self.index, "text": piece.content, "finish_reason": finish_reason,
                                           "logprobs": self._logprobs(lps)}, stop_reason)
        return out

    def stream_chunks(self, piece: Piece, first: bool = False, lps=()) -> list[dict]:
        """The chunks of one step; each tool call becomes a header chunk then an arguments chunk.

        OpenAI's streamed shape: a call's first delta carries ``index``,
        ``id``, ``type`` and ``function.name`` (arguments ``""``); later
        deltas carry the same ``index`` and ``arguments`` fragments. mlx-lm
        parses a call when it is complete, so its arguments come in one fragment.
        The step's token logprobs (``lps``) go with its first chunk.
        """
        calls = piece.tool_calls
        out = [self.chunk(Piece(piece.content, piece.reasoning), None, first=first, lps=lps)] if (
            piece.content or piece.reasoning or first or not calls) else []
        for tc in calls:
            fn = tc.get("function") or {}
            head = {"index": tc.get("index", 0), "id": tc.get("id"), "type": "function",
                    "function": {"name": fn.get("name"), "arguments": ""}}
            out.append(self.chunk(Piece(tool_calls=[head]), None, first=first and not out,
                                  lps=() if out else lps))
            if fn.get("arguments"):
                out.append(self.chunk(Piece(tool_calls=[{"index": head["index"],
                                                         "function": {"arguments": fn["arguments"]}}])))
        return out

    def add_token_ids(self, obj: dict, ids: list[int], prompt: Optional[list[int]]) -> None:
        """vLLM's ``return_token_ids`` on an answer or chunk ``obj``: its choice's ``token_ids``
        (the answer's tokens it carries) and, when ``prompt`` is given (a whole answer, or a
        stream's first chunk), ``prompt_token_ids``: at the top level on chat, on the choice on
        the legacy completions endpoint, as vLLM places them."""
        choice = obj["choices"][0]
        choice["token_ids"] = [int(t) for t in ids]
        if prompt is not None:  # an array (`GenRequest.ids`): numpy's ints are not JSON's
            (obj if self.kind == "chat" else choice)["prompt_token_ids"] = (
                prompt.tolist() if hasattr(prompt, "tolist") else [int(t) for t in prompt])

    def usage_chunk(self, usage: dict) -> dict:
        out = self._base()
        out["choices"] = []
        out["usage"] = usage
        return out

    def full(self, content: str, reasoning: str, tool_calls: list, finish_reason: str, usage: dict,
             stop_reason: Optional[str] = None, lps=()) -> dict:
        out = self._base()
        if self.kind == "chat":
            msg = {"role": "assistant", "content": content or (None if tool_calls else "")}
            if reasoning and self.reasoning:
                msg["reasoning"] = msg["reasoning_content"] = reasoning  # both names: see `chunk`
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out["choices"] = self._choice({"index": self.index, "message": msg, "finish_reason": finish_reason,
                                           "logprobs": self._logprobs(lps)}, stop_reason)
        else:
            out["choices"] = self._choice({"index": self.index, "text": content, "finish_reason": finish_reason,
                                           "logprobs": self._logprobs(lps)}, stop_reason)
        out["usage"] = usage
        return out
