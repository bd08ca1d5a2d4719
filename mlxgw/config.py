"""``mlxgw serve`` configuration: a TOML file (``configs/*.toml``) plus flags.

Flags given on the command line override the file. See ``configs/`` for
commented examples.
"""

from __future__ import annotations

import errno
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from . import schema


ENGINES = ("mlx", "sim")  # `mlxgw backend --engine`


@dataclass
class ModelConfig:
    """One served model and its backends (ports ``port .. port + backends - 1``)."""

    name: str = ""
    path: str = ""  # empty: the demo model
    # "mlx": the model computes; "sim": the simulated engine (docs/sim.md: the model's tokenizer and
    # config, no weights loaded, prefill and decode timed as on an Apple Silicon Mac)
    engine: str = "mlx"
    backends: int = 2
    port: int = 8100
    # The backends' listen address: loopback reaches a gateway on this machine only; "0.0.0.0"
    # lets gateways on other Macs reach them too (each then registers this Mac's address on the
    # network to Redis, `backend.main.advertised_url`; the internal token guards them).
    host: str = "127.0.0.1"
    cache_bytes: str = "2GB"
    cache_entries: int = 64
    min_hit_tokens: int = 1000
    min_shared_tokens: int = 0  # cache rule 6, opt-in (docs/cache-policy.md)
    cache_layout: str = "shared"  # cache rule 7: a shared prefix held once; "whole" is mlx-lm's way (docs/cache-policy.md)
    prefill_save: bool = True  # a request sharing a prompt in prefill waits for it and reuses it (docs/cache-policy.md)
    prefill_concurrency: int = 2  # prompts prefilled side by side per backend
    decode_concurrency: int = 16  # decode slots per backend (8 until session 31; docs/cache-policy.md)
    prefill_order: str = "step-beside"  # which waiting request prefills next (backend.engine.DEFAULT_PREFILL_ORDER)
    # Opt-in, measured in docs/cache-policy.md: admit a request only while the KV in flight stays within this
    # share of cache_bytes ("Admission by memory"; 0: off), and pin waiting requests' hits by reference.
    max_inflight_share: float = 0.0
    pin_by_reference: bool = False
    # What a request that sets no sampling gets: "model", its generation_config.json (as vLLM);
    # "none", greedy (as mlx_lm.server): `mlxgw backend --sampling-defaults`.
    sampling_defaults: str = "model"
    # Sampling temperature of a request that gives none, over the model's (0: greedy; the OpenAI and
    # Anthropic APIs default to 1.0): `mlxgw backend --default-temperature`; None: the model's.
    default_temperature: Optional[float] = None
    # Seconds from a request's arrival at a backend (queue, prefill, decode) before it is cancelled with a 504 /
    # an SSE error, its prompt cache still saved: `mlxgw backend --request-timeout` (0: no limit).
    request_timeout: float = 600.0
    # Keep the prompt caches across restarts: backend i saves to and restores from
    # <cache_dir>/<name>-<i> (backend.persist); empty: not kept.
    cache_dir: str = ""
    # With cache_dir: also save while idle, at most this often (s), when the cache changed; 0: only at stop.
    cache_save_interval: float = 600.0
    # Cache rule 8: entries the memory budget evicts go to disk (DIR/<name>-<i>/tier of cache_dir),
    # up to this many bytes per backend (a size string or a number of bytes); empty: no disk tier.
    disk_cache_bytes: str = ""

    @property
    def loads_weights(self) -> bool:
        """True when its backends load the model's weights and hold real KV in memory (not the
        simulated engine, which has neither)."""
        return self.engine != "sim"


@dataclass
class RemoteBackend:
    """A backend on another machine; it registers itself in Redis (informational here)."""

    model: str = ""
    url: str = ""


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: Optional[str] = None
    redis_port: Optional[int] = None  # the embedded Redis's port (no redis_url); None: a free one
    namespace: str = schema.DEFAULT_NAMESPACE
    block_size: int = schema.DEFAULT_BLOCK_SIZE
    routing: dict = field(default_factory=dict)  # RoutingConfig fields (gateway/route.py)
    # Gateway access and limits (docs/security.md); 0 turns a limit off.
    api_key_file: Optional[str] = None
    allow_unauthenticated: bool = False
    max_in_flight: Optional[int] = None  # None: the gateway's default (a quarter of its open-files limit)
    max_connections: Optional[int] = None  # None: the gateway's default (gateway.connguard)
    max_concurrent_per_key: int = 0
    rate_limit_rpm: float = 0.0
    rate_burst: int = 0
    max_messages: int = 10_000
    max_answer_tokens: int = 0  # 0: only the context bounds an answer
    max_body_bytes: str = "32MiB"
    body_timeout: float = 60.0
    write_timeout: float = 60.0
    keepalive: float = 5.0  # seconds of stream silence before an SSE keep-alive
    drain_seconds: float = 8.0  # at stop, seconds the gateway gives the answers in flight
    models: list[ModelConfig] = field(default_factory=lambda: [ModelConfig()])
    remote_backends: list[RemoteBackend] = field(default_factory=list)


