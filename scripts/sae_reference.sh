#!/usr/bin/env bash
# Create .venv-saelens: a side venv holding SAELens, the reference tests/test_sae_reference.py runs in a
# subprocess to check engine/core/sae.py against it. SAELens 6.x imports TransformerLens 3.x
# (HookedTransformer), which our TransformerLens 4.x removed, so it cannot share .venv.
#
#   bash scripts/sae_reference.sh     # idempotent: skips pip when the stamp matches the pins below
#
# CPU torch only: the torch pin of pyproject.toml with +cpu, the local CPU wheel that scripts/setup.sh's
# cpu world also installs (pip's find-links); no CUDA wheels. About 1.5 GB, 1-3 minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-saelens
torch_pin=$("$PY" scripts/pins.py cpu | grep '^torch==')
transformers_pin=$("$PY" scripts/pins.py cpu | grep '^transformers==')
want="${torch_pin}+cpu $transformers_pin transformer-lens==3.9.0 sae-lens==6.54.12"
stamp=$VENV/.sae-reference-stamp
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "sae_reference: installing $want into $VENV" >&2
# shellcheck disable=SC2086
if ! "$VENV/bin/pip" install -q $want > "$VENV/pip.log" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$VENV/pip.log" | tail -20 >&2
  echo "sae_reference: pip failed (log: $VENV/pip.log); ${torch_pin}+cpu comes from a local wheel folder in pip's" \
       "find-links (as for scripts/setup.sh --cpu): check that one is configured" >&2
  exit 1
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, f'sae_reference: torch {torch.__version__} is a CUDA build'"
"$VENV/bin/python" -c "import sae_lens, sae_lens.saes" 2>&1 | tail -3
echo "$want" > "$stamp"
