"""Cell files: one gzipped JSON per model x engine, with provenance, written atomically.

A cell is complete or absent: it is written to a temporary file in the same directory and moved
into place with os.replace, so a killed run never leaves half a cell. Its file name is its key:
model, engine and variant tag (validator/variant.py), so cells of different meaning never share a
file. Its `inputs_digest` covers everything else that decides its content (weights fingerprint, the
code that computes and scores it, package versions); a run skips a cell whose digest matches
(resume) unless --force. Reading is strict: a file in cells/ that is not a cell of this schema, or
sits under another cell's name, is an error that names it (never silently dropped).

Cells are stored gzipped (`<key>.json.gz`): as plain JSON the published 672 came to 43 MiB, two thirds of
a checkout that a GPU device call must carry whole within 64 MiB. Read one with `zcat FILE | jq`. A plain
`<key>.json` written up to 2026-12-07 is still read (also from git history), and writing a cell removes it.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "reports" / "validator"
SCHEMA = 1
# this process's packages; nnterp is not one of them: it runs in a child on its own nnsight (validator/engines/child.py),
# and its cells record that child's versions
PACKAGES = ("torch", "transformers", "transformer_lens", "nnsight", "vllm", "interp_engine")


def cell_dir(out: Path) -> Path:
    return Path(out) / "cells"


def slug(name: str) -> str:
    """A file-name-safe model name: 'meta-llama/Llama-3.2-1B' -> 'meta-llama__Llama-3.2-1B'."""
    return name.replace("/", "__")


SUFFIX = ".json.gz"  # a cell's file: its key and this
LEGACY = ".json"  # the plain JSON of cells written up to 2026-12-07 (read, never written)
_GZIP = b"\x1f\x8b"  # the first bytes of a gzip stream


def key(model: str, engine: str, tag: str = "") -> str:
    """The name of (model, engine, variant tag) in file names, records and changes; the published variant has
    no tag."""
    return f"{slug(model)}__{engine}{'@' + tag if tag else ''}"


def key_of(c: dict) -> str:
    return key(c["model"], c["engine"], c.get("variant_tag", ""))


def cell_path(out: Path, model: str, engine: str, tag: str = "") -> Path:
    """The one file of (model, engine, variant tag)."""
    return cell_dir(out) / (key(model, engine, tag) + SUFFIX)


def key_of_file(path: Path) -> str | None:
    """The key a cell file's name gives, or None for a file that is no cell's by its name."""
    name = Path(path).name
    for suffix in (SUFFIX, LEGACY):
        if name.endswith(suffix) and not name.startswith("."):
            return name[:-len(suffix)]
    return None


def files(out: Path) -> list[Path]:
    """The cell files under `out`'s cells/ (files_in)."""
    return files_in(cell_dir(out))


def files_in(d: Path) -> list[Path]:
    """The cell files in folder `d`, gzipped and legacy plain ones, sorted by name ([] where it is none)."""
    d = Path(d)
    return sorted(p for p in d.iterdir() if p.is_file() and key_of_file(p) is not None) if d.is_dir() else []


def encode(data: dict) -> bytes:
    """A cell's stored bytes: compact sorted JSON, gzipped without a name or time, so the same cell is the same
    bytes at every write."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def decode(raw: bytes):
    """The JSON value of a cell file's bytes, gzipped or (written up to 2026-12-07) plain. Raises OSError
    (gzip.BadGzipFile, EOFError as OSError) for a damaged stream, json.JSONDecodeError or UnicodeDecodeError."""
    if raw[:2] == _GZIP:
        try:
            raw = gzip.decompress(raw)
        except EOFError as e:
            raise OSError(f"truncated gzip stream ({e})") from None
    return json.loads(raw.decode())


DECODE_ERRORS = (OSError, UnicodeDecodeError, json.JSONDecodeError)  # what `decode` of damaged bytes raises


class CellError(ValueError):
    """Files under cells/ that are not readable cells; the message names each file and why."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def _legacy(path: Path) -> Path:
    """The plain-JSON file a cell at `path` (a .json.gz) had up to 2026-12-07."""
    path = Path(path)
    return path.with_name(path.name[:-len(SUFFIX)] + LEGACY) if path.name.endswith(SUFFIX) else path


def write(path: Path, data: dict) -> None:
    """One cell, written atomically (cells are committed files: mode 0644); its legacy plain file goes."""
    from engine.core.files import write_atomic  # deferred: `validator --help` imports neither engine nor torch
    write_atomic(path, encode(data), mode=0o644)
    old = _legacy(path)
    if old != Path(path):
        old.unlink(missing_ok=True)


def read(path: Path) -> dict | None:
    """The cell at `path` (or its legacy plain file), or None when it is absent or unreadable (resume treats
    both as missing)."""
    path = Path(path)
    for p in dict.fromkeys((path, _legacy(path))):  # one read where `path` is itself a plain file
        try:
            c = decode(p.read_bytes())
        except FileNotFoundError:
            continue
        except DECODE_ERRORS:
            return None
        return c if isinstance(c, dict) else None
    return None


