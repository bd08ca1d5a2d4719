"""``mlxgw gateway``: run the gateway process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
from pathlib import Path

from aiohttp import web

from mlxgw import schema
from mlxgw.protocol import DEFAULT_MAX_TOKENS

from mlxgw.rlimit import open_files_limit, raise_open_files_limit
from mlxgw.stopping import EMBEDDED_REDIS_ENV, Stopper, shut_down_embedded_redis
from mlxgw.util import (count, host_port, model_spec_arg, namespace_arg, non_empty_arg, non_negative_float, non_negative_int, parse_bytes, port_arg, positive_int, redact_url,
                        redis_url_arg, size_arg)

from .app import ADMISSION, STATE, GatewayConfig, GatewayIdInUse, RedisRefused, make_app
from .connguard import GuardedRunner, auto_max_connections
from .auth import AuthConfigError, check_exposure, read_keys
from .limits import DECODE_BODIES, LimitConfig, auto_max_in_flight
from .route import POLICIES, RETIRED, RoutingConfig
from .stability import DEFAULT_STRIP, compile_patterns

log = logging.getLogger("mlxgw.gateway")


class _Retired(argparse.Action):
    """A removed routing flag: the parser exits with `gateway.route.RETIRED`'s reason."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was {RETIRED[self.dest]}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH", type=model_spec_arg,
                   help="a served model's tokenizer dir (repeatable); NAME defaults to the dir name")
    p.add_argument("--host", default="127.0.0.1", type=non_empty_arg,
                   help="listen address (default %(default)s; :: is IPv6 only, 0.0.0.0 IPv4 only (asyncio's binding, as nginx's [::]))")
    p.add_argument("--port", type=port_arg, default=8000, help="listen port (default 8000)")
    p.add_argument("--redis-url", type=redis_url_arg,
                   default=os.environ.get("MLXGW_REDIS_URL", schema.DEFAULT_REDIS_URL))
    p.add_argument("--namespace", type=namespace_arg, default=schema.DEFAULT_NAMESPACE)
    p.add_argument("--block-size", type=positive_int, default=schema.DEFAULT_BLOCK_SIZE)
    p.add_argument("--lookup-deadline-ms", type=non_negative_float, default=50.0,
                   help="abandon the Redis lookup after this long and route on load (time in which Redis "
                        "answered other lookups or the gateway was too busy to read the answer does not "
                        "count; never past 1 s)")
    p.add_argument("--max-retries", type=non_negative_int, default=2, help="other backends tried before the first byte (tries that reached no backend, a refused connection, not counted)")
    p.add_argument("--gateway-id", default=None, type=non_empty_arg,
                   help="name of this gateway in Redis (default: host:port); gateways publish in-flight load under it")
    p.add_argument("--janitor-grace", type=non_negative_float, default=300.0,
                   help="seconds without a heartbeat before a dead backend's claims are deleted from Redis")
    p.add_argument("--routing-policy", choices=POLICIES, default=RoutingConfig.policy)
    p.add_argument("--load-weight", type=non_negative_float, default=RoutingConfig.load_weight,
                   help="cost per token of backend load (docs/routing.md)")
    p.add_argument("--decode-weight", type=non_negative_float, default=RoutingConfig.decode_weight,
                   help="tokens of load per running decode")
    p.add_argument("--balance-abs-tokens", type=non_negative_int, default=RoutingConfig.balance_abs_tokens,
                   help="balance guard: load above the least-loaded backend's by more than this ...")
    p.add_argument("--balance-rel", type=non_negative_float, default=RoutingConfig.balance_rel,
                   help="... and more than this factor makes a backend overloaded")
    p.add_argument("--affinity-slack-tokens", type=non_negative_int, default=RoutingConfig.affinity_slack_tokens,
                   help="a session's backend may cost this much more than the best and still be chosen")
    p.add_argument("--placement-slack-tokens", type=non_negative_int, default=RoutingConfig.placement_slack_tokens,
                   help="a prompt that makes the cheapest backend evict may go to one costing up to this much more "
                        "whose next eviction victim is older (0: off; docs/routing.md)")
    p.add_argument("--heartbeat-load", action="store_true",
                   help="also count the backends' heartbeat load figures (up to a heartbeat stale)")
    p.add_argument("--short-claims", action="store_true",
                   help="count a prefix a backend is only computing even when shorter than its min_hit_tokens "
                        "(the rule before session 12; docs/routing.md)")
    p.add_argument("--no-seed-empty", dest="seed_empty", action="store_false", default=RoutingConfig.seed_empty,
                   help="never send a request to an empty, idle backend past a busier owner of its prefix "
                        "(the rule before session 46, for A/B runs; docs/routing.md, \"Seeding an empty backend\")")
    p.add_argument("--seed-claim-factor", type=non_negative_float, default=RoutingConfig.seed_claim_factor,
                   help="past a prefix the chosen backend is still computing, seed an empty, idle backend only when "
                        "the chosen one's load exceeds this many times the prefix (0: never, the rule of session 46)")
    p.add_argument("--no-seed-when-full", dest="seed_when_full", action="store_false",
                   default=RoutingConfig.seed_when_full,
                   help="seed an empty, idle backend only by load against prefix, not also when the chosen backend "
                        "has a request in flight for each of its decode slots (the rule before session 48)")
    p.add_argument("--seed-beside", action="store_true", default=RoutingConfig.seed_beside,
                   help="in the seeding comparison, charge a request whose remainder would start beside the "
                        "chosen backend's running prefill its first steps and one prefill chunk per step of its "
                        "answer (max_tokens), weighed by depth, not the whole queue (opt-in; docs/routing.md, "
                        "\"Seeding an empty backend\")")
    for key in RETIRED:  # refused with the reason, not as an unknown flag
        p.add_argument("--" + key.replace("_", "-"), action=_Retired, nargs=0, help=argparse.SUPPRESS)
    p.add_argument("--no-prefill-progress", dest="prefill_progress", action="store_false",
                   default=RoutingConfig.prefill_progress,
                   help="routing only: count a streamed request's prefill as all still to do until its first "
                        "token (for its first second), not down by the backend's progress comments, which still "
                        "reach the client (for comparisons; docs/routing.md)")
    p.add_argument("--slot-wait-weight", type=non_negative_float, default=RoutingConfig.slot_wait_weight,
                   help="cost per token of the wait for a decode slot on the chosen backend when it has a "
                        "request in flight for each of its slots (its measured decode time and prefill rate turned "
                        "into tokens), against backends with compute to spare (0: none, the rule before "
                        "session 49; docs/routing.md)")
    p.add_argument("--pending-grace", type=non_negative_float, default=RoutingConfig.pending_grace,
                   help="seconds a routed prefix still counts as owned after its request ended")
    p.add_argument("--load-publish-ms", type=non_negative_float, default=GatewayConfig.load_publish_interval * 1000,
                   help="how often this gateway's in-flight work is written to Redis for the other gateways, "
                        "when it changed (ms)")
    # An empty one overrode MLXGW_INTERNAL_TOKEN, and every backend refused the gateway (helper-67).
    p.add_argument("--internal-token", default=os.environ.get("MLXGW_INTERNAL_TOKEN") or None, type=non_empty_arg,
                   help="the token this gateway sends to backends that require one (their --internal-token; "
                        "default: $MLXGW_INTERNAL_TOKEN, as `mlxgw serve`'s join line sets it)")
    p.add_argument("--read-timeout", type=non_negative_float, default=300.0,
                   help="seconds of backend silence before failing over (0: no limit); a backend sends a "
                        "keep-alive each second while a request waits there or a whole answer is computed")
    p.add_argument("--gone-after", type=non_negative_float, default=3.0,
                   help="seconds a backend may be out of the Redis registry (no heartbeat: hung or dead) before "
                        "the requests waiting on it go to another backend, or a stream it began ends with an "
                        "error event (0: wait for --read-timeout)")
    p.add_argument("--keepalive", type=non_negative_float, default=5.0,
                   help="seconds of silence on a streamed answer before the gateway sends an SSE keep-alive (default 5; "
                        "0: off; the backends' prefill progress comments still pass)")
    p.add_argument("--strip-line", action="append", default=None, metavar="REGEX",
                   help="volatile system-prompt lines to remove before templating (repeatable; "
                        "default: Claude Code's x-anthropic-billing-header line)")
    p.add_argument("--no-strip", action="store_true", help="remove no system-prompt lines")
    p.add_argument("--token-cache-mb", type=non_negative_float, default=64.0,
                   help="per-model LRU of token ids per chat-template segment (gateway/segcache.py); 0 = off")
    add_security_arguments(p)


