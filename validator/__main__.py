"""`python -m validator ...` (see validator/cli.py)."""
import sys

from validator.cli import main

sys.exit(main())
