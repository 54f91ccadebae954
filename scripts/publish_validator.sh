#!/usr/bin/env bash
# Regenerate the committed validator matrix at the commit that publishes it, in one command:
# the main job (default engines), the vLLM columns, the mutation self-test (its score is published
# beside the matrix), the site data, then the checks that a clean
# rerun on this commit computes and rewrites nothing. Only stale cells are recomputed (a cell's
# inputs digest covers the code, package versions and declarations that decide it), so after an
# engine change expect the whole matrix. Commit what it leaves in reports/validator and
# visualizer-data/validation.generated.ts and history.generated.ts.
#   JOBS=2 (models validated in parallel processes, both runs)   SKIP_VLLM=1 (default engines only; the vLLM cells stay as they are)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=.venv/bin/python
if [ -n "$(git status --porcelain -- engine validator)" ]; then
  echo "publish_validator: engine/ or validator/ has uncommitted changes; commit them first (cells record" \
       "the commit they were computed at)" >&2
  exit 2
fi
start=$(date +%s)
$py -m validator run --jobs "${JOBS:-2}" --record  # --record: the dated record (reports/validator/history)
if [ -z "${SKIP_VLLM:-}" ]; then
  $py -m validator run --engines vllm,vllm-static --jobs "${JOBS:-2}" --record
fi
$py -m validator selftest  # every seeded bug must be caught: publishes reports/validator/selftest.json
$py -m validator report  # the README's "what a pass is worth" reads it
$py -m visualizer_data build --only validation,history  # the History page reads the dated records
$py -m validator run --check
[ -n "${SKIP_VLLM:-}" ] || $py -m validator run --engines vllm,vllm-static --check
$py -m validator report --check
echo "publish_validator: done in $(( ($(date +%s) - start) / 60 )) min; commit reports/validator and" \
     "visualizer-data/{validation,history}.generated.ts" >&2
git status --short -- reports/validator visualizer-data | sed -n 1,5p >&2  # sed reads it all: no SIGPIPE under pipefail
