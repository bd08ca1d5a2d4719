"""Constrained decoding: forced tool calls (``tool_choice`` "required" or a named
function) and JSON answers (``response_format`` ``json_schema`` / ``json_object``).

A logits processor masks every token the grammar of a well-formed tool call
does not allow, so the model itself writes the call and mlx-lm's own tool
parser (``ToolCallFormatter`` in ``backend.render``) reads it back, exactly
as for an unforced call. The grammar is the model's tool-call syntax around
the tool's JSON schema; masks come from llguidance (the Rust engine behind
Guidance, also used by vLLM/SGLang), which handles any tokenizer and JSON
schema at a few microseconds per token.

Only mlx-lm's ``json_tools`` syntax (``<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>``, Qwen/Hermes style; the demo model's) is built here; for
another tool parser the request is answered unforced (logged once).
Once the call is complete the processor allows only the end-of-turn token.

A JSON response format is the same processor with the grammar of one JSON value
of the schema (``{"type": "object"}`` for ``json_object``), from the answer's
first token: the model writes the JSON as its whole answer (OpenAI's structured
outputs); a forced tool call takes precedence when a request has both.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional

import numpy as np

from mlxgw.protocol import RequestError, forced_tool_names

log = logging.getLogger("mlxgw.backend.toolchoice")

_LLTOK: dict[int, Any] = {}
_WARNED: set[str] = set()


def _lltokenizer(tokenizer):
    import llguidance.hf

    key = id(tokenizer)
    if key not in _LLTOK:
        _LLTOK[key] = llguidance.hf.from_tokenizer(tokenizer._tokenizer)
    return _LLTOK[key]


def forced_tools(tools: Optional[list], tool_choice) -> Optional[list[dict]]:
    """The function definitions a ``tool_choice`` forces a call to (None: nothing is forced);
    the forms and their rules are `mlxgw.protocol.forced_tool_names`'.

    Raises:
        RequestError: 400, as `forced_tool_names`.
    """
    names = forced_tool_names(tools, tool_choice)
    if names is None:
        return None
    fns = [t.get("function") or {} for t in tools or [] if t.get("type", "function") == "function"]
    return [f for f in fns if f.get("name") in names]


def _token_or_text(tokenizer, text: str) -> str:
    """A lark item for ``text``: its single token when it is one (e.g. ``<tool_call>``), else the literal."""
    tid = tokenizer._tokenizer.convert_tokens_to_ids(text)
    if isinstance(tid, int) and tid != tokenizer._tokenizer.unk_token_id and tid is not None:
        return f"<[{tid}]>"
    return json.dumps(text)


def call_grammar(tokenizer, fns: list[dict]) -> str:
    """A lark grammar (llguidance dialect) of one json_tools call to any of ``fns``."""
    start = _token_or_text(tokenizer, tokenizer.tool_call_start)
    end = _token_or_text(tokenizer, tokenizer.tool_call_end)
    lines, alts = [], []
    for i, f in enumerate(fns):
        head = json.dumps('\n{"name": ' + json.dumps(f.get("name")) + ', "arguments": ')
        lines.append(f"args{i}: %json {_compact(f.get('parameters') or {'type': 'object'})}")
        alts.append(f"{head} args{i}")
    return "\n".join([f"start: {start} call {end}", "call: (" + " | ".join(alts) + ') "}\\n"', *lines])


def _compact(schema: dict) -> str:
    """``schema`` for llguidance's ``%json``, asking for compact, deterministic JSON, as models write it."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                                                "item_separator": ", "}})


def json_grammar(schema: dict) -> str:
    """A lark grammar (llguidance dialect) of one JSON value matching ``schema``."""
    return f"start: answer\nanswer: %json {_compact(schema)}"


def constraint_grammar(kind: str, value) -> str:
    """A lark grammar (llguidance dialect) of vLLM's ``guided_json`` (``kind`` "json": a JSON
    value of the schema), ``guided_choice`` ("choice": one of the strings, verbatim) or
    ``guided_regex`` ("regex": text the whole pattern matches, Rust regex syntax, as vLLM's
    llguidance and xgrammar back ends take it)."""
    if kind == "json":
        return json_grammar(value)
    if kind == "choice":
        return "start: " + " | ".join(json.dumps(c) for c in value)
    return "start: /" + value.replace("/", "\\/") + "/"


