"""Third-party output goes to the run's log file; the console gets only the validator's own lines.

Libraries print from Python (warnings, logging, tqdm bars, tracebacks they format themselves) and from
C (OpenMP, vLLM's engine core), and worker processes inherit file descriptors, so the redirection is
made at the descriptor level (fd 1 and 2 point at the log) as well as for sys.stdout/sys.stderr.
The console streams are duplicated first; under a test runner that captures sys.stdout itself they
are those capture objects, so tests still read the summary.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Console:
    out: io.TextIOBase
    err: io.TextIOBase
    log: Path

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)


def _own(stream, fd: int):
    """A stream that keeps reaching what `stream` reaches after fd `fd` is redirected."""
    try:
        real = stream.fileno() == fd
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        real = False
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace") if real else stream


@contextlib.contextmanager
def to_log(path: Path):
    """Yield a Console while everything else written to stdout/stderr goes to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    out, err = _own(sys.stdout, 1), _own(sys.stderr, 2)
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = sys.stdout, sys.stderr
    try:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        sys.stdout = sys.stderr = log
        yield Console(out, err, path)
    finally:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        sys.stdout, sys.stderr = streams
        for fd, keep in saved.items():
            os.dup2(keep, fd)
            os.close(keep)
        log.close()
        for s in (out, err):
            if s not in streams:
                with contextlib.suppress(Exception):
                    s.flush()
                    s.close()
