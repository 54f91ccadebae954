#!/usr/bin/env bash
# The short check for a lent GPU machine that has torch (CUDA) and transformers but no vLLM, no
# registry and only what the call carries (the repository, at most 64 MiB): real-size twins in bf16 on
# the GPU, the eager backend against the peers that are importable there, publish what ran, then the
# validator's eager columns on cuda. Anything missing (a peer, vLLM, pandas for the report) is
# skipped and named, never fatal.
#
#   bash benchmarks/device.sh                    # on the lent machine, from the repository root
#
# Phases share BUDGET_S (benchmarks/phases.sh). What ran is written to RESULTS (default $OUT, the
# folder the device tool brings back, else reports/device): device-env.txt (torch, CUDA, which packages
# import), the sweep folder, the validator cells and reports, the published benchmark report and site
# data. Knobs are environment variables, so the CPU test runs it with a tiny twin:
#
#   DEVICE=cpu SIZE=tiny MODELS=meta-llama/Llama-3.2-1B PROMPT=16 NEW=4 ROUNDS=6 RESULTS=/tmp/d \
#     bash benchmarks/device.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-real}
MODELS=${MODELS:-"meta-llama/Llama-3.2-1B google/gemma-2-2b"}
CANDIDATES=${CANDIDATES:-eager,hf-generate,transformerlens,nnsight,interp-engine}
WORKLOADS=${WORKLOADS:-prefill,decode,capture_all,capture_gen,steer_all}
VALIDATOR_MODELS=${VALIDATOR_MODELS:-$MODELS}
ENGINES=${ENGINES:-}                      # validator reference engines (default: its defaults, those importable)
VALIDATOR_ARGS=${VALIDATOR_ARGS:-}        # extra validator arguments, e.g. "--points resid_post --no-decode"
PROMPT=${PROMPT:-512}
NEW=${NEW:-64}
ROUNDS=${ROUNDS:-6}
MIN_SAMPLE=${MIN_SAMPLE:-0.3}
BUDGET_S=${BUDGET_S:-660}
RESULTS=${RESULTS:-${OUT:-reports/device}}
SWEEPS=${SWEEPS:-$RESULTS/sweeps}
if [ "$DEVICE" = cpu ]; then DTYPE=${DTYPE:-float32}; THREADS=${THREADS:-1}; else DTYPE=${DTYPE:-bfloat16}; THREADS=${THREADS:-0}; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 INTERP_ZOO_SIZE=$SIZE PIP_NO_INDEX=1
START=$(date +%s)
. benchmarks/phases.sh
mkdir -p "$RESULTS" "$SWEEPS"

# 0. what this machine has (written first, so a later failure still says what the world was)
"$PY" - "$DEVICE" > "$RESULTS/device-env.txt" <<'PYEOF' || { echo "device: torch is not importable with $PY"; exit 2; }
import importlib.util, sys, torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"cuda available {torch.cuda.is_available()}"
      + (f"; {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
for m in ("transformers", "vllm", "transformer_lens", "nnsight", "nnterp", "interp_engine", "pandas", "matplotlib"):
    try:
        spec = importlib.util.find_spec(m)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        print(f"{m}: missing")
        continue
    from importlib import metadata
    try:
        v = metadata.version({"transformer_lens": "transformer-lens", "interp_engine": "interp-engine"}.get(m, m))
    except metadata.PackageNotFoundError:
        v = "?"
    print(f"{m}: {v}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("DEVICE=cuda but torch sees no GPU; for the CPU test of this script set DEVICE=cpu")
PYEOF
cat "$RESULTS/device-env.txt"

# the variants that can run here (eager always; a peer only where its package imports), in one line
VARIANTS=$("$PY" - "$CANDIDATES" <<'PYEOF'
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

# 1. twins at the chosen size, in parallel
phase "build $SIZE twins" 90 bash -c ". benchmarks/phases.sh; PY='$PY' SIZE='$SIZE' MODELS='$MODELS' build_twins"

# 2. the sweeps, one model at a time
for m in $MODELS; do
  phase "sweep $m" 120 "$PY" -m benchmarks run --model "$m" --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
    --threads "$THREADS" --prompt-tokens "$PROMPT" --long-prompt-tokens "$PROMPT" --new-tokens "$NEW" \
    --rounds "$ROUNDS" --min-sample "$MIN_SAMPLE" --variants "$VARIANTS" --workloads "$WORKLOADS" --sweeps "$SWEEPS"
done

# 3. publish what ran (report, plots, site data) into RESULTS, beside the sweeps
if ls -d "$SWEEPS"/*/ >/dev/null 2>&1; then
  printf '# R\n<!-- THROUGHPUT:START -->\n<!-- THROUGHPUT:END -->\n' > "$RESULTS/THROUGHPUT.md"
  phase "publish" 10 "$PY" -m benchmarks publish --sweeps $(ls -d "$SWEEPS"/*/) --readme "$RESULTS/THROUGHPUT.md" \
    --out "$RESULTS/published"
  phase "site data" 5 "$PY" -m visualizer_data build --only benchmarks --benchmark-cells "$SWEEPS" --out "$RESULTS"
else
  echo "== publish: skipped (no sweep finished)"; SKIPPED+=("publish")
fi

# 4. the validator's eager columns (every reference engine importable here; the rest skipped by name),
#    last: it may use whatever budget is left
phase "validator eager columns" 90 "$PY" -m validator run --device "$DEVICE" --dtype "$DTYPE" \
  --out "$RESULTS/validator" $(for m in $VALIDATOR_MODELS; do printf -- "--models %s " "$m"; done) \
  ${ENGINES:+--engines "$ENGINES"} $VALIDATOR_ARGS

phases_summary