# Keys allowed in [gateway]: ServeConfig fields of the same name.
GATEWAY_KEYS = ("host", "port", "block_size", "api_key_file", "allow_unauthenticated", "max_in_flight",
                "max_connections", "max_concurrent_per_key", "rate_limit_rpm", "rate_burst", "max_messages",
                "max_answer_tokens", "max_body_bytes", "body_timeout", "write_timeout", "keepalive", "drain_seconds")


def _pick(cls, d: dict, where: str):
    known = {f.name for f in fields(cls)}
    extra = set(d) - known
    if extra:
        raise ValueError(f"{where}: unknown keys {sorted(extra)}")
    return cls(**d)


def load(path: str) -> ServeConfig:
    """Read a TOML config.

    Raises:
        OSError: unreadable file. ValueError: bad TOML, unknown keys, or a value `check_values` refuses.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from e
    gw = data.pop("gateway", {})
    rd = data.pop("redis", {})
    routing = data.pop("routing", {})
    models = [_pick(ModelConfig, m, f"{path} [[models]]") for m in data.pop("models", [])] or [ModelConfig()]
    from backend.cache import LAYOUTS
    from backend.engine import PREFILL_ORDERS

    for m in models:
        if not m.host.strip():
            raise ValueError(f"{path} [[models]]: host must be an address to listen on (127.0.0.1, 0.0.0.0, ::)")
        if m.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"{path} [[models]]: prefill_order must be one of {', '.join(PREFILL_ORDERS)}")
        if m.cache_layout not in LAYOUTS:
            raise ValueError(f"{path} [[models]]: cache_layout must be one of {', '.join(LAYOUTS)}, "
                             f"not {m.cache_layout!r}")
        if m.engine not in ENGINES:
            raise ValueError(f"{path} [[models]]: engine must be one of {', '.join(ENGINES)}, not {m.engine!r}")
    remotes = [_pick(RemoteBackend, r, f"{path} [[remote_backends]]") for r in data.pop("remote_backends", [])]
    if data:
        raise ValueError(f"{path}: unknown sections {sorted(data)}")
    cfg = ServeConfig(models=models, remote_backends=remotes)
    for k, v in gw.items():
        if k not in GATEWAY_KEYS:
            raise ValueError(f"{path} [gateway]: unknown key {k!r}")
        setattr(cfg, k, v)
    for k, v in rd.items():
        if k not in ("url", "namespace", "port"):
            raise ValueError(f"{path} [redis]: unknown key {k!r}")
        setattr(cfg, {"url": "redis_url", "port": "redis_port"}.get(k, k), v)
    why = schema.namespace_error(cfg.namespace) if isinstance(cfg.namespace, str) else "namespace must be a string"
    if why:
        raise ValueError(f"{path} [redis]: {why}")
    from gateway.route import POLICIES, RETIRED, RoutingConfig

    known = {f.name for f in fields(RoutingConfig) if not f.name.startswith("_")}
    for k, v in routing.items():
        if k in RETIRED:
            raise ValueError(f"{path} [routing]: {k!r} was {RETIRED[k]}")
        if k not in known:
            raise ValueError(f"{path} [routing]: unknown key {k!r} (known: {', '.join(sorted(known))})")
        if k == "policy" and v not in POLICIES:
            raise ValueError(f"{path} [routing]: policy must be one of {', '.join(POLICIES)}")
        cfg.routing[k] = v
    check_values(cfg, path)
    return cfg


def _type_errors(cls, values: dict, where: str) -> None:
    """Each value must have the type of its field's default in dataclass ``cls`` (an int is a
    float too; fields without a default, or defaulting to None, are not checked)."""
    defaults = {f.name: f.default for f in fields(cls)}
    for k, v in values.items():
        if k in ("cache_bytes", "max_body_bytes", "disk_cache_bytes"):
            continue  # a size: a string or a number of bytes, checked by positive_bytes
        default = defaults.get(k)
        if v is None or not isinstance(default, (int, float, str, bool)):
            continue
        want = type(default)
        ok = isinstance(v, want) and not (isinstance(v, bool) and want is not bool)
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            ok = True
        if not ok:
            raise ValueError(f"{where}: {k} must be {_WHAT.get(want, want.__name__)}, not {v!r}")


_WHAT = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}

# Numbers that must be at least 1; every other number must not be negative (0 turns a
# limit or a feature off). A block size of 0 started a stack whose every request failed.
_AT_LEAST_ONE = ("block_size", "backends", "cache_entries", "prefill_concurrency", "decode_concurrency")


def _range_errors(values: dict, where: str) -> None:
    """Each number in ``values`` is finite and at least 1 (``_AT_LEAST_ONE``) or at least 0."""
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v):  # TOML has nan and inf; every comparison with NaN is false
            raise ValueError(f"{where}: {k} must be a finite number, not {v!r}")
        lo = 1 if k in _AT_LEAST_ONE else 0
        if v < lo:
            raise ValueError(f"{where}: {k} must be at least {lo}, not {v!r}")


def _check_cache_dir(path: str, where: str) -> None:
    """A ``cache_dir`` the backends can write in: made now (owner only: the saves hold the
    prompts), so a bad one stops serve before anything starts, not each backend after."""
    d = Path(path).expanduser()
    try:
        if d.exists() and not d.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise ValueError(f"{where}: cache_dir {d} cannot be used: {e.strerror or e}") from None


def check_values(cfg: ServeConfig, where: str = "") -> None:
    """Check each value of ``cfg`` on its own: its type, that it is finite and not below its
    least value, sizes that parse, an empty Redis URL. `load` runs it on the file before flags
    override anything (helper-66: `[gateway] port = "x"` passed while `--port` was given, and
    failed once the flag was dropped); `validate` runs it on the merge.

    Raises:
        ValueError: naming the section (after ``where``, the file's path) and the key.
    """
    from gateway.route import RoutingConfig

    from .util import positive_bytes

    at = f"{where} " if where else ""
    gateway = {k: getattr(cfg, k) for k in GATEWAY_KEYS + ("namespace",)}
    _type_errors(ServeConfig, gateway, f"{at}[gateway]")
    _range_errors(gateway, f"{at}[gateway]")
    for k in ("max_in_flight", "max_connections"):  # None (left out): the gateway picks
        v = getattr(cfg, k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{at}[gateway]: {k} must be an integer, not {v!r}")
    _type_errors(RoutingConfig, cfg.routing, f"{at}[routing]")
    _range_errors(cfg.routing, f"{at}[routing]")
    for name, size in [(f"{at}[gateway] max_body_bytes", cfg.max_body_bytes)] + \
            [(f"{at}{_label(m)} cache_bytes", m.cache_bytes) for m in cfg.models]:
        try:
            positive_bytes(size)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if cfg.redis_url == "":
        raise ValueError(f"{at}[redis] url is empty; leave it out for the embedded Redis")
    for m in cfg.models:
        m_at = f"{at}{_label(m)}"
        _type_errors(ModelConfig, vars(m), m_at)
        _range_errors(vars(m), m_at)


def served_name(m: ModelConfig) -> str:
    """The name `mlxgw serve` serves a ``[[models]]`` table's model under: its ``name``, else its
    path's last part, else the demo model's ``demo-tiny``."""
    return m.name or (Path(m.path.rstrip("/")).name if m.path else "demo-tiny")


def _label(m: ModelConfig) -> str:
    """How an error names a ``[[models]]`` table: as the file has it (its name, else its path)."""
    return f"[[models]] {m.name or m.path or 'demo'}"


def validate(cfg: ServeConfig) -> None:
    """Check a config (file and flags merged) before anything starts.

    Raises:
        ValueError: a value of the wrong type, NaN or infinity, a negative number (or below 1 where 0 makes
            no sense: block size, backends, cache entries, prefill and decode concurrency), a size that
            does not parse, a port out of range, two models with one name or overlapping ports,
            a ``cache_dir`` that cannot be made or written, ``disk_cache_bytes`` without one,
            ``max_inflight_share`` above 1, ``pin_by_reference`` without the shared layout.
    """
    from .util import positive_bytes

    check_values(cfg)
    ranges = [("[gateway] port", cfg.port, cfg.port)]
    if cfg.redis_port is not None:  # helper-69, -76, -77: the embedded Redis's port could not be chosen
        if isinstance(cfg.redis_port, bool) or not isinstance(cfg.redis_port, int) or not 0 < cfg.redis_port < 65536:
            raise ValueError(f"[redis] port must be a port number (1-65535), not {cfg.redis_port!r}")
        if cfg.redis_url:
            raise ValueError("[redis] port / --redis-port is the embedded Redis's; with [redis] url / --redis-url "
                             "the URL names the port")
        ranges.append(("[redis] port", cfg.redis_port, cfg.redis_port))
    names = set()
    for m in cfg.models:
        where = _label(m)
        # The name serve gives it (mlxgw.launcher.run): helper-69's two tables without a name or
        # path both served the demo model, started backends, then the gateway refused the name twice.
        name = served_name(m)
        if name in names:
            raise ValueError(f"{where}: two models are named {name!r}" + (
                "" if m.name else " (a [[models]] table names its model by its name, else its path's last "
                                  "part, else the demo model's demo-tiny)"))
        names.add(name)
        ranges.append((f"{where} backend ports", m.port, m.port + m.backends - 1))
        if m.cache_dir:
            _check_cache_dir(m.cache_dir, where)
        if m.max_inflight_share > 1:
            raise ValueError(f"{where}: max_inflight_share must be at most 1 (0: off), not {m.max_inflight_share!r}")
        if m.sampling_defaults not in ("model", "none"):
            raise ValueError(f"{where}: sampling_defaults must be \"model\" or \"none\", not {m.sampling_defaults!r}")
        t = m.default_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))):
            raise ValueError(f"{where}: default_temperature must be a number, not {t!r}")
        if m.default_temperature is not None and m.default_temperature > 2:
            raise ValueError(f"{where}: default_temperature must be from 0 to 2 (OpenAI's range), not "
                             f"{m.default_temperature!r}")
        if m.pin_by_reference and m.cache_layout != "shared":
            raise ValueError(f"{where}: pin_by_reference needs cache_layout = \"shared\" (pins reference its segments)")
        if m.disk_cache_bytes:
            try:
                positive_bytes(m.disk_cache_bytes)
            except ValueError as e:
                raise ValueError(f"{where} disk_cache_bytes: {e}") from None
            if not m.cache_dir:
                raise ValueError(f"{where}: disk_cache_bytes (--disk-cache-bytes) needs cache_dir (--cache-dir): "
                                 "the disk tier's files go under it")
    for where, lo, hi in ranges:
        if not (1 <= lo and hi <= 65535):
            raise ValueError(f"{where}: {lo}-{hi} is outside 1-65535")
    for i, (a, lo, hi) in enumerate(ranges):
        for b, lo2, hi2 in ranges[i + 1:]:
            if lo <= hi2 and lo2 <= hi:
                raise ValueError(f"{a} ({lo}-{hi}) and {b} ({lo2}-{hi2}) overlap")


def apply_flags(cfg: ServeConfig, args) -> ServeConfig:
    """Override ``cfg`` with the flags the user gave (None means not given)."""
    for flag, attr in (("host", "host"), ("port", "port"), ("redis_url", "redis_url"), ("redis_port", "redis_port"),
                       ("namespace", "namespace"), ("block_size", "block_size"),
                       *((k, k) for k in GATEWAY_KEYS[3:])):
        v = getattr(args, flag, None)
        if v is not None:
            setattr(cfg, attr, v)
    if getattr(args, "routing_policy", None):
        cfg.routing["policy"] = args.routing_policy
    m0 = cfg.models[0]
    if getattr(args, "model", None):
        m0.path = args.model
        m0.name = args.served_name or ""
    elif getattr(args, "served_name", None):
        m0.name = args.served_name
    for flag, attr in (("backends", "backends"), ("backend_port", "port"), ("cache_bytes", "cache_bytes"),
                       ("cache_entries", "cache_entries"), ("cache_layout", "cache_layout"),
                       ("decode_concurrency", "decode_concurrency"), ("cache_dir", "cache_dir"),
                       ("cache_save_interval", "cache_save_interval"), ("disk_cache_bytes", "disk_cache_bytes"),
                       ("max_inflight_share", "max_inflight_share"), ("pin_by_reference", "pin_by_reference"),
                       ("engine", "engine")):
        v = getattr(args, flag, None)
        if v is not None:
            setattr(m0, attr, v)
    return cfg