def add_security_arguments(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """API key and limit flags, shared with ``mlxgw serve`` (there without defaults, so the config file can set them)."""
    d = LimitConfig()

    def dflt(v):
        return v if defaults else None

    p.add_argument("--api-key-file", metavar="FILE",
                   help="file of client API keys, one a line (also MLXGW_API_KEYS=k1,k2); keys are required "
                        "when set, and needed to listen on a non-loopback address")
    p.add_argument("--allow-unauthenticated", action="store_true", default=dflt(False),
                   help="listen on a non-loopback address without API keys (something in front authenticates)")
    p.add_argument("--max-in-flight", type=non_negative_int, default=None, metavar="N",
                   help="requests the gateway holds at once, all callers (503 'overloaded' over it); "
                        "default: a quarter of the open-files limit (each request holds two sockets); 0: no cap")
    p.add_argument("--max-connections", type=non_negative_int, default=None, metavar="N",
                   help="client connections held at once; over it a new one gets a 503 before its request "
                        "is read (default: the open files left after --max-in-flight backend sockets and 256 "
                        "spare); 0: no cap")
    p.add_argument("--max-concurrent-per-key", type=non_negative_int, default=dflt(d.max_concurrent_per_key),
                   help=f"requests in flight per API key (per address without keys; default {d.max_concurrent_per_key}); 0: no limit")
    p.add_argument("--rate-limit-rpm", type=non_negative_float, default=dflt(d.rate_per_minute),
                   help=f"requests per minute per API key (token bucket; default {d.rate_per_minute:g}); 0: no limit")
    p.add_argument("--rate-burst", type=non_negative_int, default=dflt(d.rate_burst),
                   help="token-bucket size (default: 10 seconds of --rate-limit-rpm)")
    p.add_argument("--max-messages", type=non_negative_int, default=dflt(d.max_messages), help=f"most messages per chat request (default {d.max_messages})")
    p.add_argument("--max-answer-tokens", type=non_negative_int, default=dflt(d.max_answer_tokens), metavar="N",
                   help="most tokens one answer may take: a larger max_tokens, or none when the backends' default "
                        f"({DEFAULT_MAX_TOKENS}) is larger, is lowered to it (finish_reason length), as one past the "
                        "context is (default 0: only the context bounds it)")
    p.add_argument("--max-body-bytes", type=size_arg, default=dflt("32MiB"),
                   help="largest request body, e.g. 32MiB or 32M (binary units; default 32MiB)")
    p.add_argument("--body-timeout", type=non_negative_float, default=dflt(d.body_timeout),
                   help=f"seconds to receive a request body before answering 408 (default {d.body_timeout:g})")
    p.add_argument("--drain-seconds", type=non_negative_float, default=dflt(8.0),
                   help="on SIGTERM / Ctrl-C, seconds the answers in flight may take to finish; streams still "
                        "running then end with an error event naming the stop, other requests with a 503 "
                        "(default 8)")
    p.add_argument("--write-timeout", type=non_negative_float, default=dflt(d.write_timeout),
                   help=f"seconds a client may leave an answer unread before it is dropped (default {d.write_timeout:g})")


def parse_models(specs: list[str]) -> dict[str, str]:
    """``["name=path", "path"]`` -> ``{name: path}`` (a bare path is named after its directory).

    Raises:
        ValueError: one name given twice.
    """
    out = {}
    for s in specs:
        name, _, path = s.partition("=") if "=" in s else ("", "", s)
        name = name or Path(path.rstrip("/")).name
        if name in out:  # helper-66: the second silently replaced the first
            raise ValueError(f"--model: the name {name!r} is given twice")
        out[name] = path
    return out


def routing_changes(routing: RoutingConfig) -> list[str]:
    """``key=value`` for each routing setting that differs from its default (`RoutingConfig`
    fields, in their order), for the start-up log: a config's or a flag's setting shows there
    (helper-94 could confirm ``seed_progress`` only from the process list)."""
    import dataclasses

    default = RoutingConfig()
    return [f"{f.name}={getattr(routing, f.name)}" for f in dataclasses.fields(RoutingConfig)
            if not f.name.startswith("_") and getattr(routing, f.name) != getattr(default, f.name)]


def config_from_args(args) -> GatewayConfig:
    """The gateway's settings from its flags.

    Raises:
        ValueError: a setting out of range (the caller exits with code 2).
    """
    if not args.load_publish_ms > 0:
        raise ValueError(f"--load-publish-ms must be > 0 (got {args.load_publish_ms:g})")
    files = open_files_limit()  # both defaults share out the same files
    max_in_flight = auto_max_in_flight(files) if args.max_in_flight is None else args.max_in_flight
    models = parse_models(args.model)
    if not models:
        from mlxgw.demo_model import ensure_demo_model

        models = parse_models([str(ensure_demo_model("tiny"))])
    return GatewayConfig(
        api_keys=read_keys(args.api_key_file),
        limits=LimitConfig(
            max_in_flight=max_in_flight,
            max_connections=(auto_max_connections(files, max_in_flight) if args.max_connections is None
                             else args.max_connections),
            max_concurrent_per_key=args.max_concurrent_per_key,
            rate_per_minute=args.rate_limit_rpm,
            rate_burst=args.rate_burst,
            max_messages=args.max_messages,
            max_answer_tokens=args.max_answer_tokens,
            body_timeout=args.body_timeout,
            write_timeout=args.write_timeout,
        ),
        max_body_bytes=parse_bytes(args.max_body_bytes),
        redis_url=args.redis_url,
        namespace=args.namespace,
        block_size=args.block_size,
        lookup_deadline=args.lookup_deadline_ms / 1000,
        max_retries=args.max_retries,
        internal_token=args.internal_token,
        read_timeout=args.read_timeout,
        gone_after=args.gone_after,
        routing=RoutingConfig(policy=args.routing_policy, load_weight=args.load_weight,
                              decode_weight=args.decode_weight, balance_abs_tokens=args.balance_abs_tokens,
                              balance_rel=args.balance_rel, affinity_slack_tokens=args.affinity_slack_tokens,
                              heartbeat_load=args.heartbeat_load, pending_grace=args.pending_grace,
                              short_claims=args.short_claims, placement_slack_tokens=args.placement_slack_tokens,
                              seed_empty=args.seed_empty, seed_claim_factor=args.seed_claim_factor,
                              seed_when_full=args.seed_when_full, seed_beside=args.seed_beside,
                              prefill_progress=args.prefill_progress,
                              slot_wait_weight=args.slot_wait_weight),
        gateway_id=args.gateway_id or f"{socket.gethostname()}:{args.port}",
        janitor_grace=args.janitor_grace,
        load_publish_interval=args.load_publish_ms / 1000,
        models=models,
        keepalive=args.keepalive,
        token_cache_bytes=int(args.token_cache_mb * 2**20),
        strip_lines=() if args.no_strip else tuple(args.strip_line or DEFAULT_STRIP),
    )


# Exit code when the gateway refuses to start for its security settings.
EXIT_INSECURE = 6


def run(args: argparse.Namespace) -> int:
    raise_open_files_limit()  # first: the default --max-in-flight follows the raised limit
    try:
        cfg = config_from_args(args)
        check_exposure(args.host, cfg.api_keys, args.allow_unauthenticated)
        compile_patterns(cfg.strip_lines)
    except AuthConfigError as e:
        log.error("%s", e)
        return EXIT_INSECURE
    except re.error as e:
        log.error("--strip-line: invalid regex: %s", e)
        return 2
    except ValueError as e:
        log.error("bad setting: %s", e)
        return 2
    if cfg.api_keys:
        log.info("API keys required (%d configured)", len(cfg.api_keys))
    for name, path in cfg.models.items():
        if not (Path(path).expanduser() / "config.json").exists():
            log.error("model %s: no model directory at %s", name, path)
            return 2
    app = make_app(cfg)
    lim = cfg.limits
    log.info("gateway %s starting on %s: Redis %s (namespace %s), models %s, at most %s in flight "
             "and %s connections%s", cfg.gateway_id,
             host_port(args.host, args.port),  # helper-68: ":::8743"
             redact_url(cfg.redis_url), cfg.namespace,
             ", ".join(cfg.models) or "-", count(lim.max_in_flight, "request") if lim.max_in_flight else "unlimited requests", lim.max_connections or "unlimited",
             f", answers of at most {count(lim.max_answer_tokens, 'token')}" if lim.max_answer_tokens else "")
    changed = routing_changes(cfg.routing)
    log.info("routing: %s", ", ".join(changed) if changed else f"{cfg.routing.policy}, the defaults")
    code = asyncio.run(_serve(app, cfg, args.host, args.port, args.drain_seconds))
    if code == 0:
        log.info("gateway %s stopped", cfg.gateway_id)
    return code


async def _serve(app: web.Application, cfg: GatewayConfig, host: str, port: int, drain: float = 8.0) -> int:
    """Listen (behind `gateway.connguard`) until SIGINT, SIGTERM or SIGHUP, or until the `mlxgw serve`
    that started it is gone (`mlxgw.stopping`), then shut down gracefully: no new connections,
    ``drain`` seconds for the answers in flight, then streams still running end with an error
    event (`Proxy.begin_drain`) and what is left is cancelled a second later.
    Returns the exit code: 0, 2 when a live gateway uses its id (`gateway.app.GatewayIdInUse`),
    3 when the address cannot be bound, 4 when Redis refuses the URL's password or database
    (`gateway.app.RedisRefused`)."""
    # auto_decompress off: request bodies are decoded whole by gateway.limits.decode_body.
    app[DECODE_BODIES] = True
    runner = GuardedRunner(app, cfg.limits.max_connections, counts=app[ADMISSION].rejected,
                           handler_cancellation=True, access_log=None, shutdown_timeout=drain + 1.0,
                           auto_decompress=False)
    try:
        await runner.setup()
    except GatewayIdInUse as e:
        log.error("%s", e)
        await runner.cleanup()
        return 2
    except RedisRefused as e:
        log.error("%s", e)
        await runner.cleanup()
        return 4
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", host, port, e)
        await runner.cleanup()
        return 3
    stopper = Stopper(f"gateway on port {port}")
    if STATE in app:  # a second stop signal ends the drain at once (helper-69: it was ignored)
        stopper.on_again = app[STATE].proxy.end_drain
    try:
        await stopper.wait()
    finally:
        stopper.close()
        # Orphaned: Redis first. Routing is over, and draining the answers still streaming can
        # outlast the orphan's 20-s exit (a Redis stopped after the drain leaked: helper-47).
        if stopper.orphaned and os.environ.get(EMBEDDED_REDIS_ENV):
            shut_down_embedded_redis(cfg.redis_url)
        if STATE in app:
            app[STATE].proxy.begin_drain(drain)
        await runner.cleanup()
    return 0
