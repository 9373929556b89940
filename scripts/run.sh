#!/usr/bin/env bash
# Set up (or reuse) a virtual environment with pinned versions, then run one of:
#   bash scripts/run.sh train [modelparallel train options]   # the main job (.venv, constraints.txt)
#   bash scripts/run.sh test  [pytest options]                # the whole test suite (.venv, constraints.txt)
#   bash scripts/run.sh smoke-oldest [pytest options]         # the smoke tests on the oldest supported
#                                                             # torch/transformers (.venv-oldest,
#                                                             # constraints-oldest.txt)
set -euo pipefail
cd "$(dirname "$0")/.."

# setup VENV CONSTRAINTS: create VENV if missing and install the package with its test extras at the
# versions CONSTRAINTS pins; skipped while neither file changed since the last install.
setup() {
  local venv=$1 constraints=$2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  local stamp="$venv/.modelparallel-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$constraints" -nt "$stamp" ]; then
    local torch_pin
    torch_pin=$(grep -m1 '^torch==' "$constraints")
    # torch first, exactly pinned, so no resolver reaches for another build of it
    "$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints" "$torch_pin"
    "$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints" -e ".[test,fastcrc]"
    touch "$stamp"
  fi
}

cmd=${1:-test}; shift || true
case "$cmd" in
  train|test) VENV=${MODELPARALLEL_VENV:-.venv}; setup "$VENV" constraints.txt ;;
  smoke-oldest) VENV=${MODELPARALLEL_OLDEST_VENV:-.venv-oldest}; setup "$VENV" constraints-oldest.txt ;;
  *) echo "usage: bash scripts/run.sh {train|test|smoke-oldest} [args]" >&2; exit 2 ;;
esac
case "$cmd" in
  # the run's reported times start here, not at this script's start (before the install above)
  train) MODELPARALLEL_CLI_START=$(date +%s.%N) exec "$VENV/bin/modelparallel" train "$@" ;;
  test)  exec "$VENV/bin/python" -m pytest -q "$@" ;;
  smoke-oldest)
    "$VENV/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'
    exec "$VENV/bin/python" -m pytest -q -m smoke "$@" ;;
esac
