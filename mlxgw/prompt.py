"""Prompt rendering shared by gateway and backend, so both tokenize identically.

Both sides load the tokenizer through mlx-lm's own `load_tokenizer` (a
transformers tokenizer wrapped with mlx-lm's per-model template arguments,
such as the thinking switch), and render chats through `render_chat` here.
`tests/test_tokenize.py` pins the result to mlx-lm's own
``TokenizerWrapper.apply_chat_template`` output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .protocol import RequestError, overloaded
from .rlimit import out_of_resources

# Roles whose text counts as the system prompt (exo PR 1817 counts system and
# developer messages).
SYSTEM_ROLES = ("system", "developer")


@dataclass
class ChatPrompt:
    """A rendered prompt.

    Attributes:
        token_ids: the full prompt, generation prompt included.
        system_tokens: length in tokens of the leading system/developer part
            (0 when there is none); the backend saves it as its own cache
            entry and the cache policy uses it as the floor of a good hit.
    """

    token_ids: list[int]
    system_tokens: int = 0


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: Optional[list[dict]] = None,
    template_kwargs: Optional[dict[str, Any]] = None,
    encode: Optional[Callable[[str], list[int]]] = None,
) -> ChatPrompt:
    """Render a chat with the model's template and tokenize it as mlx-lm does.

    Args:
        tokenizer: an mlx-lm ``TokenizerWrapper`` (``mlx_lm.utils.load_tokenizer``).
        messages: OpenAI-style messages (already validated).
        tools: OpenAI-style tool definitions or None.
        template_kwargs: extra chat-template arguments (``chat_template_kwargs``).
        encode: tokenizes the rendered text instead of the template call's
            own tokenization; must return the same ids (the gateway passes
            `gateway.segcache.SegmentEncoder.encode`).

    Returns:
        `ChatPrompt` with the token ids and the system-prompt length in tokens.

    Raises:
        RequestError: 400, the template failed to render these messages (a
            template error is a client error: e.g. roles out of order), or
            ``continue_final_message`` with a last message that has tool calls or no text; 503
            ``overloaded`` when it failed for want of open files or memory.
    """
    kwargs = dict(template_kwargs or {})
    messages = template_roles(tokenizer, messages)
    # ``continue_final_message`` (transformers; Anthropic's assistant prefill sets it): the reply
    # continues the last assistant message, so no new assistant turn is opened. A client's own
    # ``add_generation_prompt`` (validated by `mlxgw.protocol.template_kwargs`) is honoured.
    opens_turn = kwargs.pop("add_generation_prompt", not kwargs.get("continue_final_message"))
    if kwargs.get("continue_final_message") and messages:
        last = messages[-1]
        # transformers cuts the prompt after the last message's text: tool calls after it were
        # dropped without a word, and an empty text cut the whole message (helper-62).
        if last.get("tool_calls") or not (isinstance(last.get("content"), str) and last["content"]):
            raise RequestError("'continue_final_message' needs a last message with text and no tool calls "
                               "(a tool call cannot be continued; leave the flag out to open a new turn)",
                               param="continue_final_message")
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=opens_turn, tokenize=encode is None, **kwargs
        )
    except Exception as e:  # jinja2 TemplateError, TypeError from bad content...
        if out_of_resources(e):  # jinja2 opens files on error paths: the server's trouble, not the client's
            raise overloaded(f"out of open files or memory while rendering the chat template ({e}); "
                             "retry shortly") from e
        raise RequestError(f"the chat template failed to render the messages: {e}", param="messages") from e
    ids = encode(ids) if encode is not None else list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return ChatPrompt(ids, system_prefix_tokens(tokenizer, messages, tools, kwargs, ids, encode))


def template_roles(tokenizer, messages: list[dict]) -> list[dict]:
    """Messages with the roles OpenAI accepts but many chat templates drop renamed.

    ``developer`` becomes ``system`` unless the template names the developer role
    (OpenAI treats the two alike; ChatML-style templates render only system,
    user, assistant and tool, and silently drop the rest). The deprecated
    ``function`` role (a function's result) becomes ``tool``. Gateway and backend
    both render through here, so the token ids stay the same on both sides.
    Returns ``messages`` itself when nothing is renamed.
    """
    template = getattr(tokenizer, "chat_template", None)
    keep_developer = "developer" in str(template or "")
    rename = {"function": "tool"} if keep_developer else {"function": "tool", "developer": "system"}
    if not any(m.get("role") in rename for m in messages):
        return messages
    return [{**m, "role": rename[m["role"]]} if m.get("role") in rename else m for m in messages]


def system_prefix_tokens(tokenizer, messages, tools, kwargs, ids, encode=None) -> int:
    """Tokens of the leading system/developer messages within ``ids``, or of the
    tool definitions when there is no system message.

    The method is mlx-lm's (server ``_tokenize``): render the system messages
    followed by an empty user turn and take the common prefix with the full
    prompt. Chat templates render ``tools`` in the system turn, so with tools
    and no system message the same probe finds the tools block (ours: every
    conversation with those tools shares it, and rule 3 and the system entry
    must protect it as they protect a system prompt). Returns 0 when there is
    neither, or the template fails on the probe.
    """
    n = 0
    for m in messages:
        if m.get("role") in SYSTEM_ROLES:
            n += 1
        else:
            break
    if n == 0 and not tools:
        return 0
    kwargs = {k: v for k, v in kwargs.items() if k != "continue_final_message"}  # the probe ends in a user turn
    try:
        probe = tokenizer.apply_chat_template(
            messages[:n] + [{"role": "user", "content": ""}],
            tools=tools or None,
            add_generation_prompt=False,
            tokenize=encode is None,
            **kwargs,
        )
    except Exception:
        return 0
    probe = encode(probe) if encode is not None else list(probe["input_ids"] if isinstance(probe, dict) else probe)
    end = 0
    for a, b in zip(probe, ids):
        if a != b:
            break
        end += 1
    return end if end < len(ids) else 0


def tokenizer_fingerprint(tokenizer) -> str:
    """16 hex digits (xxh3-64) of the tokenizer's vocabulary: every token string and its id,
    added and special tokens included, in id order.

    Gateway and backend publish and compare it (`gateway.index`): the gateway forwards token
    ids it computed with its own tokenizer, so a backend whose ids mean other tokens (another
    model family served under the same name, a re-trained tokenizer) would answer nonsense.
    Two quantizations of one model share a tokenizer and so a fingerprint. Computed once at
    start (``get_vocab`` of the transformers tokenizer under mlx-lm's wrapper).
    """
    import xxhash

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    text = "".join(f"{i}\t{token}\n" for token, i in sorted(hf.get_vocab().items(), key=lambda kv: kv[1]))
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def encode_text(tokenizer, prompt: str) -> list[int]:
    """Tokenize a text-completion prompt as mlx-lm's server does (``tokenizer.encode``)."""
    return list(tokenizer.encode(prompt))
