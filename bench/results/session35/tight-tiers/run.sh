# Session 35: our gateway, sglang-router and the pooled cache in front of disk-tier backends
# whose tier holds a tenth of the working set each (the pooled backend: four backends' disk),
# memory budgets 0.05 and 0.2, 3 rounds. From the repository root of a clean clone (46a6f32).
Q='--disk-cache-dir /tmp/tierD/{backend} --disk-cache-bytes {ws_bytes*0.1}'
for T in conversation synthetic; do
python bench/replay_routers.py --trace ../shared/traces/${T}_trace.jsonl --requests 600 --budgets 0.05,0.2 \
  --routers mlxgw-diskq,sglang-diskq,pooled-diskq \
  --backend-variant "mlxgw-diskq=$Q" --backend-variant "sglang-diskq=$Q" --backend-variant "pooled-diskq=$Q" \
  --repeat 3 --out-dir OUT/$T
done
