#!/usr/bin/env bash
# Installs what mlxgw needs on a fresh machine: redis-server (Homebrew on
# macOS, apt-get on Debian/Ubuntu), chromium for the tests (apt-get only) and a
# virtualenv in .venv with the package.
# Usage: scripts/setup.sh [pip extras, e.g. test]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server..." >&2
  if [[ "$(uname)" == "Darwin" ]]; then
    command -v brew >/dev/null || { echo "install Homebrew (https://brew.sh) or redis-server yourself" >&2; exit 1; }
    brew install redis
  elif command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  else
    echo "please install redis-server with your package manager" >&2; exit 1
  fi
fi

# The dashboard's browser test needs Chromium: installed with the test extras on
# Debian/Ubuntu (apt-get), never for plain `serve`. Elsewhere the test skips and says why.
if [[ "${1:-}" == *test* ]] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
   && [[ "$(uname)" != "Darwin" ]] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (for the dashboard browser test)..." >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } \
    || echo "chromium install failed; the dashboard browser test will be skipped" >&2
fi

# Python 3.10+ (pyproject.toml): $PYTHON, else the first of python3 / python3.14 ... python3.10
# that is new enough (macOS's /usr/bin/python3 is 3.9).
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
  py_ok "$PY" || { echo "PYTHON=$PY is not Python 3.10 or newer" >&2; exit 1; }
else
  PY=""
  for c in python3 python3.14 python3.13 python3.12 python3.11 python3.10; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then PY=$c; break; fi
  done
  [[ -n "$PY" ]] || { echo "mlxgw needs Python 3.10 or newer: install one (e.g. brew install python@3.12)," \
                            "or point PYTHON= at it" >&2; exit 1; }
fi
if [[ ! -x .venv/bin/python ]]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    # Debian/Ubuntu ship venv separately (python3.X-venv).
    if [[ "$(uname)" != "Darwin" ]] && command -v apt-get >/dev/null 2>&1; then
      pkg="python$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
      echo "installing $pkg..." >&2
      SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
      { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$pkg" >/dev/null; } \
        || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
    fi
    "$PY" -m venv .venv || { echo "could not create .venv with $PY (python -m venv)" >&2; exit 1; }
  fi
fi
extras=${1:-}
spec="."
[[ -n "$extras" ]] && spec=".[$extras]"
# Imports go through mlxgw's guard: a bare `import mlx_lm` fails under a hard open-files
# limit below 4096 (mlx-lm issue 1589), where mlxgw itself runs fine.
IMPORT_CHECK="from mlxgw.rlimit import guard_mlx_lm_import; guard_mlx_lm_import(); import mlx_lm, aiohttp, redis"
imports_ok=1
if ! .venv/bin/python -c "$IMPORT_CHECK" >/dev/null 2>&1; then
  imports_ok=0
  echo "installing mlxgw and its dependencies into .venv (first run: mlx, mlx-lm, transformers," \
       "about 400 MB on Linux x86_64; from under a minute with a warm pip cache to a few minutes)..." >&2
fi
# A start after a finished install of the same pyproject.toml and extras skips pip (helper-92: each
# start spent ~6 s and asked PyPI again); the package is editable, so code changes need no install.
STAMP=.venv/.mlxgw-installed
key=$(.venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()
      + sys.argv[1].encode()).hexdigest())' "$spec")
if [[ $imports_ok == 1 && -f "$STAMP" ]] && grep -qxF "$key" "$STAMP"; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e "$spec" 2>&1 | grep -v -E "^(WARNING: Location|  )" >&2 || true
.venv/bin/python -c "$IMPORT_CHECK" || { echo "install failed" >&2; exit 1; }
# pip printed its errors above but exits 0 through the pipe: check the extras' own imports too
if [[ "$extras" == *test* ]]; then
  .venv/bin/python -c "import pytest, xdist, openai, anthropic" || { echo "install of the test extras failed" >&2; exit 1; }
fi
echo "$key" >> "$STAMP"
