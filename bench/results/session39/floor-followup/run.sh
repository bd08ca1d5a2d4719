# Session 39: the cache floor's unowned losses followed (synthetic 0.2, two rounds).
# From a clean clone of a668273 plus a scratch log line in backend/cache.py
# (`_add`, `_remove`, `trim_to`: one INFO line per insert, eviction and trim; not committed).
cd /tmp/benchG
MLXGW_TEST_LOGS=/tmp/benchG/logs PYTHONPATH=/tmp/benchG /tmp/fresh1/.venv/bin/python -u bench/replay_routers.py \
  --trace /work/shared/traces/synthetic_trace.jsonl --requests 600 --budgets 0.2 --routers mlxgw,mlxgw-f25 \
  --backend-variant 'mlxgw-f25=--cache-floor-share 0.25' --repeat 2 --overhead-probes 0 \
  --out-dir /tmp/benchG/out --dump-requests /tmp/benchG/out/req.jsonl
