"""Engines: what turns prompt token ids into generated tokens.

The HTTP server drives an engine through `Engine.submit` / `Engine.cancel`
and reads `GenEvent` objects from the request's queue. `MLXEngine` runs
mlx-lm's own continuous-batching ``BatchGenerator`` in one thread (MLX work
stays on one thread and one stream, as in ``mlx_lm.server``). The prompt
cache (`backend.cache.PromptCache`) lives outside the engine's model code, so
the simulated engine (issue: sim engine) can share it.

Cache saves happen on every way a request ends after its prefill started
(SharpAI/SwiftLM issue 245, PR 253): end of sequence, ``max_tokens``, a
cancel (client disconnect, text stop sequence, server timeout), and at the
end of the system-prompt segment (mlx-lm's segment save).

Requests wait in the engine's own FIFO queue, not in the ``BatchGenerator``'s,
and are admitted (prefill queued) only when the batch has a free prefill slot.
A request's cache hit is taken (a private copy, as mlx-lm does) when it
arrives, so an eviction while it waits cannot take it away, and looked up again
at admission if an entry was saved meanwhile: a better match replaces it (vLLM's
scheduler matches the prefix cache when it schedules a request; our entries are
copies, not shared blocks, hence the pin). A waiting request that shares at least
``min_hit_tokens`` of a prompt still being prefilled waits for that prefill to
end (SGLang's in-batch prefix caching deprioritizes such a request), and that
prompt is then saved at once (into free space; its final save replaces it), so
the waiting one reuses it instead of computing it again; when the save does not
fit, the waiting one gets a copy of that KV directly, as its pinned hit. A request that shares
as much with one already decoding gets that one's prompt saved the same way
when it is admitted (a radix cache holds a running request's prefix too).

Every request's prompt counts as owned by this backend from its arrival until
it ends (`Reporter.claim`): gateways, including ones that did not route it,
then send its siblings here, where the rules above let them reuse it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import queue
import random
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mlxgw.util import count

from . import persist
from .attention import attention_parity_tokens
from .cache import CacheHit, PromptCache, common_prefix, kv_trimmable
from .metrics import BackendMetrics
from .processors import AllowedTokens, BadWords, MinTokens

log = logging.getLogger("mlxgw.backend.engine")

#: The disk tier's figures in stats, the registry record and /metrics (docs/redis-schema.md).
DISK_FIGURES = ("disk_entries", "disk_bytes", "disk_budget_bytes", "disk_spills", "disk_reads", "disk_read_tokens",
                "disk_evictions", "disk_failures", "disk_write_bytes")

#: Least seconds between two checkpoints of the disk tier's manifest at quiet moments.
DISK_CHECKPOINT_SECONDS = 5.0

#: Seconds `MLXEngine.stop` waits for the prompt cache to be written to --cache-dir.
SAVE_SECONDS = 600.0
#: Seconds without a new request before an idle save may start (helper-52: a save 46 ms after
#: an answer held the agent's next turn 3.6 s); shorter when the save interval is shorter.
IDLE_SAVE_QUIET_SECONDS = 30.0
#: Seconds of prefill steps `MLXEngine.prefill_tps` is measured over.
PREFILL_RATE_WINDOW = 0.5
#: Weight of the latest request in `MLXEngine.decode_seconds` (about the last 10 requests count).
DECODE_SECONDS_SMOOTHING = 0.1
HOLD_SCAN = 16  # waiting requests looked at per admission pass (bounds the prefix comparisons)
PREFILL_ORDERS = ("fifo", "shorter-beside", "step-beside")
# Measured side by side in session 17 (docs/cache-policy.md): lower TTFT p50 than fifo on both traces,
# lower p99 on the synthetic one, the conversation p99 level (-1% / +4%).
DEFAULT_PREFILL_ORDER = "step-beside"
_ENTROPY = random.SystemRandom()  # reseeds MLX's shared random state after a seeded request's draw
# What a -inf logprob reads in an answer (vLLM's value; JSON has no infinity).
LOGPROB_FLOOR = -9999.0


@dataclass
class GenParams:
    """Sampling and stopping parameters of one request (OpenAI meanings)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    repetition_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_context_size: int = 20  # tokens each penalty looks back over (mlx-lm's processors)
    presence_context_size: int = 20
    frequency_context_size: int = 20
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logprobs: Optional[int] = None  # None: none; else the alternatives per token (0 to 20)
    seed: Optional[int] = None
    processors: list = field(default_factory=list)  # extra logits processors (e.g. backend.toolchoice)
    ignore_eos: bool = False  # vLLM's extension: end-of-sequence tokens do not stop the answer
    # vLLM's extensions: the first min_tokens tokens are never an end-of-sequence or stop token;
    # a stop token ends the answer as end-of-sequence does (its text kept unless it is special).
    min_tokens: int = 0
    stop_token_ids: tuple = ()
    allowed_token_ids: Optional[tuple] = None  # vLLM's: sample only these
    bad_words: tuple = ()  # vLLM's: token sequences never generated (`bad_words_ids`, `BadWords`)
    skip_special_tokens: bool = True  # vLLM's default: special tokens' text is not in the answer


@dataclass
class GenEvent:
    """One event on a request's stream.

    kind:
        ``"start"``: prefill begins; ``cached`` tokens were reused.
        ``"progress"``: ``done``/``total`` prompt tokens processed.
        ``"token"``: one generated ``token`` with its detokenized ``text``; when the request
        asked for logprobs (`GenParams.logprobs`), ``logprob`` (the token's natural log
        probability) and ``top`` (the likeliest tokens as ``(id, logprob)``, most likely
        first); an end-of-sequence token has neither (it is not part of the answer).
        ``"end"``: ``finish_reason`` in {"stop", "length", "cancelled", "error"}.
    """

    kind: str
    token: int = -1
    text: str = ""
    logprob: Optional[float] = None
    top: Optional[list] = None
    finish_reason: Optional[str] = None
    cached: int = 0
    done: int = 0
    total: int = 0
    error: Optional[str] = None


@dataclass(eq=False)
class GenRequest:
    """A request as the engine sees it: token ids in, events out.

    ``system_tokens`` is the length of the leading system prompt (saved as its
    own cache entry; the floor of a good hit).
    """

    rid: str
    prompt: list[int]
    params: GenParams
    system_tokens: int = 0
    loop: Optional[asyncio.AbstractEventLoop] = None
    events: Optional[asyncio.Queue] = None
    cached: int = 0
    generated: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    _ids: Optional[np.ndarray] = field(default=None, repr=False)
    hit: Any = field(default=None, repr=False)  # the cache hit pinned on arrival (`CacheHit`)
    cache_version: int = -1  # `PromptCache.version` when it was pinned
    queued_reuse: int = 0  # tokens of its pinned hit left out of `queued_prefill_tokens` while it waits (`_pin`)
    claim: Optional[list] = field(default=None, repr=False)  # blocks claimed in Redis while it runs
    memory_waited: bool = False  # put off at least once by `max_inflight_share` (counted once)
    # A choice after the first of an ``n`` > 1 request: saved only into free space (`_save`).
    spare: bool = False

    @property
    def ids(self) -> np.ndarray:
        """The prompt as an int32 array (made once, for prefix comparisons)."""
        if self._ids is None:
            self._ids = np.asarray(self.prompt, dtype=np.int32)
        return self._ids

    def emit(self, ev: GenEvent) -> None:
        """Thread-safe: hand an event to the request's asyncio queue."""
        if self.loop is not None and self.events is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)


