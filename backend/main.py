"""``mlxgw backend``: one backend process (engine + prompt cache + reporter + HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from aiohttp import web

from mlxgw import schema
from mlxgw.config import ENGINES, ModelConfig
from mlxgw.prompt import tokenizer_fingerprint
from mlxgw.redis_client import redis_problem
from mlxgw.rlimit import raise_open_files_limit
from mlxgw.stopping import PARENT_ENV, Stopper
from mlxgw.util import (WILDCARD_LOOPBACK, deadline, http_base, is_loopback, namespace_arg, non_empty_arg, non_negative_float, non_negative_int, parse_bytes, port_arg, redis_url_arg,
                        count, positive_float, positive_int, seconds_arg, share_arg, share_or_off_arg, size_arg, size_text, temperature_arg)

from . import persist, sim
from .cache import LAYOUTS, KVOps, PromptCache
from .disktier import BRANCH_SHARE, MAX_CHAIN, DiskTier
from .engine import DEFAULT_PREFILL_ORDER, PREFILL_ORDERS
from .metrics import BackendMetrics
from .report import Reporter
from .server import BackendConfig, make_app, sampling_defaults

log = logging.getLogger("mlxgw.backend")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=non_empty_arg, help="model path or repo id (default: the demo model)")
    p.add_argument("--served-name", type=non_empty_arg, help="model name clients use (default: the model dir name)")
    p.add_argument("--port", type=port_arg, default=8100)
    p.add_argument("--host", default="127.0.0.1", type=non_empty_arg, help="listen address (loopback by default; :: is IPv6 only, 0.0.0.0 IPv4 only (asyncio's binding, as nginx's [::]))")
    p.add_argument("--id", dest="backend_id", type=non_empty_arg, help="backend name, stable across restarts (default: host:port)")
    p.add_argument("--url", type=non_empty_arg, help="URL gateways reach this backend at (default: http://host:port; with a wildcard "
                                 "--host such as 0.0.0.0, the address this machine reaches Redis from, or "
                                 "127.0.0.1 when Redis is on this machine)")
    p.add_argument("--redis-url", type=redis_url_arg,
                   default=os.environ.get("MLXGW_REDIS_URL", schema.DEFAULT_REDIS_URL),
                   help="Redis holding the ownership index and registry (default: env MLXGW_REDIS_URL, else redis://127.0.0.1:6379/0)")
    p.add_argument("--namespace", type=namespace_arg, default=schema.DEFAULT_NAMESPACE,
                   help="Redis key prefix shared with the gateways (default %(default)s; docs/redis-schema.md)")
    p.add_argument("--block-size", type=positive_int, default=schema.DEFAULT_BLOCK_SIZE, help="tokens per block")
    # The same defaults as `mlxgw serve` (mlxgw.config.ModelConfig): a backend started by hand
    # on another Mac gets what the README states.
    p.add_argument("--cache-entries", type=positive_int, default=ModelConfig.cache_entries,
                   help="most prompt-cache entries (default %(default)s)")
    p.add_argument("--cache-bytes", type=size_arg, default=ModelConfig.cache_bytes,
                   help="prompt-cache byte budget, e.g. 512MB, 512M, 8GB (binary units: 1GB = 2**30 bytes; "
                        "default %(default)s)")
    p.add_argument("--min-hit-tokens", type=non_negative_int, default=ModelConfig.min_hit_tokens,
                   help="floor of a good hit, tokens (exo PR 1817; default %(default)s)")
    p.add_argument("--min-hit-ratio", type=non_negative_float, default=0.5, help="reused/prompt ratio of a good hit")
    p.add_argument("--min-shared-tokens", type=non_negative_int, default=0,
                   help="cache rule 6 (docs/cache-policy.md), off by default: keep a prefix two other prompts "
                        "branched from, at least this many tokens long, as its own entry when the last entry "
                        "holding it is evicted (the block size is the natural value)")
    p.add_argument("--cache-layout", choices=LAYOUTS, default=ModelConfig.cache_layout,
                   help="how the prompt cache stores entries: 'shared' (the default, cache rule 7: a prefix "
                        "several entries share is held once) or 'whole' (one KV copy per entry, as mlx-lm); "
                        "docs/cache-policy.md")
    p.add_argument("--cache-dir", help="keep the prompt cache across restarts: write it to this directory "
                                        "at a clean stop and read it back at start (one directory per backend; "
                                        "docs/cache-policy.md, 'Across restarts'); default: not kept")
    p.add_argument("--cache-save-interval", type=non_negative_float, default=ModelConfig.cache_save_interval,
                   help="with --cache-dir, also save the prompt cache while the backend is idle, at most every "
                        "this many seconds and only when it changed, so a crash loses at most that much "
                        "(default %(default)g; 0: only at a clean stop)")
    p.add_argument("--disk-cache-bytes", type=size_arg, default=None,
                   help="cache rule 8 (docs/cache-policy.md), off by default: write prompt-cache entries the "
                        "memory budget evicts to disk, up to this many bytes of KV (e.g. 100GB), and read one "
                        "back when a prompt's longest cached prefix is there (a disk read instead of a prefill)")
    p.add_argument("--disk-write-queue-bytes", type=str, default=None,
                   help="with --disk-cache-bytes: KV copies waiting for the disk writer, held outside the memory "
                        "budget, before an eviction waits for it (default: a quarter of --cache-bytes; 0: no disk "
                        "I/O beside the batch: writes and reads in the engine thread, pausing decodes)")
    p.add_argument("--disk-chain-parts", type=positive_int, default=None,
                   help="with --disk-cache-bytes: most files (parts) one entry's chain on disk may have; an "
                        "entry that continues a chain on disk writes only its new tokens, up to this many parts "
                        f"(default {MAX_CHAIN}; 1: one whole file per entry, each eviction writing all of it; a turn "
                        "adds a part for its prompt and one for its answer, so below 4 chains barely grow)")
    p.add_argument("--disk-branch-share", type=share_arg, default=None,
                   help="with --disk-cache-bytes: an entry whose tokens leave a chain on disk inside one of its "
                        "parts uses that part's first tokens (reading its whole file) when they are at least this "
                        f"fraction of it, and writes only the rest (default {BRANCH_SHARE:g}; 1: only where a part "
                        "ends, each such entry writing its own copy from that part's start)")
    p.add_argument("--disk-cache-dir", help="with --disk-cache-bytes: where its files go (default: "
                                             "<--cache-dir>/tier); kept at a clean stop for the next start "
                                             "with the same model and settings")
    p.add_argument("--decode-concurrency", type=positive_int, default=ModelConfig.decode_concurrency,
                   help="decode slots: sequences generating at once (mlx-lm's completion_batch_size; default "
                        "16); a request beyond them waits for one to end. Each running sequence holds "
                        "its whole context's KV (docs/cache-policy.md, 'Decode slots')")
    p.add_argument("--prefill-concurrency", type=positive_int, default=ModelConfig.prefill_concurrency,
                   help="prompts prefilled side by side (mlx-lm's prefill_batch_size; default %(default)s); at most "
                        "--decode-concurrency")
    p.add_argument("--prefill-step-size", type=positive_int, default=512,
                   help="tokens of each prompt computed per prefill step (mlx-lm's prefill_step_size; default "
                        "%(default)s)")
    p.add_argument("--prefill-order", choices=PREFILL_ORDERS, default=DEFAULT_PREFILL_ORDER,
                   help="which waiting request takes a free prefill slot beside a running prefill: the oldest "
                        "(fifo), or the one with the fewest tokens to compute if fewer than the running one has "
                        "left (shorter-beside) and at most one prefill step (step-beside, the default); "
                        "docs/cache-policy.md")
    p.add_argument("--heartbeat-interval", type=seconds_arg(MIN_HEARTBEAT_INTERVAL, MAX_HEARTBEAT_TTL / 2),
                   default=schema.DEFAULT_HEARTBEAT_INTERVAL, help="seconds between registry heartbeats")
    p.add_argument("--heartbeat-ttl", type=seconds_arg(2 * MIN_HEARTBEAT_INTERVAL, MAX_HEARTBEAT_TTL),
                   help=f"seconds the registry record outlives the last heartbeat (at least two intervals; "
                        f"default {schema.DEFAULT_HEARTBEAT_TTL:g}, or two intervals when that is more)")
    p.add_argument("--engine-stall-seconds", type=positive_float, default=BackendConfig.engine_stall_seconds,
                   help="a request's keep-alives stop once the engine thread has made no progress for this long "
                        "(a hung step), so a gateway's --read-timeout tries another backend")
    p.add_argument("--request-timeout", type=non_negative_float, default=ModelConfig.request_timeout,
                   help="seconds from a request's arrival (its wait for a decode slot, prefill and decode) before "
                        "it is cancelled with a 504 / SSE error, which gateways pass on without retrying; "
                        "its prompt cache is still saved (default %(default)s; 0: no limit; [[models]] request_timeout "
                        "under mlxgw serve)")
    p.add_argument("--cancel-prefill", action="store_true",
                   help="on client disconnect or timeout, stop a running prefill at once (default: finish the "
                        "prefill and save it, so the client's retry reuses the whole prompt)")
    p.add_argument("--prefill-save", action=argparse.BooleanOptionalAction, default=True,
                   help="a waiting request sharing at least --min-hit-tokens of a prompt being prefilled waits for "
                        "that prefill, and the prompt is saved as it ends (into free space only) so the waiting one "
                        "reuses it; a request sharing as much with one already decoding gets that prompt saved as it "
                        "is admitted (docs/cache-policy.md)")
    p.add_argument("--prefill-save-evicts", action=argparse.BooleanOptionalAction, default=False,
                   help="the save for a waiting request (--prefill-save) may evict other entries when free space is "
                        "short (the waiting request reuses it for certain); off: free space only")
    p.add_argument("--prefill-handoff", action=argparse.BooleanOptionalAction, default=True,
                   help="when that save does not fit in free space, hand a copy of the prompt's KV straight to the "
                        "waiting requests that reuse it (KV in flight, nothing evicted; docs/cache-policy.md); "
                        "off: they compute it again")
    p.add_argument("--prefill-save-pin", action=argparse.BooleanOptionalAction, default=True,
                   help="when that save fits, the waiting requests take their hit from it at once (pinned, KV in "
                        "flight) rather than at admission, when a full cache may have evicted it; off: at admission")
    p.add_argument("--pin-by-reference", action=argparse.BooleanOptionalAction, default=False,
                   help="a waiting request holds its cache hit as a reference to the cache's segments and copies "
                        "it out when admitted (shared layout); off (default): a private copy from its arrival, KV "
                        "in flight that counts against --cache-bytes while it waits (docs/cache-policy.md: opt-in, "
                        "measured)")
    p.add_argument("--sampling-defaults", choices=("model", "none"), default=ModelConfig.sampling_defaults,
                   help="what a request that sets no temperature, top_p, top_k, min_p or repetition_penalty "
                        "samples with: 'model' (default), the values in the model's generation_config.json, what "
                        "its authors recommend and vLLM applies; 'none', greedy, as mlx_lm.server")
    p.add_argument("--default-temperature", type=temperature_arg, default=ModelConfig.default_temperature,
                   help="sampling temperature of a request that gives none, over the model's (0 to 2; 0 is "
                        "greedy, mlx_lm.server's --temp; the OpenAI and Anthropic APIs default to 1.0)")
    p.add_argument("--max-inflight-share", type=share_or_off_arg, default=0.0,
                   help="admit a request only while the KV in flight plus its prompt's stays within this share of "
                        "--cache-bytes (unless nothing runs), so the rest stays the prompt cache's; 0 (default): no "
                        "such wait (docs/cache-policy.md, measured)")
    p.add_argument("--cache-floor-share", type=share_or_off_arg, default=0.0,
                   help="experimental: the prompt cache keeps at least this share of --cache-bytes even when the KV "
                        "in flight takes the rest (the total may then pass the budget by that much); 0 (default): "
                        "the KV in flight can empty the cache")
    p.add_argument("--inflight-claims", action=argparse.BooleanOptionalAction, default=True,
                   help="report a request's prompt blocks as owned from its arrival until it ends, so every "
                        "gateway sends its siblings here (docs/redis-schema.md); off: only saved entries")
    p.add_argument("--engine", choices=ENGINES, default="mlx",
                   help="mlx: the model; sim: a timing model, no weights (docs/sim.md)")
    p.add_argument(
        "--internal-token",
        default=os.environ.get("MLXGW_INTERNAL_TOKEN"),
        help="require 'Authorization: Bearer TOKEN' (set by the launcher; env MLXGW_INTERNAL_TOKEN)",
    )
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen beyond loopback (--host) without an internal token: only when something in front "
                        "of the backend already authenticates (docs/security.md)")
    sim.add_arguments(p)


def exposure_error(host: str, token: Optional[str], allow_unauthenticated: bool) -> Optional[str]:
    """Why this backend must not start as configured (None: it may): listening beyond loopback
    without an internal token would let anyone who reaches the address use the model and skip
    the gateways' routing, keys and limits. The gateway's rule for API keys (gateway.auth)."""
    if token or allow_unauthenticated or is_loopback(host):
        return None
    return (f"refusing to listen on {host!r} without an internal token: anyone who can reach that address could "
            "use the model and skip the gateways' keys and limits. Give --internal-token TOKEN or "
            "MLXGW_INTERNAL_TOKEN (the gateways' token), or pass --allow-unauthenticated if something in front of "
            "the backend already authenticates (docs/security.md)")


def looks_loadable(model: str) -> bool:
    """True for an existing local path or a hub repo id of the form ``org/name``."""
    if looks_local(model):
        return True
    return not model.startswith(("/", ".", "~")) and model.count("/") == 1


def looks_local(model: str) -> bool:
    """True for an existing local path (anything else is a hub repo id)."""
    return Path(model).expanduser().exists()


#: A prompt-cache budget below this holds no useful prompt (1 MiB: a few thousand tokens of a
#: tiny model's KV, a few tokens of an 8B model's).
SMALL_BUDGET_BYTES = 1 << 20


#: With the model's KV size known, a budget below this many tokens of it is pointed out.
SMALL_BUDGET_TOKENS = 256


def model_kv_bytes_per_token(model_path) -> Optional[int]:
    """KV bytes per token of the model in ``model_path`` from its ``config.json`` (2 bytes a value,
    4 for a float32 model); None when it cannot be read (a hub name, another layout)."""
    try:
        cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        layers, heads, dim = sim.kv_config(cfg)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return sim.kv_bytes_per_token(layers, heads, dim, 4 if cfg.get("torch_dtype") == "float32" else 2)


def budget_warnings(text: str, budget: int, total_memory: Optional[int] = None,
                    kv_per_token: Optional[int] = None) -> list[str]:
    """What to tell the operator about a prompt-cache budget of ``budget`` bytes (given as
    ``text``): a size without a unit is bytes, so ``--cache-bytes 512`` meant 512MB most likely
    and caches nothing, silently (helper-46); a budget above the machine's memory never binds.
    ``total_memory`` in bytes (default: this machine's); ``kv_per_token`` the model's KV bytes
    per token when known: the budget is then small below `SMALL_BUDGET_TOKENS` tokens of it
    (helper-56/57: a tiny model's 512 KB held 1,000 tokens and was called too small), else
    below `SMALL_BUDGET_BYTES`."""
    out = []
    small = budget < kv_per_token * SMALL_BUDGET_TOKENS if kv_per_token else budget < SMALL_BUDGET_BYTES
    if small:
        why = (f"less than {SMALL_BUDGET_TOKENS} tokens of this model's KV ({kv_per_token} bytes a token), so next "
               "to nothing will be cached") if kv_per_token else "too small to hold a prompt, so nothing will be cached"
        bare = text.strip().replace(".", "", 1).isdigit()
        out.append(f"--cache-bytes {text} is {budget} bytes: {why}" +
                   (f" (a size without a unit counts bytes; did you mean {text.strip()}MB?)" if bare else ""))
    if total_memory is None:
        import psutil

        total_memory = int(psutil.virtual_memory().total)
    if total_memory and budget > total_memory:
        out.append(f"--cache-bytes {text} is more than this machine's memory ({total_memory / 2**30:.1f} GiB): "
                   "memory, not the budget, will bound the prompt cache")
    return out


def kv_settings(args: argparse.Namespace, timing) -> dict:
    """What, besides the model files, decides whether a saved prompt cache fits this run
    (`backend.persist.kv_settings`): the engine (and the sim's KV model), the cache layout and
    mlx-lm's version (its cache file format and KV layout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlx_lm = version("mlx-lm")
    except PackageNotFoundError:  # pragma: no cover (a source checkout)
        mlx_lm = "unknown"
    return {"engine": args.engine, "layout": args.cache_layout, "mlx_lm": mlx_lm,
            "sim": [timing.kv_bytes_per_token, timing.token_scale] if timing is not None else None}


def disk_tier(args: argparse.Namespace, cache_dir: Optional[Path], ops, settings: dict) -> Optional[DiskTier]:
    """The disk tier ``--disk-cache-bytes`` asks for (cache rule 8), or None.

    Its directory is ``--disk-cache-dir``, else ``<cache_dir>/tier`` (under the ``--cache-dir``
    lock); a directory of its own is locked like a ``--cache-dir``. ``ops``: the cache's
    `KVOps` (None: mlx-lm's); ``settings``: the run's `persist.kv_settings` (a tier kept at the
    last clean stop under equal settings is adopted). Raises ValueError (no directory, or the same as ``--cache-dir``),
    RuntimeError (locked by another backend) or OSError (unusable); the caller exits 2.
    """
    if not args.disk_cache_bytes:
        for flag in ("disk_cache_dir", "disk_chain_parts", "disk_branch_share", "disk_write_queue_bytes"):
            if getattr(args, flag) is not None:  # a tier's setting without a tier is a mistake, not a no-op
                raise ValueError(f"--{flag.replace('_', '-')} needs --disk-cache-bytes (the disk tier's budget)")
        return None
    if args.disk_cache_dir:
        where = Path(args.disk_cache_dir).expanduser().resolve()
        if cache_dir is not None and where == cache_dir:
            raise ValueError("--disk-cache-dir must differ from --cache-dir (leave it out to use <--cache-dir>/tier)")
        flag = "--disk-cache-dir"
    elif cache_dir is not None:
        where, flag = cache_dir / "tier", "--cache-dir's disk tier"
    else:
        raise ValueError("--disk-cache-bytes needs a directory: --disk-cache-dir, or --cache-dir (then <dir>/tier)")
    # Locked whichever way it was named (helper-56: a backend given another's <--cache-dir>/tier
    # as its --disk-cache-dir ran beside it, both writing the same files).
    try:
        lock = persist.CacheDirLock(where, flag=flag)
    except OSError as e:
        raise OSError(f"{flag} {where}: {e.strerror or e}") from None
    atexit.register(lock.release)
    budget = parse_bytes(args.disk_cache_bytes)
    if budget < SMALL_BUDGET_BYTES:  # helper-56: "--disk-cache-bytes 10" made a tier that held nothing
        text = str(args.disk_cache_bytes).strip()
        bare = text.replace(".", "", 1).isdigit() and float(text) < 10_000  # "500": 500GB meant, likely
        log.warning("--disk-cache-bytes %s is %d bytes: too small to hold a prompt, so nothing will go to disk%s", text,
                    budget, f" (a size without a unit counts bytes; did you mean {text}GB?)" if bare else "")
    # Host copies waiting for the writer sit outside the memory budget: at most a quarter of it.
    if args.disk_write_queue_bytes is None:
        pending: Optional[int] = parse_bytes(args.cache_bytes) // 4
    else:
        try:
            pending = parse_bytes(args.disk_write_queue_bytes) or None  # 0: no write-behind
        except ValueError as e:
            raise ValueError(f"--disk-write-queue-bytes: {e}") from None
        if pending is not None and pending < 0:
            raise ValueError("--disk-write-queue-bytes must be >= 0")
    tier = DiskTier(where, budget, ops or KVOps(), max_pending_bytes=pending, settings=settings,
                    max_chain=args.disk_chain_parts or MAX_CHAIN,
                    branch_share=args.disk_branch_share or BRANCH_SHARE)
    free = shutil.disk_usage(where).free
    if free < budget:
        log.warning("the disk tier's budget (%s) exceeds the free space in %s (%s): once the disk is full, new "
                    "entries replace the tier's oldest", size_text(budget), where, size_text(free))
    log.info("disk tier: up to %s of evicted prompt-cache entries in %s", size_text(budget), where)
    return tier


def advertised_url(host: str, port: int, redis_url: str, url: Optional[str] = None) -> tuple[str, str]:
    """The URL this backend registers for gateways to reach it at, and a warning ('' if none).

    ``url`` (``--url``) when given. Else, listening on a wildcard address (``0.0.0.0``, ``::``):
    loopback when Redis is on this machine, otherwise the address this machine reaches Redis
    from (the gateways share that Redis, so they are on a network that reaches it); a
    backend on another Mac registered ``127.0.0.1`` and the gateway's own backend at that
    port took its traffic (helper-64). Else ``host``. The warning says when gateways on other
    machines cannot reach the URL: a loopback URL while Redis is elsewhere.
    """
    where = urlsplit(redis_url)
    redis_host = where.hostname or "127.0.0.1"
    remote = not is_loopback(redis_host)
    if not url:
        h = host
        if host in WILDCARD_LOOPBACK:
            h = WILDCARD_LOOPBACK[host]
            if remote:
                try:  # no packet is sent: connect() on UDP only picks the route
                    fam = socket.AF_INET6 if ":" in redis_host else socket.AF_INET
                    with socket.socket(fam, socket.SOCK_DGRAM) as so:
                        so.connect((redis_host, where.port or 6379))
                        h = so.getsockname()[0]
                except OSError:
                    h = socket.gethostname()
        url = http_base(h, port)
    if remote and is_loopback(urlsplit(url).hostname or ""):
        return url, (f"registering {url} while Redis is on another machine ({redis_host}): gateways there "
                     "cannot reach this backend at a loopback address (a gateway's own backend at that port "
                     "would take its requests); listen with --host 0.0.0.0 and, if needed, --url "
                     "http://<this machine's address>:<port>")
    return url, ""


#: The shortest heartbeat interval, seconds (0 wrote to Redis ~12,000 times a second: helper-66).
MIN_HEARTBEAT_INTERVAL = 0.1
#: The longest registry TTL, seconds: a killed backend counts as live for its TTL, and 1e30 made
#: Redis refuse the EXPIRE after the record was written, leaving it for good (helper-67).
MAX_HEARTBEAT_TTL = 600.0


def heartbeat_error(interval: float, ttl: float) -> Optional[str]:
    """Why ``--heartbeat-interval`` / ``--heartbeat-ttl`` (seconds) cannot be used (None: they
    can): an interval under `MIN_HEARTBEAT_INTERVAL`, or a TTL under two intervals, which lets
    the registry record expire between two heartbeats (helper-66: TTL 1 s with 5-s heartbeats
    left and rejoined the registry every 5 s)."""
    if interval < MIN_HEARTBEAT_INTERVAL:
        return f"--heartbeat-interval {interval:g} is under {MIN_HEARTBEAT_INTERVAL:g} s"
    if ttl > MAX_HEARTBEAT_TTL:
        return (f"--heartbeat-ttl {ttl:g} is over {MAX_HEARTBEAT_TTL:g} s (a killed backend counts as live "
                f"until its record expires)")
    if ttl < 2 * interval:
        return (f"--heartbeat-ttl {ttl:g} is under two --heartbeat-interval ({interval:g} s): the registry "
                f"record would expire between heartbeats; give a TTL of at least {2 * interval:g} s")
    return None


def run(args: argparse.Namespace) -> int:
    """Run one backend until SIGINT/SIGTERM; returns the process exit code."""
    if args.heartbeat_ttl is None:  # helper-69: --heartbeat-interval 3 alone was refused for a TTL not given
        args.heartbeat_ttl = max(schema.DEFAULT_HEARTBEAT_TTL, 2 * args.heartbeat_interval)
    why = heartbeat_error(args.heartbeat_interval, args.heartbeat_ttl)
    if why:  # before the engine's imports (seconds of them)
        log.error("%s", why)
        return 2
    from .engine import MLXEngine

    if args.pin_by_reference and args.cache_layout != "shared":
        log.error("--pin-by-reference needs --cache-layout shared (pins reference the shared layout's segments)")
        return 2
    if not args.model:
        from mlxgw.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model("tiny"))
    model_path = args.model
    if not looks_loadable(model_path):
        log.error("model path %s does not exist", model_path)
        return 2
    why = exposure_error(args.host, args.internal_token, args.allow_unauthenticated)
    if why:
        log.error("%s", why)
        return 6
    name = args.served_name or Path(model_path.rstrip("/")).name
    backend_id = args.backend_id or f"{socket.gethostname()}:{args.port}"
    raise_open_files_limit()
    url, why = advertised_url(args.host, args.port, args.redis_url, args.url)
    bad_url = schema.url_error(url)
    if bad_url:
        log.error("--url: %s: gateways reach a backend at http://<address>:<port> (e.g. http://mac2.local:8100)",
                  bad_url)
        return 2
    if why:
        log.warning("%s", why)
    budget = parse_bytes(args.cache_bytes)  # size_arg checked it
    for line in budget_warnings(args.cache_bytes, budget, kv_per_token=None if args.engine == "sim"
                                else model_kv_bytes_per_token(model_path)):
        log.warning("%s", line)

    reporter = Reporter(
        args.redis_url,
        args.namespace,
        name,
        backend_id,
        url,
        block_size=args.block_size,
        heartbeat_interval=args.heartbeat_interval,
        ttl=args.heartbeat_ttl,
        extra={"model_path": str(model_path), "cache_budget_bytes": budget, "engine": args.engine,
               "min_hit_tokens": args.min_hit_tokens, "cache_layout": args.cache_layout,
               "max_inflight_share": args.max_inflight_share, "pin_by_reference": int(args.pin_by_reference),
               "heartbeat_interval": args.heartbeat_interval,
               "auth": "token" if args.internal_token else "none", "url_problem": "",
               # Backends serving one name from other files disagree here (`mlxgw status` says so).
               "model_files": persist.model_files(model_path)},
    )
    timing = None
    if args.engine == "sim":
        try:
            timing = sim.timing_from_args(args)
        except (ValueError, OSError, KeyError) as e:
            log.error("bad --sim-* settings: %s", e)
            return 2
    cache_dir, lock = None, None
    if args.cache_dir:
        cache_dir = Path(args.cache_dir).expanduser().resolve()
        try:
            lock = persist.CacheDirLock(cache_dir)
        except RuntimeError as e:
            log.error("%s", e)
            return 2
        except OSError as e:  # not a directory, read-only, ...
            log.error("--cache-dir %s cannot be used: %s", cache_dir, e.strerror or e)
            return 2
    # What decides the KV (model files sampled once, for the memory save and the disk tier).
    settings = persist.kv_settings(model_path, reporter.extra["model_files"], **kv_settings(args, timing)) \
        if cache_dir or args.disk_cache_bytes else {}
    try:
        # The tier's chains are the same in either cache layout: the layout does not decide its files.
        disk = disk_tier(args, cache_dir, sim.SimKVOps(timing) if timing is not None else None,
                         {k: v for k, v in settings.items() if k != "layout"})
    except (ValueError, OSError, RuntimeError) as e:
        log.error("%s", e)
        return 2
    cache = PromptCache(
        max_entries=args.cache_entries,
        max_bytes=budget,
        min_hit_tokens=args.min_hit_tokens,
        min_hit_ratio=args.min_hit_ratio,
        min_shared_tokens=args.min_shared_tokens,
        layout=args.cache_layout,
        share_min_tokens=args.block_size,
        listener=reporter,
        ops=sim.SimKVOps(timing) if timing is not None else None,
        disk=disk,
    )
    metrics = BackendMetrics(name)
    kw = dict(decode_concurrency=args.decode_concurrency, prefill_concurrency=args.prefill_concurrency,
              prefill_step_size=args.prefill_step_size, finish_prefill_on_cancel=not args.cancel_prefill,
              metrics=metrics, save_at_prefill_end=args.prefill_save, prefill_save_evicts=args.prefill_save_evicts,
              prefill_handoff=args.prefill_handoff, prefill_save_pin=args.prefill_save_pin,
              pin_by_reference=args.pin_by_reference, max_inflight_share=args.max_inflight_share or None,
              cache_floor_share=args.cache_floor_share,
              claims=reporter if args.inflight_claims else None, prefill_order=args.prefill_order,
              hit_tokens=args.block_size, cache_dir=cache_dir,
              cache_settings=settings if cache_dir else None,
              cache_save_interval=args.cache_save_interval)
    if timing is not None:
        engine = sim.SimEngine(model_path, cache, budget, timing, **kw)
    else:
        engine = MLXEngine(model_path, cache, budget, **kw)
    metrics.bind(engine.stats, budget)
    reporter.info = lambda: {**engine.stats(), **metrics.record_fields()}
    reporter.cache_figures = engine.cache_figures
    cfg = BackendConfig(backend_id, name, str(model_path), internal_token=args.internal_token,
                        request_timeout=args.request_timeout, engine_stall_seconds=args.engine_stall_seconds,
                        sampling=sampling_defaults(model_path, args.sampling_defaults, args.default_temperature))
    try:
        return asyncio.run(_serve(engine, reporter, cfg, args))
    finally:
        if lock is not None:
            lock.release()


async def _serve(engine, reporter: Reporter, cfg: BackendConfig, args) -> int:
    # Bind first so a port in use fails before the model loads.
    app = make_app(engine, reporter, cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        await runner.cleanup()
        return 3
    engine.start()
    loop = asyncio.get_running_loop()
    ready = await loop.run_in_executor(None, engine.wait_ready, None)
    if engine.load_error is not None or not ready:
        log.error("model load failed (%s): %s%s", type(engine.load_error).__name__, engine.load_error,
                  "" if looks_local(args.model) else
                  f" ('{args.model}' is not a local directory, so it was looked up on the Hugging Face hub; "
                  "pass a model directory to --model, or see README 'Set up' for the offline demo model)")
        await runner.cleanup()
        return 2
    # Gateways route here only if their tokenizer's fingerprint is the same (gateway.index).
    reporter.extra["tokenizer"] = tokenizer_fingerprint(engine.tokenizer)
    stopper = Stopper(f"backend {cfg.backend_id}")
    code = await _register(reporter, stopper, args)
    if code is not None:
        stopper.close()
        engine.stop()
        await runner.cleanup()
        return code
    mib = engine.cache.max_bytes / 2**20
    opt_in = "".join([f"; admits while the KV in flight stays within {args.max_inflight_share:g} of the budget"
                      if args.max_inflight_share else "", "; pins hits by reference" if args.pin_by_reference else ""])
    log.info("backend %s registered at %s (model %s from %s, files %s, epoch %d; prompt cache %s MiB, %s, "
             "%s layout; %d decode slots%s)", cfg.backend_id, reporter.url, cfg.model_name,
             reporter.extra["model_path"], reporter.extra["model_files"], reporter.epoch,
             f"{mib:.0f}" if mib >= 10 else f"{mib:.3g}", count(engine.cache.max_entries, "entry", "entries"),
             engine.cache.layout, engine.decode_concurrency, opt_in)
    log.info("backend %s: a request that sets no sampling gets %s", cfg.backend_id,
             ", ".join(f"{k} {v:g}" for k, v in cfg.sampling.items()) + (
                 " (the model's generation_config.json; --sampling-defaults none for greedy)"
                 if args.sampling_defaults == "model" and cfg.sampling != {"temperature": args.default_temperature}
                 else "") if cfg.sampling else "greedy decoding (temperature 0)")
    if engine.restored is not None:
        log.info("backend %s: %s (%s tokens) restored from %s and published under epoch %d", cfg.backend_id,
                 count(engine.restored.entries, "prompt-cache entry", "prompt-cache entries"),
                 f"{engine.restored.tokens:,}", engine.cache_dir, reporter.epoch)
    if not cfg.internal_token:
        # Where it listens, not the URL it registered (helper-66: a wildcard host was named as
        # 127.0.0.1, a wrong --url as a port nothing listened on).
        where = (f"port {args.port} on any of this machine's addresses" if args.host in WILDCARD_LOOPBACK
                 else http_base(args.host, args.port))
        log.warning("backend %s has no internal token: anything that reaches %s can send it requests directly, "
                    "past the gateways' routing, keys and limits (mlxgw serve sets one; docs/security.md)",
                    cfg.backend_id, where)
    # Ready (and /health 200) only after the lines above: whoever waits on /health then reads a
    # complete start log (a test read it between the two and missed the layout, CI at cd6f088).
    reporter.state = "ready"
    await reporter.heartbeat()
    watch = asyncio.get_running_loop().create_task(_stop_on_fault(engine, reporter, stopper, cfg.backend_id))
    probe = asyncio.get_running_loop().create_task(_check_own_url(reporter.url, cfg.backend_id, reporter))
    await stopper.wait()
    stopper.close()
    watch.cancel()
    probe.cancel()
    log.info("backend %s stopping: draining, then withdrawing from Redis", cfg.backend_id)
    reporter.state = "draining"
    await runner.cleanup()
    await reporter.stop()
    engine.stop()
    log.info("backend %s stopped", cfg.backend_id)
    return ENGINE_DIED if engine.failed else (TAKEN_OVER if reporter.taken_over else 0)


async def _check_own_url(url: str, backend_id: str, reporter: Optional[Reporter] = None,
                         timeout: float = 3.0) -> Optional[str]:
    """Ask this backend's registered ``url`` for ``/health`` once, as the gateways will; log a
    warning (and return it, and publish it as the registry's ``url_problem`` for `mlxgw
    status`) when the answer is not this backend's. helper-66: a backend
    registered with the wrong port in ``--url`` said nothing, and the gateways' logs named a
    connection error without pointing at ``--url``. From another machine the URL may still
    work where it does not from here (a firewall's hairpin), hence a warning, not an exit."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            # Sent as a gateway's request is, so a gateway there names itself (its 421 `misaddressed`)
            async with session.get(url + "/health", headers={schema.FORWARDED_BY: f"self-check of {backend_id}"}) as r:
                served_by, gateway = r.headers.get(schema.SERVED_BY), r.headers.get(schema.GATEWAY_ID)
                if served_by == backend_id:
                    return None
                what = (f"backend {served_by} answers there" if served_by
                        else f"mlxgw gateway {gateway} (not a backend) answers there" if gateway  # helper-76
                        else f"something that is not an mlxgw backend answers there (HTTP {r.status})")
    except aiohttp.ClientSSLError as e:  # helper-67: an https:// URL for this plain-http server
        what = (f"no TLS connection can be made there (it serves plain http: an https:// URL needs a TLS "
                f"proxy in front; {type(e).__name__})")
    except Exception as e:  # refused, unreachable, timed out
        what = f"nothing answers there from this machine ({type(e).__name__}: {e or 'no answer'})"
    msg = (f"backend {backend_id} registered the URL {url}, but {what}: gateways cannot reach it there; "
           f"start it with --url http://<address>:<port> at an address and port it listens on")
    log.warning("%s", msg)
    if reporter is not None:
        reporter.extra["url_problem"] = msg  # with the next heartbeat
    return msg


#: Exit code of a backend whose engine thread died (`mlxgw serve` restarts it, as any crash).
ENGINE_DIED = 5
#: Exit code of a backend whose id a later backend took (`backend.report.TakenOver`): a setting
#: to change, not a crash (`mlxgw serve` does not restart it).
TAKEN_OVER = 2


async def _register(reporter, stopper, args) -> Optional[int]:
    """Register with Redis (`Reporter.start`); None once registered, else the exit code.

    A duplicate live id is exit 2. Redis unreachable is exit 4 for a backend started by hand
    (a wrong URL should fail at once); one started by `mlxgw serve` waits for it instead,
    retrying every second (helper-64: it exited 4 on each restart while an outside Redis was
    down, and serve's growing restart delay brought it back 28 s after Redis), unless stopped.
    """
    from .report import DuplicateBackend

    said = float("-inf")
    while True:
        try:
            await reporter.start()
            return None
        except DuplicateBackend as e:
            log.error("%s", e)
            return 2
        except Exception as e:
            problem = redis_problem(args.redis_url, e)
            if not os.environ.get(PARENT_ENV):
                given = args.redis_url != schema.DEFAULT_REDIS_URL or os.environ.get("MLXGW_REDIS_URL")
                log.error("%s%s", problem, "" if given else (
                    " (no --redis-url or MLXGW_REDIS_URL was given, so this is the default: start redis-server "
                    "there, pass the URL of the Redis the gateways use, or run `mlxgw serve`, which starts one)"))
                return 4
            if time.monotonic() - said >= 10:
                said = time.monotonic()
                log.warning("%s; registering when it answers (tried every second)", problem)
            if reporter.redis is not None:
                await reporter.redis.aclose()
            try:
                async with deadline(1.0):
                    await stopper.wait()
                return 0  # stopped while waiting
            except asyncio.TimeoutError:
                pass


async def _stop_on_fault(engine, reporter, stopper, backend_id: str) -> None:
    """Withdraw from Redis and exit when this backend can no longer serve as registered: its
    engine thread died (`ENGINE_DIED`: it answered every request with an error, helper-56; `mlxgw
    serve` restarts it), or a later backend took its id while it was not heartbeating
    (`TAKEN_OVER`, helper-64: the registry flipped between the two every second)."""
    while not engine.failed and reporter.taken_over is None:
        await asyncio.sleep(0.2)
    if engine.failed:
        log.error("backend %s: its engine thread died (the traceback above says why); withdrawing from Redis and "
                  "exiting with code %d", backend_id, ENGINE_DIED)
    else:
        log.error("%s: exiting with code %d", reporter.taken_over, TAKEN_OVER)
    stopper.stop.set()

