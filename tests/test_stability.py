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


def test_two_agents_with_one_opening_and_their_own_system_prompts_are_no_drift(demo_model):
    """helper-92: agents A and B, each with its own system prompt, opened with the same exchange
    (greedy replies, or a client's fixed first message); A's next turn was compared with B's
    prompt and logged as a drift. A's own earlier prompt is its history; a system prompt changed
    between two turns of one conversation (with none of the old one filed) still is a drift."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(demo_model))
    body = words(100, seed=5)
    opening = [{"role": "user", "content": "Fix the failing tests."},
               {"role": "assistant", "content": "Running them now."}, {"role": "user", "content": "go on"}]
    more = [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    d = DriftDetector()

    def turn(system: str, hist: list):
        msgs = [{"role": "system", "content": system}] + hist
        return d.observe("m", msgs, render_chat(tok, msgs).token_ids)

    assert turn("You are agent A. " + body, opening) is None
    assert turn("You are agent B. " + body, opening) is None and d.checks == 0  # nothing of 1 exchange filed
    assert turn("You are agent A. " + body, opening + more) is None
    assert turn("You are agent B. " + body, opening + more) is None
    assert d.checks == 2 and d.drifts == 0  # each compared with its own first turn
    # A third agent's system prompt was never filed with this history: a changed system prompt
    drift = turn("You are agent C. " + body, opening + more + more)
    assert drift is not None and d.drifts == 1 and drift.shared_messages == 5
    ids_b = render_chat(tok, [{"role": "system", "content": "You are agent B. " + body}] + opening + more).token_ids
    ids_c = render_chat(tok, [{"role": "system", "content": "You are agent C. " + body}] + opening + more + more).token_ids
    assert drift.diverged_at == common_prefix(ids_b, ids_c) and 5 < drift.diverged_at < 15  # at "B" / "C"
