"""`python -m validator ...` (see validator/cli.py)."""
from validator.cli import main
from validator.pipes import run

run(main)