def seeded_sampler(sampler, seed: int):
    """``sampler`` drawing from its own random stream, started from ``seed`` (any integer): the
    same seed gives the same answer whatever else is in the batch, as far as the batch leaves
    the logits the same.

    mlx-lm's samplers draw from MLX's one global random state, which a batch shares; mlx_lm.server
    makes a seeded request reproducible by running it alone, unbatched. Here each call reseeds
    the global state from the request's own sequence (MLX takes the key when an op is made, not
    when it runs), then reseeds it at random for the rest of the batch, whose requests asked for
    no particular stream.
    """
    import mlx.core as mx

    # As an unsigned 64-bit number: Random takes a negative seed's absolute value (helper-80:
    # seed -1 answered as seed 1).
    own = random.Random(seed % 2**64)

    def sample(logprobs):
        mx.random.seed(own.getrandbits(64))
        try:
            return sampler(logprobs)
        finally:
            mx.random.seed(_ENTROPY.getrandbits(64))

    return sample


class Engine:
    """The interface the server drives (real and simulated engines implement it)."""

    tokenizer: Any = None
    context_length: int = 0
    logits_size: int = 0  # tokens the model's logits cover (its config's vocab_size); 0: unknown

    def start(self) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def submit(self, req: GenRequest) -> None:
        raise NotImplementedError

    def cancel(self, rid: str, abandoned: bool = False) -> None:
        """Stop a request; its cache is still saved. ``abandoned``: nobody waits
        for the answer any more (client gone, timeout), so its save must not
        evict other entries (docs/cache-policy.md)."""
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


@dataclass
class _Live:
    req: GenRequest
    reused_from: Optional[int]
    detok: Any
    prompt_left: int
    save_system_at: int = 0
    prompt_done: int = 0  # of ``prompt_left``, tokens already prefilled
    started: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0  # time.monotonic() of its first generated token (0: none yet)
    prompt_saved: bool = False  # `_save_prompt` already saved it for a waiting request

    @property
    def queued_out(self) -> int:
        """Tokens of ``prompt_left`` already taken out of the engine's ``queued_prefill_tokens``:
        those prefilled, as the figure follows the prompt chunk by chunk."""
        return min(self.prompt_done, self.prompt_left)


