"""Exit quietly when the reader goes away (`python -m validator report | head`): no BrokenPipeError
traceback, exit status 141 (128 + SIGPIPE) as a shell reports a writer killed by the pipe."""
from __future__ import annotations

import os
import sys

BROKEN_PIPE = 141


def run(main, *args) -> None:
    """sys.exit(main(*args)); a closed stdout ends the command silently."""
    try:
        code = main(*args)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's own final flush cannot raise again
        code = BROKEN_PIPE
    sys.exit(code)
