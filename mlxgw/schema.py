"""The Redis schema: the one contract between gateway and backends.

Both sides import this module; it imports neither. It holds:

* block hashing (`block_hashes`, `block_keys`): prompts are cut into fixed-size
  token blocks and each *full* block gets a chained 64-bit xxh3 hash of the
  model id, the previous block's hash and the block's token ids as
  little-endian u32 (the layout NVIDIA Dynamo's KV router uses). Equal keys
  mean equal prefixes, so owning block ``i`` implies owning blocks ``0..i``.
* key names (`Keys`): everything lives under one namespace and a per-model
  Redis Cluster hash tag ``{model}`` so the one-round-trip lookup touches a
  single slot.
* the Lua scripts for the lookup and for cleaning up a dead epoch.
* event types written to the capped event stream.

The human-readable description of every key is in ``docs/redis-schema.md``;
``tests/test_schema_doc.py`` walks that document against a live stack.
"""

from __future__ import annotations

import json
import re
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import msgpack
import xxhash

from .util import redact_url

# Where every command looks for Redis when neither --redis-url nor MLXGW_REDIS_URL says.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = "mlxgw"
# A namespace is matched in SCAN patterns and wraps the model's cluster hash tag, so glob
# characters, braces and whitespace would reach other namespaces' keys or split a model's.
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")


def namespace_error(ns: str) -> Optional[str]:
    """Why ``ns`` cannot be a key namespace (None if it can): empty, longer than 64 characters,
    or holding anything but letters, digits and ``_ . : / -``."""
    if NAMESPACE_RE.fullmatch(ns):
        return None
    if not ns:
        return "the Redis key namespace is empty"
    return (f"the Redis key namespace must be 1-64 letters, digits or _ . : / - "
            f"(no spaces, braces or glob characters), not {ns!r}")
# Tokens per block. 64 is the measured sweet spot on agent-style prompts:
# lookups of a 32k-token prompt stay under a millisecond of Redis work while a
# divergence costs at most 63 tokens of lost matching (docs/redis-schema.md).
DEFAULT_BLOCK_SIZE = 64
# Registry records expire this many seconds after the last heartbeat.
DEFAULT_HEARTBEAT_TTL = 5.0
DEFAULT_HEARTBEAT_INTERVAL = 1.0
# The event stream is capped (approximately, MAXLEN ~) at this many entries.
EVENT_STREAM_MAXLEN = 10_000

_TAG_UNSAFE = re.compile(r"[{}\s]")
_U32 = "I"  # C unsigned int: 4 bytes on every platform MLX runs on (checked below)
if array(_U32).itemsize != 4:  # refuse rather than hash other bytes ("L" is 8 on LP64)
    raise ImportError("mlxgw block hashing needs a 4-byte unsigned int array type")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids packed as little-endian u32: the bytes block hashing reads, and the
    gateway's forward of the prompt to the backend (``_mlxgw.prompt_ids``).

    Raises:
        OverflowError: an id outside ``[0, 2**32)``.
    """
    arr = array(_U32, token_ids)  # 3x faster than numpy from a list
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def tokens_from_bytes(raw: bytes) -> list[int]:
    """Inverse of `token_bytes`. Raises ValueError when ``len(raw)`` is not a multiple of 4."""
    if len(raw) % 4:
        raise ValueError("packed token ids must be a multiple of 4 bytes")
    arr = array(_U32)
    arr.frombytes(raw)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def block_hashes(model_id: str, token_ids: Sequence[int] | bytes, block_size: int) -> list[int]:
    """Chained xxh3-64 hashes of the full blocks of ``token_ids``.

    Args:
        model_id: served model name; seeds the chain so two models never share
            a key.
        token_ids: the prompt, token ids in ``[0, 2**32)``, or those ids
            already packed by `token_bytes` (the gateway packs once, for the
            hashes and the forward).
        block_size: tokens per block (> 0). A trailing partial block is not
            hashed: only full blocks are keyed.

    Returns:
        ``len(token_ids) // block_size`` unsigned 64-bit integers; element ``i``
        depends on every token of blocks ``0..i``.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    step = 4 * block_size
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raw = bytes(token_ids)
        n = len(raw) // step
    else:
        n = len(token_ids) // block_size
        raw = token_bytes(token_ids[: n * block_size]) if n else b""
    if n == 0:
        return []
    prev = xxhash.xxh3_64_intdigest(model_id.encode("utf-8"))
    out = []
    for i in range(n):
        prev = xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "little") + raw[i * step : (i + 1) * step]
        )
        out.append(prev)
    return out


