#!/usr/bin/env bash
# The check for a lent GPU machine that has torch (CUDA) and transformers but no vLLM, no registry and only
# what the call carries (the repository and .whl/, at most 64 MiB; benchmarks/device_prep.sh fills .whl/):
#   1. the twins (real-size Llama-3.2-1B and gemma-2-2b) built, while the README's examples run on cuda
#   2. issue 33's GPU goals: batched prefill (16 x PROMPT tokens: capture, steer and a probe readout at every
#      layer) against HF's SDPA forward and the peers that import here, then batched generation (16 streams
#      x NEW tokens) with and without a steer at every layer, in interleaved rounds of >= MIN_SAMPLE s samples,
#      and the steered decode step's host time, site by site (benchmarks/decode_sites.py)
#   3. the validator on cuda in bf16 for both models (every reference engine importable here)
#   4. SmolLM2-135M's batched prefill if the budget still allows; publish what ran; the one table
# Anything missing (a peer, vLLM) is skipped and named, never fatal. Phases share BUDGET_S
# (benchmarks/phases.sh), each capped so that one cannot starve the rest.
#
#   bash benchmarks/device.sh              # on the lent machine, from the repository root (the run call: see
#                                          # benchmarks/device_prep.sh)
#   DRY=1 OUT=/tmp/o bash benchmarks/device.sh   # every phase, tiny, on the CPU (tests/test_benchmarks_device_script.py)
#
# Everything is written under RESULTS (default: a temporary folder when OUT is set, else reports/device) and,
# when OUT is set (the folder the device tool brings back: at most 8 files, 2 folders deep), packed into it:
# summary.md (the table, also printed last), device.log (all output), device-env.txt, readme.log,
# sweeps.tgz, validator.tgz, published.tgz (report, README block, site data, plots), logs.tgz (worker and
# validator logs). Unpack here with `tar xzf sweeps.tgz -C reports/benchmarks` and so on.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${DRY:-}" ]; then  # every phase, tiny and quick, on the CPU: the script's own test
  DEVICE=${DEVICE:-cpu}; SIZE=${SIZE:-tiny}; PROMPT=${PROMPT:-8}; NEW=${NEW:-2}; ROUNDS=${ROUNDS:-6}
  MIN_SAMPLE=${MIN_SAMPLE:-0}; WARMUPS=${WARMUPS:-1}; BUDGET_S=${BUDGET_S:-900}
  VALIDATOR_ARGS=${VALIDATOR_ARGS:-"--points resid_post,attn_out,lm_head"}
fi
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-real}
MODELS=${MODELS:-"meta-llama/Llama-3.2-1B google/gemma-2-2b"}
BENCH_MODEL=${BENCH_MODEL:-${MODELS%% *}}
SMOL_MODEL=${SMOL_MODEL:-HuggingFaceTB/SmolLM2-135M}   # "" leaves its sweep out
PEERS=${PEERS:-hf-generate,nnsight,interp-engine,transformerlens}
PREFILL_WORK=${PREFILL_WORK:-batch_prefill,batch_capture,batch_steer,batch_readout}
GEN_WORK=${GEN_WORK:-batch_generate,batch_steer_gen,batch_capture_gen}
VALIDATOR_MODELS=${VALIDATOR_MODELS:-$MODELS}
ENGINES=${ENGINES:-}                      # validator reference engines (default: its defaults, those importable)
VALIDATOR_ARGS=${VALIDATOR_ARGS:-}
README_BLOCKS=${README_BLOCKS:-}          # scripts/readme_blocks.py --names (default: every fast block)
PROMPT=${PROMPT:-512}
NEW=${NEW:-64}
ROUNDS=${ROUNDS:-6}
MIN_SAMPLE=${MIN_SAMPLE:-1.0}
WARMUPS=${WARMUPS:-2}
BUDGET_S=${BUDGET_S:-450}
if [ -n "${OUT:-}" ]; then RESULTS=${RESULTS:-$(mktemp -d /tmp/device-results.XXXX)}; else RESULTS=${RESULTS:-reports/device}; fi
SWEEPS=$RESULTS/sweeps
if [ "$DEVICE" = cpu ]; then DTYPE=${DTYPE:-float32}; THREADS=${THREADS:-1}; else DTYPE=${DTYPE:-bfloat16}; THREADS=${THREADS:-0}; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 INTERP_ZOO_SIZE=$SIZE PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
START=$(date +%s)
. benchmarks/phases.sh
mkdir -p "$RESULTS" "$SWEEPS" "$RESULTS/logs"
exec > >(tee -a "$RESULTS/device.log") 2>&1

