#!/usr/bin/env bash
# The committed CPU sweeps, rerun and published in one command (after any change to engine code):
# the tiny twin (framework overhead) and the real-size SmolLM2-135M twin (real shape), then publish
# and the --check that the committed outputs match the new cells, then the server against stock
# `vllm serve` on the real-size twin (reports/serve/load-latest.md), so both land at one commit.
#
#   bash benchmarks/cpu.sh             # over an hour on the idle 2-core dev machine (the real-size sweep 24 min
#                                      # with its lead-ins, 2026-12-07; the server 20)
#   SKIP_REAL=1 bash benchmarks/cpu.sh # the tiny sweep only (about 10 minutes)
#   SKIP_SERVE=1 bash benchmarks/cpu.sh # the sweeps without the server benchmark
#   SKIP_READOUT=1 ...                   # without the SAE readout against raw capture sweep (about 5 minutes)
#   SKIP_STEP_COST=1 ...                 # without benchmarks/step_cost.py (vLLM's step cost, issue 52)
#   RERUN=1 ...                          # each sweep run twice, the second into reports/benchmarks/reruns/: a
#                                        # ratio the rerun does not reproduce is published as unresolved
#                                        # (benchmarks/ratios.py); without it, the reruns of the sweeps run here
#                                        # are deleted (a rerun of an older sweep reproduces nothing of this one)
#
# Each sweep replaces its folder under reports/benchmarks/sweeps/; commit first (a sweep records the
# commit it ran at, '+dirty' when the tree had changes). Knobs: TINY_ROUNDS, REAL_ROUNDS,
# REAL_MODEL, REAL_WORKLOADS, SERVE_ROUNDS. The sweeps include the vLLM variants, so they are timed on the wall
# clock: run them on an otherwise idle machine (the sweep warns when it is not, and every sample
# records the machine's load). 9 rounds is the fewest whose 95% interval for a median leaves out the
# fastest and the slowest round.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TINY_ROUNDS=${TINY_ROUNDS:-15}
REAL_ROUNDS=${REAL_ROUNDS:-9}
SERVE_ROUNDS=${SERVE_ROUNDS:-9}
REAL_MODEL=${REAL_MODEL:-HuggingFaceTB/SmolLM2-135M}
# what the headline ratios need; lens, capture_one and steer one layer only add minutes at this size
REAL_WORKLOADS=${REAL_WORKLOADS:-decode,concurrency8,prefill,capture_all,capture_gen,capture_gen8,steer_all,long_prefill,long_capture}
START=$(date +%s)
stamp() { echo "== $1 after $(( $(date +%s) - START )) s"; }

RERUNS=reports/benchmarks/reruns
# one sweep ($1: its name; the rest: benchmarks run's arguments), then with RERUN=1 the same again as its rerun
sweep() {
  local name=$1
  shift
  rm -rf "${RERUNS:?}/$name"
  "$PY" -m benchmarks run "$@" --sweep "$name"
  if [ -n "${RERUN:-}" ]; then
    "$PY" -m benchmarks run "$@" --sweep "$name" --sweeps "$RERUNS"
  fi
}
if [ -z "${SKIP_REAL:-}" ]; then
  "$PY" -m engine.zoo build --size real "$REAL_MODEL"
  sweep cpu-smollm2-135m-real --model "$REAL_MODEL" --size real --rounds "$REAL_ROUNDS" --warmups 1 \
    --workloads "$REAL_WORKLOADS"
  stamp "real-size sweep"
fi
if [ -z "${SKIP_READOUT:-}" ]; then
  # raw capture of resid_post at every layer against an SAE top-k readout at the same points, during
  # generation, with bytes per token (its own sweep: the real-size sweep above keeps its folder)
  "$PY" -m engine.zoo build --size real "$REAL_MODEL"
  sweep cpu-smollm2-135m-real-readout --model "$REAL_MODEL" --size real --rounds "${READOUT_ROUNDS:-$REAL_ROUNDS}" \
    --warmups 1 --variants eager,vllm,vllm-generate --workloads decode,capture_gen,readout_gen
  stamp "readout sweep"
fi
sweep cpu-llama-3.2-1b-tiny --rounds "$TINY_ROUNDS"
stamp "tiny sweep"
if [ -z "${SKIP_STEP_COST:-}" ]; then
  # what a vLLM worker's step costs around its forward (capture, a steer at every layer, a readout against
  # plain decode; ms a token, host us and ops a step), at 30 and 2 layers, 1 and 8 streams (issue 52)
  mkdir -p reports/benchmarks/step-cost
  for spec in "vllm-static $REAL_MODEL real smollm2-135m-real" "vllm $REAL_MODEL real smollm2-135m-real" \
              "vllm-static meta-llama/Llama-3.2-1B tiny llama-3.2-1b-tiny"; do
    read -r backend model size tag <<< "$spec"
    "$PY" -m benchmarks.step_cost --backend "$backend" --model "$model" --size "$size" --streams 1,8 \
      --rounds "$REAL_ROUNDS" --json "reports/benchmarks/step-cost/$backend-$tag.json" \
      --md "reports/benchmarks/step-cost/$backend-$tag.md"
  done
  stamp "step cost"
fi
"$PY" -m benchmarks publish
"$PY" -m benchmarks publish --check
"$PY" -m visualizer_data build --only benchmarks,history   # the site data of the same cells, and the dated record publish just left
"$PY" -m visualizer_data build --only benchmarks,history --check
stamp "published"
if [ -z "${SKIP_SERVE:-}" ]; then
  "$PY" -m benchmarks.serve_load --model "$REAL_MODEL" --size real --rounds "$SERVE_ROUNDS" --requests 16
  stamp "server load"
fi
