"""``mlxgw top``: ``mlxgw status`` live in the terminal, from Redis alone.

Backends sorted by load (active requests, then queued prefill tokens), with
sparklines of the per-interval token hit ratio and generated tokens/s. Data
gathering and rates are `mlxgw.status`'s (`collect`, `backend_view`, `History`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import redis
from rich.console import Group
from rich.live import Live
from rich.text import Text

from .status import (REPLY_TIMEOUT, History, backend_view, collect, connect, console, dropped_line, event_line,
                     fit_table, live_text, model_total, problem_lines, unreachable)
from .redis_client import connect as redis_connect
from .util import redact_url, serve_url_file

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[Optional[float]], hi: Optional[float] = None, width: int = 20) -> str:
    """The last ``width`` values as block characters scaled to ``[0, hi]``.

    ``hi`` defaults to the largest value shown; None values (no data in that
    interval) render as a blank. Returns ``""`` for no values.
    """
    vals = list(values)[-width:]
    top = hi if hi is not None else max((v for v in vals if v is not None), default=0.0)
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif top <= 0:
            out.append(_BARS[0])
        else:
            out.append(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))])
    return "".join(out)


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(data: dict, hist: History, namespace: str, now: Optional[float] = None,
           width: Optional[int] = None) -> Group:
    """One frame: per model a totals line, the backends table (by load, fitted to ``width``
    terminal columns: `mlxgw.status.fit_table`; None: every column) and recent events."""
    now = time.time() if now is None else now
    parts: list = [Text(f"mlxgw top  namespace {namespace}  {time.strftime('%H:%M:%S', time.localtime(now))}",
                        style="bold")]
    if not data:
        parts.append(Text(f"no live backend or gateway under namespace '{namespace}'"))
    for m, d in data.items():
        views = sorted((backend_view(r, now) for r in d["backends"]), key=lambda v: v["load"], reverse=True)
        last = (hist.model_series(m) or [{}])[-1]
        # helper-69: a backend with a URL problem (or left out, or silent) was counted as serving
        t = model_total(d["backends"])
        parts.append(Text(
            # helper-99: the rates are the last interval's, beside the rows' figures since start
            f"model {m}: {len(views)} backends ({live_text(t)}), {t['active']} active; last interval: "
            f"{_fmt(last.get('rps'), '.2f')} req/s, token hit ratio {_fmt(last.get('hit_ratio'), '.2f')}, "
            f"{_fmt(last.get('gen_tps'), '.1f')} gen tok/s, TTFT {_fmt(last.get('ttft_ms'), '.1f')} ms"))
        rows = []
        for v in views:
            s = hist.backend_series(m, v["id"])
            cur = s[-1] if s else {}
            rows.append([v["id"], v["state"], v["active_text"], str(v["queued"]), f"{v['cache_mb']:.1f}",
                         f"{v['cache_use']:.0%}", str(v["requests"]), f"{v['hit_ratio']:.2f}",
                         sparkline([p["hit_ratio"] for p in s], hi=1.0),
                         f"{sparkline([p['gen_tps'] for p in s], width=10)} {_fmt(cur.get('gen_tps'), '.1f')}",
                         _fmt(cur.get("ttft_ms"), ".1f"), f"{v['age_s']:.1f}"])
        # sorted by load; on a narrow terminal short headers, then columns leave (`fit_table`)
        spec = [("backend", "backend", 0), ("state", "state", 0), ("active/slots", "act/slots", 0),
                ("queued tok", "queued", 0), ("cache MiB", "MiB", 5), ("cache use", "use", 1), ("requests", "req", 2),
                ("hit ratio (tokens)", "hit", 0), ("hit ratio / interval", "hit/interval", 4),
                ("gen tok/s", "gen tok/s", 7), ("TTFT ms", "TTFT ms", 6), ("heartbeat s", "hb s", 3)]
        t, dropped = fit_table(None, spec, rows, width)
        if views:
            parts.append(t)
            if dropped:
                parts.append(Text(dropped_line(dropped, "`mlxgw status --json`")))
        # status's warning lines (helper-77: top showed none: a gateway waiting for backends,
        # backends no gateway serves, a gateway routing to none, why a backend is left out)
        for line in problem_lines(d, namespace):
            parts.append(Text(line, style="yellow"))
        for e in d["recent_events"]:
            parts.append(Text(event_line(e)))
    return Group(*parts)


def run(args) -> int:
    """Refresh every ``args.interval`` s; stop after ``args.iterations`` frames (0: until Ctrl-C).

    The first frame comes after ``min(interval, 1)`` s, so that its rates are already measured.

    On a terminal the frame is redrawn in place; otherwise each frame is printed.
    Returns 4 when Redis is unreachable at the start; once running, a frame Redis does not
    answer says so and the next one tries again (helper-63: top quit on the first failed poll,
    though `mlxgw serve` brings its Redis back within a second).
    """
    con = console()
    hist = History(maxlen=60)
    try:
        r = connect(args)

        last_ok = time.time()

        def frame():
            nonlocal last_ok, r
            try:
                data = collect(r, args.namespace, events=args.events, types=args.event_types)
            except redis.RedisError as e:
                if args.url_source == "serve":
                    # A restarted `mlxgw serve` runs its embedded Redis on a new port and leaves
                    # the new URL in its file (helper-64: top kept asking the old one).
                    new = serve_url_file().read_text().strip() if serve_url_file().exists() else ""
                    if new and new != args.redis_url:
                        args.redis_url = new
                        r = redis_connect(new, REPLY_TIMEOUT)
                        return frame()
                return Text(f"mlxgw top  namespace {args.namespace}  Redis unreachable at "
                            f"{redact_url(args.redis_url)} ({type(e).__name__}: {e}); last answer "
                            f"{time.time() - last_ok:.0f} s ago, retrying every {args.interval:g} s",
                            style="bold red")
            last_ok = time.time()
            hist.add(data)
            return render(data, hist, args.namespace, width=con.width if con.is_terminal else None)

        # Per-interval rates need two snapshots: take one first, so even the first frame (and
        # `--iterations 1`) has them, over a window of at most a second.
        hist.add(collect(r, args.namespace, events=args.events, types=args.event_types))
        time.sleep(min(args.interval, 1.0))
        n = 0
        if con.is_terminal:
            with Live(frame(), console=con, refresh_per_second=4, screen=False) as live:
                n = 1
                while not args.iterations or n < args.iterations:
                    time.sleep(args.interval)
                    live.update(frame())
                    n += 1
        else:
            while not args.iterations or n < args.iterations:
                if n:
                    time.sleep(args.interval)
                con.print(frame())
                n += 1
    except redis.RedisError as e:
        return unreachable(args, e)
    except KeyboardInterrupt:
        pass
    return 0
