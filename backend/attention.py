"""How a prefill token's cost grows with its depth in the context, from a model's config.

A prompt token at depth ``d`` (tokens already in its KV cache) costs the model's matrix
multiplications, the same at any depth, plus attention over ``d`` keys and values, which grows
with it. In FLOPs per token and layer (a multiply-add counted as 2):

* matmuls: ``2 * (h*H*hd + 2*h*KV*hd + H*hd*h + 3*h*I)`` (q, k and v, o, the gated MLP's
  three; ``I`` the active experts' width in a mixture of experts),
* attention: ``4 * H * hd * d`` (scores and the weighted sum of values, full-attention layers
  only),

so a token at depth ``d`` costs ``1 + d / P`` times one at depth 0, with ``P`` (the *attention
parity*, tokens) the depth where the two are equal. Qwen3-4B: 12,320 tokens; the project's
demo model (64 wide): 360. A chunk of a prompt 6,000 tokens deep thus costs the demo model
about 2.6 times what the same tokens cost averaged over a fresh 4,200-token prompt, which is
what helper-95 measured on this machine's CPU (about 0.45 s against 0.17 s a 512-token step;
docs/routing.md, "Seeding an empty backend"). Published measurements agree in shape at long
contexts on Apple Silicon: an M3 Max's prefill at 2k / 16k / 32k of context ran at 323 / 250 /
120 tokens/s (antirez/ds4 issue 917); mlx-lm's DeepSeek-V3 at 4k / 8k / 16k at 213 / 188 / 148
(ml-explore/mlx-lm PR 839).
"""

from __future__ import annotations

from typing import Any, Mapping


def attention_parity_tokens(cfg: Mapping[str, Any]) -> int:
    """The depth (tokens) at which a prompt token's attention FLOPs equal its matmul FLOPs, from a
    Hugging Face ``config.json`` (parsed; a multimodal one's ``text_config`` is used), or 0 when
    the config does not say (missing fields) or no layer attends over the whole context (sliding
    windows or linear attention only: depth then costs nothing more past the window).

    Layers listed in ``layer_types`` count only when ``"full_attention"``; a config with
    ``use_sliding_window`` true and no ``layer_types`` counts as having none."""
    cfg = cfg.get("text_config", cfg) or {}
    try:
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or h // heads)
        width = int(cfg.get("intermediate_size") or 0)
        if cfg.get("num_experts_per_tok") and cfg.get("moe_intermediate_size"):
            width = int(cfg["num_experts_per_tok"]) * int(cfg["moe_intermediate_size"])
            width += int(cfg.get("shared_expert_intermediate_size") or 0)
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        full = sum(t == "full_attention" for t in types) / len(types)
    else:
        full = 0.0 if cfg.get("use_sliding_window") else 1.0
    if full <= 0 or width <= 0 or layers <= 0:
        return 0
    matmul = 2 * (h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * width)
    return round(matmul / (4 * heads * head_dim * full))
