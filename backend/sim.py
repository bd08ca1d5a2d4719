"""The simulated engine: the real backend with a timing model instead of a model.

``mlxgw backend --engine sim`` runs the same HTTP server, `PromptCache` (every
cache-policy rule), `Reporter` (Redis) and `MLXEngine` request loop as the real
backend. The only object that differs is the batch generator: `SimBatchGenerator`
has the interface of mlx-lm's ``BatchGenerator`` (``insert_segments``, ``next``,
``remove``, ``extract_cache``, ``prompt_cache_nbytes``) and its step structure
(mlx-lm 0.32 ``BatchGenerator._next``: one decode step for every running
sequence, then one prefill chunk of at most ``prefill_step_size`` tokens for each
of at most ``prefill_batch_size`` prompts, the last prompt token being fed by the
first decode step), but it computes nothing: each step sleeps for the modelled
time and the KV caches are `SimKV` token counters.

Timing model (all "real" tokens: a sim token stands for ``token_scale`` real
ones, so a trace replay can send short prompts; see docs/sim.md):

* prefill: ``tokens / prefill_rate`` seconds (compute bound); attention's growth
  with depth is left out unless ``--sim-attention-parity P`` is given: then a
  token at depth d costs ``1 + d/P`` times one at depth 0 (`backend.attention`),
  normalised to the cited benchmark's 2,048-token prompt.
* decode, batched: one step reads the weights once for the whole batch and
  each running sequence's KV once (decode is memory-bandwidth bound):
  ``step = t_weights + sum(context_i) * kv_bytes_per_token / bandwidth`` with
  ``t_weights = 1/decode_rate - ref_context * kv_bytes_per_token / bandwidth``,
  so a lone sequence at ``ref_context`` tokens decodes at exactly
  ``decode_rate``. A real step adds one token to each running sequence; a
  sim output token stands for ``token_scale`` real steps, and a step that
  prefills is one real step (`SimBatchGenerator.next`).
* both times are divided by ``speed`` (a benchmark that compresses trace time
  by C runs the sim C times faster to keep the same load).

Defaults: Qwen3-4B-Instruct-2507 4-bit (``mlx-community/Qwen3-4B-Instruct-2507-4bit``)
on a 64 GB M4 Max, ``mlx_lm.benchmark -p 2048 -g 128`` with mlx-lm 0.28.2:
prompt 1622.27 tok/s, generation 134.52 tok/s (Awni Hannun, "MLX LM
Benchmarks", gist awni/c1790e4c3a39be6e8f1c4afd42423d2d). KV per token from
Qwen3-4B's config.json (36 layers, 8 KV heads, head_dim 128, bf16): 147,456
bytes. Bandwidth: Apple's M4 Max (16-core CPU) figure, 546 GB/s.

Disk (the prompt cache's disk tier, rule 8, and ``--cache-dir`` saves): writing
or reading a KV file takes ``bytes / disk_write_rate`` or ``bytes / disk_read_rate``
seconds (divided by ``speed``), in the engine thread as the real engine's
file I/O is. Defaults: Tom's Guide's Blackmagic Disk Speed Test of a 14-inch
MacBook Pro M2 Max, 2 TB (read 5,319 MB/s, write 6,402 MB/s; MacRumors,
"M2 Pro and M2 Max MacBook Pros Feature Faster SSD Write Speeds, Tests Show",
2023-01-24). Conservative for the M4 Max: The Verge measured an M5 Max at
13.6 GB/s read, which it put at 86% faster than the M4 Max (about 7.3 GB/s).

Output tokens are deterministic: a hash of the prompt's last tokens and the
step, drawn from the tokenizer's ordinary vocabulary (never EOS, so every
answer runs to ``max_tokens``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import xxhash

from mlxgw.util import positive_float

from .cache import KVOps
from .engine import MLXEngine

#: mlx_lm.benchmark on M4 Max 64 GB, Qwen3-4B-Instruct-2507-4bit (see module docstring).
DEFAULT_PREFILL_RATE = 1622.27
DEFAULT_DECODE_RATE = 134.52
DEFAULT_REF_CONTEXT = 2048 + 64  # the benchmark's prompt plus half its generation
BENCH_MEAN_DEPTH = 1024  # the benchmark's 2,048-token prompt: its tokens' mean depth
#: Qwen3-4B config.json: num_hidden_layers, num_key_value_heads, head_dim; bf16.
DEFAULT_LAYERS, DEFAULT_KV_HEADS, DEFAULT_HEAD_DIM, DEFAULT_DTYPE_BYTES = 36, 8, 128, 2
DEFAULT_BANDWIDTH = 546e9  # bytes/s, Apple M4 Max (16-core CPU, 40-core GPU)
#: Bytes/s, Blackmagic Disk Speed Test, MacBook Pro 14" M2 Max 2 TB (see the module docstring).
DEFAULT_DISK_READ_RATE, DEFAULT_DISK_WRITE_RATE = 5.319e9, 6.402e9


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of keys plus values one token adds to a full-attention KV cache."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_config_from_file(path: str | Path) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from a Hugging Face ``config.json``.

    Raises:
        OSError / ValueError / KeyError: unreadable file or missing fields.
    """
    return kv_config(json.loads(Path(path).read_text()))


