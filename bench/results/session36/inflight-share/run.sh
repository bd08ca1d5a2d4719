# Session 36: --max-inflight-share (admit a request only while the KV in flight plus its prompt's
# stays within that share of the cache budget) on sim backends, from clean clones.
# At 1f05258, both traces, shares 0.5 and 0.8 against none and the pooled cache:
for T in conversation synthetic; do
python bench/replay_routers.py --trace ../shared/traces/${T}_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,mlxgw-m50,mlxgw-m80,pooled --backend-variant 'mlxgw-m50=--max-inflight-share 0.5' --backend-variant 'mlxgw-m80=--max-inflight-share 0.8' --repeat 3
done
# At 0cb2d49, conversation, shares 0.8 and 1 against none, sglang-router and the pooled cache:
python bench/replay_routers.py --trace ../shared/traces/conversation_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,mlxgw-m80,mlxgw-m100,sglang,pooled --backend-variant 'mlxgw-m80=--max-inflight-share 0.8' --backend-variant 'mlxgw-m100=--max-inflight-share 1' --repeat 3
