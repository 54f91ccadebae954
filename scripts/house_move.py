"""The house move (issue 20): engine/ reorganized by layer and by process, reproducibly.

    .venv/bin/python scripts/house_move.py            # move + rewrite, in the repository it lives in
    .venv/bin/python scripts/house_move.py --dry-run  # say what it would do, change nothing
    .venv/bin/python scripts/house_move.py --strict   # exit 1 when engine/ holds a file the table lacks

One table (MOVES: old file -> new file) decides the layout; everything else is derived from it:
  1. `git mv` each file still at its old path (a file already at its new path is skipped: idempotent);
  2. every import and every dotted or slashed reference to an old module is rewritten, in the code,
     tests, docs and generated site data (SCOPE): `from engine.x import y`, `import engine.x as z`,
     `from engine.backends import vllm_wire` (a submodule imported from its package), relative
     imports, dotted strings (`"engine.backends.vllm_worker.InterpWorker"`, `"...vllm_rows:RowMap"`),
     path strings (`engine/backends/vllm_tree.py`) and bare file names unique to the old layout;
  3. the new packages get their `__init__.py` (INITS, one line per module), `engine/_moved.py` gets
     the old -> new module table the deprecation finder serves old imports from (CHANGELOG.md lists it);
  4. PATCHES: the few edits that depend on the layout (the validator's digest rules) as exact
     old -> new text, applied once;
  5. the import blocks of engine/ sorted by ruff (the lint step's rule), when ruff is installed.

A Python file under engine/ that the table does not know (added by a branch merged after the table
was written) is reported loudly and left where it is (its imports are still rewritten): add a row to
MOVES and run again. Files under serve/, harvest/, zoo/ and families/ stay where they are.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# old file -> new file (None: removed, its names served by the deprecation hooks)
MOVES: dict[str, str | None] = {
    # core: no HF or vLLM imports (module-level or deferred); torch allowed
    "engine/errors.py": "engine/core/errors.py",
    "engine/points.py": "engine/core/points.py",
    "engine/address.py": "engine/core/address.py",
    "engine/positions.py": "engine/core/positions.py",
    "engine/steering.py": "engine/core/steering.py",
    "engine/steer_inputs.py": "engine/core/steer_checks.py",
    "engine/plan.py": "engine/core/plan.py",
    "engine/results.py": "engine/core/results.py",
    "engine/tokens.py": "engine/core/tokens.py",
    "engine/inputs.py": "engine/core/inputs.py",
    # model: the backend-free model surface (options/sampling defer-import vLLM, so not core)
    "engine/model_base.py": "engine/model/base.py",
    "engine/capabilities.py": "engine/model/capabilities.py",
    "engine/catalogue.py": "engine/model/catalogue.py",
    "engine/module_paths.py": "engine/model/paths.py",
    "engine/lens.py": "engine/model/lens.py",
    "engine/weights.py": "engine/model/weights.py",
    "engine/sources.py": "engine/model/sources.py",
    "engine/options.py": "engine/model/options.py",
    "engine/sampling.py": "engine/model/sampling.py",
    "engine/model.py": None,  # the old shim: engine.model.EagerModel etc. served by engine/model/__init__.py
    # families
    "engine/family_limits.py": "engine/families/limits.py",
    # backends/hf: the eager HF model and its hook sites
    "engine/backends/eager.py": "engine/backends/hf/eager.py",
    "engine/backends/eager_stream.py": "engine/backends/hf/stream.py",
    "engine/sites.py": "engine/backends/hf/sites.py",
    "engine/site_kinds.py": "engine/backends/hf/site_kinds.py",
    "engine/attention.py": "engine/backends/hf/attention.py",
    # backends/vllm: the client side (the user's process)
    "engine/backends/vllm_backend.py": "engine/backends/vllm/backend.py",
    "engine/backends/vllm_client.py": "engine/backends/vllm/client.py",
    "engine/backends/vllm_runtime.py": "engine/backends/vllm/runtime.py",
    "engine/backends/vllm_catalogue.py": "engine/backends/vllm/catalogue.py",
    "engine/backends/vllm_proof.py": "engine/backends/vllm/proof.py",
    "engine/backends/vllm_sizing.py": "engine/backends/vllm/sizing.py",
    # backends/vllm/worker: importable inside vLLM's worker processes (never imports the client side)
    "engine/backends/vllm_worker.py": "engine/backends/vllm/worker/extension.py",
    "engine/backends/vllm_tree.py": "engine/backends/vllm/worker/tree.py",
    "engine/backends/vllm_rows.py": "engine/backends/vllm/worker/rows.py",
    "engine/backends/vllm_static.py": "engine/backends/vllm/worker/static.py",
    "engine/backends/vllm_loader.py": "engine/backends/vllm/worker/loader.py",
    "engine/backends/vllm_wire.py": "engine/backends/vllm/worker/wire.py",
    "engine/backends/vllm_attn.py": "engine/backends/vllm/worker/attn.py",
    "engine/backends/vllm_runner.py": "engine/backends/vllm/worker/runner.py",
    # workflows and interop
    "engine/patching.py": "engine/workflows/patching.py",
    "engine/attention_capture.py": "engine/workflows/attention_capture.py",
    "engine/mappers.py": "engine/interop/mappers.py",
    "engine/docs.py": "engine/interop/docs.py",
}

# files that stay where they are (checked so an unknown file is noticed)
STAYS = ("engine/__init__.py", "engine/loading.py", "engine/_moved.py", "engine/backends/__init__.py")
STAY_DIRS = ("engine/serve/", "engine/harvest/", "engine/zoo/", "engine/families/", "engine/core/", "engine/model/",
             "engine/backends/hf/", "engine/backends/vllm/", "engine/workflows/", "engine/interop/")

# names the old engine.model shim re-exported -> the module that defines them now
SHIM_NAMES = {"engine.model": {"EagerModel": "engine.backends.hf.eager", "ActivationCache": "engine.core.results",
                               "GenerationResult": "engine.core.results"}}

# where references are rewritten (generated site data included: its headers name source files)
SCOPE = ("engine", "validator", "benchmarks", "visualizer_data", "tests", "scripts", "docs", ".github", ".ci",
         "README.md", "visualizer-data",
         # generated from validator/known_gaps.py's text (its evidence names engine files); the cells and the
         # per-model details hold the engine's own messages and are regenerated by the validator, not here
         "reports/validator/README.md")
SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".ts", ".txt", ".cfg", ".ini", ""}
SKIP_PARTS = {"node_modules", "__pycache__", ".venv"}
SELF = ("scripts/house_move.py", "engine/_moved.py", "CHANGELOG.md", "tests/test_imports.py",  # these name
        "tests/test_house_move.py")  # the old paths on purpose

INITS = {
    "engine/core/__init__.py": '''"""The engine's core: what a request means, independent of any model library (no HF or vLLM import,
