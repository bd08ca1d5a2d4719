"""Prefix stability: keep a conversation's prompt a prefix of its next one.

A prefix cache only pays when turn N+1's tokens start with turn N's. Two
things break that and are handled here, before and after templating:

* `strip_volatile` removes per-request lines from system messages. The
  default pattern is Claude Code's ``x-anthropic-billing-header: ...;
  cch=<hash>;`` line, which changes on every request (exo PR 1552 measured a
  0.2% hit rate with it, 98.5% once stripped). Configurable with
  ``--strip-line REGEX`` (repeatable) and ``--no-strip``; clients can also
  set ``CLAUDE_CODE_ATTRIBUTION_HEADER=0``.
* `DriftDetector` notices when a conversation's new prompt shares much less
  with its previous prompt than their common message history says it should
  (a template re-rendering old turns, e.g. dropping thinking blocks, or a
  date in the system prompt), logs the token position where they diverge
  and counts it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from mlxgw.prompt import SYSTEM_ROLES

log = logging.getLogger("mlxgw.gateway.drift")

#: Claude Code's per-request attribution line (a whole line of a system block).
BILLING_HEADER = r"^x-anthropic-billing-header:.*$"
DEFAULT_STRIP = (BILLING_HEADER,)


def compile_patterns(patterns) -> list[re.Pattern]:
    """Multiline regexes, each matching whole lines to remove.

    Raises:
        re.error: an invalid pattern (at startup).
    """
    return [re.compile(p, re.MULTILINE) for p in patterns]


def strip_volatile(messages: list[dict], patterns: list[re.Pattern]) -> list[dict]:
    """Remove lines matching ``patterns`` (and their line break) from system/developer messages.

    Other messages are never touched: a user may quote such a line on purpose.
    Returns the same list when nothing matched.
    """
    if not patterns:
        return messages
    out, changed = [], False
    for m in messages:
        c = m.get("content")
        if m.get("role") in SYSTEM_ROLES and isinstance(c, str):
            new = c
            for p in patterns:
                new = p.sub("", new)
            if new != c:
                new = re.sub(r"\A\n+", "", re.sub(r"\n{3,}", "\n\n", new)) if new.strip() else ""
                m, changed = {**m, "content": new}, True
        out.append(m)
    return out if changed else messages


def _digest(h: "hashlib._Hash", m: dict) -> None:
    h.update(json.dumps([m.get("role"), m.get("content"), m.get("tool_calls"), m.get("tool_call_id")],
                        sort_keys=True, default=str).encode())
    h.update(b"\x00")


@dataclass
class Drift:
    """One detected drift: the previous prompt of the same history diverged early."""

    model: str
    previous_tokens: int
    diverged_at: int
    shared_messages: int


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    # Blocks of 64 first: long prompts share thousands of tokens.
    while i + 64 <= n and a[i:i + 64] == b[i:i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DriftDetector:
    """Remembers recent prompts by their conversation history; flags re-rendered history.

    A prompt is filed under a hash of its non-system messages, and again under
    that hash with its system messages: a new prompt whose non-system messages
    extend a filed one by at least one message should start with that prompt's
    tokens, except the generation prompt at its end; if the common token
    prefix falls more than ``slack`` tokens short of that, it is a drift.

    Of the filed prompts of the longest shared history, one with the same
    system messages is compared first: the same conversation, whose old turns
    must render the same. Only when none has them is one with other system
    messages compared, so a system prompt changed between two turns (a date in
    it) is caught, while two agents with different system prompts that opened
    with the same exchange (helper-92: identical greedy replies, or a client's
    fixed first message) are not taken for one conversation.

    Args:
        capacity: histories remembered (LRU; 4 bytes per token each, a
            prompt's two filings share one array).
        slack: tokens at the end of a prompt allowed to differ (the generation
            prompt, e.g. ``<|im_start|>assistant\\n``, and a template's
            closing of the last turn).
        min_history: non-system messages the two must share (2: a first
            exchange; shorter histories are too common across sessions).
    """

    def __init__(self, capacity: int = 256, slack: int = 16, min_history: int = 2):
        self.capacity = capacity
        self.slack = slack
        self.min_history = min_history
        self._seen: OrderedDict[tuple, array] = OrderedDict()
        self.drifts = 0
        self.checks = 0
        self.last: Optional[Drift] = None

    def observe(self, model: str, messages: list[dict], ids: list[int]) -> Optional[Drift]:
        """Check ``ids`` against the prompt of the longest filed history, then file it."""
        conv = [m for m in messages if m.get("role") not in SYSTEM_ROLES]
        system = hashlib.blake2b(digest_size=16)
        for m in messages:
            if m.get("role") in SYSTEM_ROLES:
                _digest(system, m)
        sys_key = system.digest()
        h = hashlib.blake2b(model.encode(), digest_size=16)
        keys = []
        for m in conv:
            _digest(h, m)
            keys.append((model, h.copy().digest()))
        found = None
        for k in range(len(keys) - 2, self.min_history - 2, -1):  # strictly shorter histories, longest first
            prev = self._seen.get(keys[k] + (sys_key,))  # this conversation's own, when filed
            if prev is None:
                prev = self._seen.get(keys[k])  # one whose system messages differ
            if prev is not None:
                found = (k + 1, prev)
                break
        drift = None
        cur = array("I", ids)
        if found is not None:
            self.checks += 1
            shared, prev = found
            at = common_prefix(prev, cur)
            if at < len(prev) - self.slack:
                drift = Drift(model, len(prev), at, shared)
                self.drifts += 1
                self.last = drift
                log.warning("prefix drift model=%s: previous prompt of the same %d-message history (%d tokens) "
                            "diverges at token %d", model, shared, len(prev), at)
        if keys:
            for key in (keys[-1], keys[-1] + (sys_key,)):
                self._seen[key] = cur
                self._seen.move_to_end(key)
            while len(self._seen) > 2 * self.capacity:
                self._seen.popitem(last=False)
        return drift
