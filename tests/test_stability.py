"""Prefix stability: volatile-line stripping and the drift detector, on the real tokenizer."""

from pathlib import Path

from gateway.stability import DEFAULT_STRIP, DriftDetector, common_prefix, compile_patterns, strip_volatile
from mlxgw.prompt import render_chat
from texts import words


def test_billing_header_line_removed_from_system_only():
    pats = compile_patterns(DEFAULT_STRIP)
    sys_text = "x-anthropic-billing-header: cc_version=2.1.0; cch=9f3a;\nYou are Claude Code."
    msgs = [{"role": "system", "content": sys_text},
            {"role": "user", "content": "x-anthropic-billing-header: quoted on purpose"}]
    out = strip_volatile(msgs, pats)
    assert out[0]["content"] == "You are Claude Code."
    assert out[1] is msgs[1]
    assert msgs[0]["content"] == sys_text  # the caller's messages are not mutated
    assert strip_volatile(msgs, []) is msgs
    clean = [{"role": "system", "content": "no header"}]
    assert strip_volatile(clean, pats) is clean


def test_drift_found_at_the_changed_token(demo_model):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(demo_model))
    body = words(100, seed=4)
    hist = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    t1 = [{"role": "system", "content": "Date: 2025-01-01. " + body}] + hist
    d = DriftDetector()
    ids1 = render_chat(tok, t1).token_ids
    assert d.observe("m", t1, ids1) is None and d.checks == 0  # nothing filed yet

    # The next turn with the same system prompt: no drift.
    t2 = t1 + [{"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]
    assert d.observe("m", t2, render_chat(tok, t2).token_ids) is None and d.checks == 1

    # The same next turn with the date re-rendered: drift where the date differs.
    t2b = [{"role": "system", "content": "Date: 2025-01-02. " + body}] + t2[1:]
    ids2b = render_chat(tok, t2b).token_ids
    drift = d.observe("m", t2b, ids2b)
    assert drift is not None and d.drifts == 1
    assert drift.diverged_at == common_prefix(ids1, ids2b) and 3 < drift.diverged_at < 20
    assert drift.previous_tokens == len(ids1) and drift.shared_messages == 3
    # Other models never compare.
    assert d.observe("other", t2b, ids2b) is None and d.drifts == 1
