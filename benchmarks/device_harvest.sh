#!/bin/bash
# The eager harvest figures of docs/harvest.md "On a 16-core CPU and an H200", as run on the lent device machine
# (torch 2.11 + CUDA, no vLLM, no package index). Prepared here, in the repo root:
#   echo /.whl/ >> .git/info/exclude; echo /.devcarry/ >> .git/info/exclude
#   for p in transformers==5.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do python3 -m pip download \
#     --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl $p; done
#   mkdir -p .devcarry/zoo/hub && cp -r .zoo-cache/hub/models--meta-llama--Llama-3.2-1B .devcarry/zoo/hub/
# then run there (carry .whl and .devcarry): bash benchmarks/device_harvest.sh [cpu|gpu|breakdown|costs|spare ...]
# Results go to $OUT (default ./device-out). The real-size twin is built there by the zoo (about 10 s).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export INTERP_ZOO_HOME=${INTERP_ZOO_HOME:-$PWD/.devcarry/zoo} HF_HUB_OFFLINE=1
quiet='^\[transformers\]|Loading weights|Writing model'
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(cpu gpu breakdown)
for what in "${parts[@]}"; do
  case $what in
    cpu)  # the tiny twin's eager goal on the machine's CPU cores
      python3 benchmarks/harvest_bench.py --cells eager-one,eager-fwd,hf --tokens 128000 --rounds 10 --relaunch 4 \
        --json "$OUT/cpu-tiny-eager.json" --md "$OUT/cpu-tiny-eager.md" 2>&1 | grep -Ev "$quiet" ;;
    gpu)  # the real-size twin's eager harvest on the GPU
      python3 benchmarks/harvest_bench.py --model HuggingFaceTB/SmolLM2-135M --size real --cells eager-one,hf \
        --tokens 64000 --rounds 7 --shard-tokens 8192 --dtype bf16 --device cuda \
        --json "$OUT/gpu-real-eager.json" --md "$OUT/gpu-real-eager.md" 2>&1 | grep -Ev "$quiet" ;;
    breakdown)  # per-call stages in one process: tiny twin on the CPU, real-size twin on the GPU per batch size
      python3 benchmarks/eager_breakdown.py --tokens 64000 --batches 1024,4096 --json "$OUT/bd-cpu-tiny.json" \
        2>&1 | grep -Ev "$quiet"
      INTERP_ZOO_SIZE=real python3 benchmarks/eager_breakdown.py --model HuggingFaceTB/SmolLM2-135M --device cuda \
        --tokens 64000 --batches 1024,8192,32768 --json "$OUT/bd-gpu-real.json" 2>&1 | grep -Ev "$quiet" ;;
    costs)  # where the eager harvest's time goes beside its own forward, one process per device
      python3 benchmarks/harvest_costs.py --tokens 128000 --rounds 6 --out /tmp \
        --variants hf,fwd,harvest,no-write,read-inline,spare-1,spare-2,fwd-spare-1 \
        --json "$OUT/costs-cpu-tiny.json" --md "$OUT/costs-cpu-tiny.md" 2>&1 | grep -Ev "$quiet"
      INTERP_ZOO_SIZE=real python3 benchmarks/harvest_costs.py --model HuggingFaceTB/SmolLM2-135M --device cuda \
        --tokens 64000 --rounds 6 --out /tmp --variants hf,fwd,harvest,no-write \
        --json "$OUT/costs-gpu-real.json" --md "$OUT/costs-gpu-real.md" 2>&1 | grep -Ev "$quiet" ;;
    spare)  # spare_threads (engine/harvest/priority.py) on the machine's cores: the tiny twin's costs, the
      # same shards at any thread count, a spare on the real-size twin, the cross-process goal
      python3 benchmarks/harvest_costs.py --tokens 128000 --rounds 6 --out /tmp \
        --variants hf,fwd,harvest,spare-1,fwd-spare-1 \
        --json "$OUT/spare-cpu-tiny.json" --md "$OUT/spare-cpu-tiny.md" 2>&1 | grep -Ev "$quiet"
      python3 benchmarks/harvest_threads.py --tokens 16000 --json "$OUT/threads-tiny.json" 2>&1 | grep -Ev "$quiet"
      INTERP_ZOO_SIZE=real python3 benchmarks/harvest_threads.py --model HuggingFaceTB/SmolLM2-135M --tokens 8000 \
        --points resid_post.29,attn_out.0,mlp_out.15 --json "$OUT/threads-real.json" 2>&1 | grep -Ev "$quiet"
      INTERP_ZOO_SIZE=real python3 benchmarks/harvest_costs.py --model HuggingFaceTB/SmolLM2-135M --tokens 24000 \
        --rounds 6 --shard-tokens 4096 --out /tmp --variants harvest,spare-1 \
        --json "$OUT/spare-cpu-real.json" --md "$OUT/spare-cpu-real.md" 2>&1 | grep -Ev "$quiet"
      python3 benchmarks/harvest_bench.py --cells eager-one,eager-fwd,hf --tokens 128000 --rounds 6 --relaunch 3 \
        --json "$OUT/spare-bench-tiny.json" --md "$OUT/spare-bench-tiny.md" 2>&1 | grep -Ev "$quiet" ;;
    *) echo "unknown part $what: choose from cpu, gpu, breakdown, costs, spare" >&2; exit 2 ;;
  esac
done
