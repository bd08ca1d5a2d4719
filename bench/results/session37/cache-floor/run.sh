# Session 37: the experimental --cache-floor-share 0.25 (the prompt cache keeps a quarter of the
# budget whatever the KV in flight) against the default, our gateway and the pooled backend each,
# from a clean clone of 146ae41 plus the flag (committed as 2846782). Run 1 (conversation) beside
# helper-63's trial; run 2 (synthetic, then conversation) beside it and some test runs: noisy.
for T in conversation synthetic; do
python bench/replay_routers.py --trace ../shared/traces/${T}_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,mlxgw-f25,pooled,pooled-f25 --backend-variant 'mlxgw-f25=--cache-floor-share 0.25' --backend-variant 'pooled-f25=--cache-floor-share 0.25' --repeat 3
done
