# Session 35: chains branching inside a part (default) against only at a part's end
# (--disk-branch-share 1), memory budget 0.05, each backend's tier a tenth of the working set.
# Run from the repository root of a clean clone (commit 84d40f4); OUT is any directory.
Q='--disk-cache-dir /tmp/tierB/{backend} --disk-cache-bytes {ws_bytes*0.1}'
for T in conversation synthetic; do
python bench/replay_routers.py --trace ../shared/traces/${T}_trace.jsonl --requests 600 --budgets 0.05 \
  --routers mlxgw-diskq,mlxgw-diskq-nobranch \
  --backend-variant "mlxgw-diskq=$Q" --backend-variant "mlxgw-diskq-nobranch=$Q --disk-branch-share 1" \
  --repeat 6 --out-dir OUT/$T
done