def _age(seconds: float) -> str:
    """A duration for the log: 42 s, 7 min, 3.5 h, 2.0 days."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} days"


def _expected_load_error(e: BaseException) -> bool:
    """A model that cannot be found or fetched (a wrong path, a hub id without network, a
    gated repo) or that mlx-lm does not support: logged in one line, without a traceback."""
    return isinstance(e, (OSError, ValueError)) or type(e).__module__.startswith("huggingface_hub")

class MLXEngine(Engine):
    """mlx-lm ``BatchGenerator`` in a dedicated thread, with our prompt cache.

    Args:
        model_path: local path or repo id for ``mlx_lm.load``.
        cache: the prompt cache (owned by the engine thread after start).
        cache_bytes: byte budget; in-flight requests' KV counts against it.
        decode_concurrency / prefill_concurrency / prefill_step_size: passed to
            ``BatchGenerator`` (completion_batch_size, prefill_batch_size,
            prefill_step_size); prefill_concurrency is lowered to decode_concurrency.
        save_at_prefill_end: hold back a waiting request that shares at least
            the cache's ``min_hit_tokens`` of a prompt being prefilled, and save
            that prompt when its prefill ends (into free space only, never
            evicting) so the held one reuses it; likewise save a decoding
            request's prompt when such a request is admitted;
            docs/cache-policy.md.
        prefill_save_evicts: such a save may evict other entries (LRU) when
            free space is short, as long as the copy fits in the budget left by
            the live requests' KV: the held request reuses it for certain.
        prefill_handoff: when that save does not fit, hand a copy of the prompt's
            KV to the waiting requests that reuse it, as their pinned hits
            (`_hand_over`), instead of letting them compute it again.
        prefill_save_pin: when that save fits, the waiting requests take their
            hit from the saved entry at once, as pinned hits (`_pin_saved`),
            rather than at their admission, when the entry may be gone.
        pin_by_reference: a waiting request pins its hit as a reference to the
            cache's segments (`PromptCache.fetch`, rule 7's layout) and copies it
            out at admission; off (the default): a private copy on arrival, KV in
            flight while it waits (one per waiting request, beside the entry it
            copies). Opt-in: measured on the trace replays it did not gain
            (docs/cache-policy.md).
        max_inflight_share: admit a request only while the KV in flight (the
            batch's and the waiting requests' pinned copies) plus what its
            prompt adds stays within this share of ``cache_bytes``, unless
            nothing runs (vLLM admits a request only when its KV blocks are
            free); the rest of the budget is the cache's. None: no such wait.
        claims: the reporter; each request's prompt blocks are claimed
            (`Reporter.claim`) from arrival to end. None: no claims.
        prefill_order: ``"fifo"``, ``"shorter-beside"`` or ``"step-beside"``
            (default, ``DEFAULT_PREFILL_ORDER``); which waiting request takes a
            free prefill slot (`_admit_waiting`).
        hit_tokens: tokens a request must reuse to count in ``hits`` (else
            ``misses``); the server passes the block size, so the shared first
            tokens of every chat template (a few) do not make every request a hit.
        cache_dir / cache_settings: restore the prompt cache saved there
            before the engine is ready, and save it there when the engine stops
            (`backend.persist`; a save is restored only with equal settings,
            `persist.kv_settings`); None: neither.
        cache_save_interval: with ``cache_dir``, also save while idle at most
            this often, seconds, when the cache changed (`_save_when_idle`);
            0: only at the stop.
    """

    _xtc_keep: Optional[list] = None  # `_xtc_special_tokens`, worked out once
    _special: Optional[frozenset] = None  # `_skipped_tokens`, worked out once

    def __init__(
        self,
        model_path: str,
        cache: PromptCache,
        cache_bytes: int,
        decode_concurrency: int = 16,
        prefill_concurrency: int = 2,
        prefill_step_size: int = 512,
        finish_prefill_on_cancel: bool = True,
        metrics: Optional[BackendMetrics] = None,
        save_at_prefill_end: bool = True,
        prefill_save_evicts: bool = False,
        prefill_handoff: bool = True,
        prefill_save_pin: bool = True,
        pin_by_reference: bool = False,
        max_inflight_share: Optional[float] = None,
        cache_floor_share: float = 0.0,
        claims: Any = None,
        prefill_order: str = DEFAULT_PREFILL_ORDER,
        hit_tokens: int = 1,
        cache_dir: Optional[Path] = None,
        cache_settings: Optional[dict] = None,
        cache_save_interval: float = 0.0,
    ):
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"unknown prefill order {prefill_order!r}; one of {', '.join(PREFILL_ORDERS)}")
        self.prefill_order = prefill_order
        self.hit_tokens = max(1, hit_tokens)
        self.cache_dir = cache_dir
        self.cache_settings = cache_settings or {}
        self.cache_save_interval = cache_save_interval
        # `_save_when_idle`: the interval spaces saves; the first waits only for a quiet moment
        # (it waited the interval from start: a backend killed in its first 10 minutes lost
        # everything, helper-58).
        self._last_save, self._last_busy = -math.inf, time.monotonic()
        self._last_disk_checkpoint = 0.0  # `_checkpoint_disk_when_idle`
        self._saved_state: Optional[tuple] = None  # `_cache_state` at the last save or restore
        self._restored_state: Optional[tuple] = None
        self.restored: Optional[persist.Outcome] = None  # what the start restored (None: nothing)
        self.model_path = model_path
        self.finish_prefill_on_cancel = finish_prefill_on_cancel
        self.save_at_prefill_end = save_at_prefill_end
        self.prefill_save_evicts = prefill_save_evicts
        self.prefill_handoff = prefill_handoff
        self.prefill_save_pin = prefill_save_pin
        self.pin_by_reference = pin_by_reference
        self.max_inflight_share = max_inflight_share
        self.cache_floor_share = cache_floor_share
        self.memory_waits = 0  # requests whose admission max_inflight_share put off
        self._kv_per_token = 0.0  # the cache's last known KV bytes per token (`_fits_in_flight`)
        self.claims = claims
        self.trimmable = False  # set at load: may a prompt's blocks be claimed (as `servable_blocks`)?
        self.prefill_saves = 0
        self.prefill_handoffs = 0
        self.cache = cache
        self.cache_bytes = cache_bytes
        self.decode_concurrency = decode_concurrency
        # No more prompts in prefill than decode slots: mlx-lm's BatchGenerator raises its
        # completion_batch_size to prefill_batch_size, so one decode slot with the default 2
        # prefills ran two answers at once while /health, the record and the gateways said 1 (helper-91)
        self.prefill_concurrency = min(prefill_concurrency, decode_concurrency)
        if prefill_concurrency > decode_concurrency:
            log.warning("--prefill-concurrency %d is above --decode-concurrency %d: %d prompts are prefilled side by "
                        "side, one per decode slot", prefill_concurrency, decode_concurrency, decode_concurrency)
        self.prefill_step_size = prefill_step_size
        # The engine thread's state (`_init_loop_state`) before it starts: /health and the
        # heartbeat read these while the model loads (helper-91: /health answered 500 then)
        self._live: dict[int, _Live] = {}
        self._loop_at: Optional[float] = None  # when the thread last went round its loop (`loop_silent_for`)
        self._incoming: "queue.Queue[GenRequest]" = queue.Queue()
        self._cancels: "queue.Queue[str]" = queue.Queue()
        self._abandoned: set[str] = set()  # rids whose client is gone (set.add is atomic)
        self.saves_skipped = 0
        self._ready = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self.load_error: Optional[BaseException] = None
        self.failed = False
        self.batch_failures = 0  # batch steps that failed and were started again (`_fail_batch`)
        # Stats read by the heartbeat (plain ints: atomic enough under the GIL).
        self.active = 0
        self.queued_prefill_tokens = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.prefill_tokens_total = 0
        self.generated_tokens_total = 0
        self.requests_total = 0
        self.hits = 0
        self.misses = 0
        self.prefill_tps = 0.0
        self._prefill_window = [0, 0.0]  # prompt tokens, seconds of steps that computed them
        self._prefill_rate_measured = False  # a whole PREFILL_RATE_WINDOW measured
        self._prefill_step: Optional[tuple[float, int, float]] = None  # the last step's (began, prompt tokens, own time)
        self.decode_tps = 0.0
        # Seconds a request decodes (its first token to its end), a moving average over the last
        # ~10 (`DECODE_SECONDS_SMOOTHING`): gateways turn requests in flight past the decode
        # slots into a wait for one (gateway.route.slot_wait).
        self.decode_seconds = 0.0
        self._attention_parity = 0  # from the model's config at load (`attention_parity_tokens`)
        self.metrics = metrics or BackendMetrics()

    # -- public API (any thread) ------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout=None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, req: GenRequest) -> None:
        self.active += 1
        self.queued_prefill_tokens += len(req.prompt)
        self._incoming.put(req)

    def cancel(self, rid: str, abandoned: bool = False) -> None:
        if abandoned:
            self._abandoned.add(rid)
        self._cancels.put(rid)

    def stop(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            # Writing the prompt cache to --cache-dir takes its bytes over the disk's speed.
            # So does waiting for the disk tier's writer before it keeps its entries.
            self._thread.join(timeout=10 if self.cache_dir is None and self.cache.disk is None else SAVE_SECONDS)

    def cache_figures(self) -> dict:
        """The registry's cache figures (`schema.CACHE_FIGURES`): entries, bytes held, tokens
        held, evictions (entries, tokens), the next eviction victim's last use (unix s), KV
        bytes per token. The reporter sends them with every report batch, so they are
        computed alone, not with all of `stats`; the record then agrees with itself between
        heartbeats (a trial saw 0 entries beside 2.5 MB)."""
        entries = self.cache.entries()
        return {
            "cache_entries": len(entries),
            "cache_bytes": self.cache.nbytes,
            "cache_tokens": sum(len(e) for e in entries),
            "cache_evictions": self.cache.evictions,
            "cache_evicted_tokens": self.cache.evicted_tokens,
            "cache_victim_used_at": round(self.cache.victim_used_at(), 3),
            "kv_bytes_per_token": round(self.cache.kv_bytes_per_token(), 1),
        }

    def disk_figures(self) -> dict:
        """The disk tier's figures (cache rule 8, `backend.disktier`); zeros without one."""
        d = self.cache.disk
        if d is None:  # not `if d`: an empty tier has len 0 and is still a tier (helper-53)
            return dict.fromkeys(DISK_FIGURES, 0)
        return {"disk_entries": len(d), "disk_bytes": d.nbytes, "disk_budget_bytes": d.max_bytes,
                "disk_spills": d.spills, "disk_reads": d.reads, "disk_read_tokens": d.read_tokens,
                "disk_evictions": d.evictions, "disk_failures": d.failures, "disk_write_bytes": d.write_bytes}

    def decode_seconds_now(self) -> float:
        """Seconds a request decodes here (first token to end), for the gateways' estimate of the
        wait for a decode slot: the moving average of the requests that ended
        (``decode_seconds``), or, when longer, the mean time the requests decoding now have
        decoded so far (helper-90: answers ten times longer than the last ones held every slot
        while the average still said 3 s)."""
        now = time.monotonic()
        running = [now - lv.first_token_at for lv in list(self._live.values()) if lv.first_token_at]
        return max(self.decode_seconds, sum(running) / len(running)) if running else self.decode_seconds

    def loop_silent_for(self) -> float:
        """Seconds since the engine thread last went round its loop (0 before it started): a few
        milliseconds while it works or idles, a step's length at most, unless a step hangs
        (a Metal hang, say) while the HTTP side and the heartbeat go on."""
        at = self._loop_at
        return 0.0 if at is None else time.monotonic() - at

    def prefill_beside_tokens(self) -> int:
        """The most uncached tokens (its prompt less its cache hit) a waiting request may have and
        still start beside a running prefill rather than behind the queue: ``prefill_step_size``
        with the ``"step-beside"`` order (`_pick_beside`; while fewer than ``prefill_concurrency``
        prompts are prefilling), 0 with ``"fifo"`` and with ``"shorter-beside"``, whose bound is
        what the running prefill has left (not published). Gateways read it in the lookup
        (`gateway.route.seed_wait`)."""
        return self.prefill_step_size if self.prefill_order == "step-beside" and self.prefill_concurrency > 1 else 0

    def _model_config(self, args) -> dict:
        """The model's ``config.json`` (a local model directory), else mlx-lm's parsed model args
        (which drop the keys its model class does not read), else {}."""
        try:
            return json.loads((Path(self.model_path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            pass
        try:
            return dict(vars(args))
        except TypeError:
            return {}

    def attention_parity_tokens(self) -> int:
        """The depth (tokens) at which a prompt token's attention costs as much as the rest of its
        prefill, from the model's config (`backend.attention`; 0: unknown). Gateways weigh a
        request kept beside a deep running prefill by it (`gateway.route.seed_wait`)."""
        return self._attention_parity

    def decode_steps_per_token(self) -> float:
        """Engine steps one output token takes: 1 (mlx-lm's ``BatchGenerator`` emits one token per
        running sequence per step; the sim, whose token stands for several real ones, says more).
        A request decoding beside a running prefill waits one prefill chunk per step, so gateways
        turn an answer's tokens into the prefill that goes by meanwhile (`gateway.route.seed_wait`)."""
        return 1.0

    def stats(self) -> dict:
        return {
            "active": self.active,
            # received, not yet in the batch: behind a prefill slot, a decode slot or a shared prefill
            "waiting": len(getattr(self, "_waiting", ())),
            "decode_slots": self.decode_concurrency,
            # the most uncached tokens a request may have and start beside a running prefill
            # (the gateways' seeding rule, gateway.route.seed_wait); 0: it waits behind the queue
            "prefill_beside_tokens": self.prefill_beside_tokens(),
            "decode_steps_per_token": self.decode_steps_per_token(),
            "attention_parity_tokens": self.attention_parity_tokens(),
            "queued_prefill_tokens": max(0, self.queued_prefill_tokens),
            **self.cache_figures(),
            "requests": self.requests_total,
            "hits": self.hits,
            "misses": self.misses,
            "abandoned_saves_skipped": self.saves_skipped,
            "batch_failures": self.batch_failures,  # failed batch steps, their requests ended (`_fail_batch`)
            "prefill_saves": self.prefill_saves,
            "prefill_handoffs": self.prefill_handoffs,
            "memory_waits": self.memory_waits,
            "shared_prefixes_kept": self.cache.shared_kept,
            "cache_oversize": self.cache.oversize,  # entries larger than the whole budget: not cached
            "prompt_tokens": self.prompt_tokens_total,
            "cached_tokens": self.cached_tokens_total,
            "prefill_tokens": self.prefill_tokens_total,
            "generated_tokens": self.generated_tokens_total,
            "prefill_tps": round(self.prefill_tps, 1),
            "decode_tps": round(self.decode_tps, 1),
            "decode_seconds": round(self.decode_seconds_now(), 3),
            **self.disk_figures(),
            # --cache-dir: what the start restored (backend.persist)
            "restored_entries": self.restored.entries if self.restored else 0,
            "restored_tokens": self.restored.tokens if self.restored else 0,
        }

    # -- engine thread ----------------------------------------------------
    def _run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # reported by the server as a startup failure
            if _expected_load_error(e):  # a wrong path, no network for a hub id: the message says it all
                log.debug("model load failed", exc_info=True)
            else:
                log.exception("model load failed")
            self.load_error = e
            self._ready.set()
            return
        # A disk tier kept at the last stop (backend.disktier) is announced first: the restore
        # below may write into it (entries a smaller budget leaves out, spills), and the tier
        # entries those writes replace must have been announced to be withdrawn.
        self.cache.announce_disk()
        if self.cache_dir is not None:
            self._restore_cache()
        self._ready.set()
        try:
            self._loop()
        except Exception:
            log.exception("engine thread died")
            self.failed = True
            self._fail_all("engine failure")
            return
        finally:
            if self.cache.disk is not None:  # after the withdrawal from Redis: nobody routes here for them
                self.cache.disk.close()
        if self.cache_dir is not None:
            self._save_cache()

    def _restore_cache(self) -> None:
        """Read the prompt cache saved in ``cache_dir`` (engine thread, before ready): a save
        that cannot be used means a cold start with the reason in the log, never a failed one."""
        try:
            self.restored = persist.restore(self.cache, self.cache_dir, self.cache_settings)
        except Exception as e:  # other settings, or a damaged save: the message says which
            log.warning("prompt cache in %s not restored: %s; starting cold (that save stays until this run saves "
                        "its own cache, at a quiet moment or at its stop)", self.cache_dir, e)
            self.cache.clear(disk=False)  # the disk tier adopted at start is its own (helper-54: it was wiped)
            self.cache.nbytes = 0  # segments read before the failure had no entry yet
            return
        if self.restored is None:
            log.info("no saved prompt cache in %s yet: starting cold (it is saved there at a clean stop, and "
                     "while idle)",
                     self.cache_dir)
            return
        left, age = self.restored.left, max(0.0, time.time() - self.restored.saved_at)
        moved = self.restored.to_disk
        log.info("restored the prompt cache from %s: %s, saved %s ago%s%s", self.cache_dir, self.restored.describe(),
                 _age(age),
                 f"; {count(moved, 'older entry', 'older entries')} over --cache-entries / --cache-bytes moved into "
                 "the disk tier" if moved else "",
                 f"; {left} older entries left out (over --cache-entries / --cache-bytes"
                 + (" and the disk tier's room" if self.cache.disk is not None else "")
                 + "; they stay in the save until this run saves its own, and are gone then)" if left else "")
        if self.restored.damaged:
            log.warning("%d saved prompt-cache entries in %s could not be read and were left out (%s)",
                        self.restored.damaged, self.cache_dir, self.restored.error)
        self._saved_state = self._restored_state = self._cache_state()

    def _cache_state(self) -> tuple:
        """What a save would write, in brief: unchanged means nothing to save."""
        return (self.cache.version, self.cache.evictions, len(self.cache), self.cache.nbytes)

    def _save_when_idle(self) -> None:
        """The idle save (``cache_save_interval``): when nothing has run or waited for
        `IDLE_SAVE_QUIET_SECONDS` (the gap between an agent's turns is not idle: a
        turn arriving during a save waits for it, since the engine thread writes), the cache
        changed since the last save or restore, and the interval has passed since the last one
        (the first, only the quiet).
        A crash then loses the changes since the last quiet moment, not everything since the
        last clean stop. Traffic that never pauses is saved only at the stop."""
        now = time.monotonic()
        if (self.cache_dir is None or self.cache_save_interval <= 0 or not self._incoming.empty()
                or now - self._last_busy < min(IDLE_SAVE_QUIET_SECONDS, self.cache_save_interval)
                or now - self._last_save < self.cache_save_interval or self._nothing_to_save()):
            return
        self._save_cache(when="idle")

    def _checkpoint_disk_when_idle(self) -> None:
        """Write the disk tier's manifest while nothing runs, at most every `DISK_CHECKPOINT_SECONDS`
        (cheap: its files were flushed by its writer), so a backend killed later restarts with
        the tier as of then (helper-53: a kill lost the whole tier)."""
        d, now = self.cache.disk, time.monotonic()
        if d is None or now - self._last_disk_checkpoint < DISK_CHECKPOINT_SECONDS or not self._incoming.empty():
            return
        self._last_disk_checkpoint = now
        try:
            d.checkpoint()
        except OSError as e:
            log.warning("disk tier: could not write its manifest in %s (%s); the next try is at the next quiet "
                        "moment or at the stop", d.directory, e)

    def _nothing_to_save(self) -> str:
        """Why a save would write nothing new, for the log ("" when it would): an empty cache, or one that
        saved and evicted nothing since the last save or the restore (rewriting it would only
        drop the entries a smaller budget left out of this run)."""
        if not len(self.cache):
            return f"nothing cached: the prompt cache save in {self.cache_dir} (if any) stays as it was"
        if self._saved_state == self._cache_state():
            since = "restored" if self._saved_state == self._restored_state else "last saved"
            return f"prompt cache unchanged since it was {since}: the save in {self.cache_dir} stays as it was"
        return ""

    def _save_cache(self, when: str = "stop") -> None:
        """Write the prompt cache to ``cache_dir`` (engine thread: after the loop stopped, or
        idle, `_save_when_idle`)."""
        self._last_save = time.monotonic()
        why = self._nothing_to_save()
        if why:
            log.info("%s", why)
            return
        log.info("saving the prompt cache (%s, %.1f MiB of KV) to %s%s", count(len(self.cache), "entry", "entries"),
                 self.cache.nbytes / 2**20, self.cache_dir, " while idle" if when == "idle" else "")
        state = self._cache_state()
        try:
            out = persist.save(self.cache, self.cache_dir, self.cache_settings)
        except Exception as e:  # a full disk: the previous save stays
            try:  # mlx's own write errors do not say the disk is full (several backends may share it)
                free = "" if "free" in str(e) else \
                    f" ({shutil.disk_usage(self.cache_dir).free / 2**20:.1f} MiB free on its disk now)"
            except OSError:
                free = ""
            log.warning("prompt cache not saved to %s: %s%s; the previous save stays", self.cache_dir, e, free)
            return
        self._saved_state = state
        log.info("saved the prompt cache to %s: %s", self.cache_dir, out.describe())
        left = self.restored.left if self.restored is not None else 0
        if left:
            # helper-73: restarted with a smaller budget, the older entries left out at start were
            # dropped by the next save without a word (a disk tier does not take them either).
            log.warning("this save replaced the one restored at start, whose %d older entries this run's "
                        "--cache-bytes / --cache-entries left out: they are gone now", left)
            self.restored.left = 0

    def _load(self) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self._mx = mx
        self.model, self.tokenizer = load(self.model_path)
        self.trimmable = kv_trimmable(make_prompt_cache(self.model))
        cfg = getattr(self.model, "args", None)
        self.context_length = int(
            getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "context_length", 0) or 32768
        )
        self.logits_size = int(getattr(cfg, "vocab_size", 0) or 0)
        self._attention_parity = attention_parity_tokens(self._model_config(cfg))
        self._stream = mx.default_stream(mx.default_device())
        self._bg = self._new_batch()
        self._init_loop_state()

    def _new_batch(self):
        """A new, empty mlx-lm ``BatchGenerator`` (at start, and after a failed step: `_fail_batch`)."""
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(
            self.model,
            completion_batch_size=self.decode_concurrency,
            prefill_batch_size=self.prefill_concurrency,
            prefill_step_size=self.prefill_step_size,
            stream=self._stream,
        )

    def _init_loop_state(self) -> None:
        """Per-run bookkeeping of the engine thread (also used by the simulated engine)."""
        self._live: dict[int, _Live] = {}
        self._by_rid: dict[str, int] = {}
        self._pending_cancel: set[str] = set()
        self._cancel_after_prefill: set[int] = set()
        self._waiting: deque[GenRequest] = deque()  # submitted, not yet admitted (FIFO)
        self._failed_steps = 0  # batch steps failed in a row (`_fail_batch`)

    def _fail_batch(self, e: Exception) -> None:
        """A batch step raised: end the requests in the batch with an error and go on with a new,
        empty batch, the prompt cache and the waiting requests kept. A request's own input that
        mlx-lm fails on inside the step (helper-75: a top_k it refuses) ended the engine thread,
        the backend, and its whole prompt cache, and the gateway's retry then the next backend's.
        The entries the batch reused are private copies (`PromptCache.fetch`), so the cache is
        whole. Two failed steps in a row end the engine as before (`_loop`)."""
        log.error("a batch step failed (%s: %s): ending its %d requests with an error and starting a new batch; "
                  "the prompt cache is kept (a second failure in a row ends the backend)", type(e).__name__, e,
                  len(self._live), exc_info=True)
        msg = f"the batch this request ran in failed ({type(e).__name__}: {e})"
        for live in list(self._live.values()):
            self._finish(live, "error", error=msg)
        self.batch_failures += 1
        self._live.clear()
        self._by_rid.clear()
        self._cancel_after_prefill.clear()
        self._bg = self._new_batch()

    def _fail_all(self, msg: str) -> None:
        for live in list(getattr(self, "_live", {}).values()):
            self._release(live.req)
            live.req.emit(GenEvent("end", finish_reason="error", error=msg))
        for r in getattr(self, "_waiting", ()):
            self._release(r)
            self.cache.drop(r.hit)
            r.emit(GenEvent("end", finish_reason="error", error=msg))
        while True:
            try:
                r = self._incoming.get_nowait()
            except queue.Empty:
                break
            r.emit(GenEvent("end", finish_reason="error", error=msg))

    def _loop(self) -> None:
        while not self._stop:
            self._loop_at = time.monotonic()  # `loop_silent_for`: a step that never returns stops it
            idle = not self._live and not self._waiting
            if not idle:
                self._last_busy = time.monotonic()
            elif self._prefill_step is not None:  # no next step soon: the last one's own time
                self._count_prefill(*self._prefill_step[1:])
                self._prefill_step = None
            try:
                req = self._incoming.get(timeout=0.05) if idle else self._incoming.get_nowait()
                # A hit on the disk tier is read by its reader thread (cache rule 8) while the
                # batch runs on; the request is held until it is in (`_held`).
                self._pin(req, self.cache.fetch(req.prompt, defer=True, by_reference=self.pin_by_reference))
                if self.claims is not None and self.trimmable:
                    req.claim = self.claims.claim(req.prompt)
                self._waiting.append(req)
                continue
            except queue.Empty:
                if idle:
                    self._save_when_idle()
                    self._checkpoint_disk_when_idle()
            self._drain_cancels()
            self._admit_waiting()
            if self._live:
                try:
                    self._step()
                    self._failed_steps = 0
                except Exception as e:
                    self._failed_steps += 1
                    if self._failed_steps > 1:  # twice in a row: the engine, not one request's input
                        raise
                    self._fail_batch(e)
            elif self._waiting:  # all held by disk reads under way: do not spin
                time.sleep(0.001)

    def _admit_waiting(self) -> None:
        """Admit waiting requests while the batch has a free prefill slot.

        mlx-lm's ``BatchGenerator`` starts at most ``prefill_batch_size`` prompts
        at a time, and none while ``completion_batch_size`` sequences run; a
        request admitted beyond that would only wait inside it, with a cache
        lookup already stale. A request sharing a prompt still being prefilled
        (`_reuses`) is passed over until that prefill ends.

        Which request (``prefill_order``): with no prefill running, the oldest.
        Beside a running prefill, ``"fifo"`` also takes the oldest;
        ``"shorter-beside"`` takes the waiting request with the fewest tokens
        to compute, and only one with fewer than the longest running prefill
        has left; ``"step-beside"`` likewise, but only one that fits in one
        prefill step (`_pick_beside`). Prefill is compute bound, so prompts in
        one batch share the compute (and mlx-lm pads each step's chunks to
        the longest): two long prompts side by side both finish late, while a
        short one (a turn whose prefix is cached) beside a long one is done in
        a step or two instead of waiting for all of it. Measured in
        docs/cache-policy.md: side by side (session 17), ``"step-beside"``
        gave a lower TTFT p50 than ``"fifo"`` on both traces and a lower p99
        on the synthetic one (the conversation p99 level), so it is the
        default.
        """
        prefilling = [lv for lv in self._live.values() if lv.prompt_left > 0]
        cap = max(self.decode_concurrency, self.prefill_concurrency)
        held = []
        while (self._waiting and len(held) < HOLD_SCAN and len(prefilling) < self.prefill_concurrency
               and len(self._live) < cap):
            if prefilling and self.prefill_order != "fifo":
                req = self._pick_beside(prefilling)
                if req is None:
                    break
            else:
                req = self._waiting.popleft()
            if req.rid in self._pending_cancel:
                self._pending_cancel.discard(req.rid)
                self._drop_waiting(req)
            elif self._held(req, prefilling):
                held.append(req)
            elif self._live and not self._fits_in_flight(req):
                held.append(req)  # waits until running requests end (at its place: it was next)
                self.memory_waits += not req.memory_waited
                req.memory_waited = True
                break
            else:
                if self.save_at_prefill_end:
                    self._save_decoding_prompt_for(req)
                prefilling.append(self._admit(req))
        self._waiting.extendleft(reversed(held))

    def _pick_beside(self, prefilling: list[_Live]) -> Optional[GenRequest]:
        """Remove and return the waiting request to prefill beside ``prefilling`` (not "fifo").

        Among the oldest ``HOLD_SCAN`` waiting requests that are not held for a
        running prefill (`_reuses`), the one with the fewest uncached tokens
        (its pinned hit counts as cached), if that is fewer than the most any
        running prefill has left ("step-beside": and at most
        ``prefill_step_size``); ties go to the older. None: let them wait.
        """
        left = max(lv.prompt_left - lv.prompt_done for lv in prefilling)
        if self.prefill_order == "step-beside":
            left = min(left, self.prefill_step_size + 1)
        best, best_i = left, -1
        for i, req in enumerate(self._next_waiting()):
            if self._held(req, prefilling):
                continue
            todo = len(req.prompt) - (req.hit.reused if req.hit is not None else 0)
            if todo < best:
                best, best_i = todo, i
        if best_i < 0:
            return None
        req = self._waiting[best_i]
        del self._waiting[best_i]
        return req

    def _save_decoding_prompt_for(self, req: GenRequest) -> None:
        """Share the prompt of a decoding request that ``req`` reuses (`_reuses`) before ``req`` is admitted."""
        for uid, live in self._live.items():
            if live.prompt_left == 0 and not live.prompt_saved and self._reuses(req, live):
                self._share_prompt(uid, live, [req])
                return

    def _next_waiting(self):
        """The waiting requests `_admit_waiting` looks at (the oldest ``HOLD_SCAN``)."""
        return itertools.islice(self._waiting, HOLD_SCAN)

    def _held(self, req: GenRequest, prefilling: list[_Live]) -> bool:
        """True if ``req`` waits for a running prefill it reuses (the hold of ``save_at_prefill_end``),
        or for its hit to be read from the disk tier (cache rule 8)."""
        if req.hit is not None and req.hit.read is not None and not req.hit.read.done.is_set():
            return True
        return self.save_at_prefill_end and any(self._reuses(req, lv) for lv in prefilling)

    def _reuses(self, req: GenRequest, live: _Live) -> bool:
        """True if ``req`` would reuse at least ``min_hit_tokens`` of what ``live`` computes."""
        other = live.req
        if not len(req.prompt) or not len(other.prompt) or req.prompt[0] != other.prompt[0]:
            return False
        return common_prefix(req.ids, other.ids) - other.cached >= self.cache.min_hit_tokens

    def _drop_waiting(self, req: GenRequest) -> None:
        """End a request cancelled before it was admitted (nothing computed, nothing to save)."""
        self._abandoned.discard(req.rid)
        self.cache.drop(req.hit)
        req.hit = None
        self.active -= 1
        self.queued_prefill_tokens -= len(req.prompt) - req.queued_reuse
        self._release(req)
        if not req.spare:
            self.metrics.on_dropped()
        req.emit(GenEvent("end", finish_reason="cancelled"))

    def _release(self, req: GenRequest) -> None:
        """Drop the request's Redis claim (after its own save, so saved blocks never leave Redis)."""
        if req.claim is not None:
            self.claims.release(req.claim)
            req.claim = None

    def _fits_in_free_space(self, kv, tokens, live: Optional[_Live] = None) -> bool:
        """True if ``kv`` (holding ``tokens``; ``live``: the request saving it) can be saved
        without evicting anything (bytes and entry count, counting the entries the save
        itself replaces: `PromptCache.fits_beside`)."""
        free = self._cache_room() - self.cache.nbytes
        how = {} if live is None else dict(reused_from=live.reused_from, reused=live.req.cached,
                                           prompt_len=len(live.req.prompt), system_tokens=live.req.system_tokens)
        return self.cache.fits_beside(tokens, kv, free, **how)

    def _fits_in_flight(self, req: GenRequest) -> bool:
        """True unless ``max_inflight_share`` is set and admitting ``req`` would take the KV in
        flight past that share of the budget (its uncached prompt tokens at the cache's KV bytes
        per token; unknown before anything was cached: then it fits)."""
        if self.max_inflight_share is None:
            return True
        self._kv_per_token = self.cache.kv_bytes_per_token() or self._kv_per_token
        todo = len(req.prompt) - (req.hit.reused if req.hit is not None else 0)
        return self._inflight_nbytes() + todo * self._kv_per_token <= self.max_inflight_share * self.cache_bytes

    def _cache_room(self) -> int:
        """Bytes the prompt cache may hold: the budget less the KV in flight, but at least
        ``cache_floor_share`` of the budget (0 by default: the KV in flight can take it all)."""
        return max(self.cache_bytes - self._inflight_nbytes(), int(self.cache_floor_share * self.cache_bytes))

    def _inflight_nbytes(self) -> int:
        """KV bytes held outside the cache: the batch's, and the hits waiting requests pinned as
        copies (a hit pinned by reference holds segments the cache counts already)."""
        pinned = sum(self.cache.ops.nbytes(r.hit.kv) for r in self._waiting if r.hit is not None and r.hit.kv)
        return self._bg.prompt_cache_nbytes + pinned

    def _drain_cancels(self) -> None:
        rids = []
        while True:
            try:
                rids.append(self._cancels.get_nowait())
            except queue.Empty:
                break
        uids = [self._by_rid[r] for r in rids if r in self._by_rid]
        if self.finish_prefill_on_cancel:
            # Still prefilling: finish the prompt first (saved when it ends).
            later = {u for u in uids if self._live[u].prompt_left > 0}
            self._cancel_after_prefill |= later
            uids = [u for u in uids if u not in later]
        # Not admitted yet: cancel on admission (the request may not even have
        # left the incoming queue).
        self._pending_cancel.update(r for r in rids if r not in self._by_rid)
        if self._pending_cancel and self._waiting:
            keep: deque[GenRequest] = deque()
            for r in self._waiting:
                if r.rid in self._pending_cancel:
                    self._pending_cancel.discard(r.rid)
                    self._drop_waiting(r)
                else:
                    keep.append(r)
            self._waiting = keep
        if len(self._pending_cancel) > 10_000:
            self._pending_cancel.clear()
        if not uids:
            return
        caches = self._bg.remove(uids, return_prompt_caches=True)
        for uid in uids:
            live = self._live.pop(uid)
            self._by_rid.pop(live.req.rid, None)
            kv_tokens = caches.get(uid)
            abandoned = live.req.rid in self._abandoned  # forgotten in _finish
            if kv_tokens is not None:
                kv, tokens = kv_tokens
                self._save(live, list(tokens), kv, only_into_free_space=abandoned)
            self._finish(live, "cancelled")

    def _admit(self, req: GenRequest) -> _Live:
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        p = req.params
        prompt = req.prompt
        hit = req.hit if req.hit is not None else self.cache.fetch(prompt)
        req.hit = None
        if hit.read is not None:  # read from the disk tier while it waited
            hit = self.cache.finish_read(hit)
            if hit.kv is None:  # the read failed (entry dropped): what memory holds, if anything
                hit = self.cache.fetch(prompt)
        if self.cache.version != req.cache_version and self.cache.best_match(prompt)[1] > hit.reused:
            self.cache.drop(hit)
            hit = self.cache.fetch(prompt)  # saved while it waited, and longer than its pinned hit
        hit = self.cache.materialise(hit)  # a hit pinned by reference: copied out now
        req.cached = hit.reused
        if not req.spare:  # a request's choices count once: its prompt was looked up once (helper-84)
            self.requests_total += 1
            self.prompt_tokens_total += len(prompt)
            self.cached_tokens_total += hit.reused
            if hit.reused >= self.hit_tokens:
                self.hits += 1
            else:
                self.misses += 1
        self.metrics.on_admit(req.rid, req.submitted_at, len(prompt), hit.reused, spare=req.spare)
        self.queued_prefill_tokens -= hit.reused - req.queued_reuse  # its pinned hit is out already
        rest = prompt[hit.reused :]
        segments = [rest]
        save_system_at = 0
        # mlx-lm's segment save: stop at the end of the system prompt and save
        # it as its own entry, so other conversations share it.
        if hit.reused < req.system_tokens < len(prompt) - 1:
            cut = req.system_tokens - hit.reused
            segments = [rest[:cut], rest[cut:]]
            save_system_at = req.system_tokens
        sampler = make_sampler(p.temperature, p.top_p, p.min_p, 1, p.top_k, p.xtc_probability, p.xtc_threshold,
                               self._xtc_special_tokens() if p.xtc_probability else None)
        if p.seed is not None and p.temperature > 0:
            sampler = seeded_sampler(sampler, p.seed)
        processors = make_logits_processors(
            p.logit_bias, p.repetition_penalty or None, p.repetition_context_size,
            p.presence_penalty or None, p.presence_context_size,
            p.frequency_penalty or None, p.frequency_context_size,
        ) + list(p.processors)
        ends = ([] if p.ignore_eos else list(self.tokenizer.eos_token_ids)) + list(p.stop_token_ids)
        if p.allowed_token_ids:
            processors.append(AllowedTokens(p.allowed_token_ids))
        if p.bad_words:
            processors.append(BadWords([list(b) for b in p.bad_words]))
        if p.min_tokens:
            processors.append(MinTokens(p.min_tokens, list(self.tokenizer.eos_token_ids) + list(p.stop_token_ids)))
        stop = StopSequences([(t,) for t in ends])
        (uid,) = self._bg.insert_segments(
            segments=[segments],
            max_tokens=[p.max_tokens],
            caches=[hit.kv],
            all_tokens=[list(prompt[: hit.reused])],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[stop],
        )
        live = _Live(req, hit.entry_id, self.tokenizer.detokenizer, len(rest), save_system_at)
        self._live[uid] = live
        self._by_rid[req.rid] = uid
        req.emit(GenEvent("start", cached=hit.reused, total=len(prompt)))
        return live

    def _count_prefill(self, tokens: int, seconds: float) -> None:
        """Add one step's prompt tokens and time to the prefill rate's window; publish
        ``prefill_tps`` once the window holds `PREFILL_RATE_WINDOW` seconds (and, until the
        first window is full, the rate so far: a backend that has prefilled only short prompts
        still has one)."""
        w = self._prefill_window
        w[0] += tokens
        w[1] += seconds
        full = w[1] >= PREFILL_RATE_WINDOW
        if full or not self._prefill_rate_measured:
            self.prefill_tps = w[0] / w[1]
        if full:
            self._prefill_rate_measured = True
            self._prefill_window = [0, 0.0]

    def _step(self) -> None:
        t0 = time.perf_counter()
        if self._prefill_step is not None:  # the last step's whole cycle, to this one's start
            began, tokens, _ = self._prefill_step
            self._count_prefill(tokens, t0 - began)
            self._prefill_step = None
        prompt_resps, gen_resps = self._bg.next()
        dt = time.perf_counter() - t0
        prefilled = 0
        stepped = 0  # prompt tokens this step computed (``prefilled`` counts a prompt at its end)
        for r in prompt_resps:
            live = self._live.get(r.uid)
            if live is None:
                continue
            done, total = r.progress
            stepped += max(0, done - live.prompt_done)
            # The published queue (/health, metrics, `--heartbeat-load` gateways) follows the prompt
            # chunk by chunk: counted whole until its end, a long prompt mostly done read as all
            # still to do (the gateways' own figure counts down by the progress comments).
            self.queued_prefill_tokens -= max(0, min(done, live.prompt_left) - live.queued_out)
            live.prompt_done = done
            cached = live.req.cached
            live.req.emit(GenEvent("progress", done=cached + done, total=cached + total))
            if r.end_of_prompt:
                self.queued_prefill_tokens -= live.prompt_left - live.queued_out
                prefilled += live.prompt_left
                live.prompt_left = 0
                if self.save_at_prefill_end:
                    waiters = [w for w in self._next_waiting() if self._reuses(w, live)]
                    if waiters:
                        self._share_prompt(r.uid, live, waiters)
                if r.uid in self._cancel_after_prefill:
                    self._cancel_after_prefill.discard(r.uid)
                    self._cancels.put(live.req.rid)
            if r.end_of_segment and not r.end_of_prompt and live.save_system_at:
                extracted = self._bg.extract_cache([r.uid])
                if r.uid in extracted:
                    kv, tokens = extracted[r.uid]
                    if len(tokens) == live.save_system_at:
                        self.cache.insert(list(tokens), kv, "system")
                live.save_system_at = 0
        self.prefill_tokens_total += prefilled
        # The prefill rate: prompt tokens over the time of the steps that computed them, from
        # each step's start to the next one's (the batch's work is evaluated lazily, and the
        # sim makes up its steps' time between calls: a call's own time over- or understated
        # a short prompt's rate several times, helper-90), over at least PREFILL_RATE_WINDOW
        # seconds. Not ``prefilled`` over this step (a prompt prefilled over several steps
        # counted whole in its last one: a rate overstated a thousandfold), nor a step that
        # feeds only a prompt's last token (mlx-lm feeds it to the first decode step: a decode
        # step's time for one token read as a rate of ~140 tokens/s, helper-90).
        if stepped > 1 and dt > 0:
            self._prefill_step = (t0, stepped, dt)  # counted when the next step begins
        if gen_resps and dt > 0 and not prompt_resps:
            self.decode_tps = len(gen_resps) / dt
        for r in gen_resps:
            live = self._live.get(r.uid)
            if live is None:
                continue
            req = live.req
            if not req.generated:
                live.first_token_at = time.monotonic()
            req.generated += 1
            self.generated_tokens_total += 1
            self.metrics.on_token(req.rid, req.submitted_at, spare=req.spare)
            kept_stop = r.finish_reason == "stop" and self._kept_stop_token(r.token, req.params)
            if r.finish_reason == "stop" and not kept_stop:
                live.detok.finalize()
                text = live.detok.last_segment
            else:
                if not (req.params.skip_special_tokens and r.token in self._skipped_tokens()):
                    live.detok.add_token(r.token)
                if r.finish_reason is not None:
                    live.detok.finalize()
                text = live.detok.last_segment
            ev = GenEvent("token", token=r.token, text=text)
            if req.params.logprobs is not None and (r.finish_reason != "stop" or kept_stop):
                ev.logprob, ev.top = self._token_logprobs(r, req.params.logprobs)
            req.emit(ev)
            if r.finish_reason is not None:
                del self._live[r.uid]
                self._by_rid.pop(req.rid, None)
                self._save(live, list(r.all_tokens), r.prompt_cache)
                self._finish(live, r.finish_reason)

    def _token_logprobs(self, r, n: int) -> tuple[float, list]:
        """The sampled token's logprob and the ``n`` likeliest ``(id, logprob)``, most likely
        first, from mlx-lm's step response (``r.logprobs``: the vocabulary's log-softmax after
        the logits processors, before temperature: what mlx_lm.server reports). A token masked
        out (-inf) reads -9999.0, vLLM's convention (JSON has no infinity). A response without
        logprobs (the sim's: its tokens are certain) gives 0.0 and the token alone."""
        lp = getattr(r, "logprobs", None)
        if lp is None:
            return 0.0, [(r.token, 0.0)][:n]
        mx = self._mx
        value = max(float(lp[r.token].item()), LOGPROB_FLOOR)
        if n <= 0:
            return value, []
        n = min(n, lp.shape[-1])
        idx = mx.argpartition(-lp, kth=n - 1)[:n]
        pairs = zip(idx.tolist(), lp[idx].tolist())
        return value, sorted(((i, max(v, LOGPROB_FLOOR)) for i, v in pairs), key=lambda p: -p[1])

    def _kept_stop_token(self, token: int, p: GenParams) -> bool:
        """A stop token whose text stays in the answer: one of the request's ``stop_token_ids``
        that is not a special token (vLLM's rule: the tokenizer's ``all_special_ids``); an
        end-of-sequence token never is."""
        if token not in p.stop_token_ids:
            return False
        return token not in self._skipped_tokens() and token not in self.tokenizer.eos_token_ids

    def _skipped_tokens(self) -> frozenset:
        """The special tokens whose text a ``skip_special_tokens`` answer leaves out (vLLM's and
        transformers' set: the tokenizer's ``all_special_ids``), but for any whose text is part
        of a marker mlx-lm reads the answer's parts by (reasoning and tool-call markers,
        structural markers, response-format transitions: gpt-oss's ``<|channel|>``), which stay
        text. A request with tools skips none (`server`), as vLLM's tool parsers ask: a
        format's calls may hold special tokens inside them (Kimi K2's)."""
        if self._special is None:
            tok = self.tokenizer
            markers = [getattr(tok, name, None) or "" for name in ("think_start", "think_end", "tool_call_start",
                                                                   "tool_call_end")]
            markers += list(getattr(tok, "structural_markers", None) or ())
            for edges in (getattr(tok, "response_transitions", None) or {}).values():
                markers += [w for w, _ in edges]
            ids = getattr(tok, "all_special_ids", None) or ()
            names = tok.convert_ids_to_tokens(list(ids)) if ids else []
            self._special = frozenset(i for i, t in zip(ids, names)
                                      if not (t and any(t in m for m in markers if m)))
        return self._special

    def _xtc_special_tokens(self) -> list[int]:
        """Tokens XTC sampling never excludes: the newline and end-of-sequence tokens
        (mlx_lm.server's choice)."""
        if self._xtc_keep is None:
            self._xtc_keep = list(self.tokenizer.encode("\n", add_special_tokens=False)) + sorted(
                self.tokenizer.eos_token_ids)
        return self._xtc_keep

    def _share_prompt(self, uid: int, live: _Live, waiters: list[GenRequest]) -> None:
        """Give ``waiters`` (waiting requests that reuse it) the prompt KV of a running
        request: saved as an entry (`_save_prompt`), or, when that does not fit and
        ``prefill_handoff`` is on, handed to them directly (`_hand_over`). As its
        prefill ends, or while it decodes (the generated tokens are trimmed off)."""
        req = live.req
        got = self._bg.extract_cache([uid]).get(uid)
        if got is None:
            return
        kv, tokens = got
        tokens, n = list(tokens), len(req.prompt)
        if len(tokens) > n:  # decoding: the KV holds the prompt and what was generated so far
            if tokens[:n] != req.prompt or not self.cache.ops.trimmable(kv):
                return
            self.cache.ops.trim(kv, len(tokens) - n)
            tokens = tokens[:n]
        if not tokens or tokens != req.prompt[: len(tokens)]:
            return
        if self._save_prompt(live, tokens, kv):
            if self.prefill_save_pin:
                self._pin_saved(waiters)
            # Counted after the pins: /health (read from the event loop while this thread runs)
            # never shows the save without the waiters' queued tokens it lowered (a test read
            # prefill_saves 1 beside the waiter's whole prompt queued, CI run of session 40).
            self.prefill_saves += 1
        elif self.prefill_handoff:
            self._hand_over(tokens, kv, waiters)

    def _pin(self, req: GenRequest, hit, version: Optional[int] = None) -> None:
        """Make ``hit`` the waiting request's pinned hit (as of cache ``version``, default the
        cache's now). Only the tokens it will compute are queued work, so
        ``queued_prefill_tokens`` drops by what the new hit reuses beyond the old one (a fan-out's
        calls pinned to their shared context as its prefill ends used to stay counted whole
        until admitted: helper-49 saw 68,544 queued tokens for ~300 to compute)."""
        reused = hit.reused if hit is not None else 0
        self.queued_prefill_tokens -= reused - req.queued_reuse
        req.queued_reuse = reused
        if req.hit is not hit:
            self.cache.drop(req.hit)  # a hit pinned by reference it no longer needs
        req.hit, req.cache_version = hit, self.cache.version if version is None else version

    def _pin_saved(self, waiters: list[GenRequest]) -> None:
        """Give each request in ``waiters`` its hit from the prompt `_save_prompt` just saved
        (pinned like any waiting request's hit: by reference, or a private copy counted in
        flight) when it reuses more than the hit it holds.

        Why now rather than at admission: a waiter may still wait behind others, and when
        every save evicts (a budget below the KV of the requests in flight), the entry was
        often gone by then, so the wait bought nothing. The shared layout (cache rule 7)
        made it common: such a save adds only the prompt's unshared tail, so it fits in free
        space where a whole copy did not and went to `_hand_over`, which pins. Measured in
        docs/cache-policy.md ("On real backends, tight budget, concurrent turns").
        """
        for w in waiters:
            held = w.hit.reused if w.hit is not None else 0
            if self.cache.best_match(w.prompt)[1] > held:
                self._pin(w, self.cache.fetch(w.prompt, by_reference=self.pin_by_reference))

    def _save_prompt(self, live: _Live, tokens: list[int], kv) -> bool:
        """Save a running request's prompt KV (``tokens``, the request keeps running) for
        a waiting request that shares it. False (``kv`` untouched) if it did not fit.

        Only if the copy fits in free space (the prompt is already counted in
        flight), or with ``prefill_save_evicts`` in the budget the live
        requests' KV leaves, evicting other entries; the request's final save
        replaces this entry (a trimmable entry drops the prefixes it extends).
        """
        req = live.req
        room = self._cache_room()
        if not self._fits_in_free_space(kv, tokens, live) and not (
                self.prefill_save_evicts and self.cache.added_nbytes(tokens, kv) <= room):
            return False
        entry = self.cache.insert(tokens, kv, "user", reused_from=live.reused_from, reused=req.cached,
                                  prompt_len=len(req.prompt), system_tokens=req.system_tokens)
        if entry is None:
            return False
        self.cache.trim_to(max_bytes=room, keep=entry)
        live.prompt_saved = True
        return True

    def _hand_over(self, tokens: list[int], kv, waiters: list[GenRequest]) -> None:
        """Make a prompt's KV (holding ``tokens``) the pinned hit of each waiting request
        in ``waiters`` that reuses more of it than its own hit (each gets a private
        copy trimmed to what it reuses; the last one takes ``kv`` itself).

        No entry is made and nothing is evicted: a pinned hit is KV in flight, counted
        against the budget like the hit every request pins on arrival
        (`_inflight_nbytes`), and the request would hold the same KV once it had
        computed it. The cache rules for a hit hold: at least one token left to
        prefill (rule 1), an untrimmable KV only as an exact prefix (rule 4).
        """
        ops, ids = self.cache.ops, np.asarray(tokens, dtype=np.int32)
        trimmable = ops.trimmable(kv)
        takers = []
        for w in waiters:
            n = min(common_prefix(ids, w.ids), len(w.prompt) - 1)
            if not trimmable and n != len(ids):
                continue
            if n >= self.cache.min_hit_tokens and n > (w.hit.reused if w.hit is not None else 0):
                takers.append((w, n))
        for i, (w, n) in enumerate(takers):
            mine = kv if i == len(takers) - 1 else ops.copy(kv)
            self._pin(w, CacheHit(ops.prefix(mine, len(ids), n), n, None, len(ids)), version=w.cache_version)
            self.prefill_handoffs += 1

    def _save(self, live: _Live, tokens: list[int], kv, only_into_free_space: bool = False) -> None:
        req = live.req
        kind = "assistant" if len(tokens) > len(req.prompt) else "user"
        if only_into_free_space or req.spare:
            # An abandoned request (client gone, timeout) is kept only if it
            # fits beside everything else: under memory pressure the other
            # sessions' entries are worth more than a turn nobody waits for.
            # So is a spare choice: the first choice's entry holds the prompt they share, and
            # n siblings must not evict n other conversations (helper-83: n=64 took 64).
            if not self._fits_in_free_space(kv, tokens, live):
                # With a disk tier (cache rule 8) it goes there: no memory taken from anyone.
                if self.cache.save_to_disk(tokens, kv, kind, len(req.prompt)) is None:
                    self.saves_skipped += 1
                    log.debug("abandoned request %s not saved: no free cache space", req.rid)
                return
        self.cache.insert(
            tokens,
            kv,
            kind,
            reused_from=live.reused_from,
            reused=req.cached,
            prompt_len=len(req.prompt),
            system_tokens=req.system_tokens,
        )
        # Live requests' KV counts against the byte budget.
        self.cache.trim_to(max_bytes=self._cache_room())

    def _finish(self, live: _Live, reason: str, error: str = "") -> None:
        self._abandoned.discard(live.req.rid)
        self.active -= 1
        if live.prompt_left:
            self.queued_prefill_tokens -= live.prompt_left - live.queued_out
            live.prompt_left = 0
        self._release(live.req)
        if live.first_token_at and reason != "error":  # a failed batch's requests end at once
            took = time.monotonic() - live.first_token_at
            a = DECODE_SECONDS_SMOOTHING
            self.decode_seconds = took if not self.decode_seconds else (1 - a) * self.decode_seconds + a * took
        self.metrics.on_finish(live.req.rid, live.req.submitted_at, live.req.generated, reason, spare=live.req.spare)
        live.req.emit(GenEvent("end", finish_reason=reason, error=error or None))