module-level or deferred; torch is allowed).

    errors        the error types (each names the bad input and the fix)
    points        the point registry: every point's definition and traits
    address       `resid_post.10`, `z.4.head-3`: parsing and the Address type
    positions     which token positions a capture or steer applies to
    steering      Steer, the op table and the maths of each op
    steer_checks  steers validated against a model (once, before any backend sees them)
    plan          addresses and steers -> a Plan of typed sites and steps (the one pipeline)
    results       ActivationCache, Request, RequestResult, GenerationResult, StreamStep
    tokens        token/string helpers shared by every backend
    inputs        what a user may pass as input (strings, token lists, tensors) and its limits
"""
''',
    "engine/model/__init__.py": '''"""The backend-free model surface: what every loaded model offers whichever backend runs it.

    base          ModelBase: the methods every backend's model shares
    capabilities  describe(): what this model serves, point by point, with the reasons for gaps
    catalogue     PointCatalogue: the points this model has, by layer
    paths         get_path: a dotted path walked in a module tree
    lens          the logit lens (final norm + unembedding, with the family's softcap)
    weights       the weight layout (which parameter holds what) for the lens and the mappers
    sources       where a model comes from: the real checkpoint if cached, else its zoo twin
    options       load options (device, dtype, backend knobs) checked once
    sampling      the sampling knobs every backend takes

`from engine.model import EagerModel, ActivationCache, GenerationResult` (the names the old shim module
re-exported) still works for one release, with a DeprecationWarning.
"""
import importlib as _importlib
import warnings as _warnings

_OLD_SHIM = {"EagerModel": "engine.backends.hf.eager", "ActivationCache": "engine.core.results",
             "GenerationResult": "engine.core.results"}


def __getattr__(name: str):
    if name in _OLD_SHIM:
        _warnings.warn(f"engine.model.{name} moved: import it from {_OLD_SHIM[name]} (or `engine`); the old "
                       f"name goes away in the next release.", DeprecationWarning, stacklevel=2)
        return getattr(_importlib.import_module(_OLD_SHIM[name]), name)
    raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
''',
    "engine/backends/__init__.py": '''"""The backends, one folder per process world; `engine.loading.load_model` dispatches here and every
backend runs the one pipeline of engine/core/plan.py.

    hf/            eager HF with hooks (`eager`): per-call attachment of typed sites
    vllm/          the vLLM client side (`vllm`, `vllm-static`, `vllm-generate`), in the user's process
    vllm/worker/   what runs inside vLLM's worker processes (never imports the client side)
"""
''',
    "engine/backends/hf/__init__.py": '''"""The eager backend: the HF model with hooks; serves every point, capture and steering, with gradients.

    eager       EagerModel: load, run_with_cache, generate, steer contexts
    stream      token-by-token generation (StreamStep) on the eager model
    sites       where (in one loaded HF model) a point at a layer is read and written: one resolver per point
    site_kinds  the typed sites (module output, input, attention internals, ...) and how each attaches
    attention   attention scores/probs recomputed from the HF attention module's inputs
"""
''',
    "engine/backends/vllm/__init__.py": '''"""The vLLM backends, client side (the user's process): `vllm` (hooks), `vllm-static` (taps baked into
the compiled forward) and `vllm-generate` (stock).

    backend     `load` and the synchronous VLLMModel (a private event loop drives the async one)
    client      AsyncVLLMModel: plans to the workers, requests through vLLM, results gathered
    catalogue   what the engine serves, merged from the workers' own tables
    runtime     engine start/stop (engine core in its own process), environment, load report
    proof       the startup proof that static taps capture real data and steers act
    worker/     what runs inside vLLM's processes
"""
''',
    "engine/backends/vllm/worker/__init__.py": '''"""What runs inside vLLM's worker processes; imports only engine.core, engine.model, engine.families and
itself (never the client side, which imports it).

    extension  the worker extension (collective_rpc endpoints), step spans, hooks, TP shards
    tree       where each point lives in vLLM's module tree, one resolver per point
    rows       a logits processor that maps vLLM's batch rows to plans
    static     vllm-static's capture/steer buffers and their per-step fill and read
    loader     the registered load format that installs vllm-static's taps before compile
    wire       plain-data messages between client and workers (tensors, plans)
    attn       attn_scores / attn_probs recomputed from captured q and k
"""
''',
    "engine/workflows/__init__.py": '''"""Workflows built on any loaded model (they take a model, never a backend class).

    patching           activation patching sweeps and logit differences
    attention_capture  attention patterns for every layer and head in one call
"""
''',
    "engine/interop/__init__.py": '''"""The engine's names next to other libraries' names.

    mappers  our addresses <-> TransformerLens, nnsight/nnterp and HF module names
    docs     docs/points.md rendered from the point registry and the families
"""
''',
}

# layout-dependent edits: (file by its old path, old text, new text), applied when the old text is there
PATCHES = [
    ("validator/cells.py",
     '''# engine/ paths that never touch a capture; the vLLM backends (engine/backends/vllm_*.py) only decide
# the vllm columns, whose adapters list them. The eager backend (engine/backends/eager.py) decides all.
ENGINE_EXCLUDED = ("docs.py", "serve", "harvest")


def _engine_file(rel: Path) -> bool:
    if rel.name == "__main__.py" or "__pycache__" in rel.parts or rel.parts[0] in ENGINE_EXCLUDED:
        return False
    return not (rel.parts[0] == "backends" and rel.name.startswith("vllm_"))
''',
     '''# engine/ subtrees that never touch a capture (by layout: a file added there is excluded with them);
# the vLLM backends (engine/backends/vllm/, client and worker) only decide the vllm columns, whose
# adapters list that subtree. The eager backend (engine/backends/hf/) decides all.
ENGINE_EXCLUDED = (("interop", "docs.py"), ("serve",), ("harvest",), ("backends", "vllm"))


def _engine_file(rel: Path) -> bool:
    if rel.name == "__main__.py" or "__pycache__" in rel.parts:
        return False
    return not any(rel.parts[:len(sub)] == sub for sub in ENGINE_EXCLUDED)
'''),
    ("validator/engines/__init__.py", 'zoo_flag="vllm", code=("engine/backends",)),',
     'zoo_flag="vllm", code=("engine/backends/vllm",)),'),
    ("engine/docs.py", 'OUT = Path(__file__).resolve().parent.parent / "docs" / "points.md"',
     'OUT = Path(__file__).resolve().parents[2] / "docs" / "points.md"  # the repository\'s docs/'),
    ("engine/__init__.py", '"""\nfrom engine.',
     '"""\nfrom engine import _moved  # noqa: F401  (importing it installs the finder for the pre-move paths)\n'
     'from engine.'),
]

