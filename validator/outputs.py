"""Where a run writes, so that an ad-hoc run never touches the published results.

Only the published job (the whole zoo, the published variant; any engines) writes into
reports/validator by default. Any other run (a subset of models, other points/layers, another
dtype or device, real weights) goes to its own directory under .validator/runs/ unless `--out`
says otherwise, and even then its cells carry their variant tag, so they sit beside the published
ones and never replace them. Each run's third-party output goes to its own log file.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from pathlib import Path

from validator.cells import DEFAULT_OUT, REPO, cell_dir
from validator.variant import Variant

RUNS = REPO / ".validator" / "runs"
LOGS = REPO / ".validator" / "logs"


class OutputError(OSError):
    """--out cannot be created or written; the message says which and why."""


def publishable(variant: Variant, all_models: bool) -> bool:
    return all_models and variant.published


def run_name(variant: Variant, models: list[str], all_models: bool) -> str:
    """A readable directory name for an ad-hoc run: its models and its variant tag."""
    if all_models:
        who = "zoo"
    elif len(models) <= 2:
        who = "+".join(m.split("/")[-1] for m in models)
    else:
        who = f"{len(models)}-models-{hashlib.sha256(','.join(models).encode()).hexdigest()[:6]}"
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(x for x in (who, variant.tag()) if x))


def default_out(variant: Variant, models: list[str], all_models: bool) -> Path:
    return DEFAULT_OUT if publishable(variant, all_models) else RUNS / run_name(variant, models, all_models)


def ensure_writable(out: Path) -> None:
    """Create out/cells (a new one is proven writable with a probe file; an existing one is checked
    with os.access, so a rerun that computes nothing writes nothing), before any model runs."""
    d = cell_dir(Path(out))
    existed = d.is_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        if existed and not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied: not writable")
        if not existed:
            fd, probe = tempfile.mkstemp(dir=d, prefix=".write-probe.")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise OutputError(f"--out {out} is not usable: cannot create or write {d} ({why}). "
                          f"Pass a writable directory with --out.") from None


KEEP_LOGS = 30


def log_path() -> Path:
    """A new log file name for this run; only the newest KEEP_LOGS logs are kept."""
    old = sorted(LOGS.glob("run-*.log"), key=lambda p: p.stat().st_mtime)
    for p in old[:max(0, len(old) - KEEP_LOGS + 1)]:
        p.unlink(missing_ok=True)
    return LOGS / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
