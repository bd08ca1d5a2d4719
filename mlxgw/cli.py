"""``mlxgw``: the one console command (serve, backend, gateway, demo-model, status, top)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from .rlimit import guard_mlx_lm_import
from .util import namespace_arg, non_empty_arg, non_negative_int, positive_float, redis_url_arg


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _status_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--redis-url", type=redis_url_arg, default=os.environ.get("MLXGW_REDIS_URL"),
                    help="default: MLXGW_REDIS_URL, else the URL the last `mlxgw serve` wrote, else "
                         "redis://127.0.0.1:6379/0")
    sp.add_argument("--namespace", type=namespace_arg, default="mlxgw")


def _event_arguments(sp: argparse.ArgumentParser, default: int) -> None:
    from .status import EVENT_SCAN, event_types_arg

    sp.add_argument("--events", type=non_negative_int, default=default, help="recent events shown per model")
    sp.add_argument("--event-types", type=event_types_arg, metavar="TYPES",
                    help="only these event types (comma list: saved, evicted, routed, started, cleared, lost, or "
                         f"'lifecycle' for started,cleared,lost), among each model's last {EVENT_SCAN} events")


def _add_status(sp: argparse.ArgumentParser) -> None:
    _status_arguments(sp)
    sp.add_argument("--json", action="store_true")
    _event_arguments(sp, 10)


def _add_top(sp: argparse.ArgumentParser) -> None:
    _status_arguments(sp)
    sp.add_argument("--interval", type=positive_float, default=1.0, help="seconds between refreshes")
    sp.add_argument("--iterations", type=non_negative_int, default=0, help="stop after N frames (0: until Ctrl-C)")
    _event_arguments(sp, 5)


def _add_demo_model(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("dir", nargs="?", type=non_empty_arg, help="output dir (default: the cache dir; prints the path)")
    sp.add_argument("--variant", default="tiny", help="tiny | bench | swa")


def _add_serve(sp: argparse.ArgumentParser) -> None:
    from . import launcher

    launcher.add_arguments(sp)


def _add_backend(sp: argparse.ArgumentParser) -> None:
    from backend import main as backend_main

    backend_main.add_arguments(sp)


def _add_gateway(sp: argparse.ArgumentParser) -> None:
    from gateway import main as gateway_main

    gateway_main.add_arguments(sp)


# name -> (help, adds its arguments). Only the chosen command's arguments are built: the
# backend's import mlx-lm (about 1.3 s), which `status`, `top`, `--help` and a flag error never
# need (a gateway imports it anyway, later, to load its tokenizer as the backend does).
COMMANDS = {
    "serve": ("Redis (embedded if none given) + N backends + gateway", _add_serve),
    "backend": ("one mlx-lm backend process", _add_backend),
    "gateway": ("the gateway process", _add_gateway),
    "demo-model": ("build the offline demo model into DIR (or the cache)", _add_demo_model),
    "status": ("cluster state from Redis", _add_status),
    "top": ("status, live-refreshing, sorted by load", _add_top),
}


def _chosen(argv: list[str]) -> str | None:
    """The command word in ``argv`` (after the global ``--log-level``), or None."""
    it = iter(argv)
    for a in it:
        if a == "--log-level":
            next(it, None)
        elif not a.startswith("-"):
            return a
    return None


_NEGATIVE = re.compile(r"-[\d.]")


def _negative_values(argv: list[str]) -> list[str]:
    """``--flag -5MB`` as ``--flag=-5MB``: argparse takes a value starting with ``-`` that is
    not a plain number for an option and says only "expected one argument" (helper-56); joined,
    the flag's own check says what is wrong with the value."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(a):
            out[-1] += "=" + a
        else:
            out.append(a)
    return out


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (130 when interrupted before a command
    installs its own signal handling: helper-66 saw a KeyboardInterrupt traceback from a
    gateway Ctrl-C'd while it loaded its tokenizers)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, so that a closed pipe is caught below, not at the interpreter's exit
        return code
    except KeyboardInterrupt:
        print("mlxgw: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `mlxgw status --json | head -c 10` (helper-70: a traceback): the reader left, which is
        # no error of ours to report; stdout goes to /dev/null so the exit's flush is quiet too
        # (the recipe of Python's `signal` documentation).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _exit_past_teardown(code: int) -> int:
    """End a backend process now with ``code``, past the interpreter's teardown: MLX's C++
    threads met their static destructors there now and then ("terminate called without an
    active exception", exit 134 instead of 4: helper-68, 3 of 17 backends refused by Redis).
    The backend has stopped its engine, saved its caches and left Redis by then; logs and
    standard streams are flushed first. Returns ``code`` (to the caller of `main`) only when a
    thread other than this one still runs, which the normal exit waits for."""
    import threading

    if any(t is not threading.current_thread() and not t.daemon for t in threading.enumerate()):
        return code
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _check_env_redis_url(p: argparse.ArgumentParser, chosen: str | None, argv: list[str]) -> None:
    """Exit 2 naming ``MLXGW_REDIS_URL`` when the command would take a malformed URL from it
    (argparse checks a default with the flag's type and blamed ``argument --redis-url``, which
    the user never gave: helper-69). ``serve`` does not read the variable."""
    env = os.environ.get("MLXGW_REDIS_URL")
    given = any(a.startswith("--redis") for a in argv)  # the flag, or argparse's abbreviation of it
    if not env or given or chosen not in ("gateway", "backend", "status", "top"):
        return
    try:
        redis_url_arg(env)
    except argparse.ArgumentTypeError as e:
        p.error(f"the environment's MLXGW_REDIS_URL {e} (--redis-url overrides it)")


def _main(argv: list[str] | None = None) -> int:
    argv = _negative_values(sys.argv[1:] if argv is None else argv)
    # Before anything imports mlx-lm (a backend; the demo model build in `serve` or a
    # gateway with no model, whose children inherit the limit): its import would cap
    # the open-files limit. This does not import mlx-lm itself.
    guard_mlx_lm_import()
    p = argparse.ArgumentParser(prog="mlxgw", description="Prefix-cache-aware gateway for mlx-lm backends")
    p.add_argument("--log-level", default=os.environ.get("MLXGW_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)
    chosen = _chosen(argv)
    for name, (help_text, add) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            add(sp)

    _check_env_redis_url(p, chosen, argv)
    args = p.parse_args(argv)
    if getattr(args, "redis_url", None) == "":
        # An unset variable expanded to nothing must not quietly mean "the default Redis"
        # (serve would start a private one; a fleet of gateways would each talk to its own).
        p.error("--redis-url (or MLXGW_REDIS_URL) is empty; leave it out for the default")
    if args.log_level.lower() not in LOG_LEVELS:  # the env's value too, which argparse does not check
        p.error(f"--log-level (or MLXGW_LOG_LEVEL) must be one of {', '.join(LOG_LEVELS)}, not {args.log_level!r}")
    _logging(args.log_level)
    if args.cmd == "serve":
        from . import launcher

        return launcher.run(args)
    if args.cmd == "backend":
        from backend import main as backend_main

        return _exit_past_teardown(backend_main.run(args))
    if args.cmd == "gateway":
        from gateway import main as gateway_main

        return gateway_main.run(args)
    if args.cmd == "demo-model":
        from .demo_model import VARIANTS, build_demo_model, ensure_demo_model, holds_demo_model

        if args.variant not in VARIANTS:
            p.error(f"unknown variant {args.variant!r}; one of {', '.join(VARIANTS)}")
        if args.dir and holds_demo_model(args.dir, args.variant):
            # helper-69: a second run failed "already exists"; like the cache's, it is kept
            print(f"mlxgw demo-model: {args.dir} already holds the demo model {args.variant!r}; kept",
                  file=sys.stderr)
            print(Path(args.dir).expanduser().absolute())
            return 0
        try:
            path = build_demo_model(args.dir, args.variant) if args.dir else ensure_demo_model(args.variant)
        except OSError as e:  # an existing or unwritable directory: say which, no traceback
            where = Path(e.filename) if getattr(e, "filename", None) else None
            if where is not None and where.name.startswith(".") and ".tmp-" in where.name:
                where = where.parent  # the build's temporary directory: its parent is what failed
            print(f"mlxgw demo-model: cannot build into {args.dir or 'the cache'}: {e.strerror or e}"
                  + (f" ({where})" if where is not None else ""), file=sys.stderr)
            return 1
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