def problem(path: Path) -> tuple[dict | None, str]:
    """(cell, "") or (None, why this file is not a cell of this schema under its own name)."""
    path = Path(path)
    try:
        c = decode(path.read_bytes())
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {e})"
    except json.JSONDecodeError as e:
        return None, f"{path}: not valid JSON ({e})"
    if not isinstance(c, dict):
        return None, f"{path}: a JSON {type(c).__name__}, not a cell object"
    missing = [k for k in ("schema", "model", "engine", "status") if not isinstance(c.get(k), (str, int))]
    if missing:
        return None, f"{path}: not a validator cell (missing {', '.join(missing)})"
    mistyped = _mistyped(c)
    if mistyped:
        return None, f"{path}: not a validator cell of this schema ({mistyped})"
    if c["schema"] != SCHEMA:
        return None, f"{path}: cell schema {c['schema']!r}, this validator reads schema {SCHEMA}"
    want = key_of(c)
    if key_of_file(path) != want:
        return None, f"{path}: holds the cell of {c['model']} / {c['engine']}, whose file is {want}{SUFFIX}"
    return c, ""


# the type of every field the reports read, where a cell has it (a cell holding another type is
# corrupt: named, never a crash in the middle of a report)
FIELD_TYPES = {"schema": int, "model": str, "engine": str, "status": str, "source": str, "variant": dict,
               "variant_tag": str, "inputs_digest": str, "engine_what": str, "family": str, "model_type": str,
               "n_layers": int, "addresses": list, "cases": dict, "known": dict, "provenance": dict,
               "reference_versions": dict, "tensors": dict, "summary": dict, "rows": list, "notes": list,
               "reason": str, "unavailable": str, "error": str, "trace": str}
ROW_TYPES = {"case": str, "point": str, "verdict": str, "known": str, "reason": str, "stale_known": str}


def _kind(t) -> str:
    return {dict: "an object", list: "a list", str: "a string", int: "an integer"}.get(t, t.__name__)


def _mistyped(c: dict) -> str:
    """'' or what the first wrongly typed field of cell `c` is (rows and summary counts included)."""
    for k, t in FIELD_TYPES.items():
        if k in c and (not isinstance(c[k], t) or isinstance(c[k], bool)):
            return f"{k} is {type(c[k]).__name__} {json.dumps(c[k])[:40]}, not {_kind(t)}"
    for v, n in c.get("summary", {}).items():
        if isinstance(n, bool) or not isinstance(n, int):
            return f"summary[{v!r}] is {type(n).__name__} {json.dumps(n)[:40]}, not an integer"
    for i, r in enumerate(c.get("rows", [])):
        if not isinstance(r, dict):
            return f"rows[{i}] is {type(r).__name__}, not an object"
        for k, t in ROW_TYPES.items():
            if (k in r or k in ("case", "point", "verdict")) and not isinstance(r.get(k), t):
                return f"rows[{i}].{k} is {type(r.get(k)).__name__}, not {_kind(t)}"
    return ""


def load_all(out: Path) -> list[dict]:
    """Every cell under `out`, sorted by (model, engine, variant tag); CellError names any file in
    cells/ that is not one."""
    cells: list[dict] = []
    problems: list[str] = []
    seen: dict[str, Path] = {}
    for p in files(out):
        c, why = problem(p)
        if c is None:
            problems.append(why)
        elif (k := key_of(c)) in seen:
            problems.append(f"{p}: the cell of {c['model']} / {c['engine']} is also in {seen[k].name}; "
                            f"remove the older of the two")
        else:
            seen[k] = p
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


def _drop_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


@lru_cache(maxsize=2048)
def _content(raw: bytes, python: bool) -> bytes:
    """What of a file decides results: for Python, its syntax tree without docstrings, comments or
    layout (so a comment-only or docstring-only edit stales nothing, while any change to code or a
    constant does); other files (and Python that does not parse) byte for byte."""
    if not python:
        return raw
    try:
        tree = ast.parse(raw)
    except (SyntaxError, ValueError):
        return raw
    return ast.dump(_drop_docstrings(tree), annotate_fields=False, include_attributes=False).encode()


def files_digest(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(str(x) for x in paths):
        h.update(os.path.relpath(p, REPO).encode())
        h.update(b"\0")
        h.update(_content(Path(p).read_bytes(), p.endswith(".py")))
    return h.hexdigest()[:16]


# validator modules whose code decides a cell's rows; the reports, the CLI and the run plumbing do not.
# known_gaps is not a file dependency: each cell depends on the entries that can apply to it
# (known_gaps.digest, in runner.inputs_digest)
CELL_MODULES = ("runner", "columns", "plan", "subject", "sides", "maths", "checks", "prompts", "matrix", "scoring",
                "tolerances", "rows", "models", "variant")
# engine/ subtrees that never touch a capture (by layout: a file added there is excluded with them; remote/ is
# the HTTP client of a server);
# the vLLM backends (engine/backends/vllm/, client and worker) only decide the vllm columns, whose
# adapters list that subtree. The eager backend (engine/backends/hf/) decides all.
ENGINE_EXCLUDED = (("interop", "docs.py"), ("serve",), ("remote",), ("harvest",), ("backends", "vllm"))


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
    """Digest of code_files() (what decides a cell's numbers and verdicts), as syntax trees: comments
    and docstrings do not count."""
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