# bare file names unique to the old layout (mentioned in prose without their folder); a name the new
# layout still has (site_kinds.py, attention_capture.py) is left alone
BARE_UNIQUE = {Path(o).name for o, n in MOVES.items() if n and Path(o).name != Path(n).name and (
    Path(o).name.startswith("vllm_") or Path(o).name in (
        "family_limits.py", "eager_stream.py", "model_base.py", "steer_inputs.py", "module_paths.py"))}


def mod(path: str) -> str:
    p = path[:-3] if path.endswith(".py") else path
    p = p[:-9] if p.endswith("/__init__") else p
    return p.replace("/", ".")


MODULES = {mod(o): mod(n) for o, n in MOVES.items() if n}          # old module -> new module
PATHS = {o: n for o, n in MOVES.items() if n}
PATHS["engine/model.py"] = "engine/model/__init__.py"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def move_files(dry: bool) -> list[str]:
    done = []
    for old, new in MOVES.items():
        src, dst = REPO / old, (REPO / new if new else None)
        if not src.exists():
            continue
        if new is None:
            if not dry:
                git("rm", "-q", old)
            done.append(f"rm {old}")
            continue
        if dst.exists():
            sys.exit(f"house_move: both {old} and {new} exist; merge them by hand, then rerun.")
        if not dry:
            dst.parent.mkdir(parents=True, exist_ok=True)
            git("mv", old, new)
        done.append(f"mv {old} -> {new}")
    return done


