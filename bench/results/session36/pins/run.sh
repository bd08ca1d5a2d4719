# Session 36: hits pinned by reference (mlxgw, --pin-by-reference; the default then) against private
# copies (mlxgw-copy, --no-pin-by-reference) on sim backends, from clean clones at the commits named
# in the directory names; diffs.txt has each round's hit ratios (by reference minus copies).
# 8293361 (pin held its whole last segment, no free-bytes filter):
python bench/replay_routers.py --trace ../shared/traces/conversation_trace.jsonl --requests 600 --budgets 0.05,0.2,1.0 --routers mlxgw,mlxgw-copy,pooled --backend-variant 'mlxgw-copy=--no-pin-by-reference' --repeat 3
# cddf81b (whole last segment, with the filter):
python bench/replay_routers.py --trace ../shared/traces/conversation_trace.jsonl --requests 600 --budgets 0.05 --routers mlxgw,mlxgw-copy --backend-variant 'mlxgw-copy=--no-pin-by-reference' --repeat 3
# 167f0ec (the pin split at its end):
python bench/replay_routers.py --trace ../shared/traces/conversation_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,mlxgw-copy --backend-variant 'mlxgw-copy=--no-pin-by-reference' --repeat 3
# 3fb43bd (same cache code as 167f0ec), both traces:
for T in synthetic conversation; do
python bench/replay_routers.py --trace ../shared/traces/${T}_trace.jsonl --requests 600 --budgets 0.05,0.2 --routers mlxgw,mlxgw-copy --backend-variant 'mlxgw-copy=--no-pin-by-reference' --repeat 4
done
# cedf43d with a diagnostic patch (not committed): --pin-as-copy counted each pin's bytes in flight as if a copy
python bench/replay_routers.py --trace ../shared/traces/conversation_trace.jsonl --requests 600 --budgets 0.05 --routers mlxgw,mlxgw-copy,mlxgw-ascopy --backend-variant 'mlxgw-copy=--no-pin-by-reference' --backend-variant 'mlxgw-ascopy=--pin-as-copy' --repeat 4
# Since the flag is opt-in (default off), today's equivalents name the by-reference variant:
#   --routers mlxgw,mlxgw-ref --backend-variant 'mlxgw-ref=--pin-by-reference'