def kv_config(cfg: dict) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from a parsed Hugging Face ``config.json``.

    Raises:
        KeyError / ValueError / TypeError: missing or odd fields.
    """
    cfg = cfg.get("text_config", cfg)
    layers = int(cfg["num_hidden_layers"])
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return layers, kv_heads, head_dim


@dataclass
class SimTiming:
    """The sim's timing and memory model (see the module docstring); rates in real tokens/s."""

    prefill_rate: float = DEFAULT_PREFILL_RATE
    decode_rate: float = DEFAULT_DECODE_RATE
    kv_bytes_per_token: int = kv_bytes_per_token(DEFAULT_LAYERS, DEFAULT_KV_HEADS, DEFAULT_HEAD_DIM, DEFAULT_DTYPE_BYTES)
    bandwidth: float = DEFAULT_BANDWIDTH
    ref_context: int = DEFAULT_REF_CONTEXT
    token_scale: float = 1.0
    speed: float = 1.0
    disk_read_rate: float = DEFAULT_DISK_READ_RATE
    disk_write_rate: float = DEFAULT_DISK_WRITE_RATE
    #: --sim-attention-parity: real tokens of depth at which a prompt token's attention costs as
    #: much as the rest of its prefill (`backend.attention`); 0: every token costs the same (the
    #: model before session 53, and still the default, so the benchmarks' runs compare).
    attention_parity: int = 0
    fail_after: int = 0  # --sim-fail-after: the engine thread dies past this many requests (0: never)
    hang_after: int = 0  # --sim-hang-after: the engine thread hangs past this many requests (0: never)

    @property
    def t_weights(self) -> float:
        """Seconds per decode step not spent reading KV (floored at 10% of a step)."""
        step = 1.0 / self.decode_rate
        return max(0.1 * step, step - self.ref_context * self.kv_bytes_per_token / self.bandwidth)

    def prefill_seconds(self, sim_tokens: int, depth: int = 0) -> float:
        """Seconds to prefill ``sim_tokens`` of a prompt whose KV already holds ``depth`` sim tokens.

        With ``attention_parity`` P, a token at depth d costs ``1 + d / P`` times one at depth 0
        (`backend.attention`), scaled so the cited benchmark's prompt (2,048 tokens from depth 0,
        mean depth `BENCH_MEAN_DEPTH`) still runs at ``prefill_rate``; without, depth costs nothing."""
        n = sim_tokens * self.token_scale
        t = n / self.prefill_rate / self.speed
        if self.attention_parity > 0:
            p = self.attention_parity
            t *= (1 + (depth * self.token_scale + n / 2) / p) / (1 + BENCH_MEAN_DEPTH / p)
        return t

    def decode_seconds(self, contexts: list[int], real_steps: float = 1.0) -> float:
        """``real_steps`` batched real decode steps over sequences holding ``contexts`` sim tokens each.

        One sim output token stands for ``token_scale`` real decode steps.
        """
        if not contexts:
            return 0.0
        kv = sum(contexts) * self.token_scale * self.kv_bytes_per_token / self.bandwidth
        return (self.t_weights + kv) * real_steps / self.speed

    def nbytes(self, sim_tokens: int) -> int:
        return int(sim_tokens * self.token_scale * self.kv_bytes_per_token)

    def disk_seconds(self, nbytes: int, write: bool) -> float:
        """Time to write (or read) ``nbytes`` of KV to (from) the disk."""
        return nbytes / (self.disk_write_rate if write else self.disk_read_rate) / self.speed


