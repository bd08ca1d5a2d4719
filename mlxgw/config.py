"""``mlxgw serve`` configuration: a TOML file (``configs/*.toml``) plus flags.

Flags given on the command line override the file. See ``configs/`` for
commented examples.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from . import schema


@dataclass
class ModelConfig:
    """One served model and its backends (ports ``port .. port + backends - 1``)."""

    name: str = ""
    path: str = ""  # empty: the demo model
    backends: int = 2
    port: int = 8100
    cache_bytes: str = "2GB"
    cache_entries: int = 16
    min_hit_tokens: int = 1000
    min_shared_tokens: int = 0  # cache rule 6, opt-in (docs/cache-policy.md)
    prefill_save: bool = True  # a request sharing a prompt in prefill waits for it and reuses it (docs/cache-policy.md)
    prefill_concurrency: int = 2  # prompts prefilled side by side per backend
    prefill_order: str = "step-beside"  # which waiting request prefills next (backend.engine.DEFAULT_PREFILL_ORDER)


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
    namespace: str = schema.DEFAULT_NAMESPACE
    block_size: int = schema.DEFAULT_BLOCK_SIZE
    routing: dict = field(default_factory=dict)  # RoutingConfig fields (gateway/route.py)
    # Gateway access and limits (docs/security.md); 0 turns a limit off.
    api_key_file: Optional[str] = None
    allow_unauthenticated: bool = False
    max_concurrent_per_key: int = 0
    rate_limit_rpm: float = 0.0
    rate_burst: int = 0
    max_messages: int = 10_000
    max_body_bytes: str = "32MiB"
    body_timeout: float = 60.0
    write_timeout: float = 60.0
    keepalive: float = 5.0  # seconds of stream silence before an SSE keep-alive
    models: list[ModelConfig] = field(default_factory=lambda: [ModelConfig()])
    remote_backends: list[RemoteBackend] = field(default_factory=list)


# Keys allowed in [gateway]: ServeConfig fields of the same name.
GATEWAY_KEYS = ("host", "port", "block_size", "api_key_file", "allow_unauthenticated", "max_concurrent_per_key",
                "rate_limit_rpm", "rate_burst", "max_messages", "max_body_bytes", "body_timeout", "write_timeout",
                "keepalive")


def _pick(cls, d: dict, where: str):
    known = {f.name for f in fields(cls)}
    extra = set(d) - known
    if extra:
        raise ValueError(f"{where}: unknown keys {sorted(extra)}")
    return cls(**d)


def load(path: str) -> ServeConfig:
    """Read a TOML config.

    Raises:
        OSError: unreadable file. ValueError: bad TOML or unknown keys.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from e
    gw = data.pop("gateway", {})
    rd = data.pop("redis", {})
    routing = data.pop("routing", {})
    models = [_pick(ModelConfig, m, f"{path} [[models]]") for m in data.pop("models", [])] or [ModelConfig()]
    from backend.engine import PREFILL_ORDERS

    for m in models:
        if m.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"{path} [[models]]: prefill_order must be one of {', '.join(PREFILL_ORDERS)}")
    remotes = [_pick(RemoteBackend, r, f"{path} [[remote_backends]]") for r in data.pop("remote_backends", [])]
    if data:
        raise ValueError(f"{path}: unknown sections {sorted(data)}")
    cfg = ServeConfig(models=models, remote_backends=remotes)
    for k, v in gw.items():
        if k not in GATEWAY_KEYS:
            raise ValueError(f"{path} [gateway]: unknown key {k!r}")
        setattr(cfg, k, v)
    for k, v in rd.items():
        if k not in ("url", "namespace"):
            raise ValueError(f"{path} [redis]: unknown key {k!r}")
        setattr(cfg, "redis_url" if k == "url" else k, v)
    from gateway.route import POLICIES, RoutingConfig

    known = {f.name for f in fields(RoutingConfig) if not f.name.startswith("_")}
    for k, v in routing.items():
        if k not in known:
            raise ValueError(f"{path} [routing]: unknown key {k!r} (known: {', '.join(sorted(known))})")
        if k == "policy" and v not in POLICIES:
            raise ValueError(f"{path} [routing]: policy must be one of {', '.join(POLICIES)}")
        cfg.routing[k] = v
    return cfg


def apply_flags(cfg: ServeConfig, args) -> ServeConfig:
    """Override ``cfg`` with the flags the user gave (None means not given)."""
    for flag, attr in (("host", "host"), ("port", "port"), ("redis_url", "redis_url"),
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
                       ("cache_entries", "cache_entries")):
        v = getattr(args, flag, None)
        if v is not None:
            setattr(m0, attr, v)
    return cfg
