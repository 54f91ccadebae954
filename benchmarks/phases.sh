# Shared by benchmarks/gpu.sh and benchmarks/device.sh (sourced, not run): a device-time budget split
# into phases, each run under what is left of BUDGET_S or skipped, saying so, when less than its
# estimate is left; a failed phase is recorded and the script goes on.
#   START, BUDGET_S     set by the caller before sourcing
#   SKIPPED, FAILED     arrays the caller reports at the end (phases_summary)
SKIPPED=(); FAILED=()
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
phase() {  # phase NAME ESTIMATE_S COMMAND...: run COMMAND under what is left of the budget, or skip it
  capped "$1" "$2" 0 "${@:3}"
}
capped() {  # capped NAME ESTIMATE_S CAP_S COMMAND...: as phase, for at most CAP_S seconds (0: no cap)
  local name=$1 est=$2 cap=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$est" ]; then
    echo "== $name: skipped ($l s of the budget left, it needs about $est s)"; SKIPPED+=("$name"); return 0
  fi
  [ "$cap" -gt 0 ] && [ "$cap" -lt "$l" ] && l=$cap
  echo "== $name (for at most $l s)"
  local t0; t0=$(date +%s)
  timeout --kill-after=20 "$l" "$@"; local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc)")
  return 0
}
# build_twins: the zoo twins of MODELS at SIZE, in parallel (CPU-bound: seeded init and calibration)
build_twins() { local pids=(); for m in $MODELS; do "$PY" -m engine.zoo build --size "$SIZE" "$m" & pids+=($!); done
                local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; return $rc; }
phases_summary() {  # exit status: 1 when a phase failed
  echo "== done in $(( $(date +%s) - START )) s of a ${BUDGET_S} s budget"
  [ ${#SKIPPED[@]} -eq 0 ] || printf '   skipped: %s\n' "${SKIPPED[@]}"
  [ ${#FAILED[@]} -eq 0 ] || { printf '   failed: %s\n' "${FAILED[@]}"; return 1; }
}
