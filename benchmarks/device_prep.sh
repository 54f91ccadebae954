#!/usr/bin/env bash
# Prepares the one call of benchmarks/device.sh on a lent GPU machine, here, in the checkout that the call
# sends (the session's own): the wheels that machine lacks into .whl/ (ignored by git, carried by the
# call), a check that the peers, the validator and the benchmarks import with only that machine's
# packages and those wheels, and a check that the checkout plus .whl/ fit the 64 MiB a call carries.
#
#   bash benchmarks/device_prep.sh                 # TransformerLens, nnsight 0.8.1, interp-engine and their
#                                                  # imports, and in .whl/nnterp-ref nnterp with its own nnsight
#                                                  # 0.7.0 (about 13 MB); transformers stays the machine's 5.17
#   bash benchmarks/device_prep.sh --transformers  # also transformers 5.19 (12.6 MB more: fits only if the
#                                                  # checkout leaves room; the size check says)
#
# Then the call (a device session's `run` tool; .whl must be named in carry):
#   run(command="bash benchmarks/device.sh", carry=[".whl"], timeout_s=560)
# device.sh installs .whl/ into /tmp/site there, runs in about 7.5 minutes (BUDGET_S=450) and leaves
# 8 files in $OUT (summary.md, device.log, device-env.txt, readme.log, sweeps.tgz, validator.tgz,
# published.tgz, logs.tgz); the table is also the end of its output.
# Needs: .venv (or PY) with pip and a registry it can reach (pip download), git, and .nnterp-ref
# (scripts/nnterp_reference.sh, which setup.sh runs) for the check of nnterp's side folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
git check-ignore -q .whl/x.whl || { echo "device_prep: .whl/ is not ignored by git here; add /.whl/ to .gitignore" >&2; exit 2; }
"$PY" -m benchmarks.device_wheels download "$@"
"$PY" -m benchmarks.device_wheels check
"$PY" -m benchmarks.device_wheels size
