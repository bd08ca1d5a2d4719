"""Per-model tokenizers in the gateway, identical to the backends'.

Loads each model's tokenizer with mlx-lm's ``load_tokenizer`` (transformers
underneath, plus mlx-lm's per-model template arguments), so the token ids the
gateway hashes and forwards are the ones the backend would compute
(`tests/test_tokenize.py`). Chats are tokenized through a per-model
`gateway.segcache.SegmentEncoder` (token ids cached per template segment, same
ids, `tests/test_segment_cache.py`) when the tokenizer allows it.
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

from .segcache import DEFAULT_CACHE_BYTES, SegmentEncoder

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
    and its token-id segment cache (None: the tokenizer needs the plain path)."""

    name: str
    path: str
    tokenizer: object
    context_length: int
    segments: Optional[SegmentEncoder] = None


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
    segments = SegmentEncoder.create(getattr(tok, "_tokenizer", tok), segment_cache_bytes)
    return ModelInfo(name, str(p), tok, read_context_length(p), segments)


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
        if not tools and _text_chars(messages) < INLINE_CHARS:
            return work()  # ~0.2 ms: cheaper than the hop to a worker thread and back
        return await asyncio.get_running_loop().run_in_executor(None, work)

    async def encode(self, info: ModelInfo, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, prompt_mod.encode_text, info.tokenizer, text)
