"""Cell files: one JSON per model x engine, with provenance, written atomically.

A cell is complete or absent: it is written to a temporary file in the same directory and moved
into place with os.replace, so a killed run never leaves half a cell. Its file name is its key:
model, engine and variant tag (validator/variant.py), so cells of different meaning never share a
file. Its `inputs_digest` covers everything else that decides its content (weights fingerprint, the
code that computes and scores it, package versions); a run skips a cell whose digest matches
(resume) unless --force. Reading is strict: a file in cells/ that is not a cell of this schema, or
sits under another cell's name, is an error that names it (never silently dropped).
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
PACKAGES = ("torch", "transformers", "transformer_lens", "nnsight", "nnterp", "vllm", "interp_engine")


def cell_dir(out: Path) -> Path:
    return Path(out) / "cells"


def slug(name: str) -> str:
    """A file-name-safe model name: 'meta-llama/Llama-3.2-1B' -> 'meta-llama__Llama-3.2-1B'."""
    return name.replace("/", "__")


def cell_path(out: Path, model: str, engine: str, tag: str = "") -> Path:
    """The one file of (model, engine, variant tag); the published variant has no tag."""
    return cell_dir(out) / f"{slug(model)}__{engine}{'@' + tag if tag else ''}.json"


class CellError(ValueError):
    """Files under cells/ that are not readable cells; the message names each file and why."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


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
    """The cell at `path`, or None when it is absent or unreadable (resume treats both as missing)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def problem(path: Path) -> tuple[dict | None, str]:
    """(cell, "") or (None, why this file is not a cell of this schema under its own name)."""
    path = Path(path)
    try:
        c = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {e})"
    except json.JSONDecodeError as e:
        return None, f"{path}: not valid JSON ({e})"
    if not isinstance(c, dict):
        return None, f"{path}: a JSON {type(c).__name__}, not a cell object"
    missing = [k for k in ("schema", "model", "engine", "status") if not isinstance(c.get(k), (str, int))]
    if missing:
        return None, f"{path}: not a validator cell (missing {', '.join(missing)})"
    if c["schema"] != SCHEMA:
        return None, f"{path}: cell schema {c['schema']!r}, this validator reads schema {SCHEMA}"
    want = cell_path(path.parent.parent, c["model"], c["engine"], c.get("variant_tag", "")).name
    if path.name != want:
        return None, f"{path}: holds the cell of {c['model']} / {c['engine']}, whose file is {want}"
    return c, ""


def load_all(out: Path) -> list[dict]:
    """Every cell under `out`, sorted by (model, engine, variant tag); CellError names any file in
    cells/ that is not one."""
    cells, problems = [], []
    for p in sorted(cell_dir(out).glob("*.json")):
        c, why = problem(p)
        if why:
            problems.append(why)
        else:
            cells.append(c)
    if problems:
        raise CellError(problems)
    return sorted(cells, key=lambda c: (c["model"], c["engine"], c.get("variant_tag", "")))


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
        name = {"transformer_lens": "transformer-lens", "interp_engine": "interp-engine"}.get(pkg, pkg)
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


# validator modules whose code decides a cell's rows; the reports, the CLI and the run plumbing do not.
# known_gaps is not a file dependency: each cell depends on the entries that can apply to it
# (known_gaps.digest, in runner.inputs_digest)
CELL_MODULES = ("runner", "subject", "prompts", "matrix", "scoring", "tolerances", "rows", "models", "variant")
# engine/ subtrees that never touch a capture (by layout: a file added there is excluded with them);
# the vLLM backends (engine/backends/vllm/, client and worker) only decide the vllm columns, whose
# adapters list that subtree. The eager backend (engine/backends/hf/) decides all.
ENGINE_EXCLUDED = (("interop", "docs.py"), ("serve",), ("harvest",), ("backends", "vllm"))


def _engine_file(rel: Path) -> bool:
    if rel.name == "__main__.py" or "__pycache__" in rel.parts:
        return False
    return not any(rel.parts[:len(sub)] == sub for sub in ENGINE_EXCLUDED)


def code_files() -> list[Path]:
    """The engine and validator code every cell depends on (adapters add their own files); command-line
    entry points (__main__.py) compute nothing a cell holds."""
    root = REPO / "engine"
    eng = [p for p in root.rglob("*.py") if _engine_file(p.relative_to(root))]
    return eng + [REPO / "validator" / f"{m}.py" for m in CELL_MODULES]


@lru_cache(maxsize=1)
def code_digest() -> str:
    """Digest of code_files() (what decides a cell's numbers and verdicts)."""
    return files_digest(code_files())


@lru_cache(maxsize=1)
def git_commit() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--", "engine", "validator")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "engine_dirty": bool(dirty)}