def block_keys(model_id: str, token_ids: Sequence[int] | bytes, block_size: int) -> list[str]:
    """`block_hashes` rendered as 16-digit lowercase hex strings (Redis key suffixes)."""
    return [f"{h:016x}" for h in block_hashes(model_id, token_ids, block_size)]


def model_tag(model_id: str) -> str:
    """The Redis Cluster hash tag for a model: its name with ``{``, ``}`` and blanks replaced."""
    return _TAG_UNSAFE.sub("_", model_id)


@dataclass(frozen=True)
class Keys:
    """Key names for one model under one namespace.

    Every key of a model carries the hash tag ``{model}`` so scripts that touch
    a model's blocks and registry stay in one Cluster slot.
    """

    namespace: str
    model: str

    @property
    def prefix(self) -> str:
        return f"{self.namespace}:{{{model_tag(self.model)}}}"

    def block(self, block_hex: str) -> str:
        """HASH backend id -> epoch (a saved copy) or epoch + `CLAIM_SUFFIX` (only being
        computed there): who holds the prefix ending at this block."""
        return f"{self.prefix}:blk:{block_hex}"

    def blocks(self, block_hexes: Iterable[str]) -> list[str]:
        p = f"{self.prefix}:blk:"
        return [p + h for h in block_hexes]

    def backend(self, backend_id: str) -> str:
        """HASH, expires with the heartbeat: the backend's registry record."""
        return f"{self.prefix}:backend:{backend_id}"

    @property
    def backend_prefix(self) -> str:
        return f"{self.prefix}:backend:"

    @property
    def backends(self) -> str:
        """ZSET backend id -> unix time (s) of its last heartbeat."""
        return f"{self.prefix}:backends"

    def owned(self, backend_id: str, epoch: int) -> str:
        """SET of block keys owned by one backend epoch (for cleanup and re-publish)."""
        return f"{self.prefix}:owned:{backend_id}:{epoch}"

    def epoch_counter(self, backend_id: str) -> str:
        """STRING counter; INCR gives a (re)started backend its new epoch."""
        return f"{self.prefix}:epoch:{backend_id}"

    @property
    def events(self) -> str:
        """STREAM (capped): saves, evictions, clears, routing decisions."""
        return f"{self.prefix}:events"

    @property
    def gateways(self) -> str:
        """ZSET gateway id -> unix time (s) of its last in-flight publish."""
        return f"{self.prefix}:gateways"

    def gateway_load(self, gateway_id: str) -> str:
        """HASH backend id -> "requests:prefill_tokens" in flight from one gateway (expires in 3 s)."""
        return f"{self.prefix}:gwload:{gateway_id}"

    @property
    def gateway_load_prefix(self) -> str:
        return f"{self.prefix}:gwload:"

    @property
    def lost(self) -> str:
        """HASH backend id -> the epoch a gateway's janitor wrote a `EVENT_LOST` event for
        (`LOST_LUA`: one event per vanished run, however many gateways sweep)."""
        return f"{self.prefix}:lost"

    @property
    def gateway_settings(self) -> str:
        """HASH gateway id -> JSON of what a backend must match to be routed to by that
        gateway (`gateway_settings_value`); backends and ``mlxgw status`` read it."""
        return f"{self.prefix}:gwconf"


def as_str(x) -> str:
    """A Redis reply item as text: bytes decoded as UTF-8 (undecodable bytes replaced),
    anything else through ``str`` (clients with and without ``decode_responses``)."""
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


# Registry record fields that are text (docs/redis-schema.md); every other field is a number.
REGISTRY_TEXT_FIELDS = frozenset({"id", "url", "model", "model_path", "host", "state", "engine", "cache_layout",
                                  "tokenizer", "auth", "url_problem", "model_files"})


# Gateways rewrite their `Keys.gateway_settings` entry every registry refresh (1 s); an entry
# older than GATEWAY_SETTINGS_FRESH seconds is a gateway that stopped (readers skip it, and
# a gateway deletes entries older than GATEWAY_SETTINGS_PRUNE when it writes its own).
GATEWAY_SETTINGS_FRESH = 10.0
GATEWAY_SETTINGS_PRUNE = 60.0


