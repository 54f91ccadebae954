"""Cell files: one JSON per model x engine, with provenance, written atomically.

A cell is complete or absent: it is written to a temporary file in the same directory and moved
into place with os.replace, so a killed run never leaves half a cell. Its `inputs_digest` covers
everything that decides its content (model weights fingerprint, dtype, engine, point/layer
selection, the code of engine/ and validator/, package versions); a run skips a cell whose digest
matches (resume) unless --force.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "reports" / "validator"
SCHEMA = 1
PACKAGES = ("torch", "transformers", "transformer_lens", "nnsight", "nnterp", "vllm")


def cell_dir(out: Path) -> Path:
    return Path(out) / "cells"


def slug(name: str) -> str:
    """A file-name-safe model name: 'meta-llama/Llama-3.2-1B' -> 'meta-llama__Llama-3.2-1B'."""
    return name.replace("/", "__")


def cell_path(out: Path, model: str, engine: str) -> Path:
    return cell_dir(out) / f"{slug(model)}__{engine}.json"


def write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; cells are committed files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_all(out: Path) -> list[dict]:
    """Every readable cell under `out`, sorted by (model, engine)."""
    cells = [c for p in sorted(cell_dir(out).glob("*.json")) if (c := read(p)) is not None]
    return sorted(cells, key=lambda c: (c.get("model", ""), c.get("engine", "")))


def up_to_date(path: Path, inputs_digest: str) -> bool:
    c = read(path)
    return bool(c and c.get("schema") == SCHEMA and c.get("inputs_digest") == inputs_digest
                and c.get("status") in ("ok", "skipped"))


# -- provenance -----------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def versions() -> dict:
    from importlib import metadata
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        name = {"transformer_lens": "transformer-lens"}.get(pkg, pkg)
        try:
            out[pkg] = metadata.version(name)
        except metadata.PackageNotFoundError:
            try:
                out[pkg] = metadata.version(f"{name}-cpu")
            except metadata.PackageNotFoundError:
                pass
    return out


def sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def files_digest(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(str(x) for x in paths):
        h.update(os.path.relpath(p, REPO).encode())
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def code_digest() -> str:
    """Digest of every .py file under engine/ and validator/ (what decides a cell's numbers)."""
    files = [p for d in ("engine", "validator") for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts]
    return files_digest(files)


@lru_cache(maxsize=1)
def git_commit() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--", "engine", "validator")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "engine_dirty": bool(dirty)}
