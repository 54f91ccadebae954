"""Environment variables set for one scope: the processes started inside it inherit them, and this
process's environment is as it was afterwards (a vLLM engine's settings, a local Ray cluster's)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_environ(env: dict[str, str]) -> Iterator[None]:
    """`env` in os.environ inside the block; every variable it names restored (or removed) on exit."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
