cd /tmp/benchF
for T in conversation synthetic; do
PYTHONPATH=/tmp/benchF /tmp/fresh1/.venv/bin/python -u bench/replay_routers.py --trace /work/shared/traces/${T}_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,mlxgw-f25,pooled --backend-variant 'mlxgw-f25=--cache-floor-share 0.25' --repeat 3 --out-dir /tmp/benchF/out/$T > /tmp/benchF/out/$T.log 2>&1
done
echo done > /tmp/benchF/out/DONE
