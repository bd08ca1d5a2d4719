"""The routing policy: a pure function from candidates to a ranked choice.

Cost of sending a request to backend ``b``, in tokens of work:

    load(b) = queued(b) + decode_weight * active(b)
    cost(b) = prefill(b) + load_weight * load(b)

* ``prefill(b) = prompt_tokens - matched(b)``: the prompt tokens ``b`` would
  still have to compute, ``matched(b)`` being the prefix it can serve, capped
  at ``prompt_tokens - 1`` (one token is always prefilled): the part it holds
  a saved copy of, or the longer part it is computing (a request's claim in
  Redis, or this gateway's pending claim, `gateway.pending`) when that is at
  least the backend's ``min_hit_tokens``. A request shares a prompt still
  being computed only by waiting for its prefill, which the backend does from
  ``min_hit_tokens`` on (backend.engine); a shorter claimed match reuses
  nothing, so it must not attract the request (measured: a prompt's common
  first block, claimed on every busy backend, sent requests to queues where
  nothing was cached; docs/benchmarks.md, session 12).
* ``queued(b)``: prefill tokens the gateways sent ``b`` that it has not
  started answering (this gateway's own counters plus the others' published
  ones; see `gateway.load`). With ``heartbeat_load`` the backend's heartbeat
  figure counts too (the larger of the two), at up to a heartbeat's staleness.
* ``active(b)``: running decodes (each of a request's ``n`` choices), same sources.

Balance guard (SGLang router's ``balance_abs_threshold`` /
``balance_rel_threshold``, counted in tokens of work rather than requests):
a backend whose load exceeds the least-loaded backend's by more than
``balance_abs_tokens`` and by a factor of more than ``balance_rel`` is
*overloaded* and ranks after every backend that is not, whatever prefix it
owns. Below those thresholds the owned prefix decides.

Seeding an empty backend: a backend that holds no prefix of the request and
has nothing to do (just started, restarted or added, or idle beside busy
owners) takes the request when the chosen backend's load is larger than the
saved prefix it would reuse there: for that one comparison the load counts in
full (Dynamo's overlap weight 1, the request's own wait), not at
``load_weight``. At ``load_weight`` alone a prefix every backend shares (a
system prompt) kept a new backend idle until its owners were ~33 times its
length busier; once it has taken one such request it owns the prefix too and
the usual cost applies. With ``seed_beside`` (opt-in) a request past a saved
prefix whose remainder starts beside the chosen backend's running prefill there
(at most its published ``prefill_beside_tokens``, its ``step-beside`` prefill
step) is charged, instead of the whole queue, the steps to its first token plus
one prefill chunk per step of its answer (``max_tokens``) while that prefill
lasts, weighed by the chunks' depth (`seed_wait`; session 53; opt-in,
docs/routing.md, "Seeding an empty backend").
Past a prefix the chosen backend is still computing (a
claim: a burst or a fan-out that pending ownership gathers there) the load must
exceed ``seed_claim_factor`` (2) times it: the claim's own prefill, which a
sibling waits for there and would redo elsewhere, plus as much again; an owner
whose cache keeps nothing (the KV in flight filling its budget, every match a
claim) otherwise kept every request beside an idle backend (docs/routing.md,
"Seeding an empty backend"). Whatever the prefix, an idle empty backend also takes
the request when the chosen one cannot start it: as many requests in flight there as
it has decode slots (``Candidate.decode_slots``), so this one would wait for a slot.
The load figure counts a running request as ``decode_weight`` tokens, which does not
say that: 20 agents on a shared 8,000-token system prompt kept an added backend idle
beside an owner with all 16 slots busy and 4 requests waiting (``seed_when_full``).

The wait for a decode slot (checked last): when the chosen backend has a request
in flight for each of its ``S`` decode slots, this one would wait for a slot there:
``wait = (active - S + 1) / S * decode_seconds * prefill_tps`` tokens of prefill
(slots free at about ``S`` per ``decode_seconds``, the mean time a request
decodes there, first token to end, or what the running ones have run if longer;
both figures measured by the backend and read from its registry record;
`slot_wait`). A backend with compute to spare (no prompt queued, at most a
quarter of its decode slots in use) whose cost is under the chosen one's plus
``slot_wait_weight`` times that takes the request (reason ``wait``): a conversation whose history the full backend
holds, beside one holding only its system prompt (helper-89: 18 requests on 16
slots beside one with 1, the history outweighing the load figure's 256 tokens
per running request). Only a spare backend: the prefill a move adds is free
there and would delay a busy one's queue; counting the wait against every
backend moved conversation-trace turns off their owners for no TTFT gain
(docs/routing.md, "The wait for a decode slot").

Placement (eviction-aware): when storing the request's new tokens would make
the cheapest backend evict, the request goes to the candidate, among those
with the same matched prefix that are not overloaded and cost at most
``placement_slack_tokens`` more, whose cache evicts least: one with room for
its queued prompts and this one first, then the one whose next eviction
victim was used longest ago (``Candidate.victim_used_at``, the backends' own
LRU order) and is not already due to go for the prompts queued there. Four
LRU caches then evict in about the order one cache of their total size
would, instead of one backend dropping prefixes another would have kept for
longer (docs/benchmarks.md, "Which lost ids are routing's": those evictions were the
losses left against the pooled cache). Off by default: in the trace replays
it bought little hit ratio for worse TTFT (docs/routing.md, "Eviction-aware
placement").

Ties: a client session key (header ``X-Session-Id``, or the body's
``prompt_cache_key`` / ``user``) picks its rendezvous-hash backend among the
candidates within ``affinity_slack_tokens`` of the cheapest (never a much
costlier one). Then fewer active requests, then the most free cache (cold
prompts spread over every backend's memory instead of piling onto the
first; sglang issue 32983), then a rendezvous hash of the prompt's first
block, stable across gateways. Weights and measurements: ``docs/routing.md``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import xxhash

from mlxgw.schema import Candidate

POLICIES = ("cache_aware", "longest_prefix", "least_loaded", "round_robin")


#: Routing settings that were removed, with what replaced them: a config key or flag that still
#: names one is refused with this reason (`mlxgw.config`, `gateway.main`), not as an unknown key.
RETIRED = {
    "seed_progress": "retired: the queued figure now follows each stream's prefill progress "
                     "(`prefill_progress`, the default), which the time-based estimate counted a second time "
                     "(docs/routing.md, \"Seeding an empty backend\"); remove it",
}


@dataclass
class RoutingConfig:
    """Routing policy and weights.

    policy: ``cache_aware`` (default: cost above with the balance guard),
        ``longest_prefix`` (owned prefix only, no load and no guard; the
        baseline), ``least_loaded`` (load only), ``round_robin``.
    load_weight: cost per token of load on the backend (0: load only breaks
        ties and trips the guard; see docs/routing.md for the measurements).
    decode_weight: prefill-token equivalent of one running decode, in the
        load figure.
    balance_abs_tokens / balance_rel: the balance guard's thresholds.
    affinity_slack_tokens: how much costlier than the best a session's own
        backend may be and still be chosen.
    heartbeat_load: also count the backends' heartbeat load figures.
    pending_grace: seconds a routed prefix still counts as owned after its
        request ended (`gateway.pending`; 0 since session 47, 1 before: the
        backend's reports land before its answer ends, so a claim kept past the
        end can only be stale, and an owner whose cache keeps nothing looked as
        if it held each conversation's last turn: docs/routing.md).
    short_claims: count a prefix a backend is only computing at any length,
        not only from its ``min_hit_tokens`` on (the rule before; for A/B runs).
    placement_slack_tokens: how much costlier than the best a backend may be
        and still take a prompt because its cache evicts an older entry (0,
        the default: placement off; measured not to pay, docs/routing.md).
    seed_empty: let an idle backend holding no prefix of the request take one whose cheapest
        backend is busier than the prefix it would reuse (module docstring;
        False: the rule before, for A/B runs).
    seed_claim_factor: past a prefix the cheapest backend is still computing (claimed, not
        saved), seeding needs its load above this many times the prefix (0: never, the rule
        of session 46; module docstring).
    seed_when_full: also seed when the cheapest backend has a request in flight for each of
        its decode slots, whatever the prefix (False: the rule before session 48).
    seed_beside: in that comparison, charge a request whose remainder starts beside the chosen
        backend's running prefill (``Candidate.prefill_beside_tokens``) the steps to its first
        token and one prefill chunk per step of its answer (``max_tokens``) while that prefill
        lasts, weighed by the chunks' depth, not the whole queue (`seed_wait`; opt-in, session 53;
        docs/routing.md).
    prefill_progress: count a streamed request's prefill tokens in this gateway's ``queued``
        figure down by its backend's progress comments (`schema.progress_comment`, one a prefill
        step) rather than whole for its first second (`gateway.proxy.InFlight`; False: the rule
        before session 54, which read a long prompt mostly done as all still to do: the
        synthetic trace lost 2-4% of its hits and 7-11% of its p99 TTFT in the sim,
        docs/routing.md).
    slot_wait_weight: cost per token of the chosen backend's wait for a decode slot when it
        has none free, against backends with compute to spare ("The wait for a decode slot" in
        the module docstring; 0: none, the rule before session 49).
    """

    policy: str = "cache_aware"
    load_weight: float = 0.03
    decode_weight: float = 256.0
    balance_abs_tokens: int = 262144
    balance_rel: float = 2.0
    affinity_slack_tokens: int = 256
    heartbeat_load: bool = False
    pending_grace: float = 0.0
    short_claims: bool = False
    placement_slack_tokens: int = 0
    seed_empty: bool = True
    seed_claim_factor: float = 2.0
    seed_when_full: bool = True
    seed_beside: bool = False
    prefill_progress: bool = True
    slot_wait_weight: float = 1.0
    _turn: itertools.count = field(default_factory=itertools.count, repr=False, compare=False)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; one of {', '.join(POLICIES)}")


@dataclass
class Scored:
    """One candidate with its routing figures (tokens)."""

    cand: Candidate
    matched: int
    prefill: int
    queued: int
    active: int
    cost: float
    load: float = 0.0
    overloaded: bool = False
    free_cache: int = 0
    tiebreak: int = 0
    evicts: bool = False
    wait: float = 0.0  # its wait for a decode slot, in prefill tokens, when it has none free (`_relieve`)
    # The seeding rule's charge here when it is not the load (`seed_wait` with --seed-beside):
    # shown, as helper-96 read a move past load < matched as a broken rule.
    seed_charge: float = 0.0

    def explain(self) -> str:
        flag = (",overloaded" if self.overloaded else "") + (",evicts" if self.evicts else "")
        wait = f",wait={self.wait:.0f}" if self.wait else ""
        wait += f",seed_wait={self.seed_charge:.0f}" if self.seed_charge else ""
        return (
            f"{self.cand.backend_id}:matched={self.matched},queued={self.queued},"
            f"active={self.active},load={self.load:.0f}{wait},cost={self.cost:.0f}{flag}"
        )


@dataclass
class Decision:
    """Candidates ranked best first (empty when none is live)."""

    ranked: list[Scored] = field(default_factory=list)
    reason: str = ""  # "prefix", "load", "wait", "seed", "placement", "affinity", "balance", "round_robin"

    @property
    def best(self) -> Optional[Scored]:
        return self.ranked[0] if self.ranked else None


def _hash(key: str, backend_id: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}|{backend_id}".encode())


def servable_blocks(c: Candidate, pending_blocks: int, block_size: int, short_claims: bool = False) -> int:
    """The prefix of the request (blocks) backend ``c`` can serve it from: its saved
    copy, or the longer prefix it is computing (Redis claim or ``pending_blocks``, this
    gateway's pending claim) when that reaches the backend's ``min_hit_tokens`` (any
    length with ``short_claims``)."""
    computing = max(c.depth_blocks, pending_blocks)
    if computing > c.saved_blocks and (short_claims or computing * block_size >= c.min_hit_tokens):
        return computing
    return c.saved_blocks


def slot_wait(c: Candidate, active: int) -> float:
    """The wait for a decode slot on ``c`` of a request sent now, in tokens of prefill ``c``
    does meanwhile: ``(active - decode_slots + 1) / decode_slots * decode_seconds * prefill_tps``
    with ``active`` requests in flight there (the gateways' count), 0 below the slots or while
    any of those figures is unpublished or unmeasured (module docstring)."""
    slots = c.decode_slots
    if slots <= 0 or active < slots or c.decode_seconds <= 0 or c.prefill_tps <= 0:
        return 0.0
    return (active - slots + 1) / slots * c.decode_seconds * c.prefill_tps


def _order(s: Scored) -> tuple:
    return (s.overloaded, s.cost, s.active, -s.free_cache, s.tiebreak)


def spare_slots(slots: int) -> int:
    """The decode slots a backend may have in use and still count as having compute to spare (a
    quarter of its ``slots``, rounded down; 0 when it publishes none): `_spare` here, and the
    status CLI's line on an idle backend beside a busy one."""
    return slots // 4


def _spare(s: Scored) -> bool:
    """``s`` has compute to spare: no prompt queued and at most a quarter of its decode slots in
    use (none when it publishes no slots), in the gateways' figures and its own heartbeat's."""
    c = s.cand
    return (not s.overloaded and s.queued == 0 and c.queued_prefill_tokens == 0
            and max(s.active, c.active) <= spare_slots(c.decode_slots))


def _relieve(out: list[Scored], weight: float) -> Optional[Scored]:
    """A backend with compute to spare to take the request from ``out[0]`` (the choice so far,
    after placement, affinity and seeding), which has no decode slot free for it, or None: the
    cheapest spare one whose cost is under ``out[0]``'s plus ``weight`` times its wait for a slot
    (`slot_wait`). Each backend's wait is stored in ``wait`` and shown, at any weight, never
    added to its cost, so the candidates' costs stay comparable and a request that waits says
    so (helper-90; helper-91 read a chosen owner's cost with its wait beside a full peer's
    without as the dearer one chosen). Only a spare backend: the prefill a move adds costs
    nothing there, while on a busy one it delays the prompts queued there (counting the wait
    against every backend, or against their queued prefill too, moved conversation-trace turns
    off their owners for no TTFT gain; docs/routing.md, "The wait for a decode slot")."""
    for s in out:
        s.wait = slot_wait(s.cand, s.active)
    best = out[0]
    if best.wait <= 0 or weight <= 0:
        return None
    spare = [s for s in out[1:] if _spare(s) and s.cost < best.cost + weight * best.wait]
    return min(spare, key=_order) if spare else None


#: Steps of the owner's running prefill a request kept beside it waits for its first token:
#: half the step under way, its own step (its chunk beside the running one) and the first decode
#: step (beside the next chunk). helper-94 measured 2.5 steps on a real backend (session 52).
BESIDE_FIRST_STEPS = 2.5


def seed_wait(s: Scored, block_size: int, beside: bool = False, answer_tokens: Optional[int] = None) -> float:
    """The wait (tokens of work) the seeding rule charges a request on ``s``: the time to its
    answer's last token there, in tokens of prefill, against the prefix it would recompute on an
    idle backend. By default the backend's load (its queued prefill, behind which the request
    waits, plus its running decodes).

    With ``beside`` (opt-in, `RoutingConfig.seed_beside`), past a saved prefix, a remainder
    (``s.prefill`` tokens) of at most the backend's ``prefill_beside_tokens`` S (its
    ``step-beside`` prefill step) starts beside the queued prefill Q rather than behind it, then
    decodes one token per chunk of Q: charged the running decodes, plus, times `depth_ratio`, its
    own chunk padded to S (``min(S, Q)``), `BESIDE_FIRST_STEPS` steps of Q to its first token (the
    last its first decode step) and one chunk of Q per decode step of the rest of its answer
    (``answer_tokens - 1`` times the backend's ``decode_steps_per_token``; ``None``: as long as
    the queue). helper-94 (session 52, real backends): a 16-token turn kept beside a 7,053-token
    prefill answered after 3.4-5.3 s, moved after 0.92 s. helper-95 (session 53): without
    `depth_ratio` a 4-token turn past 4,160 cached tokens stayed and answered later (TTFT
    1.48-1.93 s against 1.34-1.42 s, E2E 2.85-3.22 s against 1.34-1.43 s moved): the owner's
    chunks, 4-8k tokens deep, took ~2.7 times a fresh chunk's time. The idle backend's own decode
    steps, short beside a prefill chunk, are left out."""
    c = s.cand
    queued = s.queued
    decode = max(0.0, s.load - s.queued)
    step = c.prefill_beside_tokens
    if (beside and 0 < s.prefill <= step and c.saved_blocks * block_size >= s.matched):
        first = min(queued, BESIDE_FIRST_STEPS * step)
        rest = max(0.0, queued - first)
        if answer_tokens is not None:
            rest = min(rest, max(0, answer_tokens - 1) * max(c.decode_steps_per_token, 1.0) * step)
        return decode + (min(step, queued) + first + rest) * depth_ratio(s.matched, c.attention_parity_tokens)
    return decode + queued


def depth_ratio(depth: int, parity: int) -> float:
    """What a prefill token ``depth`` tokens deep costs against the mean token of a fresh prompt
    ``depth`` tokens long: ``(1 + depth/P) / (1 + depth/(2P))`` with the backend's attention
    parity ``P`` (`backend.attention`; 1 when 0, unknown). The seeding estimate weighs the owner's
    chunks, taken to sit as deep as the request's own prefix, against the prefix a move
    recomputes from depth 0 by it: on the demo model (P = 360) a 4,160-token prefix gives 1.85,
    where helper-95 measured ~2.7 for chunks 4-8k deep against a fresh 4,200-token prompt."""
    if parity <= 0 or depth <= 0:
        return 1.0
    return (1 + depth / parity) / (1 + depth / (2 * parity))


def _seed(out: list[Scored], block_size: int, claim_factor: float, when_full: bool = True,
          beside: bool = False, answer_tokens: Optional[int] = None) -> Optional[Scored]:
    """An idle backend holding no prefix of the request to take it instead of ``out[0]`` (the
    choice so far), or None: see "Seeding" in the module docstring. Empty (of this request):
    no prefix of it saved or claimed there (helper-86: requiring an empty cache left a backend
    holding one unrelated 32-token entry idle for 6 minutes beside a busy peer); idle: no load
    in the gateways' figures nor in its own heartbeat. The request's wait on the chosen backend
    (`seed_wait`: its load; with ``beside``, opt-in, its answer's steps beside a running prefill)
    must exceed the prefix it would reuse there. Past a prefix the chosen backend only claims
    (still computing it), its load must exceed ``claim_factor`` times the prefix (0: never;
    `RoutingConfig.seed_claim_factor`). With ``when_full``, a chosen backend with a request in
    flight for each of its decode slots is passed whatever its load and prefix."""
    best = out[0]
    if best.matched <= 0:
        return None
    slots = best.cand.decode_slots
    if not (when_full and slots > 0 and best.active >= slots):
        charge = seed_wait(best, block_size, beside, answer_tokens)
        if round(charge) != round(best.load):
            best.seed_charge = charge
        if charge <= best.matched:
            return None
        if best.cand.saved_blocks * block_size < best.matched and (
                claim_factor <= 0 or best.load <= claim_factor * best.matched):
            return None
    for s in out[1:]:
        c = s.cand
        if (not s.overloaded and s.load == 0 and s.matched == 0 and c.depth_blocks == 0
                and c.active == 0 and c.queued_prefill_tokens == 0):
            return s
    return None


def _eviction_key(s: Scored) -> tuple:
    # Room first (most free), then the oldest next victim. The queued prompts' KV is
    # not in the published figures yet; when it already overflows the free room, the
    # published victim is as good as gone and what goes next is unknown: such a backend
    # ranks after those whose victim is still there, and among themselves by cost (the
    # stable min), which keeps a burst of cold prompts from piling onto one backend
    # whose victim looked oldest. A backend that publishes no victim (0) ranks last.
    if not s.evicts:
        return (0, -s.free_cache)
    if s.queued * s.cand.kv_bytes_per_token > s.free_cache:
        return (2, 0.0)
    return (1, s.cand.victim_used_at or float("inf"))


def _place(out: list[Scored], slack: int) -> Scored:
    """The eviction-aware choice among ``out`` (ranked by cost): see the module docstring."""
    best = out[0]
    if slack <= 0 or not best.evicts or best.overloaded:
        return best
    near = [s for s in out if not s.overloaded and s.matched == best.matched and s.cost <= best.cost + slack]
    return min(near, key=_eviction_key)  # min is stable: best wins ties


def rank(
    candidates: list[Candidate],
    prompt_tokens: int,
    block_size: int,
    inflight: Optional[dict[str, tuple[int, int]]] = None,
    first_block: str = "",
    cfg: Optional[RoutingConfig] = None,
    session: Optional[str] = None,
    pending: Optional[dict[str, int]] = None,
    answer_tokens: Optional[int] = None,
) -> Decision:
    """Rank live backends for one request.

    Args:
        candidates: from the Redis lookup (``depth_blocks`` is 0 when the
            lookup was skipped or failed: load-only routing; ``gw_*`` carry
            the other gateways' published in-flight work).
        prompt_tokens: request length in tokens.
        block_size: tokens per block.
        inflight: backend id -> (requests, fresh prefill tokens) in flight
            from this gateway.
        first_block: hex key of the prompt's first block (stable tie-break),
            "" if the prompt is shorter than a block.
        cfg: policy and weights.
        session: the client's session key, if any (affinity tie-break).
        pending: backend id -> prefix depth in blocks this gateway routed
            there and the backend has not reported yet (`gateway.pending`).
        answer_tokens: the most tokens the answer may take (the request's ``max_tokens``, capped
            to the context), None when unbounded; the seeding rule's estimate reads it (`seed_wait`).
    """
    cfg = cfg or RoutingConfig()
    inflight = inflight or {}
    pending = pending or {}
    out: list[Scored] = []
    for c in candidates:
        if c.state not in ("ready", ""):
            continue
        matched = min(servable_blocks(c, pending.get(c.backend_id, 0), block_size, cfg.short_claims) * block_size,
                      max(prompt_tokens - 1, 0))
        own_req, own_tok = inflight.get(c.backend_id, (0, 0))
        if cfg.heartbeat_load:
            queued = max(c.queued_prefill_tokens, own_tok + c.gw_prefill_tokens)
            active = max(c.active, own_req + c.gw_requests)
        else:
            queued = own_tok + c.gw_prefill_tokens
            active = own_req + c.gw_requests
        load = queued + cfg.decode_weight * active
        prefill = prompt_tokens - matched
        cost = prefill + cfg.load_weight * load
        tb = _hash(first_block, c.backend_id)
        # Would storing this prompt's new tokens, after the queued ones, make the cache evict?
        evicts = c.kv_bytes_per_token > 0 and c.free_cache_bytes < (queued + prefill) * c.kv_bytes_per_token
        out.append(Scored(c, matched, prefill, queued, active, cost, load, False, c.free_cache_bytes, tb, evicts))
    if not out:
        return Decision([], "none")

    if cfg.policy == "round_robin":
        out.sort(key=lambda s: s.cand.backend_id)
        i = next(cfg._turn) % len(out)
        return Decision(out[i:] + out[:i], "round_robin")
    if cfg.policy == "least_loaded":
        out.sort(key=lambda s: (s.load, s.active, -s.free_cache, s.tiebreak))
        return Decision(out, "load")
    if cfg.policy == "longest_prefix":
        out.sort(key=lambda s: (-s.matched, s.tiebreak))
        return Decision(out, "prefix" if out[0].matched else "hash")

    least = min(s.load for s in out)
    for s in out:
        s.overloaded = s.load - least > cfg.balance_abs_tokens and s.load > cfg.balance_rel * least
    out.sort(key=_order)
    reason = "prefix" if out[0].matched else "load"
    if any(s.overloaded for s in out) and max(out, key=lambda s: s.matched).overloaded and not out[0].overloaded:
        reason = "balance"
    placed = _place(out, cfg.placement_slack_tokens)
    if placed is not out[0]:
        out.remove(placed)
        out.insert(0, placed)
        reason = "placement"
    if session:
        best = out[0]
        near = [s for s in out if not s.overloaded and s.cost <= best.cost + cfg.affinity_slack_tokens]
        pick = max(near, key=lambda s: _hash(session, s.cand.backend_id)) if near else best
        if pick is not best:
            out.remove(pick)
            out.insert(0, pick)
            reason = "affinity"
    seeded = (_seed(out, block_size, cfg.seed_claim_factor, cfg.seed_when_full, cfg.seed_beside,
                    answer_tokens) if cfg.seed_empty else None)
    if seeded is not None:
        out.remove(seeded)
        out.insert(0, seeded)
        reason = "seed"
    spare = _relieve(out, cfg.slot_wait_weight)
    if spare is not None:
        out.remove(spare)
        out.insert(0, spare)
        reason = "wait"
    return Decision(out, reason)
