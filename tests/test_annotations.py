"""Issue 20 rule 7: every public function in engine/ carries type annotations.

A public function or method is one whose name does not start with ``_`` (plus ``__init__``); it
needs an annotation on every parameter except ``self``/``cls`` and a return annotation. Nested
functions (closures) are private to their enclosing function and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"
# The folders of engine/ this test checks ("." = the modules at engine/'s top): every one of them.
CHECKED = (".", "core", "model", "families", "interop", "workflows", "backends", "serve", "harvest", "zoo")


def _is_public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if method and params and params[0].arg in ("self", "cls") and not _is_static(fn):
        params = params[1:]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    missing = [p.arg for p in params if p.annotation is None]
    if fn.returns is None:
        missing.append("return")
    return missing


def _is_static(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def offenders(root: Path = ENGINE) -> list[str]:
    """Every public function or method under ``root`` lacking an annotation, as ``file:line name (what)``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root.parent)

        def visit(body: list[ast.stmt], method: bool) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    visit(node.body, True)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_public(node.name):
                    missing = _missing(node, method)
                    if missing:
                        found.append(f"{rel}:{node.lineno} {node.name} (missing: {', '.join(missing)})")
                elif isinstance(node, (ast.If, ast.Try)):
                    visit(node.body + node.orelse, method)

        visit(tree.body, False)
    return found


def _checked(line: str) -> bool:
    parts = Path(line.split(":")[0]).parts  # ("engine", folder, ...) or ("engine", "x.py")
    return (parts[1] if len(parts) > 2 else ".") in CHECKED


def test_public_functions_in_engine_are_annotated():
    bad = [line for line in offenders() if _checked(line)]
    assert not bad, f"{len(bad)} public functions without full annotations:\n" + "\n".join(bad)


def test_check_finds_a_missing_annotation(tmp_path):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def ok(a: int) -> int:\n    return a\n"
        "def bad(a, b: int):\n    return a\n"
        "def _private(a):\n    return a\n"
        "class C:\n"
        "    def __init__(self, x):\n        pass\n"
        "    def m(self) -> None:\n        pass\n"
        "    @staticmethod\n    def s(self) -> None:\n        pass\n"
        "    def __repr__(self):\n        return ''\n"
    )
    assert offenders(pkg) == [
        "engine/m.py:3 bad (missing: a, return)",
        "engine/m.py:8 __init__ (missing: x, return)",
        "engine/m.py:13 s (missing: self)",
    ]
