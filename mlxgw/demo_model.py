"""Small deterministic demo models that load like hub checkpoints, fully offline.

A demo model directory holds ``config.json``, ``generation_config.json``,
``model.safetensors`` (seeded random weights, float32), and a byte-level BPE
tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) trained at build time on a text corpus embedded
in this module. Both ``mlx_lm.load(path)`` and
``transformers.AutoTokenizer.from_pretrained(path)`` accept it, and nothing is
fetched from the Hugging Face hub.

The tokenizer copies Qwen2's normalizer, pre-tokenizer and decoder, and
``tokenizer_config.json`` names ``Qwen2Tokenizer`` (transformers 5 picks that
class for ``model_type`` qwen2 whatever the config says, and rebuilds the
pipeline from the vocab and merges, so the two must agree). The chat template
is Qwen2.5's ChatML template with tools. mlx-lm selects its ``json_tools``
parser (``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``)
because the template contains both ``<tool_call>`` and ``tool_call.name``;
it also reports ``has_thinking`` because ``<think>``/``</think>`` are tokens.

Variants (see ``VARIANTS``); times are for mlx's Linux CPU build on 2 cores,
which runs single-threaded on a reference BLAS:

* ``tiny``: qwen2, 2 layers, hidden 64. For tests; ~0.4 s per 2,000-token
  prefill.
* ``bench``: qwen2, 4 layers, hidden 128. ~3 s per 3,000-token prefill.
* ``swa``: llama with one sliding-window layer (window 128) and one full
  layer. Its mlx-lm prompt cache holds a ``RotatingKVCache``, so
  ``mlx_lm.models.cache.can_trim_prompt_cache`` is False once more than 128
  tokens have been processed.

Builds are deterministic: the same variant and seed give the same bytes in
every file (given the same ``tokenizers`` version).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: Bump when the files a build writes change, so cached directories rebuild.
BUILD_VERSION = 1

#: Special tokens: skipped by ``decode(..., skip_special_tokens=True)``.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Added (never split) tokens that stay visible in decoded text, as in Qwen.
ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
#: Size of the trained vocabulary including the special and added tokens.
TOKENIZER_VOCAB_SIZE = 3072

_COMMON = {
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    # Untied, so greedy decoding walks through varied tokens instead of
    # echoing the last prompt token (which tied random embeddings favour).
    "tie_word_embeddings": False,
}

#: Variant name -> model architecture settings for ``config.json``.
#: ``vocab_size`` and the token ids are added at build time from the tokenizer.
VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_COMMON,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "bench": {
        **_COMMON,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "swa": {
        **_COMMON,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 128,
    },
}

# Qwen2's pre-tokenization regex.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's ChatML template with tools; tool-call arguments may be a dict or
# an already-encoded JSON string.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Fixed training text: English prose, code, JSON and chat snippets.
_CORPUS = r'''
A prefix cache stores the attention keys and values computed for a prompt so
that a later request which starts with the same tokens can skip that work.
The gateway sits in front of several model servers. For every request it
tokenizes the conversation, looks up which server already holds the longest
matching prefix, and routes the request there. When no server has a useful
prefix, the request goes to the least loaded server instead.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen
liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz,
judge my vow. The five boxing wizards jump quickly.

Once upon a time there was a small village at the edge of a great forest.
Every morning the baker opened her shop before sunrise, and the smell of fresh
bread drifted down the narrow streets. Children ran to school, farmers drove
their carts to the market, and the old clockmaker wound every clock in town.
One winter the river froze so hard that people walked across it to visit
their neighbours on the other side. They talked about the weather, the
harvest, the price of wheat, and the strange lights seen above the hills.

Machine learning models are trained on large amounts of data. A language
model predicts the next token given the previous tokens. During inference,
the prompt is processed in a single forward pass called prefill, and then
tokens are generated one at a time during decoding. Prefill is limited by
compute, while decoding is usually limited by memory bandwidth. Batching
several requests together improves throughput but can increase latency.

Please summarize the following document in three sentences.
Can you help me write a function that parses a date string?
What is the capital of France? The capital of France is Paris.
Translate "good morning" into Spanish: buenos dias.
I would like to book a table for two people at seven o'clock tonight.
Thanks! That was really helpful. Could you explain it once more, step by step?

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class LRUCache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        value = self.items.pop(key, None)
        if value is not None:
            self.items[key] = value
        return value

    def put(self, key: str, value: bytes) -> None:
        self.items.pop(key, None)
        self.items[key] = value
        while len(self.items) > self.capacity:
            del self.items[next(iter(self.items))]


async def fetch_json(session, url, timeout=10.0):
    async with session.get(url, timeout=timeout) as response:
        response.raise_for_status()
        return await response.json()


import json, os, sys
from pathlib import Path

if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
    for entry in sorted(os.listdir(path)):
        print(json.dumps({"name": entry, "size": os.path.getsize(path / entry)}))

function debounce(fn, wait = 100) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), wait);
  };
}

const users = await fetch("/api/v1/users?limit=20").then((r) => r.json());
console.log(`loaded ${users.length} users`);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    println!("hello, {}!", args.get(1).unwrap_or(&"world".to_string()));
    Ok(())
}

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;
UPDATE orders SET status = 'shipped' WHERE order_id = 4821;

$ pip install --upgrade mlx-lm
$ curl -s http://localhost:8080/v1/chat/completions -H "Content-Type: application/json" -d @request.json
$ git commit -m "Fix off-by-one error in the token counter"

{"model": "demo", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
{"id": "chatcmpl-123", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}], "usage": {"prompt_tokens": 42, "completion_tokens": 7}}

# Installation

1. Create a virtual environment: `python -m venv .venv`
2. Install the package with `pip install -e .`
3. Run the tests with `pytest -q`.

| Model | Layers | Hidden size | Parameters |
|-------|--------|-------------|------------|
| small | 12     | 768         | 124M       |
| large | 24     | 1024        | 355M       |

Error: connection refused (os error 111). Retrying in 2.5 seconds...
WARNING: request 7f3a9c timed out after 30000 ms; upstream=10.0.0.12:8080
INFO 2024-05-17 12:34:56,789 served 1,024 tokens in 0.83 s (1233.7 tok/s)
'''

_WORD_POOL = (
    "cache key value token prompt model server request response stream batch "
    "queue worker route prefix length window layer head tensor array buffer "
    "user session client config path file name size count index offset limit "
    "time date number string list dict map set item node tree graph edge "
    "read write load save open close start stop parse format encode decode "
    "get put add remove update create delete find match sort merge split join "
    "river forest village market winter summer morning evening garden window "
    "happy quiet bright simple careful gentle rapid silent golden ancient "
    "weather city music letter story question answer reason method result"
).split()

_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar".split()


class _Rng:
    """Tiny RNG built only on ``random.Random.random``, whose output for an
    integer seed Python guarantees across versions (``choice``/``shuffle``
    are not guaranteed)."""

    def __init__(self, seed: int) -> None:
        self._r = random.Random(seed)

    def below(self, n: int) -> int:
        return int(self._r.random() * n)

    def pick(self, seq):
        return seq[self.below(len(seq))]


def _training_lines(seed: int = 0) -> list[str]:
    """Return the deterministic tokenizer training text, one entry per line."""
    rng = _Rng(seed)
    words = _WORD_POOL + [w.strip(".,!?\"'()").lower() for w in _CORPUS.split()]
    words = sorted({w for w in words if w.isalpha()})
    lines = _CORPUS.splitlines(keepends=True) * 4
    for _ in range(3000):
        kind = rng.below(6)
        a, b, c = rng.pick(words), rng.pick(words), rng.pick(words)
        if kind == 0:
            n = 6 + rng.below(12)
            sentence = " ".join(rng.pick(words) for _ in range(n))
            lines.append(sentence.capitalize() + rng.pick(".?!") + "\n")
        elif kind == 1:
            lines.append(f"def {a}_{b}({c}, {b}=None):\n    return {c}.{a}({b})\n")
        elif kind == 2:
            camel = a + b.capitalize() + c.capitalize()
            lines.append(f"const {camel} = new {b.capitalize()}{c.capitalize()}();\n")
        elif kind == 3:
            value = rng.below(100000)
            lines.append(f'{{"name": "{a}_{b}", "arguments": {{"{c}": {value}}}}}\n')
        elif kind == 4:
            who = rng.pick(_NAMES)
            lines.append(f"{who} asked about the {a} {b}; the answer was {c}.\n")
        else:
            lines.append(
                f"{rng.below(10000)}.{rng.below(100):02d} {a} "
                f"{rng.below(2030):04d}-{1 + rng.below(12):02d}-{1 + rng.below(28):02d}\n"
            )
    return lines


def _train_tokenizer(seed: int = 0):
    """Train and return the byte-level BPE ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Regex, Tokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS) - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_lines(seed), trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS]
    )
    return tok