class SimKV:
    """A KV cache that only counts its tokens; bytes come from the `SimTiming`."""

    __slots__ = ("n", "timing")

    def __init__(self, n: int, timing: SimTiming):
        self.n = n
        self.timing = timing

    @property
    def nbytes(self) -> int:
        return self.timing.nbytes(self.n)


class SimKVOps(KVOps):
    """`KVOps` for `SimKV`: always trimmable (a full-attention model). ``timing``: the
    engine's, for KV read back from disk (`load_parts`, `load_kv`)."""

    def __init__(self, timing: Optional["SimTiming"] = None):
        self.timing = timing

    # Persistence (backend.persist) and the disk tier (backend.disktier): a sim KV is its token
    # count; the time its bytes would take on the disk is slept (`SimTiming.disk_seconds`).
    def save_parts(self, parts, path: str) -> None:
        Path(path).write_text(json.dumps({"tokens": parts.n}))
        time.sleep(parts.timing.disk_seconds(parts.nbytes, write=True))

    def load_parts(self, path: str, prefetched: bool = False):
        kv = SimKV(int(json.loads(Path(path).read_text())["tokens"]), self.timing)
        if self.timing is not None and not prefetched:
            time.sleep(self.timing.disk_seconds(kv.nbytes, write=False))
        return kv

    save_kv = save_parts
    load_kv = load_parts

    # The disk tier's write-behind: a sim KV's host copy is itself (its token count).
    def to_host(self, kv):
        return SimKV(kv.n, kv.timing)

    def host_nbytes(self, host) -> int:
        return host.nbytes

    def host_slice(self, host, start: int, end: int, copy: bool = False):
        return SimKV(end - start, host.timing)

    def kv_parts(self, kv):
        return kv

    write_host = save_parts

    def prefetch(self, path: str) -> str:
        """The disk read of a sim file, modelled (the tier's reader thread sleeps its time)."""
        import xxhash

        raw = Path(path).read_bytes()
        if self.timing is not None:
            time.sleep(self.timing.disk_seconds(SimKV(int(json.loads(raw)["tokens"]), self.timing).nbytes, write=False))
        return xxhash.xxh3_128(raw).hexdigest()

    def from_host(self, host):
        return SimKV(host.n, host.timing)

    def nbytes(self, kv) -> int:
        return kv.nbytes

    def trimmable(self, kv) -> bool:
        return True

    def trim(self, kv, n: int) -> None:
        kv.n = max(0, kv.n - max(0, n))

    def copy(self, kv):
        return SimKV(kv.n, kv.timing)

    def prefix(self, kv, length: int, n: int):
        return SimKV(min(n, kv.n), kv.timing)

    # Rule 7 (backend.cache): a segment's parts are a SimKV of its token count.
    def sliceable(self, kv) -> bool:
        return True

    def slice(self, kv, start: int, end: int):
        return SimKV(end - start, kv.timing)

    def parts_nbytes(self, parts) -> int:
        return parts.nbytes

    def split_parts(self, parts, at: int):
        return SimKV(at, parts.timing), SimKV(parts.n - at, parts.timing)

    def join(self, pieces, n: int):
        # As the real join's concatenation: the pieces' counts make the n tokens, each within its piece.
        if sum(m for _, m in pieces) != n or any(not 0 < m <= kv.n for kv, m in pieces):
            raise ValueError(f"pieces of {[(kv.n, m) for kv, m in pieces]} tokens do not join into {n}")
        return SimKV(n, pieces[0][0].timing)


