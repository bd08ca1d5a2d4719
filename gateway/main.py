"""``mlxgw gateway``: run the gateway process."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from aiohttp import web

from mlxgw import schema

from .app import GatewayConfig, make_app
from .route import POLICIES, RoutingConfig

log = logging.getLogger("mlxgw.gateway")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH",
                   help="a served model's tokenizer dir (repeatable); NAME defaults to the dir name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis-url", default=os.environ.get("MLXGW_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--namespace", default=schema.DEFAULT_NAMESPACE)
    p.add_argument("--block-size", type=int, default=schema.DEFAULT_BLOCK_SIZE)
    p.add_argument("--lookup-deadline-ms", type=float, default=50.0,
                   help="abandon the Redis lookup after this long and route on load")
    p.add_argument("--max-retries", type=int, default=2, help="other backends tried before the first byte")
    p.add_argument("--load-weight", type=float, default=RoutingConfig.load_weight)
    p.add_argument("--decode-weight", type=float, default=RoutingConfig.decode_weight)
    p.add_argument("--routing-policy", choices=POLICIES, default="cost",
                   help="cost: owned prefix and load (default); round_robin / least_loaded: for comparison")
    p.add_argument("--internal-token", default=os.environ.get("MLXGW_INTERNAL_TOKEN"))
    p.add_argument("--read-timeout", type=float, default=300.0, help="seconds of backend silence before failing")


def parse_models(specs: list[str]) -> dict[str, str]:
    """``["name=path", "path"]`` -> ``{name: path}``."""
    out = {}
    for s in specs:
        name, _, path = s.partition("=") if "=" in s else ("", "", s)
        out[name or Path(path.rstrip("/")).name] = path
    return out


def config_from_args(args) -> GatewayConfig:
    models = parse_models(args.model)
    if not models:
        from mlxgw.demo_model import ensure_demo_model

        models = parse_models([str(ensure_demo_model("tiny"))])
    return GatewayConfig(
        redis_url=args.redis_url,
        namespace=args.namespace,
        block_size=args.block_size,
        lookup_deadline=args.lookup_deadline_ms / 1000,
        max_retries=args.max_retries,
        internal_token=args.internal_token,
        read_timeout=args.read_timeout,
        routing=RoutingConfig(load_weight=args.load_weight, decode_weight=args.decode_weight,
                              policy=args.routing_policy),
        models=models,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    for name, path in cfg.models.items():
        if not (Path(path).expanduser() / "config.json").exists():
            log.error("model %s: no model directory at %s", name, path)
            return 2
    app = make_app(cfg)
    try:
        web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                    access_log=None, print=lambda *_: None)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 3
    return 0