def _tokenizer_files(tok, max_length: int) -> dict[str, Any]:
    """Return the JSON documents describing ``tok`` for transformers."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "unk_token": None,
        **special_map,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "split_special_tokens": False,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": special_map}


def _random_weights(model, seed: int) -> dict:
    """Return seeded weights for ``model``'s parameters as mlx float32 arrays.

    Values come from numpy's PCG64 stream so they do not depend on mlx's
    initializers: norms are 1, biases 0, other tensors N(0, 0.02).
    """
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        if "norm" in name:
            value = np.ones(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            value = np.zeros(shape, dtype=np.float32)
        else:
            value = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        weights[name] = mx.array(value)
    return weights


def _write_model(directory: Path, variant: str, seed: int) -> None:
    """Write every file of ``variant`` into the existing empty ``directory``."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    tok = _train_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = {
        **VARIANTS[variant],
        "vocab_size": vocab_size,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    weights = _random_weights(model, seed)
    model.load_weights(list(weights.items()))  # checks names and shapes
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})

    documents = {
        "config.json": dict(sorted(config.items())),
        "generation_config.json": {
            "bos_token_id": pad,
            "eos_token_id": [eos, pad],
            "pad_token_id": pad,
        },
        **_tokenizer_files(tok, config["max_position_embeddings"]),
    }
    for name, doc in documents.items():
        text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
        (directory / name).write_text(text, encoding="utf-8")
    (directory / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")


def build_demo_model(out_dir: str | os.PathLike, variant: str = "tiny", seed: int = 0) -> Path:
    """Build the demo model ``variant`` into the new directory ``out_dir``.

    The files are written to a temporary directory next to ``out_dir`` which is
    then renamed into place, so ``out_dir`` is either absent or complete.
    Building takes a fraction of a second once mlx-lm is imported. ``seed``
    (an int) selects the random weights; the tokenizer is the same for every
    seed.

    Returns the absolute path of ``out_dir``.

    Raises:
        KeyError: ``variant`` is not in ``VARIANTS``.
        FileExistsError: ``out_dir`` already exists (also when a concurrent
            build got there first; use ``ensure_demo_model`` to share one).
        OSError: the parent directory cannot be created or written.
    """
    if variant not in VARIANTS:
        raise KeyError(f"unknown demo model variant {variant!r}; choose from {sorted(VARIANTS)}")
    out = Path(out_dir).expanduser().absolute()
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private
        _write_model(tmp, variant, seed)
        try:
            os.rename(tmp, out)
        except OSError as e:  # a concurrent build renamed first
            if out.exists():
                raise FileExistsError(f"{out} already exists") from e
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def holds_demo_model(path: str | os.PathLike, variant: str = "tiny") -> bool:
    """True when the directory ``path`` holds a built demo model ``variant``: its weights and
    tokenizer files, and a ``config.json`` with the variant's settings (a build is complete or
    absent, so these say it was built; every build of a variant is the same, seed 0).
    Never raises: an unreadable or foreign directory is False."""
    d = Path(path).expanduser()
    try:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
        files = all((d / f).is_file() for f in ("model.safetensors", "tokenizer.json"))
    except (OSError, ValueError):
        return False
    want = VARIANTS.get(variant, {})
    return bool(want) and files and isinstance(config, dict) and all(config.get(k) == v for k, v in want.items())


def demo_model_dir(variant: str = "tiny") -> Path:
    """Return the cache path of ``variant``, built or not.

    The path is ``$MLXGW_CACHE_DIR/demo-<variant>-v<BUILD_VERSION>``, with
    ``MLXGW_CACHE_DIR`` defaulting to ``~/.cache/mlxgw``.

    Raises:
        KeyError: ``variant`` is not in ``VARIANTS``.
    """
    if variant not in VARIANTS:
        raise KeyError(f"unknown demo model variant {variant!r}; choose from {sorted(VARIANTS)}")
    root = Path(os.environ.get("MLXGW_CACHE_DIR") or "~/.cache/mlxgw").expanduser()
    return root / f"demo-{variant}-v{BUILD_VERSION}"


def ensure_demo_model(variant: str = "tiny") -> Path:
    """Return ``demo_model_dir(variant)``, building it first if it is missing.

    Concurrent callers (threads or processes) serialize on an ``fcntl.flock``
    lock file next to the directory, so the model is built once.

    Raises:
        KeyError: ``variant`` is not in ``VARIANTS``.
        OSError: the cache directory cannot be created or written.
    """
    path = demo_model_dir(variant)
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.is_dir():
                build_demo_model(path, variant)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path