def write_inits(dry: bool) -> list[str]:
    done = []
    for path, text in INITS.items():
        p = REPO / path
        if p.exists() and p.read_text() == text:
            continue
        if not dry:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            git("add", path)
        done.append(f"write {path}")
    return done


MOVED_TEMPLATE = '''"""Old module paths (before the house move, issue 20) -> where the module lives now; generated by
scripts/house_move.py from its MOVES table. Importing it (engine/__init__.py does) puts a finder
on sys.meta_path that serves an old name as the new module itself (one module object under both
names, so patching either patches both) with a DeprecationWarning. Removed in the next release;
CHANGELOG.md lists the names."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED: dict[str, str] = {
%s}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # importlib stamped the alias spec on the shared module; put its own back


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        warnings.warn(f"{name} moved to {new}; import it from there (the old path goes away in the next release).",
                      DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())


install()
'''


def write_moved(dry: bool) -> list[str]:
    body = "".join(f'    "{o}": "{n}",\n' for o, n in sorted(MODULES.items()))
    text = MOVED_TEMPLATE % body
    p = REPO / "engine/_moved.py"
    if p.exists() and p.read_text() == text:
        return []
    if not dry:
        p.write_text(text)
        git("add", "engine/_moved.py")
    return ["write engine/_moved.py"]


CHANGELOG_START, CHANGELOG_END = "<!-- HOUSE-MOVE:START -->", "<!-- HOUSE-MOVE:END -->"


def changelog_block() -> str:
    rows = "\n".join(f"| `{o}` | `{n}` |" for o, n in sorted(MODULES.items()))
    shim = "\n".join(f"| `engine.model.{name}` | `{where}.{name}` |" for name, where in SHIM_NAMES["engine.model"].items())
    return f"""{CHANGELOG_START}
## Unreleased: the house move (issue 20)

`engine/` is organized by layer and by process (docs/architecture.md): `core/`, `model/`, `families/`,
`backends/hf/`, `backends/vllm/` (client), `backends/vllm/worker/` (inside vLLM's processes),
`workflows/`, `interop/`. The public names of `engine` (`from engine import load_model, Steer, ...`) are
unchanged. The old module paths below still import, as the same module object, with a
DeprecationWarning (engine/_moved.py); they go away in the next release. Generated by
scripts/house_move.py from its table.

| old module | new module |
|---|---|
{rows}
{shim}

Commands: `python -m engine.docs` is now `python -m engine.interop.docs`. vLLM's
`worker_extension_cls` is `engine.backends.vllm.worker.extension.InterpWorker`.
{CHANGELOG_END}
"""


