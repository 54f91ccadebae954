#!/usr/bin/env bash
# Create .nnterp-ref/: nnterp and the nnsight 0.7.0 it needs (nnsight 0.8 removed a module nnterp 1.3.0 imports; .venv
# has 0.8.1), plus what they import that .venv lacks, installed with --no-deps from the pins in
# scripts/nnterp_reference.txt. The validator's nnterp column runs in a child process with this directory first on
# sys.path (validator/engines/child.py); tests/test_mappers_nnterp.py runs nnterp with it first on PYTHONPATH.
#
#   bash scripts/nnterp_reference.sh                  # from the registry; idempotent (skips pip when the stamp matches)
#   bash scripts/nnterp_reference.sh --wheels DIR     # offline, every wheel in DIR (the GPU machine: benchmarks/device.sh)
#
# scripts/setup.sh runs it. Seven wheels, about 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=.nnterp-ref
stamp=$DIR/.stamp
wheels=
case "${1:-}" in
  "") ;;
  --wheels) wheels=${2:?nnterp_reference: --wheels needs a folder of wheels} ;;
  -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
  *) echo "nnterp_reference: unknown option $1; use --wheels DIR or nothing" >&2; exit 2 ;;
esac
want=$(grep -v '^[[:space:]]*#' scripts/nnterp_reference.txt | xargs)
if [ -z "$wheels" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$DIR"
mkdir -p "$DIR"
if [ -n "$wheels" ]; then
  echo "nnterp_reference: installing the wheels in $wheels into $DIR (--no-deps, no index)" >&2
  set -- --no-index "$wheels"/*.whl
else
  echo "nnterp_reference: installing $want into $DIR (--no-deps)" >&2
  # shellcheck disable=SC2086
  set -- $want
fi
if ! "$PY" -m pip install -q --no-deps --no-compile --target "$DIR" "$@" > "$DIR/pip.log" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$DIR/pip.log" | tail -20 >&2
  echo "nnterp_reference: pip failed (log: $DIR/pip.log)" >&2
  exit 1
fi
# nnsight and nnterp must come from here, at the pinned versions, with .venv (and any PYTHONPATH) behind them
PYTHONPATH=$DIR${PYTHONPATH:+:$PYTHONPATH} "$PY" - "$PWD/$DIR" $want <<'PYEOF'
import sys
from importlib import metadata
side, pins = sys.argv[1], dict(p.split("==") for p in sys.argv[2:])
import nnsight, nnterp  # noqa: E401,E402
for mod in (nnsight, nnterp):
    assert mod.__file__.startswith(side + "/"), f"nnterp_reference: {mod.__name__} resolved to {mod.__file__}, not {side}"
    got = metadata.version(mod.__name__)
    assert got == pins[mod.__name__], f"nnterp_reference: {mod.__name__} {got} in {side}, the pin is {pins[mod.__name__]}"
PYEOF
echo "$want" > "$stamp"
