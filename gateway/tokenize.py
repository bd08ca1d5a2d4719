"""Per-model tokenizers in the gateway, identical to the backends'.

Loads each model's tokenizer with mlx-lm's ``load_tokenizer`` (transformers
underneath, plus mlx-lm's per-model template arguments), so the token ids the
gateway hashes and forwards are the ones the backend would compute
(`tests/test_tokenize.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mlxgw import prompt as prompt_mod
from mlxgw.prompt import ChatPrompt

log = logging.getLogger("mlxgw.gateway.tokenize")


@dataclass
class ModelInfo:
    """A served model as the gateway knows it: name, local path, tokenizer, context (tokens)."""

    name: str
    path: str
    tokenizer: object
    context_length: int


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


def load_model_info(name: str, path: str) -> ModelInfo:
    """Load one model's tokenizer.

    Raises:
        FileNotFoundError: ``path`` is not a local model directory.
    """
    from mlx_lm.utils import load_tokenizer

    p = Path(path).expanduser()
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no model directory at {path}")
    tok = load_tokenizer(p)
    return ModelInfo(name, str(p), tok, read_context_length(p))


class Tokenizers:
    """The gateway's models: name -> `ModelInfo`, loaded at start or on first use."""

    def __init__(self):
        self.models: dict[str, ModelInfo] = {}

    def add(self, name: str, path: str) -> ModelInfo:
        info = load_model_info(name, path)
        self.models[name] = info
        return info

    def get(self, name: str) -> Optional[ModelInfo]:
        return self.models.get(name)

    async def render_chat(self, info: ModelInfo, messages, tools, template_kwargs) -> ChatPrompt:
        """Template + tokenize off the event loop (a 30k-token prompt takes tens of ms)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, prompt_mod.render_chat, info.tokenizer, messages, tools, template_kwargs
        )

    async def encode(self, info: ModelInfo, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, prompt_mod.encode_text, info.tokenizer, text)