def write_changelog(dry: bool) -> list[str]:
    p = REPO / "CHANGELOG.md"
    text = p.read_text() if p.exists() else "# Changelog\n\n"
    block = changelog_block()
    if CHANGELOG_START in text:
        a, b = text.index(CHANGELOG_START), text.index(CHANGELOG_END) + len(CHANGELOG_END) + 1
        new = text[:a] + block + text[b:]
    else:
        head, _, rest = text.partition("\n\n")
        new = head + "\n\n" + block + ("\n" + rest if rest else "")
    if new == text:
        return []
    if not dry:
        p.write_text(new)
        git("add", "CHANGELOG.md")
    return ["write CHANGELOG.md"]


# ---- reference rewriting -------------------------------------------------------------------------

_DOTTED = sorted(MODULES, key=len, reverse=True)
_DOTTED_RE = re.compile(r"(?<![\w.])(" + "|".join(re.escape(m) for m in _DOTTED) + r")(?![\w])")
_PATH_RE = re.compile(r"(?<![\w/.-])(" + "|".join(re.escape(p) for p in sorted(PATHS, key=len, reverse=True))
                      + r")(?![\w])")
_BARE_RE = re.compile(r"(?<![\w/.-])(" + "|".join(re.escape(b) for b in sorted(BARE_UNIQUE)) + r")(?![\w])")
_BARE_TO = {Path(o).name: n for o, n in PATHS.items() if Path(o).name in BARE_UNIQUE}
# a from-import, one line or parenthesized over several
_FROM_RE = re.compile(r"^([ \t]*)from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*?)([ \t]*#[^\n]*)?$", re.M)
# string prefixes used to recognise the old vLLM backend files as a group
_PREFIX_RE = re.compile(r"engine/backends/vllm_(?=[\"'])")


def _old_module_of(rel: str) -> str:
    """The module name a file had before the move (relative imports are resolved against it)."""
    for o, n in PATHS.items():
        if n == rel:
            return mod(o)
    return mod(rel)


def _absolute(frm: str, rel: str) -> str:
    if not frm.startswith("."):
        return frm
    level = len(frm) - len(frm.lstrip("."))
    here = _old_module_of(rel).split(".")
    base = here if rel.endswith("__init__.py") else here[:-1]
    base = base[:len(base) - (level - 1)]
    tail = frm[level:]
    return ".".join(base + ([tail] if tail else []))


def _names(spec: str) -> list[tuple[str, str | None]]:
    inner = spec.strip()
    if inner.startswith("("):
        inner = inner[1:-1]
    inner = re.sub(r"#[^\n]*", "", inner)
    out = []
    for part in inner.replace("\n", " ").split(","):
        part = part.strip()
        if not part:
            continue
        bits = part.split()
        out.append((bits[0], bits[2] if len(bits) == 3 and bits[1] == "as" else None))
    return out


def _fmt(indent: str, pkg: str, names: list[tuple[str, str | None]], comment: str) -> str:
    items = ", ".join(n if a is None or a == n else f"{n} as {a}" for n, a in names)
    line = f"{indent}from {pkg} import {items}"
    if len(line) + len(comment) > 120 and len(names) > 1:
        # wrap like the project does: continuation aligned after the opening parenthesis
        head = f"{indent}from {pkg} import ("
        lines, cur = [], head
        for i, (n, a) in enumerate(names):
            item = (n if a is None or a == n else f"{n} as {a}") + (", " if i < len(names) - 1 else ")")
            if len(cur) + len(item.rstrip()) > 120:
                lines.append(cur.rstrip())
                cur = " " * len(head) + item
            else:
                cur += item
        lines.append(cur)
        line = "\n".join(lines)
    return line + (comment or "")


def _rewrite_from(m: re.Match, rel: str) -> str:
    indent, frm, spec, comment = m.group(1), m.group(2), m.group(3), m.group(4) or ""
    pkg = _absolute(frm, rel)
    if not pkg.startswith("engine"):
        return m.group(0)
    names = _names(spec)
    if any(n == "*" for n, _ in names):
        return m.group(0).replace(frm, MODULES.get(pkg, pkg), 1) if pkg in MODULES else m.group(0)
    groups: dict[str, list[tuple[str, str | None]]] = {}
    for n, a in names:
        full = f"{pkg}.{n}"
        if full in MODULES:                       # a submodule imported from its package
            new = MODULES[full]
            parent, leaf = new.rsplit(".", 1)
            groups.setdefault(parent, []).append((leaf, a or n))
        elif pkg in SHIM_NAMES and n in SHIM_NAMES[pkg]:
            groups.setdefault(SHIM_NAMES[pkg][n], []).append((n, a))
        else:
            groups.setdefault(MODULES.get(pkg, pkg), []).append((n, a))
    if list(groups) == [pkg] and not frm.startswith("."):
        return m.group(0)                          # nothing to change
    if list(groups) == [pkg] and frm.startswith(".") and _old_module_of(rel) == mod(rel):
        return m.group(0)                          # a relative import in a file that did not move, to a module that did not
    out = [_fmt(indent, p, ns, comment if i == 0 else "") for i, (p, ns) in enumerate(groups.items())]
    return "\n".join(out)


