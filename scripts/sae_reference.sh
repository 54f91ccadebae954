#!/usr/bin/env bash
# Create .saelens-ref/: SAELens and the TransformerLens 3.x it imports, installed with --no-deps into a
# side directory that tests/test_sae_reference.py puts first on PYTHONPATH in a subprocess of our own
# .venv, to check engine/core/sae.py against SAELens itself. SAELens 6.x imports TransformerLens 3.x
# (HookedTransformer), which our TransformerLens 4.x removed, so neither can be installed into .venv;
# everything else they import at load (torch, transformers, safetensors, ...) is .venv's own.
# datasets 3.6 too, the oldest line SAELens accepts (datasets>=3.1): tests/test_harvest_saelens.py loads a
# harvest's SAELens export with it there (datasets 4 renamed a feature type that 3.x does not know).
#
#   bash scripts/sae_reference.sh     # idempotent: skips pip when the stamp matches the pins below
#
# Five wheels, about 15 s (a side venv with its own torch took 3-9 minutes in CI's slow step).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=.saelens-ref
want="transformer-lens==3.9.0 sae-lens==6.54.12 better-abc==0.0.3 simple-parsing==0.1.9 datasets==3.6.0"
stamp=$DIR/.sae-reference-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$DIR"
mkdir -p "$DIR"
echo "sae_reference: installing $want into $DIR (--no-deps)" >&2
# shellcheck disable=SC2086
if ! "$PY" -m pip install -q --no-deps --target "$DIR" $want > "$DIR/pip.log" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$DIR/pip.log" | tail -20 >&2
  echo "sae_reference: pip failed (log: $DIR/pip.log)" >&2
  exit 1
fi
PYTHONPATH=$DIR "$PY" -c "import sae_lens, sae_lens.saes, transformer_lens, datasets; assert all(m.__file__.startswith('$PWD/$DIR') for m in (transformer_lens, datasets)), (transformer_lens.__file__, datasets.__file__)" 2>&1 | tail -3
echo "$want" > "$stamp"
