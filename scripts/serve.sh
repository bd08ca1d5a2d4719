#!/usr/bin/env bash
# Command 1 of the README: install, then run the gateway with backends.
# Arguments go to `mlxgw serve` (default: demo model, 2 backends, embedded Redis).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/mlxgw serve "$@"
