#!/usr/bin/env bash
# The GPU run, in one script, for a CUDA machine with no model hub (everything offline), within a
# device-time budget: real-size twins of the headline models, the gpu-marked tests, the vLLM /
# vllm-static validator columns, the headline sweep (1 stream and 8 concurrent; eager, vllm,
# vllm-static, vllm-generate; 512-token prompt, 128 new tokens), the server against stock `vllm serve`,
# then publish.
#
#   bash benchmarks/gpu.sh                       # on the GPU machine, from the repository root
#
# Each phase gets what is left of BUDGET_S and is skipped, saying so, when less than its estimate is
# left; sweeps run one model at a time in SWEEP_MODELS order and publish whatever finished. Every
# knob is an environment variable, so the same script runs on CPU with a tiny model as its test:
#
#   DEVICE=cpu SIZE=tiny MODELS=meta-llama/Llama-3.2-1B PROMPT=32 NEW=4 ROUNDS=6 SKIP_TESTS=1 \
#     SKIP_VALIDATOR=1 SKIP_SERVE=1 OUT=/tmp/gpu-smoke PUBLISH_ARGS="--readme /tmp/R.md --out /tmp/o" SITE_ARGS="--out /tmp/s" \
#     bash benchmarks/gpu.sh
#
# Needs: .venv (or PY) with CUDA torch and vLLM for CUDA (`bash scripts/setup.sh --cuda`); the zoo cache
# is built here, so no hub is needed (REAL=1 sweeps the real checkpoints of the local HF cache instead).
# A GPU machine without vLLM or a registry: benchmarks/device.sh.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-real}
MODELS=${MODELS:-"google/gemma-2-2b Qwen/Qwen3-4B meta-llama/Llama-3.1-8B"}
SWEEP_MODELS=${SWEEP_MODELS:-$MODELS}
VARIANTS=${VARIANTS:-eager,vllm,vllm-static,vllm-generate}
# stock-relative vLLM ratios at 1, 8 and 32 streams (capture and steering), and the readout at 1
WORKLOADS=${WORKLOADS:-decode,concurrency8,concurrency32,capture_gen,capture_gen8,capture_gen32,steer_all,steer_all8,steer_all32,readout_gen}
PROMPT=${PROMPT:-512}
NEW=${NEW:-128}
ROUNDS=${ROUNDS:-6}
MIN_SAMPLE=${MIN_SAMPLE:-0.5}
BUDGET_S=${BUDGET_S:-570}                 # the device time this script may use, in seconds
OUT=${OUT:-reports/benchmarks/sweeps}     # sweeps root; publish reads every sweep under it
VALIDATOR_OUT=${VALIDATOR_OUT:-/tmp/gpu-validator}
SERVE_OUT=${SERVE_OUT:-/tmp/gpu-serve}    # the server load report (never the committed CPU one)
PUBLISH_ARGS=${PUBLISH_ARGS:-}
SITE_ARGS=${SITE_ARGS:-}                  # python -m visualizer_data build's, e.g. --out DIR (default: visualizer-data/)
REAL=${REAL:-}                            # set: sweep the real checkpoints from the HF cache, not twins
if [ "$DEVICE" = cpu ]; then DTYPE=${DTYPE:-float32}; THREADS=${THREADS:-1}; else DTYPE=${DTYPE:-bfloat16}; THREADS=${THREADS:-0}; fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 INTERP_ZOO_SIZE=$SIZE
START=$(date +%s)
. benchmarks/phases.sh

if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "DEVICE=cuda but torch sees no GPU; for the CPU test of this script set DEVICE=cpu"; exit 2; }
fi

# 1. twins at the chosen size, in parallel (CPU-bound: seeded init and calibration, then bf16 on disk)
[ -n "$REAL" ] || phase "build $SIZE twins" 60 bash -c ". benchmarks/phases.sh; PY='$PY' SIZE='$SIZE' MODELS='$MODELS' build_twins"

# 2. the gpu-marked tests (tiny twins; the CUDA-graph path of vllm-static)
[ -n "${SKIP_TESTS:-}" ] || phase "gpu-marked tests" 90 env INTERP_ZOO_SIZE=tiny "$PY" -m pytest -q -p no:cacheprovider -m gpu

# 3. the vLLM / vllm-static validator columns on the headline models (tiny twins: what they check,
#    the capture and steering of the CUDA-graph path, does not depend on size)
[ -n "${SKIP_VALIDATOR:-}" ] || phase "validator vllm,vllm-static" 120 env INTERP_ZOO_SIZE=tiny \
  "$PY" -m validator run --engines vllm,vllm-static --device "$DEVICE" --out "$VALIDATOR_OUT" \
  $(for m in $MODELS; do printf -- "--models %s " "$m"; done)

# 4. the headline sweep, one model at a time
for m in $SWEEP_MODELS; do
  phase "sweep $m" 150 "$PY" -m benchmarks run --model "$m" --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
    --threads "$THREADS" --prompt-tokens "$PROMPT" --long-prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --rounds "$ROUNDS" --min-sample "$MIN_SAMPLE" --variants "$VARIANTS" --workloads "$WORKLOADS" --sweeps "$OUT" \
    ${REAL:+--real}
done

# 5. publish every sweep under OUT (the CPU sweeps beside the GPU ones), all or nothing
phase "publish" 5 "$PY" -m benchmarks publish --sweeps $(ls -d "$OUT"/*/) $PUBLISH_ARGS
phase "site data" 2 "$PY" -m visualizer_data build --only benchmarks --benchmark-cells "$OUT" $SITE_ARGS

# 6. last, so it cannot starve the publish: the server against stock `vllm serve` on the first sweep
#    model (benchmarks/serve_load.py: the same requests and ratio rules as the CPU report), into
#    SERVE_OUT; SKIP_SERVE=1 leaves it out. Not yet run on a GPU.
[ -n "${SKIP_SERVE:-}" ] || phase "serve load" 240 "$PY" -m benchmarks.serve_load --model "${SWEEP_MODELS%% *}" \
  --size "$SIZE" --concurrency 8,32 --rounds 6 --requests 16 --max-seconds 180 --out "$SERVE_OUT"

phases_summary