# 0. the carried wheels (benchmarks/device_prep.sh), then what this machine has (written first, so a later
#    failure still says what the world was)
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "device: installing .whl/ failed; the peers it carries will be skipped"
fi
# nnterp's own nnsight 0.7.0 beside the carried 0.8.1: .nnterp-ref/, from .whl/nnterp-ref (the validator's nnterp column)
if ls .whl/nnterp-ref/*.whl >/dev/null 2>&1; then
  PYTHON="$PY" bash scripts/nnterp_reference.sh --wheels .whl/nnterp-ref \
    || echo "device: .nnterp-ref from .whl/nnterp-ref failed; the validator's nnterp column will be skipped"
fi
"$PY" - "$DEVICE" > "$RESULTS/device-env.txt" <<'PYEOF' || { cat "$RESULTS/device-env.txt"; echo "device: torch is not importable with $PY"; exit 2; }
import importlib.util, sys, torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"cuda available {torch.cuda.is_available()}"
      + (f"; {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
for m in ("transformers", "huggingface_hub", "vllm", "transformer_lens", "nnsight", "interp_engine",
          "datasets", "pandas", "matplotlib"):
    try:
        spec = importlib.util.find_spec(m)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        print(f"{m}: missing")
        continue
    from importlib import metadata
    try:
        v = metadata.version({"transformer_lens": "transformer-lens", "interp_engine": "interp-engine",
                              "huggingface_hub": "huggingface-hub"}.get(m, m))
    except metadata.PackageNotFoundError:
        v = "?"
    print(f"{m}: {v}")
from pathlib import Path
stamp = Path(".nnterp-ref/.stamp")  # nnterp runs on its own nnsight from there, in the validator's child process
print(f"nnterp: .nnterp-ref holds {stamp.read_text().strip() if stamp.is_file() else 'nothing (missing)'}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("DEVICE=cuda but torch sees no GPU; for the CPU test of this script set DRY=1")
PYEOF
cat "$RESULTS/device-env.txt"

# the peers that can run here (a peer only where its package imports), in one line
VARIANTS=$("$PY" - "eager,$PEERS" <<'PYEOF'
import sys
from benchmarks.variants import get
ok = []
for name in sys.argv[1].split(","):
    why = get(name).unavailable()
    print(f"device: {name}: {'runs' if why is None else 'skipped, ' + why}", file=sys.stderr)
    ok += [name] if why is None else []
print(",".join(ok))
PYEOF
)
echo "device: variants $VARIANTS" | tee -a "$RESULTS/device-env.txt"

sweep() {  # sweep NAME MODEL VARIANTS WORKLOADS CAP_S: one `benchmarks run` into SWEEPS, its rounds ending
  # 45 s before CAP_S (the checks and cells after the last round), under a phase capped at CAP_S
  local l; l=$(left); [ "$5" -lt "$l" ] && l=$5
  capped "sweep $1" 30 "$5" "$PY" -m benchmarks run --model "$2" --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
    --threads "$THREADS" --prompt-tokens "$PROMPT" --long-prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --rounds "$ROUNDS" --warmups "$WARMUPS" --min-sample "$MIN_SAMPLE" --variants "$3" --workloads "$4" \
    --sweeps "$SWEEPS" --sweep "$1" --max-seconds $(( l > 90 ? l - 45 : l / 2 ))
}
tag=$(echo "${BENCH_MODEL##*/}" | tr 'A-Z' 'a-z')
dev=${DEVICE%%:*}

# 1. the twins at the chosen size (CPU-bound, in parallel), while the README's examples run on the device
#    with the tiny twins (another cache: the two never build the same files)
( INTERP_ZOO_SIZE=tiny "$PY" scripts/readme_blocks.py --device "$DEVICE" --workdir "$RESULTS/readme-work" \
    ${README_BLOCKS:+--names "$README_BLOCKS"} > "$RESULTS/readme.log" 2>&1; echo "readme exit $?" >> "$RESULTS/readme.log" ) &
readme_pid=$!
phase "build $SIZE twins" 30 bash -c ". benchmarks/phases.sh; PY='$PY' SIZE='$SIZE' MODELS='$MODELS ${SMOL_MODEL}' build_twins"
wait "$readme_pid"
cat "$RESULTS/readme.log"
grep -q "^readme exit 0" "$RESULTS/readme.log" || FAILED+=("README examples on $DEVICE")

