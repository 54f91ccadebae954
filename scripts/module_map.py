"""Which project modules each test file imports: the scan behind tests/module_map.py.

    python scripts/module_map.py            the draft table: module -> the test files that import it
    python scripts/module_map.py MODULE...  the test files importing each module (e.g. engine/zoo/names.py)

tests/module_map.py is the checked table (tests/test_module_map.py); this scan drafts it and
suggests rows for a new module. It reads imports with `ast` (module level and inside functions),
`from engine.x import y` counting y when y is a module, else engine.x and the module that defines y
(found by importing engine.x: a re-exported name is claimed for the module that defines it too). It cannot see a module reached only through another module (a helper
of tests/ or a subprocess): that is what the hand-made table adds.
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "validator", "benchmarks", "visualizer_data")


def modules() -> list[str]:
    """Every module file of the checked packages, repo-relative ("engine/core/address.py")."""
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def module_file(dotted: str) -> str | None:
    """engine.core.address -> engine/core/address.py; a package -> its __init__.py; None if neither."""
    base = ROOT.joinpath(*dotted.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return str(p.relative_to(ROOT))
    return None


def _defined_in(package: str, name: str) -> str | None:
    """The module that defines `name` as `package` exports it (None when it cannot be imported)."""
    try:
        obj = getattr(importlib.import_module(package), name)
    except Exception:  # noqa: BLE001  (a draft: an import that fails here leaves the package's own row)
        return None
    where = getattr(obj, "__module__", None)
    return module_file(where) if isinstance(where, str) and where.split(".")[0] in PACKAGES else None


def imported(test_file: Path) -> set[str]:
    """The project module files a test file imports (module level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES and (f := module_file(a.name)):
                    out.add(f)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PACKAGES:
            pkg = module_file(node.module)
            for a in node.names:
                sub = module_file(f"{node.module}.{a.name}")
                if sub:
                    out.add(sub)
                    continue
                if pkg:
                    out.add(pkg)
                if pkg and (d := _defined_in(node.module, a.name)):
                    out.add(d)
    return out


def scan(tests_dir: Path = ROOT / "tests") -> dict[str, list[str]]:
    """module file -> the test files (names) that import it; modules no test imports map to []."""
    table: dict[str, list[str]] = {m: [] for m in modules()}
    for t in sorted(tests_dir.glob("test_*.py")):
        for m in imported(t):
            if m in table:
                table[m].append(t.name)
    return table


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    table = scan()
    if argv:
        for m in argv:
            print(f"{m}: {', '.join(table.get(m, [])) or '(no test imports it)'}")
        return 0
    for m, ts in table.items():
        print(f"    {m!r}: ({', '.join(repr(t) for t in ts)}{',' if len(ts) == 1 else ''}),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