# Delete the entries of a `Keys.gateway_settings` hash (KEYS[1]) written before ARGV[1]
# (unix seconds): gateways gone for `GATEWAY_SETTINGS_PRUNE`. Entries that do not parse stay.
PRUNE_SETTINGS_LUA = """
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  local at = tonumber(string.match(all[i + 1], '"at": *([%d.]+)'))
  if at and at < tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[1], all[i])
    n = n + 1
  end
end
return n
"""


#: Words every ``refused`` reason of a gateway that has no internal token at all contains
#: (`gateway.proxy`'s messages), so status tells it from a wrong token (`refused_gateway_lines`).
NO_TOKEN_MARK = "this gateway has none"


def gateway_settings_value(block_size: int, tokenizer: str, at: float, skipped: Optional[dict] = None,
                           refused: Optional[dict] = None) -> str:
    """One gateway's `Keys.gateway_settings` entry: JSON ``{"block_size": tokens per block,
    "tokenizer": `mlxgw.prompt.tokenizer_fingerprint` of its tokenizer for the model, "at":
    unix seconds written}``, plus ``"skipped": {backend id: why}`` when the gateway skips live
    backends for reasons of the backend's (another backend answers at one's URL) and
    ``"refused": {backend id: why}`` for those that refuse its internal token (or need one it
    lacks): which side is wrong, status tells from how many backends refuse it
    (`left_out_reason`; `gateway.proxy`)."""
    d = {"block_size": int(block_size), "tokenizer": tokenizer, "at": round(at, 3)}
    if skipped:
        d["skipped"] = skipped
    if refused:
        d["refused"] = refused
    return json.dumps(d)


# The SSE comment a backend writes, with the reason on its line, just before it cuts a stream
# whose request failed inside the engine (a failed batch step, a dead engine thread): the
# gateway then ends its client's stream with that reason, and opens no circuit for a failed
# batch (the backend goes on). Clients never see it (the gateway drops it).
FAILED_MARK = b": mlxgw-failed "


def failed_comment(why: str, fatal: bool) -> bytes:
    """`FAILED_MARK`'s comment: ``fatal`` when the backend is exiting (its engine thread died)."""
    return FAILED_MARK + (b"fatal " if fatal else b"batch ") + " ".join(why.split()).encode() + b"\n\n"


def parse_failed_comment(chunk: bytes, at_line_start: bool = True) -> tuple[bytes, Optional[tuple[bool, str]]]:
    """``chunk`` without a `failed_comment` in it, and that comment's ``(fatal, why)`` (None: none).
    Only a mark at the start of a line counts (JSON in a data line holds no raw newline, so a
    model that writes the mark's words in its answer cuts nothing); ``at_line_start``: whether
    ``chunk`` itself starts a line."""
    at = chunk.find(FAILED_MARK)
    while at >= 0 and not (chunk[at - 1:at] == b"\n" if at else at_line_start):
        at = chunk.find(FAILED_MARK, at + 1)
    if at < 0:
        return chunk, None
    end = chunk.find(b"\n\n", at)
    end = len(chunk) if end < 0 else end + 2
    kind, _, why = chunk[at + len(FAILED_MARK):end].decode("utf-8", "replace").strip().partition(" ")
    return chunk[:at] + chunk[end:], (kind == "fatal", why)


# A backend answer's keep-alive while its request has not begun (helper-90: a request waiting
# for a decode slot sent nothing, not even headers, so a gateway `--read-timeout` shorter than the
# wait failed a healthy, full backend over). After `KEEPALIVE_SECONDS` without its first engine
# event a stream sends its headers without `CACHED_TOKENS` (its prefill has not looked the cache
# up yet), `QUEUED_COMMENT` each `KEEPALIVE_SECONDS` until the prefill starts, then
# `cached_comment`; a non-streamed answer sends a newline each `KEEPALIVE_SECONDS` (JSON allows
# leading whitespace) and its usage carries the count. A gateway reads both and sends neither.
CACHED_TOKENS = "X-Mlxgw-Cached-Tokens"
KEEPALIVE_SECONDS = 1.0
QUEUED_COMMENT = b": mlxgw-queued\n\n"
CACHED_MARK = b": mlxgw-cached "


