"""Logits processors for vLLM's request fields (mlx-lm's processor interface,
``processor(tokens, logits) -> logits``, called once per sampled token): ``allowed_token_ids``,
``bad_words`` and ``min_tokens``. Each masks token ids with -inf; the masks are made at the
first call, when the logits' size (the model's vocabulary) is known.
"""

from __future__ import annotations

import numpy as np


def token_mask(vocab: int, ids, masked: bool = True):
    """An additive (vocab,) float32 mask: -inf at ``ids`` (``masked``) or everywhere but at
    ``ids`` (not ``masked``), 0 elsewhere; ids past ``vocab`` are ignored."""
    mask = np.zeros(vocab, dtype=np.float32) if masked else np.full(vocab, -np.inf, dtype=np.float32)
    mask[[t for t in ids if t < vocab]] = -np.inf if masked else 0.0
    return mask


class AllowedTokens:
    """vLLM's ``allowed_token_ids``: every other token's logit reads -inf, so only ``ids`` are
    sampled."""

    def __init__(self, ids):
        self.ids = sorted(set(ids))
        self._mask = None

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if self._mask is None:
            self._mask = mx.array(token_mask(logits.shape[-1], self.ids, masked=False))
        return logits + self._mask.astype(logits.dtype)


def bad_words_ids(tokenizer, words) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word as written at the text's start and,
    when that tokenizes to as many tokens with another first one, after a space (vLLM's rule,
    ``get_bad_words_logits_processors``: a word is banned at the beginning and in the middle)."""
    out: list[list[int]] = []
    for w in words:
        first = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        if not first:
            continue
        out.append(list(first))
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != first[0] and len(spaced) == len(first):
            out.append(list(spaced))
    return out


class BadWords:
    """vLLM's ``bad_words`` (`bad_words_ids`): a one-token word is never sampled; a longer
    one's last token is masked whenever the answer so far ends with the rest of it (vLLM's
    ``NoBadWordsLogitsProcessor``; the answer's own tokens, not the prompt's). Reads each
    sampled token back (one ``.item()`` a step, a sync that stalls MLX's pipelined decode) only
    when a word is longer than one token: one-token words are a fixed mask."""

    def __init__(self, sequences: list[list[int]]):
        self.single = sorted({s[0] for s in sequences if len(s) == 1})
        self.longer = [s for s in sequences if len(s) > 1]
        self.generated: list[int] = []
        self.calls = 0
        self._mask = None

    def __call__(self, tokens, logits):
        import mlx.core as mx

        vocab = logits.shape[-1]
        if self._mask is None:
            self._mask = mx.array(token_mask(vocab, self.single))
        if not self.longer:
            return logits + self._mask.astype(logits.dtype)
        if self.calls:
            self.generated.append(int(tokens[-1].item()))
        self.calls += 1
        n = len(self.generated)
        hits = [s[-1] for s in self.longer if len(s) - 1 <= n and self.generated[n - len(s) + 1:] == s[:-1]]
        mask = self._mask + mx.array(token_mask(vocab, hits)) if hits else self._mask
        return logits + mask.astype(logits.dtype)


class MinTokens:
    """vLLM's ``min_tokens``: the first ``n`` tokens sampled are never one of ``banned``
    (end-of-sequence and stop tokens), whose logits read -inf. A step where nothing else is
    left (a grammar that allows only end-of-sequence) is left as it was: the constraint wins."""

    def __init__(self, n: int, banned):
        self.left = n
        self.banned = sorted(set(banned))
        self._mask = None

    def __call__(self, tokens, logits):
        if self.left <= 0 or not self.banned:
            return logits
        import mlx.core as mx

        self.left -= 1
        if self._mask is None:
            self._mask = mx.array(token_mask(logits.shape[-1], self.banned))
        out = logits + self._mask.astype(logits.dtype)
        return mx.where(mx.isinf(out).all(), logits, out)