@dataclass
class PromptResponse:
    """Same fields as mlx-lm's ``PromptProcessingBatch.Response``."""

    uid: int
    progress: tuple
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class GenResponse:
    """Same fields as mlx-lm's ``GenerationBatch.Response`` (no logprobs)."""

    uid: int
    token: int
    finish_reason: Optional[str]
    prompt_cache: Any
    all_tokens: Optional[list]


@dataclass
class _Seq:
    uid: int
    segments: list
    max_tokens: int
    kv: SimKV
    tokens: list
    processed: int = 0
    total: int = 0
    generated: int = 0
    salt: int = 0
    extra: dict = field(default_factory=dict)
    acc: float = 0.0  # real decode steps run since its last sim token (see `SimBatchGenerator.next`)


class SimBatchGenerator:
    """mlx-lm ``BatchGenerator``'s interface and step order, with modelled time.

    Args:
        timing: the timing model.
        vocab: (lo, hi) range of ordinary token ids for generated tokens.
        completion_batch_size / prefill_batch_size / prefill_step_size: as in
            mlx-lm (``completion_batch_size`` is raised to at least
            ``prefill_batch_size``, as mlx-lm does).
        sleep, clock: the wait and the clock (``time.sleep``, ``time.perf_counter``;
            tests pass a fake pair).

    Each step ends at a modelled deadline rather than sleeping its modelled
    time after the real work: the real Python time of a step (this object's
    and, while the engine stays busy, the engine loop's between steps) is
    taken out of the sleep. The hardware's measured rates already include its
    own per-step overhead, and the sim's real overhead would otherwise be
    counted on top, multiplied by the sim's ``speed`` in modelled time
    (session 15 measured about 0.4 ms a step: a 4,226-id cold prompt on an idle
    sim backend took 106-124 ms more than its 797 ms of modelled prefill). A
    step that overruns its deadline is caught up by the following steps, by at
    most `MAX_LAG` seconds, so a stall never turns into a burst of free steps.
    """

    #: Most real seconds of overrun a busy sim carries into the following steps.
    MAX_LAG = 0.05

    def __init__(self, timing: SimTiming, vocab: tuple[int, int], completion_batch_size: int = 32,
                 prefill_batch_size: int = 8, prefill_step_size: int = 2048, sleep=time.sleep,
                 clock=time.perf_counter):
        self.timing = timing
        self.vocab = vocab
        self.prefill_batch_size = prefill_batch_size
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.prefill_step_size = prefill_step_size
        self.sleep = sleep
        self.clock = clock
        self._due: Optional[float] = None  # when the last step's modelled time ended, if work was left
        self._uid = 0
        self._unprocessed: deque[_Seq] = deque()
        self._prompt: list[_Seq] = []
        self._gen: list[_Seq] = []

    # -- the BatchGenerator interface the engine uses ---------------------
    def insert_segments(self, segments, max_tokens, caches, all_tokens, **_ignored) -> list[int]:
        """Queue sequences; the last prompt token becomes its own segment (mlx-lm)."""
        uids = []
        for seq, m, c, at in zip(segments, max_tokens, caches, all_tokens):
            seq = [list(s) for s in seq if len(s)]
            if not seq:
                raise ValueError("empty prompt")
            if m <= 0:
                raise ValueError("max_tokens must be > 0")
            if len(seq[-1]) != 1:
                seq.append(seq[-1][-1:])
                seq[-2] = seq[-2][:-1]
            kv = c if c is not None else SimKV(0, self.timing)
            uid = self._uid
            self._uid += 1
            total = sum(len(s) for s in seq)
            tokens = list(at)
            tail = (tokens + [t for part in seq for t in part])[-16:]
            salt = xxhash.xxh3_64_intdigest(repr((len(tokens) + total, tail)).encode())  # same prompt, same output
            self._unprocessed.append(_Seq(uid, seq, m, kv, tokens, 0, total, salt=salt))
            uids.append(uid)
        return uids

    def next(self):
        """One step: decode every running sequence, then one prefill chunk; sleeps the modelled time.

        A step that has prompts to prefill is one real mlx-lm step: one batched
        decode step for the running sequences, then one chunk per prompt. A sim
        output token stands for ``token_scale`` real decode steps, so a running
        sequence emits its next token once it has run that many (``_Seq.acc``);
        a sequence whose prompt just ended emits its first token after one real
        step (TTFT = prefill + one decode step, as on the hardware). A step with
        nothing to prefill runs, at once, the real decode steps until the next
        sequence is due.
        """
        if self.timing.fail_after and self._uid > self.timing.fail_after:
            raise RuntimeError(f"simulated engine failure after {self.timing.fail_after} requests (--sim-fail-after)")
        while self.timing.hang_after and self._uid > self.timing.hang_after:
            time.sleep(1.0)  # a step that never returns (a GPU hang): the HTTP side and heartbeat go on
        began = self.clock()
        gen_resps: list[GenResponse] = []
        prompt_resps: list[PromptResponse] = []
        scale = self.timing.token_scale
        prefill = bool(self._prompt or self._unprocessed) and len(self._gen) < self.completion_batch_size
        steps = 1.0 if prefill else min((scale - s.acc for s in self._gen), default=scale)
        t_decode = self.timing.decode_seconds([len(s.tokens) for s in self._gen], steps)
        keep = []
        for s in self._gen:
            s.acc += steps
            if s.acc < scale - 1e-9:  # tolerance: acc sums float steps
                keep.append(s)
                continue
            s.acc = max(0.0, s.acc - scale)
            tok = self._token(s)
            # mlx-lm feeds each sampled token to the model before returning it
            # (one step of lookahead), so the KV already holds it.
            s.tokens.append(tok)
            s.kv.n += 1
            s.generated += 1
            if s.generated >= s.max_tokens:
                gen_resps.append(GenResponse(s.uid, tok, "length", s.kv, s.tokens))
            else:
                keep.append(s)
                gen_resps.append(GenResponse(s.uid, tok, None, None, None))
        self._gen = keep
        if len(self._gen) >= self.completion_batch_size:
            self._spend(began, t_decode)
            return prompt_resps, gen_resps

        n = min(self.prefill_batch_size - len(self._prompt), self.completion_batch_size - len(self._gen),
                len(self._unprocessed))
        for _ in range(max(0, n)):
            self._prompt.append(self._unprocessed.popleft())

        still = []
        for s in self._prompt:
            if len(s.segments) == 1 and len(s.segments[0]) == 1:
                # mlx-lm's split: the last prompt token is fed as the first decode input.
                s.tokens.append(s.segments[0][0])
                s.kv.n += 1
                s.acc = max(0.0, scale - 1)  # its first token comes after one real decode step
                self._gen.append(s)
                prompt_resps.append(PromptResponse(s.uid, (s.total, s.total), True, True))
            else:
                still.append(s)
        self._prompt = still

        widest = 0
        depths = []
        for s in self._prompt:
            depths.append(len(s.tokens))
            seg = s.segments[0]
            k = min(len(seg), self.prefill_step_size)
            s.tokens.extend(seg[:k])
            s.kv.n += k
            s.segments[0] = seg[k:]
            end_seg = False
            if not s.segments[0]:
                s.segments.pop(0)
                end_seg = True
            s.processed += k
            widest = max(widest, k)
            prompt_resps.append(PromptResponse(s.uid, (s.processed, s.total), end_seg, False))
        # mlx-lm right-pads the step's chunks to the longest, and the model
        # computes the padding too (each chunk at its own prompt's depth).
        self._spend(began, t_decode + sum(self.timing.prefill_seconds(widest, d) for d in depths))
        return prompt_resps, gen_resps

    def _spend(self, began: float, seconds: float) -> None:
        """Wait until this step's modelled ``seconds`` have passed since it began.

        A step begins when `next` is called (``began``, clock seconds), or, when the last step left work
        (the engine calls `next` again at once), when the last step's modelled
        time ended, but at most `MAX_LAG` before now.
        """
        now = self.clock()
        start = began
        if self._due is not None:
            start = max(self._due, now - self.MAX_LAG)
        due = start + seconds
        self.sleep(max(0.0, due - now))
        self._due = due if (self._gen or self._prompt or self._unprocessed) else None

    def _token(self, s: _Seq) -> int:
        lo, hi = self.vocab
        return lo + xxhash.xxh3_64_intdigest(f"{s.salt}:{s.generated}".encode()) % (hi - lo)

    def _find(self, uid: int) -> Optional[tuple[list, _Seq]]:
        for group in (self._unprocessed, self._prompt, self._gen):
            for s in group:
                if s.uid == uid:
                    return group, s
        return None

    def extract_cache(self, uids) -> dict:
        """uid -> (a copy of its KV, the tokens it holds)."""
        out = {}
        for uid in uids:
            f = self._find(uid)
            if f is not None:
                s = f[1]
                out[uid] = (SimKV(s.kv.n, self.timing), list(s.tokens))
        return out

    def remove(self, uids, return_prompt_caches: bool = False) -> dict:
        caches = {}
        for uid in uids:
            f = self._find(uid)
            if f is None:
                continue
            group, s = f
            if return_prompt_caches:
                caches[uid] = (s.kv, list(s.tokens))
            group.remove(s)
        return caches

    @property
    def prompt_cache_nbytes(self) -> int:
        return sum(s.kv.nbytes for g in (self._unprocessed, self._prompt, self._gen) for s in g)