def cached_comment(cached: int) -> bytes:
    """`CACHED_MARK`'s comment: the prompt tokens (int) the backend read from its prompt cache."""
    return CACHED_MARK + str(int(cached)).encode() + b"\n\n"


def parse_queue_comments(chunk: bytes, at_line_start: bool = True) -> tuple[bytes, int, Optional[int]]:
    """``chunk`` without its `QUEUED_COMMENT` and `cached_comment` lines, how many queued
    comments it held, and the cached count (None: no such comment). Only comments at the start
    of a line count, as in `parse_failed_comment`; ``at_line_start``: whether ``chunk`` starts one."""
    queued, cached = 0, None
    for mark in (QUEUED_COMMENT, CACHED_MARK):
        at = chunk.find(mark)
        while at >= 0:
            if not (chunk[at - 1:at] == b"\n" if at else at_line_start):
                at = chunk.find(mark, at + 1)
                continue
            end = chunk.find(b"\n\n", at)
            end = len(chunk) if end < 0 else end + 2
            if mark is QUEUED_COMMENT:
                queued += 1
            else:
                try:
                    cached = int(chunk[at + len(mark):end].strip())
                except ValueError:
                    pass
            chunk = chunk[:at] + chunk[end:]
            at = chunk.find(mark, at)
    return chunk, queued, cached


# A streamed answer's prefill progress, one comment per prefill step: the prompt tokens done and
# in all, cache hit included. Clients see it as a keep-alive; a gateway counts the request's
# queued prefill down by it (`parse_progress`; not with ``--no-prefill-progress``).
PROGRESS_MARK = b": keepalive "


def progress_comment(done: int, total: int) -> bytes:
    """`PROGRESS_MARK`'s comment: ``done`` of the prompt's ``total`` tokens (ints) are in the KV cache."""
    return PROGRESS_MARK + f"{int(done)}/{int(total)}".encode() + b"\n\n"


def parse_progress(chunk: bytes) -> Optional[int]:
    """Prompt tokens left to prefill by the last whole `progress_comment` in ``chunk`` (None: none,
    or only a piece of one: a comment split between reads is skipped, the next step sends another)."""
    at = chunk.rfind(PROGRESS_MARK)
    while at >= 0:
        end = chunk.find(b"\n\n", at)
        done, sep, total = chunk[at + len(PROGRESS_MARK):end].partition(b"/")
        if end > 0 and sep and done.isdigit() and total.isdigit():
            return max(0, int(total) - int(done))
        at = chunk.rfind(PROGRESS_MARK, 0, at)
    return None


# The header every backend answer carries with its backend id: a gateway that reached something
# else at a backend's registered URL (another backend, another server) can tell.
SERVED_BY = "X-Mlxgw-Served-By"
# The header every request a gateway forwards carries, with the gateway's id: a gateway that
# receives one was taken for a backend (a backend registered the gateway's URL) and answers
# 421 naming itself in `GATEWAY_ID`, neither routing it nor counting it as its own failure.
FORWARDED_BY = "X-Mlxgw-Forwarded-By"
GATEWAY_ID = "X-Mlxgw-Gateway"


