"""``mlxgw``: the one console command (serve, backend, gateway, demo-model, status, top)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .rlimit import guard_mlx_lm_import


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    p = argparse.ArgumentParser(prog="mlxgw", description="Prefix-cache-aware gateway for mlx-lm backends")
    p.add_argument("--log-level", default=os.environ.get("MLXGW_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)

    # Before anything imports mlx-lm (the demo model build in `serve` too, whose
    # children inherit the limit): its import would cap the open-files limit.
    guard_mlx_lm_import()
    from backend import main as backend_main
    from gateway import main as gateway_main

    from . import launcher

    sp = sub.add_parser("serve", help="Redis (embedded if none given) + N backends + gateway")
    launcher.add_arguments(sp)
    sp = sub.add_parser("backend", help="one mlx-lm backend process")
    backend_main.add_arguments(sp)
    sp = sub.add_parser("gateway", help="the gateway process")
    gateway_main.add_arguments(sp)
    sp = sub.add_parser("demo-model", help="build the offline demo model into DIR (or the cache)")
    sp.add_argument("dir", nargs="?", help="output dir (default: the cache dir; prints the path)")
    sp.add_argument("--variant", default="tiny", help="tiny | bench | swa")
    sp = sub.add_parser("status", help="cluster state from Redis")
    sp.add_argument("--redis-url", default=os.environ.get("MLXGW_REDIS_URL"),
                    help="default: the URL the last `mlxgw serve` wrote, else redis://127.0.0.1:6379/0")
    sp.add_argument("--namespace", default="mlxgw")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("top", help="status, live-refreshing, sorted by load")
    sp.add_argument("--redis-url", default=os.environ.get("MLXGW_REDIS_URL"),
                    help="default: the URL the last `mlxgw serve` wrote, else redis://127.0.0.1:6379/0")
    sp.add_argument("--namespace", default="mlxgw")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    sp.add_argument("--iterations", type=int, default=0, help="stop after N frames (0: until Ctrl-C)")
    sp.add_argument("--events", type=int, default=5, help="recent events shown per model")

    args = p.parse_args(argv)
    if getattr(args, "redis_url", None) == "":
        # An unset variable expanded to nothing must not quietly mean "the default Redis"
        # (serve would start a private one; a fleet of gateways would each talk to its own).
        p.error("--redis-url (or MLXGW_REDIS_URL) is empty; leave it out for the default")
    _logging(args.log_level)
    if args.cmd == "serve":
        return launcher.run(args)
    if args.cmd == "backend":
        return backend_main.run(args)
    if args.cmd == "gateway":
        return gateway_main.run(args)
    if args.cmd == "demo-model":
        from .demo_model import VARIANTS, build_demo_model, ensure_demo_model

        if args.variant not in VARIANTS:
            p.error(f"unknown variant {args.variant!r}; one of {', '.join(VARIANTS)}")
        path = build_demo_model(args.dir, args.variant) if args.dir else ensure_demo_model(args.variant)
        print(path)
        return 0
    if args.cmd == "status":
        from .status import run as status_run

        return status_run(args)
    if args.cmd == "top":
        from .top import run as top_run

        return top_run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