# 1b. the GPU-marked tests: no host sync inside an eager call (torch's own detector), captures stay on the
#     device, a CPU steer value on a CUDA model (tiny twins; they skip without CUDA)
mkdir -p "$RESULTS/logs"
capped "gpu tests" 20 90 bash -c "INTERP_ZOO_SIZE=tiny '$PY' -m pytest -q -p no:cacheprovider -m gpu tests/test_syncs.py \
  tests/test_steer_ops.py > '$RESULTS/logs/gpu-tests.log' 2>&1; rc=\$?; tail -3 '$RESULTS/logs/gpu-tests.log'; exit \$rc"

# 2. the goal ratios: batched prefill with the peers, then batched generation (eager: its own ratios)
sweep "$dev-$tag-$SIZE-batch" "$BENCH_MODEL" "$VARIANTS" "$PREFILL_WORK" "${PREFILL_CAP:-200}"
sweep "$dev-$tag-$SIZE-batch-gen" "$BENCH_MODEL" eager "$GEN_WORK" "${GEN_CAP:-100}"
# 2b. where a steered decode step's host time goes: the engine at each site against HF's own layers (the
#     generation goal's denominator on a launch-bound step), its table in device.log, its figures in logs
capped "decode sites" 20 60 "$PY" -m benchmarks.decode_sites --model "$BENCH_MODEL" --size "$SIZE" --device "$DEVICE" \
  --dtype "$DTYPE" --batch 16 --prompt "$PROMPT" --new-tokens "$NEW" --rounds 6 --reps 1 \
  --json "$RESULTS/logs/decode-sites.json"

# 3. the validator on the device (every reference engine importable here; the rest skipped by name)
capped "validator" 60 240 "$PY" -m validator run --device "$DEVICE" --dtype "$DTYPE" --out "$RESULTS/validator" \
  $(for m in $VALIDATOR_MODELS; do printf -- "--models %s " "$m"; done) ${ENGINES:+--engines "$ENGINES"} $VALIDATOR_ARGS
cp .validator/logs/run-*.log "$RESULTS/logs/" 2>/dev/null

# 4. SmolLM2's batched prefill, only if the budget allows it
if [ -n "$SMOL_MODEL" ]; then
  smol=$(echo "${SMOL_MODEL##*/}" | tr 'A-Z' 'a-z')
  [ "$(left)" -ge 100 ] && sweep "$dev-$smol-$SIZE-batch" "$SMOL_MODEL" "$VARIANTS" "$PREFILL_WORK" 150 \
    || { echo "== sweep $SMOL_MODEL: skipped ($(left) s of the budget left, it needs about 100 s)"; SKIPPED+=("sweep $SMOL_MODEL"); }
fi
cp -r /tmp/interp-benchmarks/*/ "$RESULTS/logs/" 2>/dev/null

# 5. publish what ran (report, plots, site data) beside the sweeps, then the table
if ls -d "$SWEEPS"/*/ >/dev/null 2>&1; then
  mkdir -p "$RESULTS/published"
  printf '# R\n<!-- THROUGHPUT:START -->\n<!-- THROUGHPUT:END -->\n' > "$RESULTS/published/THROUGHPUT.md"
  capped "publish" 5 60 "$PY" -m benchmarks publish --sweeps $(ls -d "$SWEEPS"/*/) \
    --readme "$RESULTS/published/THROUGHPUT.md" --out "$RESULTS/published"
  capped "site data" 5 60 "$PY" -m visualizer_data build --only benchmarks --benchmark-cells "$SWEEPS" \
    --out "$RESULTS/published"
else
  echo "== publish: skipped (no sweep finished)"; SKIPPED+=("publish")
fi
{ for s in "${SKIPPED[@]}"; do echo "skipped: $s"; done; for f in "${FAILED[@]}"; do echo "failed: $f"; done
  echo "done in $(( $(date +%s) - START )) s of a ${BUDGET_S} s budget"; } > "$RESULTS/phases.txt"
"$PY" scripts/device_summary.py --sweeps $(ls -d "$SWEEPS"/*/ 2>/dev/null) --validator "$RESULTS/validator" \
  --readme "$RESULTS/readme.log" --env "$RESULTS/device-env.txt" --phases "$RESULTS/phases.txt" > "$RESULTS/summary.md" \
  || echo "device: the summary failed (its inputs are in $RESULTS)"

# 6. what comes back: at most 8 files, none deeper than two folders
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$RESULTS/summary.md" "$RESULTS/device-env.txt" "$RESULTS/readme.log" "$OUT/" 2>/dev/null
  for part in sweeps validator published logs; do
    [ -d "$RESULTS/$part" ] && tar czf "$OUT/$part.tgz" -C "$RESULTS" "$part"
  done
fi
echo
cat "$RESULTS/summary.md"
phases_summary; rc=$?
[ -n "${OUT:-}" ] && cp "$RESULTS/device.log" "$OUT/device.log"
exit $rc