def ordinary_vocab(tokenizer) -> tuple[int, int]:
    """Token ids below the first special/added token (never EOS or a template token)."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(tok, "added_tokens_decoder", None) or {}
    lo = 16  # low ids are often byte or control tokens
    hi = min((a for a in added if a > lo), default=len(tok))
    return (lo, hi)


class SimEngine(MLXEngine):
    """`MLXEngine` with `SimBatchGenerator`: same request loop, cache saves and stats.

    Loads only the tokenizer of ``model_path`` (vocabulary, special tokens, chat
    template, context length from its ``config.json``); no weights are read.
    """

    def __init__(self, model_path: str, cache, cache_bytes: int, timing: SimTiming, **kw):
        super().__init__(model_path, cache, cache_bytes, **kw)
        self.timing = timing

    def decode_steps_per_token(self) -> float:
        """A sim output token stands for ``token_scale`` real decode steps (`SimBatchGenerator.next`)."""
        return self.timing.token_scale

    def attention_parity_tokens(self) -> int:
        """``--sim-attention-parity`` in sim tokens (the gateways' unit), 0 when off."""
        p = self.timing.attention_parity
        return max(1, round(p / self.timing.token_scale)) if p > 0 else 0

    def _load(self) -> None:
        from mlx_lm.utils import load_tokenizer

        from gateway.tokenize import read_context_length

        p = Path(self.model_path).expanduser()
        self.tokenizer = load_tokenizer(p)
        self.trimmable = True  # SimKV: a full-attention model
        self.context_length = read_context_length(p)
        self._vocab = ordinary_vocab(self.tokenizer)
        self._bg = self._new_batch()
        self._init_loop_state()

    def _new_batch(self) -> "SimBatchGenerator":
        bg = SimBatchGenerator(
            self.timing,
            self._vocab,
            completion_batch_size=self.decode_concurrency,
            prefill_batch_size=self.prefill_concurrency,
            prefill_step_size=self.prefill_step_size,
        )
        if getattr(self, "_bg", None) is not None:  # a failed batch's: request numbers (and --sim-fail-after) go on
            bg._uid = self._bg._uid
        return bg


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--sim-*`` flags of ``mlxgw backend`` (used with ``--engine sim``)."""
    g = p.add_argument_group("simulated engine (--engine sim; docs/sim.md)")
    g.add_argument("--sim-prefill-rate", type=positive_float, default=DEFAULT_PREFILL_RATE, help="real prompt tokens/s")
    g.add_argument("--sim-decode-rate", type=positive_float, default=DEFAULT_DECODE_RATE,
                   help="tokens/s of one sequence at --sim-ref-context tokens")
    g.add_argument("--sim-ref-context", type=int, default=DEFAULT_REF_CONTEXT,
                   help="context (tokens) at which --sim-decode-rate was measured")
    g.add_argument("--sim-bandwidth", type=positive_float, default=DEFAULT_BANDWIDTH, help="memory bandwidth, bytes/s")
    g.add_argument("--sim-model-config", help="a config.json to take layers/KV heads/head dim from")
    g.add_argument("--sim-layers", type=int, default=DEFAULT_LAYERS)
    g.add_argument("--sim-kv-heads", type=int, default=DEFAULT_KV_HEADS)
    g.add_argument("--sim-head-dim", type=int, default=DEFAULT_HEAD_DIM)
    g.add_argument("--sim-dtype-bytes", type=int, default=DEFAULT_DTYPE_BYTES, help="2 for bf16/fp16 KV")
    g.add_argument("--sim-token-scale", type=positive_float, default=1.0,
                   help="real tokens each prompt/output token stands for (time and bytes)")
    g.add_argument("--sim-speed", type=positive_float, default=1.0, help="divide every modelled time by this")
    g.add_argument("--sim-disk-read-rate", type=positive_float, default=DEFAULT_DISK_READ_RATE,
                   help="bytes/s reading KV files (the disk tier, --cache-dir)")
    g.add_argument("--sim-disk-write-rate", type=positive_float, default=DEFAULT_DISK_WRITE_RATE,
                   help="bytes/s writing KV files")
    g.add_argument("--sim-attention-parity", type=int, default=0, metavar="TOKENS",
                   help="make a prompt token at depth d cost 1 + d/TOKENS times one at depth 0 (attention's "
                        "growth with context; 12320 for Qwen3-4B by its FLOPs, backend/attention.py); 0, the "
                        "default: every prompt token costs the same")
    g.add_argument("--sim-fail-after", type=int, default=0,
                   help="a fault to test supervision with: the engine thread raises once more than this many "
                        "requests arrived (0, the default: never)")
    g.add_argument("--sim-hang-after", type=int, default=0,
                   help="a fault to test gateways with: the engine thread hangs once more than this many "
                        "requests arrived (0, the default: never)")


def timing_from_args(args) -> SimTiming:
    """Build the `SimTiming` from parsed flags.

    Raises:
        ValueError: a non-positive rate or speed, or a token scale below 1.
    """
    layers, heads, dim = args.sim_layers, args.sim_kv_heads, args.sim_head_dim
    if args.sim_model_config:
        layers, heads, dim = kv_config_from_file(args.sim_model_config)
    for name in ("sim_prefill_rate", "sim_decode_rate", "sim_bandwidth", "sim_token_scale", "sim_speed",
                 "sim_disk_read_rate", "sim_disk_write_rate"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.sim_attention_parity < 0:
        raise ValueError("--sim-attention-parity must be >= 0 (0: off)")
    if args.sim_token_scale < 1:
        raise ValueError("--sim-token-scale must be >= 1 (a sim token stands for at least one real token)")
    return SimTiming(
        prefill_rate=args.sim_prefill_rate,
        decode_rate=args.sim_decode_rate,
        kv_bytes_per_token=kv_bytes_per_token(layers, heads, dim, args.sim_dtype_bytes),
        bandwidth=args.sim_bandwidth,
        ref_context=args.sim_ref_context,
        token_scale=args.sim_token_scale,
        speed=args.sim_speed,
        disk_read_rate=args.sim_disk_read_rate,
        disk_write_rate=args.sim_disk_write_rate,
        attention_parity=args.sim_attention_parity,
        fail_after=max(0, args.sim_fail_after),
        hang_after=max(0, args.sim_hang_after),
    )
