#!/usr/bin/env bash
# Set up a virtual environment and run te_fuser's main job or its tests.
#   bash scripts/dev.sh main [args]   train a small model through a schedule of recipes
#   bash scripts/dev.sh test [args]   run the test suite
# A python3 that already has torch >= 2.11 (a GPU machine) is reused through a
# venv with system site packages; otherwise the CPU build torch==2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TE_FUSER_VENV:-.venv}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    if python3 -c 'import sys, torch; v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
      python3 -m venv --system-site-packages "$VENV"
    else
      python3 -m venv "$VENV"
    fi
  fi
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    "$VENV/bin/pip" install -q torch==2.13.0
  fi
  "$VENV/bin/pip" install -q -e '.[test]'
}

cmd=${1:-test}
shift || true
setup
case "$cmd" in
  main) exec "$VENV/bin/python" -m te_fuser "$@" ;;
  test) exec "$VENV/bin/python" -m pytest -q tests "$@" ;;
  *) echo "usage: bash scripts/dev.sh {main|test} [args]" >&2; exit 2 ;;
esac
