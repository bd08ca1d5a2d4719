"""Per-model tokenizers in the gateway, identical to the backends'.

Loads each model's tokenizer with mlx-lm's ``load_tokenizer`` (transformers
underneath, plus mlx-lm's per-model template arguments), so the token ids the
gateway hashes and forwards are the ones the backend would compute
(`tests/test_tokenize.py`). Chats are tokenized through a per-model
`gateway.segcache.SegmentEncoder` (token ids cached per template segment, same
ids, `tests/test_segment_cache.py`) when the tokenizer allows it; so are
text-completion prompts, with the special tokens the tokenizer adds around them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

from mlxgw import prompt as prompt_mod
from mlxgw.prompt import ChatPrompt

from .segcache import DEFAULT_CACHE_BYTES, SegmentEncoder, special_affixes

log = logging.getLogger("mlxgw.gateway.tokenize")


INLINE_CHARS = 2048  # chat text up to this many characters is rendered on the event loop


def _text_chars(messages) -> int:
    """Characters of string message contents; other content shapes count as large."""
    n = 0
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        n += len(c) if isinstance(c, str) else (0 if c is None else INLINE_CHARS)
    return n


@dataclass
class ModelInfo:
    """A served model as the gateway knows it: name, local path, tokenizer, context (tokens),
    its token-id segment cache (None: the tokenizer needs the plain path) and the special-token
    ids put around a text prompt (`gateway.segcache.special_affixes`; None: plain path for text);
    ``fingerprint`` is `mlxgw.prompt.tokenizer_fingerprint` of its tokenizer, which a backend must
    share to be routed to."""

    name: str
    path: str
    tokenizer: object
    context_length: int
    segments: Optional[SegmentEncoder] = None
    text_affixes: Optional[tuple[list[int], list[int]]] = None
    fingerprint: str = ""


def read_context_length(path: Path) -> int:
    """Context length in tokens from ``config.json`` (``max_position_embeddings`` and kin)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return 32768
    for k in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
        v = cfg.get(k) or (cfg.get("text_config") or {}).get(k)
        if isinstance(v, int) and v > 0:
            return v
    return 32768


def load_model_info(name: str, path: str, segment_cache_bytes: int = DEFAULT_CACHE_BYTES) -> ModelInfo:
    """Load one model's tokenizer and, when it is safe and ``segment_cache_bytes`` > 0,
    its `SegmentEncoder` with that LRU budget (bytes).

    Raises:
        FileNotFoundError: ``path`` is not a local model directory.
    """
    from mlx_lm.utils import load_tokenizer

    p = Path(path).expanduser()
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no model directory at {path}")
    tok = load_tokenizer(p)
    hf = getattr(tok, "_tokenizer", tok)
    segments = SegmentEncoder.create(hf, segment_cache_bytes)
    affixes = special_affixes(hf) if segments is not None else None
    return ModelInfo(name, str(p), tok, read_context_length(p), segments, affixes,
                     prompt_mod.tokenizer_fingerprint(tok))


class Tokenizers:
    """The gateway's models: name -> `ModelInfo`, loaded at start or on first use.

    Args:
        segment_cache_bytes: per-model budget of the token-id segment cache; 0 disables it.
    """

    def __init__(self, segment_cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.models: dict[str, ModelInfo] = {}
        self.segment_cache_bytes = segment_cache_bytes

    def add(self, name: str, path: str) -> ModelInfo:
        info = load_model_info(name, path, self.segment_cache_bytes)
        self.models[name] = info
        return info

    def get(self, name: str) -> Optional[ModelInfo]:
        return self.models.get(name)

    async def render_chat(self, info: ModelInfo, messages, tools, template_kwargs) -> ChatPrompt:
        """Template + tokenize off the event loop (a cold 30k-token prompt takes tens of ms)."""
        encode = info.segments.encode if info.segments is not None else None
        work = partial(prompt_mod.render_chat, info.tokenizer, messages, tools, template_kwargs, encode)
        return await _run(work, inline=not tools and _text_chars(messages) < INLINE_CHARS)

    async def encode(self, info: ModelInfo, text: str) -> list[int]:
        """A text-completion prompt's ids, those of `mlxgw.prompt.encode_text` (mlx-lm's server),
        through the segment cache when the tokenizer allows it; off the event loop when long."""
        if info.segments is not None and info.text_affixes is not None:
            work = partial(_affixed, info.segments, info.text_affixes, text)
        else:
            work = partial(prompt_mod.encode_text, info.tokenizer, text)
        return await _run(work, inline=len(text) < INLINE_CHARS)


async def _run(work, inline: bool):
    """``work()`` on the event loop when ``inline`` (a short prompt: ~0.2 ms, cheaper than the hop
    to a worker thread and back), else in the default executor."""
    if inline:
        return work()
    return await asyncio.get_running_loop().run_in_executor(None, work)


def _affixed(segments: SegmentEncoder, affixes: tuple[list[int], list[int]], text: str) -> list[int]:
    return [*affixes[0], *segments.encode(text), *affixes[1]]
