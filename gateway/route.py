"""The routing policy: a pure function from candidates to a ranked choice.

Cost of sending a request to backend ``b`` (in tokens of work):

    cost(b) = prefill(b) + load_weight * queued(b) + decode_weight * active(b)

* ``prefill(b) = prompt_tokens - matched(b)``: the prompt tokens ``b`` would
  still have to compute, ``matched(b)`` being its owned prefix from Redis
  (capped at ``prompt_tokens - 1``: one token is always prefilled).
* ``queued(b)``: prefill tokens already waiting on ``b`` (its heartbeat, or
  the gateways' own in-flight counters when those are larger: they are
  fresher).
* ``active(b)``: running requests; each decode step is shared, so a running
  request costs ``decode_weight`` tokens of prefill-equivalent delay.

Other policies (``RoutingConfig.policy``, for comparison benchmarks):
``round_robin`` (backends in id order, one after the other) and
``least_loaded`` (fewest running requests, then fewest queued prefill
tokens); both ignore the owned prefix.

Ties (cold prompts especially) go to the backend with fewer active requests,
then the one with the most free cache (so cold prompts spread over every
backend's memory instead of piling onto the first; sglang issue 32983), then
a rendezvous hash of the prompt's first block, stable across gateways.
Weights: ``docs/routing.md``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import xxhash

from mlxgw.schema import Candidate


@dataclass
class RoutingConfig:
    """Weights of the cost function.

    load_weight: cost per queued prefill token on the backend. 1.0 means a
        queued token delays us as much as one we must compute ourselves.
        Default 0: longest owned prefix wins and load only breaks ties. On
        the 300-request replay (README) any positive weight we tried moved
        requests off their prefix owners on a saturated 2-core machine and
        cost 13-30% of the oracle hit ratio, because diverting adds the
        matched tokens to the total work; a load-aware default needs the
        balance thresholds of the routing issue, measured, not guessed.
    decode_weight: prefill-token equivalent of one running decode (default 0,
        same reason).
    policy: one of `POLICIES`.
    """

    load_weight: float = 0.0
    decode_weight: float = 0.0
    policy: str = "cost"
    _turn: itertools.count = field(default_factory=itertools.count, repr=False, compare=False)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; one of {', '.join(POLICIES)}")


#: ``cost`` is the default; the others exist to be measured against it.
POLICIES = ("cost", "round_robin", "least_loaded")


@dataclass
class Scored:
    """One candidate with its routing figures (tokens)."""

    cand: Candidate
    matched: int
    prefill: int
    queued: int
    active: int
    cost: float
    free_cache: int = 0
    tiebreak: int = 0

    def explain(self) -> str:
        return (
            f"{self.cand.backend_id}:matched={self.matched},queued={self.queued},"
            f"active={self.active},cost={self.cost:.0f}"
        )


@dataclass
class Decision:
    """Candidates ranked best first (empty when none is live)."""

    ranked: list[Scored] = field(default_factory=list)

    @property
    def best(self) -> Optional[Scored]:
        return self.ranked[0] if self.ranked else None


def rank(
    candidates: list[Candidate],
    prompt_tokens: int,
    block_size: int,
    inflight: Optional[dict[str, tuple[int, int]]] = None,
    first_block: str = "",
    cfg: Optional[RoutingConfig] = None,
) -> Decision:
    """Rank live backends by cost for one request.

    Args:
        candidates: from the Redis lookup (``depth_blocks`` may be 0 when the
            lookup was skipped or failed: load-only routing).
        prompt_tokens: request length in tokens.
        block_size: tokens per block.
        inflight: backend id -> (requests, prefill tokens) in flight from
            this gateway's view (all gateways' when published).
        first_block: hex key of the prompt's first block (for the stable
            tie-break), "" if the prompt is shorter than a block.
        cfg: weights.
    """
    cfg = cfg or RoutingConfig()
    inflight = inflight or {}
    out = []
    for c in candidates:
        if c.state not in ("ready", ""):
            continue
        matched = min(c.depth_blocks * block_size, max(prompt_tokens - 1, 0))
        gw_req, gw_tok = inflight.get(c.backend_id, (0, 0))
        queued = max(c.queued_prefill_tokens, gw_tok)
        active = max(c.active, gw_req)
        prefill = prompt_tokens - matched
        cost = prefill + cfg.load_weight * queued + cfg.decode_weight * active
        tb = xxhash.xxh3_64_intdigest(f"{first_block}|{c.backend_id}".encode())
        out.append(Scored(c, matched, prefill, queued, active, cost, c.free_cache_bytes, tb))
    if cfg.policy == "round_robin" and out:
        out.sort(key=lambda s: s.cand.backend_id)
        k = next(cfg._turn) % len(out)
        out = out[k:] + out[:k]
    elif cfg.policy == "least_loaded":
        out.sort(key=lambda s: (s.active, s.queued, s.tiebreak))
    else:
        out.sort(key=lambda s: (s.cost, s.active, -s.free_cache, s.tiebreak))
    return Decision(out)