def rewrite_text(text: str, rel: str) -> str:
    if rel.endswith(".py"):
        text = _FROM_RE.sub(lambda m: _rewrite_from(m, rel), text)
    text = _DOTTED_RE.sub(lambda m: MODULES[m.group(1)], text)
    text = _PATH_RE.sub(lambda m: PATHS[m.group(1)], text)
    text = _BARE_RE.sub(lambda m: _BARE_TO[m.group(1)], text)
    text = _PREFIX_RE.sub("engine/backends/vllm/", text)
    return text


def scope_files() -> list[Path]:
    files = []
    for entry in SCOPE:
        p = REPO / entry
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += [f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES
                      and not SKIP_PARTS & set(f.relative_to(REPO).parts)]
    return sorted(f for f in files if f.relative_to(REPO).as_posix() not in SELF)


def rewrite_all(dry: bool) -> list[str]:
    done = []
    for f in scope_files():
        rel = f.relative_to(REPO).as_posix()
        try:
            old = f.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_text(old, rel)
        if new != old:
            if not dry:
                f.write_text(new)
            done.append(f"rewrite {rel}")
    return done


def apply_patches(dry: bool) -> tuple[list[str], list[str]]:
    done, missing = [], []
    for rel, old, new in PATCHES:
        rel = PATHS.get(rel, rel)  # a moved file is patched where it lives now
        p = REPO / rel
        text = p.read_text() if p.exists() else ""
        if old not in text:
            if new not in text and rewrite_text(new, rel) not in text:
                missing.append(f"{rel}: neither the old nor the new text is there; apply this edit by hand:\n{new}")
            continue
        if not dry:
            p.write_text(text.replace(old, new))
        done.append(f"patch {rel}")
    return done, missing


def sort_imports() -> list[str]:
    """The rewritten import blocks sorted the way the lint step checks them (ruff's isort, pyproject.toml)."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        print("house_move: WARNING ruff is not installed (scripts/setup.sh installs it): imports left unsorted; "
              "run `ruff check --select I --fix engine` once it is.", file=sys.stderr)
        return []
    out = subprocess.run([str(ruff), "check", "--select", "I", "--fix", "--quiet", "engine"], cwd=REPO,
                         capture_output=True, text=True)
    return [f"sort imports in engine/ (ruff): {out.stdout.strip() or 'ok'}"] if out.returncode in (0, 1) else []


def unknown_files() -> list[str]:
    known = set(MOVES.values()) | set(STAYS) | set(INITS)
    out = []
    for f in sorted((REPO / "engine").rglob("*.py")):
        rel = f.relative_to(REPO).as_posix()
        if "__pycache__" in rel or rel in known or rel in MOVES:
            continue
        if rel.startswith(STAY_DIRS):
            continue
        out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    ap.add_argument("--strict", action="store_true", help="exit 1 when engine/ has files the table does not know")
    args = ap.parse_args(argv)
    log = move_files(args.dry_run) + write_inits(args.dry_run) + write_moved(args.dry_run)
    log += write_changelog(args.dry_run)
    patched, missing = apply_patches(args.dry_run)  # before the rewrite: the patches quote the old layout
    log += patched + rewrite_all(args.dry_run)
    if not args.dry_run:
        log += sort_imports()
    print("\n".join(log) if log else "house_move: nothing to do (already moved)")
    unknown = unknown_files()
    for rel in unknown:
        print(f"house_move: WARNING {rel} is not in the MOVES table: left in place (its imports were rewritten); "
              f"add a row to MOVES in scripts/house_move.py and run again.", file=sys.stderr)
    for msg in missing:
        print(f"house_move: WARNING {msg}", file=sys.stderr)
    return 1 if (args.strict and unknown) or missing else 0


if __name__ == "__main__":
    sys.exit(main())
