#!/usr/bin/env bash
# Set up (or reuse) .venv with the pinned environment, then run one of:
#   bash scripts/run.sh train [modelparallel train options]   # the main job
#   bash scripts/run.sh test  [pytest options]                # the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MODELPARALLEL_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.modelparallel-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # torch first, exactly pinned, so no resolver ever reaches for a CUDA build
  "$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt "torch==2.13.0"
  "$VENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e ".[test,fastcrc]"
  touch "$stamp"
fi
cmd=${1:-test}; shift || true
case "$cmd" in
  # the run's reported times start here, not at this script's start (before the install above)
  train) MODELPARALLEL_CLI_START=$(date +%s.%N) exec "$VENV/bin/modelparallel" train "$@" ;;
  test)  exec "$VENV/bin/python" -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/run.sh {train|test} [args]" >&2; exit 2 ;;
esac
