#!/usr/bin/env bash
# Command 2 of the README: install (with test extras), then run the test suite.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
set +e
# -rs: a skipped test (e.g. the browser one without Chromium) is listed with its reason;
# --durations: the slowest tests, to watch the 10-minute budget from CI logs;
# -n: test processes (pytest-xdist; MLXGW_TEST_WORKERS=0 runs them all in this one);
# --dist loadscope keeps a module's tests in one process (some share a module-scoped backend
# and read its counters: split across processes, each half saw only its own requests);
# --no-loadscope-reorder: modules go out in collection order, the longest first (conftest.py).
# Three processes on 2 cores: most of a test's time is waiting on its real processes (start-up,
# timeouts); 762-765 tests took 605-658 s against 651-679 s with two (sessions 47-48).
.venv/bin/python -m pytest -q -rs --durations=15 -p no:cacheprovider -n "${MLXGW_TEST_WORKERS:-3}" \
    --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected": a failure for CI, never a pass.
exit $rc
