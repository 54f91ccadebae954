"""Tests follow the code (issue 36 item 6): tests/module_map.py names the tests of every module of
engine/, validator/, benchmarks/ and visualizer_data/, or says why it has none; every test file it
names exists, and every test file is claimed. A module added without a row, a renamed test, or a
test no module claims fails here, with the scan's suggestion (scripts/module_map.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import module_map
from scripts.module_map import PACKAGES, ROOT, imported

TESTS_DIR = ROOT / "tests"
DOC_ONLY = "docstring only"


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _doc_only(module: str) -> bool:
    body = ast.parse((ROOT / module).read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def _is_test_file(path: Path) -> bool:
    """A test_*.py at the top of tests/ that holds a test (test_vllm_common.py holds only helpers)."""
    return path.parent == TESTS_DIR and path.name.startswith("test_") and any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name.startswith(("test_", "Test"))
        for n in ast.parse(path.read_text()).body)


def _test_files() -> tuple[list[str], list[str]]:
    """(the test files' names, the other .py files of tests/ relative to it)."""
    paths = sorted(p for p in TESTS_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    return [p.name for p in paths if _is_test_file(p)], \
        [str(p.relative_to(TESTS_DIR)) for p in paths if not _is_test_file(p)]


def problems(modules: list[str], test_files: list[str], other_files: list[str], tests: dict, untested: dict,
             beyond: dict, helpers: dict, doc_only=lambda m: False, suggest=lambda m: []) -> list[str]:
    """Every way the table disagrees with the tree, one line each naming the entry and the fix."""
    out = []
    for m in modules:
        if m not in tests and m not in untested:
            seen = suggest(m)
            out.append(f"{m} is in neither TESTS nor UNTESTED of tests/module_map.py: "
                       + (f"tests importing it: {', '.join(seen)}" if seen else
                          "no test imports it; name the tests that exercise it, or say in UNTESTED why none does"))
    for m in sorted(set(tests) & set(untested)):
        out.append(f"{m} is in both TESTS and UNTESTED: keep one")
    for m in sorted(set(tests) | set(untested)):
        if m not in modules:
            out.append(f"{m} is listed in tests/module_map.py but is not a module of {', '.join(PACKAGES)}: drop its row")
    for m, ts in sorted(tests.items()):
        if not ts:
            out.append(f"{m}: TESTS lists no test file; list them, or move it to UNTESTED with why")
        for t in ts:
            if t not in test_files:
                out.append(f"{m}: its test {t} is not a test file in tests/ (renamed or removed?)")
    for m, why in sorted(untested.items()):
        if not why or not why.strip():
            out.append(f"{m}: UNTESTED needs the reason in one phrase")
        elif why.startswith(DOC_ONLY) != doc_only(m):
            out.append(f"{m}: UNTESTED says {why!r}, but the module " +
                       ("is docstring only: say so" if doc_only(m) else "has code: say why no test covers it"))
    claimed = {t for ts in tests.values() for t in ts}
    for t in test_files:
        if t not in claimed and t not in beyond:
            out.append(f"tests/{t} is claimed by no module in TESTS and is not in BEYOND_MODULES: add it to the "
                       f"rows of the modules it tests")
    for t in sorted(beyond):
        if t not in test_files:
            out.append(f"BEYOND_MODULES names {t}, which is not a test file in tests/")
    for f in other_files:
        if f not in helpers:
            out.append(f"tests/{f} is neither a test file nor in HELPERS of tests/module_map.py: say what it holds")
    for f in sorted(helpers):
        if f not in other_files:
            out.append(f"HELPERS names {f}, which is not in tests/")
    return out


def _suggest(module: str) -> list[str]:
    return sorted(p.name for p in TESTS_DIR.glob("test_*.py") if _is_test_file(p) and module in imported(p))


def test_the_table_matches_the_tree():
    test_files, others = _test_files()
    bad = problems(_modules(), test_files, others, module_map.TESTS, module_map.UNTESTED,
                   module_map.BEYOND_MODULES, module_map.HELPERS, _doc_only, _suggest)
    assert not bad, "\n".join(bad)


def test_the_table_covers_every_package_it_claims_to():
    listed = set(module_map.TESTS) | set(module_map.UNTESTED)
    for pkg in PACKAGES:
        assert any(m.startswith(f"{pkg}/") for m in listed), pkg
    assert "engine/core/address.py" in module_map.TESTS and "test_address.py" in module_map.TESTS[
        "engine/core/address.py"]


# a synthetic tree: one module with a test, one package marker; each case breaks it one way
_MODS = ["engine/a.py", "engine/__init__.py"]
_TESTS = {"engine/a.py": ("test_a.py",)}
_UNTESTED = {"engine/__init__.py": "docstring only (a package's description)"}


def _check(modules=_MODS, test_files=("test_a.py",), other=("conftest.py",), tests=_TESTS, untested=_UNTESTED,
           beyond=None, helpers=None, suggest=lambda m: []):
    return problems(list(modules), list(test_files), list(other), tests, untested, beyond or {},
                    helpers if helpers is not None else {"conftest.py": "fixtures"},
                    lambda m: m.endswith("__init__.py"), suggest)


def test_the_synthetic_tree_is_clean():
    assert _check() == []


@pytest.mark.parametrize("kw,expected", [
    (dict(modules=[*_MODS, "engine/new.py"]),
     "engine/new.py is in neither TESTS nor UNTESTED of tests/module_map.py: no test imports it"),
    (dict(modules=[*_MODS, "engine/new.py"], suggest=lambda m: ["test_new.py"]),
     "engine/new.py is in neither TESTS nor UNTESTED of tests/module_map.py: tests importing it: test_new.py"),
    (dict(modules=["engine/__init__.py"]), "engine/a.py is listed in tests/module_map.py but is not a module"),
    (dict(test_files=["test_b.py"]), "engine/a.py: its test test_a.py is not a test file in tests/"),
    (dict(test_files=["test_a.py", "test_b.py"]), "tests/test_b.py is claimed by no module in TESTS"),
    (dict(tests={"engine/a.py": ()}), "engine/a.py: TESTS lists no test file"),
    (dict(tests={}, untested={**_UNTESTED, "engine/a.py": " "}), "engine/a.py: UNTESTED needs the reason"),
    (dict(tests={}, untested={**_UNTESTED, "engine/a.py": "docstring only"}),
     "engine/a.py: UNTESTED says 'docstring only', but the module has code"),
    (dict(untested={"engine/__init__.py": "too hard"}), "engine/__init__.py: UNTESTED says 'too hard', but the module "
                                                         "is docstring only"),
    (dict(untested={**_UNTESTED, "engine/a.py": "x"}), "engine/a.py is in both TESTS and UNTESTED"),
    (dict(other=["conftest.py", "helper.py"]), "tests/helper.py is neither a test file nor in HELPERS"),
    (dict(helpers={"conftest.py": "f", "gone.py": "g"}), "HELPERS names gone.py, which is not in tests/"),
    (dict(beyond={"test_gone.py": "x"}), "BEYOND_MODULES names test_gone.py, which is not a test file"),
])
def test_each_disagreement_is_named(kw, expected):
    bad = _check(**kw)
    assert any(b.startswith(expected) for b in bad), bad


def test_the_scan_reads_direct_and_deferred_imports(tmp_path: Path):
    t = tmp_path / "test_x.py"
    t.write_text("from engine.core import address\nimport engine.core.points\n\n"
                 "def test_f():\n    from engine.harvest import runner\n    from engine import Steer\n")
    got = imported(t)
    assert {"engine/core/address.py", "engine/core/points.py", "engine/harvest/runner.py",
            "engine/__init__.py", "engine/core/steering.py"} <= got  # Steer: the package and its own module
    assert "engine/core/__init__.py" not in got  # `from engine.core import address` names the module itself