def url_error(url: str) -> Optional[str]:
    """Why ``url`` cannot be a backend's registered URL (None: it can): gateways need
    ``http://host[:port]`` or ``https://...``. helper-65: ``--url mac2.local:8100`` (no scheme)
    registered, and every request routed to it was a 500 with a traceback in the gateway."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        ok = False
    if not ok:
        return f"its URL {redact_url(url)!r} is not an http(s)://host:port URL"
    if u.hostname in ("0.0.0.0", "::"):  # helper-67: taken, and reachable from this machine only
        return (f"its URL {url!r} names a wildcard address, where nothing can be reached; give the address "
                f"the gateways reach this machine at")
    if u.path not in ("", "/") or u.query or u.fragment or u.username or u.password:
        url = redact_url(url)  # helper-67: a password in it was echoed into the log
        # helper-66: `--url http://host:8645/v1` registered, and the gateways' requests to
        # /v1/v1/... were 404s for every request routed there, never retried.
        return (f"its URL {url!r} has more than a scheme, host and port (the gateways add the API's "
                f"paths, /v1/... and /health, themselves)")
    return None


def left_out_reason(gateway: dict, gateway_id: str, backend_id: str, block_size: int,
                    tokenizer: str, refusals: bool = True) -> Optional[str]:
    """Why the gateway whose `gateway_settings_value` is ``gateway`` (decoded) does not route to
    a backend (None: it does): `incompatibility`, or the gateway's own ``skipped`` reason, or
    (with ``refusals``) its ``refused`` one. The one rule of the backend's log, its ``/health``
    ``left_out_by`` and ``mlxgw status`` (which passes ``refusals=False`` for a gateway that
    every live backend refuses: that gateway's token is the wrong one, helper-70)."""
    why = incompatibility(int(gateway.get("block_size") or 0), str(gateway.get("tokenizer") or ""),
                          block_size, tokenizer, whose=f"gateway {gateway_id}'s")
    if why:
        return why
    for field in ("skipped", "refused") if refusals else ("skipped",):
        d = gateway.get(field)
        if isinstance(d, dict) and backend_id in d:
            return str(d[backend_id])
    return None


def fresh_gateway_settings(raw: dict, now: float, fresh: float = GATEWAY_SETTINGS_FRESH) -> dict[str, dict]:
    """The entries of a `Keys.gateway_settings` hash (bytes or text, as Redis returns it)
    written within ``fresh`` seconds of ``now``: gateway id -> its decoded settings.
    Entries that do not parse are skipped. Never raises."""
    out = {}
    for k, v in raw.items():
        try:
            d = json.loads(as_str(v))
            if now - float(d["at"]) <= fresh:
                out[as_str(k)] = d
        except (ValueError, KeyError, TypeError):
            continue
    return out


def incompatibility(gateway_block_size: int, gateway_tokenizer: str, block_size: int, tokenizer: str,
                    whose: str = "this gateway's") -> Optional[str]:
    """Why a backend with ``block_size`` and ``tokenizer`` cannot serve a gateway with the
    ``gateway_*`` settings (None: it can). Its token ids must mean the same tokens (the
    gateway forwards ids it computed: another tokenizer answers nonsense) and its block keys
    must cover the same spans (another block size never matches a prefix). A value either
    side does not publish (0, "": an older process) is not checked. ``whose`` names the
    gateway in the text."""
    if block_size and gateway_block_size and block_size != gateway_block_size:
        return f"block size {block_size}, {whose} is {gateway_block_size} (--block-size must match)"
    if tokenizer and gateway_tokenizer and tokenizer != gateway_tokenizer:
        return (f"another tokenizer (vocabulary fingerprint {tokenizer}, {whose} {gateway_tokenizer}): "
                "the model it serves is not the one the gateway tokenizes for")
    return None


def registry_record(raw: dict) -> dict:
    """A registry hash (``Keys.backend``) as Redis returns it (bytes or text) with its numbers
    typed: int where the text is an integer, float where it is a decimal; the text fields
    (`REGISTRY_TEXT_FIELDS`) and anything that does not parse stay text. Never raises."""
    out = {}
    for a, b in raw.items():
        k, v = as_str(a), as_str(b)
        if k not in REGISTRY_TEXT_FIELDS:
            try:
                v = int(v)
            except ValueError:
                try:
                    v = float(v)
                except ValueError:
                    pass
        out[k] = v
    return out


def models_key(namespace: str) -> str:
    """SET of served model names (cross-model, so no hash tag)."""
    return f"{namespace}:models"


def redis_id_key(namespace: str) -> str:
    """STRING: a random id the first gateway to find it missing writes (``SET NX``, no
    expiry). A gateway that reads another value than last time, or none, knows Redis
    lost its data since (a restart without persistence, ``FLUSHALL``) and keeps routing
    to the backends it knew until they re-register (`gateway.index`)."""
    return f"{namespace}:redis_id"


# A block value ``f"{epoch}{CLAIM_SUFFIX}"``: the backend is computing that prefix (a request's
# claim) but holds no saved copy of it yet. A claimed prefix can be shared only by a request
# that waits for its prefill, which the backend does for at least its ``min_hit_tokens``
# (backend.engine); a shorter match on a claim alone reuses nothing (gateway.route).
CLAIM_SUFFIX = "c"  # the Lua scripts below spell it 'c'


def block_value(epoch: int, saved: bool) -> str:
    """The value a backend writes in a block hash: ``"7"`` (saved copy) or ``"7c"`` (claim only)."""
    return str(epoch) if saved else f"{epoch}{CLAIM_SUFFIX}"


# Lookup: KEYS[1] = backends zset, KEYS[2..] = block keys in prompt order.
# ARGV[1] = backend hash key prefix; ARGV[2] = gateways zset ('' to skip the
# other gateways' in-flight load); ARGV[3] = gateway-load hash prefix;
# ARGV[4] = the calling gateway's id (its own load it knows fresher).
# Returns one row per live backend: {id, epoch, url, active, queued_prefill,
# state, cache_bytes, cache_budget_bytes, depth_in_blocks, gw_requests,
# gw_prefill_tokens, saved_depth_in_blocks, min_hit_tokens, cache_victim_used_at,
# kv_bytes_per_token, block_size, tokenizer, auth, decode_slots, prefill_tps,
# decode_seconds, prefill_beside_tokens, decode_steps_per_token, attention_parity_tokens}
# (gw_* summed over
# the other live gateways; the depth counts saved copies and claims, the saved
# depth saved copies only). A backend is live while its registry hash exists
# (the heartbeat TTL); ownership counts only when the stored epoch equals the
# live epoch, so a restarted backend's old claims never route a request.
# The walk stops at the first block nobody live owns: with chained hashes,
# nobody can own a later one.
LOOKUP_LUA = """
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local rows = {}
local cids = {}
local claimed = {}
for _, id in ipairs(ids) do
  local h = redis.call('HMGET', ARGV[1] .. id, 'epoch', 'url', 'active', 'queued_prefill_tokens', 'state',
                      'cache_bytes', 'cache_budget_bytes', 'min_hit_tokens', 'cache_victim_used_at',
                      'kv_bytes_per_token', 'block_size', 'tokenizer', 'auth', 'decode_slots',
                      'prefill_tps', 'decode_seconds', 'prefill_beside_tokens', 'decode_steps_per_token',
                      'attention_parity_tokens')
  if h[1] then
    table.insert(rows, {id, h[1], h[2] or '', h[3] or '0', h[4] or '0', h[5] or '', h[6] or '0', h[7] or '0', 0, 0, 0,
                        0, h[8] or '0', h[9] or '0', h[10] or '0', h[11] or '0', h[12] or '',
                        h[13] or '', h[14] or '0', h[15] or '0', h[16] or '0', h[17] or '0', h[18] or '1',
                        h[19] or '0'})
    table.insert(cids, id)
    table.insert(claimed, h[1] .. 'c')
  end
end
if ARGV[2] and ARGV[2] ~= '' and #cids > 0 then
  local gws = redis.call('ZRANGE', ARGV[2], 0, -1)
  for _, g in ipairs(gws) do
    if g ~= ARGV[4] then
      local loads = redis.call('HMGET', ARGV[3] .. g, unpack(cids))
      for j, row in ipairs(rows) do
        if loads[j] then
          local r, t = string.match(loads[j], '(%d+):(%d+)')
          row[10] = row[10] + tonumber(r or 0)
          row[11] = row[11] + tonumber(t or 0)
        end
      end
    end
  end
end
if #cids > 0 then
  for i = 2, #KEYS do
    local owners = redis.call('HMGET', KEYS[i], unpack(cids))
    local any = false
    for j, row in ipairs(rows) do
      if row[9] == i - 2 then
        if owners[j] == row[2] then
          row[9] = i - 1
          if row[12] == i - 2 then row[12] = i - 1 end
          any = true
        elseif owners[j] == claimed[j] then
          row[9] = i - 1
          any = true
        end
      end
    end
    if not any then break end
  end
end
return rows
"""

# Cache figures a backend refreshes between heartbeats, with each batch of ownership
# changes (backend.report), so placement (gateway.route) sees them within a request and
# the record agrees with itself (entries, bytes and blocks owned of the same moment).
# KEYS[1] = the backend's registry hash; ARGV = field, value, field, value, ...
# Writes only while the record exists: a lapsed record stays gone until the
# heartbeat re-registers it (with its TTL) and re-publishes ownership.
CACHE_FIGURES = ("cache_entries", "cache_bytes", "cache_tokens", "cache_evictions", "cache_evicted_tokens",
                 "cache_victim_used_at", "kv_bytes_per_token", "blocks_owned")
UPDATE_IF_LIVE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  return 1
end
return 0
"""

# KEYS[1] = a backend's epoch counter, ARGV[1] = its running epoch: raise the
# counter to at least that epoch. A re-publish runs it, so a Redis that lost its
# data (a restart without persistence, FLUSHALL) cannot hand the backend's next
# start an epoch its previous life still holds blocks under. Returns the counter.
RAISE_EPOCH_LUA = """
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local e = tonumber(ARGV[1])
if c < e then
  redis.call('SET', KEYS[1], e)
  return e
end
return c
"""

# KEYS[1] = `Keys.lost`, KEYS[2] = the backend's epoch counter, KEYS[3] = its registry record,
# KEYS[4] = the events stream; ARGV[1] = backend id, ARGV[2] = the event's fields as msgpack
# data, ARGV[3] = ts, ARGV[4] = stream length cap, ARGV[5] = the event type (`EVENT_LOST`).
# Writes one `lost` event for the backend's latest epoch unless its record is back or that
# epoch already has one. Returns 1 if written.
LOST_LUA = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local epoch = redis.call('GET', KEYS[2]) or '0'
if redis.call('HGET', KEYS[1], ARGV[1]) == epoch then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], epoch)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'type', ARGV[5], 'backend', ARGV[1], 'epoch', epoch,
           'ts', ARGV[3], 'data', ARGV[2])
return 1
"""

# Cleanup of one dead epoch: KEYS[1] = owned set of (backend, epoch).
# ARGV[1] = backend id, ARGV[2] = epoch, ARGV[3] = max keys this call.
# Removes the backend's field from each block only if it still holds that
# epoch (saved or claimed), so a newer epoch's survive. Returns keys left to clean.
CLEANUP_LUA = """
local keys = redis.call('SPOP', KEYS[1], tonumber(ARGV[3]))
for _, k in ipairs(keys) do
  local v = redis.call('HGET', k, ARGV[1])
  if v == ARGV[2] or v == ARGV[2] .. 'c' then
    redis.call('HDEL', k, ARGV[1])
  end
end
return redis.call('SCARD', KEYS[1])
"""


@dataclass
class Candidate:
    """One live backend as the lookup saw it.

    ``depth_blocks`` is the longest prefix of the request it owns, in blocks,
    saved or being computed there; ``saved_blocks`` (<= ``depth_blocks``) the
    part it holds a saved copy of. ``min_hit_tokens`` is the backend's
    threshold for holding a request back to share a prompt in prefill (0:
    not published, every claim counts as before). ``victim_used_at`` is the
    unix time (s) the entry its cache would evict next was last used (0: empty
    or not published) and ``kv_bytes_per_token`` its KV bytes per cached token
    (0: unknown); placement uses both (gateway.route). ``block_size`` (tokens) and
    ``tokenizer`` (`mlxgw.prompt.tokenizer_fingerprint`) must equal the gateway's for the
    backend to be routed to (gateway.index; 0 / "": not published, not checked).
    ``auth`` is ``"token"`` when the backend refuses requests without its internal token,
    ``"none"`` when it takes any ("": not published). ``decode_slots`` is how many requests
    it decodes at once (its ``--decode-concurrency``; more wait for a slot; 0: not published).
    ``prefill_tps`` is its measured prefill rate (prompt tokens/s) and ``decode_seconds`` the
    mean time a request decoded there (s, first token to end); both 0 until measured or when not
    published. The routing cost turns requests past the slots into a wait with them.
    ``prefill_beside_tokens``: a request with at most this many tokens to compute starts beside
    a running prefill there rather than behind its queue (its ``step-beside`` prefill step; 0:
    not published, or it waits behind the queue); the seeding rule reads it (gateway.route), and
    ``decode_steps_per_token``: engine steps one output token takes there (1, mlx-lm; the sim's
    token stands for ``--sim-token-scale`` real ones; 1 when not published);
    ``attention_parity_tokens``: the depth at which a prompt token's attention costs as much as the
    rest of its prefill there (`backend.attention`; 0: unknown or flat).
    """

    backend_id: str
    epoch: int
    url: str
    active: int
    queued_prefill_tokens: int
    state: str
    cache_bytes: int = 0
    cache_budget_bytes: int = 0
    depth_blocks: int = 0
    gw_requests: int = 0  # in flight to it from the other gateways (published)
    gw_prefill_tokens: int = 0
    saved_blocks: int = 0
    min_hit_tokens: int = 0
    victim_used_at: float = 0.0
    kv_bytes_per_token: float = 0.0
    block_size: int = 0
    tokenizer: str = ""
    auth: str = ""
    decode_slots: int = 0
    prefill_tps: float = 0.0
    decode_seconds: float = 0.0
    prefill_beside_tokens: int = 0
    decode_steps_per_token: float = 1.0
    attention_parity_tokens: int = 0

    @property
    def free_cache_bytes(self) -> int:
        return max(0, self.cache_budget_bytes - self.cache_bytes)


def parse_lookup(rows: list) -> list[Candidate]:
    """Decode the rows `LOOKUP_LUA` returns (bytes or str) into `Candidate` objects."""
    out = []
    for r in rows:
        out.append(
            Candidate(
                backend_id=as_str(r[0]),
                epoch=int(as_str(r[1])),
                url=as_str(r[2]),
                active=int(float(as_str(r[3]) or 0)),
                queued_prefill_tokens=int(float(as_str(r[4]) or 0)),
                state=as_str(r[5]),
                cache_bytes=int(float(as_str(r[6]) or 0)),
                cache_budget_bytes=int(float(as_str(r[7]) or 0)),
                depth_blocks=int(r[8]),
                gw_requests=int(r[9]) if len(r) > 9 else 0,
                gw_prefill_tokens=int(r[10]) if len(r) > 10 else 0,
                # rows without the saved depth (older scripts) count every owned block as saved
                saved_blocks=int(r[11]) if len(r) > 11 else int(r[8]),
                min_hit_tokens=int(float(as_str(r[12]) or 0)) if len(r) > 12 else 0,
                victim_used_at=float(as_str(r[13]) or 0) if len(r) > 13 else 0.0,
                kv_bytes_per_token=float(as_str(r[14]) or 0) if len(r) > 14 else 0.0,
                block_size=int(float(as_str(r[15]) or 0)) if len(r) > 15 else 0,
                tokenizer=as_str(r[16]) if len(r) > 16 else "",
                auth=as_str(r[17]) if len(r) > 17 else "",
                decode_slots=int(float(as_str(r[18]) or 0)) if len(r) > 18 else 0,
                prefill_tps=float(as_str(r[19]) or 0) if len(r) > 19 else 0.0,
                decode_seconds=float(as_str(r[20]) or 0) if len(r) > 20 else 0.0,
                prefill_beside_tokens=int(float(as_str(r[21]) or 0)) if len(r) > 21 else 0,
                decode_steps_per_token=float(as_str(r[22]) or 1) if len(r) > 22 else 1.0,
                attention_parity_tokens=int(float(as_str(r[23]) or 0)) if len(r) > 23 else 0,
            )
        )
    return out


# Event types in the stream. Each entry has the plain fields `type`,
# `backend`, `epoch`, `ts` (unix s) and a msgpack `data` field.
EVENT_SAVED = "saved"  # data: {"tokens": n, "blocks": [u64...], "cache_type": str}
EVENT_EVICTED = "evicted"  # data: {"tokens": n, "blocks": [u64...]}
EVENT_CLEARED = "cleared"  # data: {} (backend re-publishes or shut down)
EVENT_STARTED = "started"  # data: {"url": str, "previous": "vanished" | "stopped"} (backend's first registration)
EVENT_LOST = "lost"  # data: {"silent_s": s} (a gateway's janitor: listed, record expired, never withdrew)
EVENT_ROUTED = "routed"  # data: {"request": id, "matched": n, "candidates": [...], ...}


def event_fields(kind: str, backend: str, epoch: int, data: dict) -> dict:
    """The field map of one stream entry (see the EVENT_* constants)."""
    return {
        "type": kind,
        "backend": backend,
        "epoch": str(epoch),
        "ts": f"{time.time():.3f}",
        "data": msgpack.packb(data, use_bin_type=True),
    }


def decode_event(fields: dict) -> dict:
    """Inverse of `event_fields` for a raw XRANGE entry (bytes keys/values accepted)."""
    out = {}
    for k, v in fields.items():
        k = as_str(k)
        if k == "data":
            out[k] = msgpack.unpackb(v, raw=False) if v else {}
        else:
            out[k] = as_str(v)
    return out