def _reason(error: str) -> str:
    """llguidance's compile error without its position and grammar dump: ``at 3(8): failed
    to compile JSON schema: Invalid type: x\n 1 | start: <[3066]> ...`` -> ``Invalid type: x``.
    A message of several lines keeps them, carets dropped (helper-66: a regex error was cut to
    ``regex parse error:``): ``regex parse error: (( error: unclosed group``."""
    lines = []
    for ln in error.strip().splitlines():
        if re.match(r"\s*\d+ \|", ln):  # the grammar dump begins
            break
        if ln.strip() and set(ln.strip()) != {"^"}:
            lines.append(ln.strip())
    return re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", " ".join(lines) or error.strip())


class GrammarMask:
    """mlx-lm logits processor: ``(tokens, logits) -> logits`` with disallowed tokens at -inf.

    ``tokens`` ends with the previous step's token (the last prompt token on
    the first call), as mlx-lm's generators pass it.
    """

    def __init__(self, tokenizer, grammar: str, what: str = "this tool call", param: str = "tools"):
        from llguidance import LLMatcher
        import llguidance.numpy as lln

        self._lln = lln
        lt = _lltokenizer(tokenizer)
        self.matcher = LLMatcher(lt, LLMatcher.grammar_from_lark(grammar))
        if self.matcher.is_error():
            raise RequestError(f"cannot constrain the answer to {what}: {_reason(self.matcher.get_error())}",
                               param=param)
        self.mask = lln.allocate_token_bitmask(1, lt.vocab_size)
        self.eos = list(tokenizer.eos_token_ids)
        self.calls = 0

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self.calls:
            self.matcher.consume_token(int(tokens[-1].item()))
        self.calls += 1
        vocab = logits.shape[-1]
        if self.matcher.is_stopped() or self.matcher.is_error():
            allowed = np.zeros(vocab, dtype=bool)
            allowed[[e for e in self.eos if e < vocab]] = True
        else:
            self._lln.fill_next_token_bitmask(self.matcher, self.mask, 0)
            bits = np.unpackbits(self.mask[0].view(np.uint8), bitorder="little").astype(bool)
            allowed = np.zeros(vocab, dtype=bool)
            n = min(vocab, bits.shape[0])
            allowed[:n] = bits[:n]
        return mx.where(mx.array(allowed), logits, -mx.inf)


def _refuse_control_text(tokenizer, texts: list[str], param: str) -> None:
    """A choice or a pattern's literal text holding an added token's text (``<|im_end|>``,
    ``<tool_call>``): the tokenizer reads that text as the control token, which llguidance's
    mask offers and its parser then refuses, so the answer stopped there, silently short of the
    pattern (helper-79: ``a<|im_start|>b`` answered ``a``).

    Raises:
        RequestError: 400 naming ``param`` and the token.
    """
    added = getattr(tokenizer._tokenizer, "added_tokens_decoder", {}) or {}
    for t in added.values():
        text = str(getattr(t, "content", t))
        if len(text) > 1 and any(text in x for x in texts):
            raise RequestError(f"'{param}' holds {text!r}, the text of one of the model's control tokens, which "
                               "cannot be written as text: the answer could not match it", param=param)


def constrained_processors(tokenizer, tools, tool_choice, constraint: Optional[tuple] = None) -> list:
    """The logits processors a request needs: a forced tool call (``tool_choice``), else the
    answer's ``constraint`` (``(kind, value, param)``, `mlxgw.protocol.structured_output`: a
    JSON schema from ``response_format`` or vLLM's ``guided_json``, a choice or a regex), else
    none ([]).

    Raises:
        RequestError: 400 for an impossible ``tool_choice``, or a schema or regex llguidance
            refuses, or a choice or pattern holding a control token's text.
    """
    fns = forced_tools(tools, tool_choice)
    if not fns:
        if constraint is None:
            return []
        kind, value, param = constraint
        what = {"json": "this JSON schema", "choice": "one of these choices"}.get(kind, "this regular expression")
        if kind != "json":
            _refuse_control_text(tokenizer, value if kind == "choice" else [re.sub(r"\\(.)", r"\1", value)], param)
        return [GrammarMask(tokenizer, constraint_grammar(kind, value), what, param)]
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    if not module.endswith(".json_tools") or not tokenizer.tool_call_start:
        if module not in _WARNED:
            _WARNED.add(module)
            log.warning("tool_choice forcing is only built for mlx-lm's json_tools syntax; this model uses %r: "
                        "answering unforced", module or None)
        return []
    return [GrammarMask(tokenizer, call_grammar(tokenizer, fns))]
