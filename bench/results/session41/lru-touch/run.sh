# Session 41: the LRU touch floor (c84e3db) side by side with the commit before it, one round,
# both replays running at the same time on the shared 2-core box (old = a clone at 2bee0d0,
# new = a clone at ff0ccde); each from its own clone:
#   cd /tmp/abX && PYTHONPATH=/tmp/abX MLXGW_CACHE_DIR=/tmp/abX/cache python -u bench/replay_routers.py \
#     --trace ../shared/traces/TRACE_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,pooled \
#     --repeat 1 --out-dir OUT
# Hit ratio (old -> new): conversation 0.05 mlxgw 0.0317 -> 0.0322, pooled 0.0358 -> 0.0360;
# 0.2 mlxgw 0.0613 -> 0.0607, pooled 0.0595 -> 0.0567 (the pooled cache's two values of session 37's
# rounds, 0.0567 / 0.0596); synthetic 0.05 mlxgw 0.0064 -> 0.0083, pooled 0.0083 each; 0.2 level
# (0.0314, 0.0357). One round each: within the round-to-round spread; the trace replay has no
# chat template, so short chance matches are rare there.
