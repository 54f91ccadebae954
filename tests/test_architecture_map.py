"""docs/architecture.md tells the truth (issue 36 item 6): its tree names every module of engine/ and
nothing else, every file it names under "How to add" exists, and each dry run's files (the table
"The dry runs") are exactly where a scan of the code finds the existing addition by name, so a
count on the page cannot drift from the code. A module added without its line, or a new file naming
`bloom` / `vllm-static` / ..., fails here with the line to write."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("engine", "validator", "benchmarks", "visualizer_data")
DESCRIPTION_COLUMN = 27  # a tree line indented this far continues the description above it


# -- the tree -------------------------------------------------------------------------------------
def _section(text: str, heading: str) -> str:
    """The text under a heading (any level) up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.M)
    assert m, f"docs/architecture.md has no heading {heading!r}"
    level = len(m.group(1))
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def parse_tree(block: str) -> list[str]:
    """The repo-relative paths of a tree drawing: each entry `name/` or `name.py`, two spaces of indent
    per level, a description after two or more spaces; lines indented to DESCRIPTION_COLUMN continue
    a description. Anything else is an error naming the line."""
    stack: list[str] = []
    out = []
    for n, line in enumerate(block.splitlines(), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION_COLUMN:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_]+(?:/|\.py))(?:\s{2,}\S.*)?", line[indent:])
        if not m or indent % 2 or indent // 2 > len(stack):
            raise ValueError(f"tree line {n} is not `<two spaces per level><name>.py|<name>/  <what it holds>`: "
                             f"{line!r}")
        del stack[indent // 2:]
        name = m.group(1)
        if name.endswith("/"):
            stack.append(name[:-1])
        else:
            out.append("/".join([*stack, name]))
    return out


def _doc_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def tree_problems(listed: list[str], modules: list[str], doc_only=lambda m: False) -> list[str]:
    """How the tree and engine/'s modules disagree, one line each naming the fix."""
    out = [f"{m} is missing from the tree in docs/architecture.md: add its line under its folder"
           for m in modules if m not in listed and not doc_only(m)]
    out += [f"{m} is in the tree in docs/architecture.md, but there is no such module: drop its line"
            for m in listed if m not in modules]
    out += [f"{m} holds only a docstring: the tree lists a folder's __init__.py only where it holds code"
            for m in listed if m in modules and doc_only(m)]
    out += [f"{m} is listed twice in the tree" for m in sorted({m for m in listed if listed.count(m) > 1})]
    return out


def _engine_modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py") if "__pycache__" not in p.parts)


def _tree_block() -> str:
    block = re.search(r"```\n(engine/\n.*?)```", _section(DOC.read_text(), "The tree"), re.S)
    assert block, "docs/architecture.md's tree section has no ``` block starting with engine/"
    return block.group(1)


def test_the_tree_names_every_module_of_engine():
    bad = tree_problems(parse_tree(_tree_block()), _engine_modules(), lambda m: _doc_only(ROOT / m))
    assert not bad, "\n".join(bad)


def test_the_rules_table_has_a_row_for_every_package():
    rows = re.findall(r"^\| `([a-z_.]+)`", _section(DOC.read_text(), "Layer rules"), re.M)
    packages = {f"engine.{p.name}" for p in (ROOT / "engine").iterdir() if (p / "__init__.py").is_file()}
    wanted = (packages - {"engine.backends"}) | {"engine.backends.hf", "engine.backends.vllm",
                                                 "engine.backends.vllm.worker", "engine.loading", "engine",
                                                 "validator", "benchmarks", "visualizer_data"}
    assert not wanted - set(rows), f"no row in the layer rules for {sorted(wanted - set(rows))}"


# -- files to touch ---------------------------------------------------------------------------------
def _named_paths(text: str) -> list[str]:
    """Backticked repo paths (`engine/core/ops.py`, `engine/backends/vllm/`); placeholders like
    `engine/families/<family>.py`, globs and generated outputs aside."""
    out = []
    for tok in re.findall(r"`([^`\s]+)`", text):
        if tok.split("/")[0] in (*PACKAGES, "tests", "docs", "scripts") and "/" in tok \
                and not re.search(r"[<*]", tok) and re.fullmatch(r"[\w./-]+", tok):
            out.append(tok)
    return out


def test_every_file_named_under_how_to_add_exists():
    named = _named_paths(_section(DOC.read_text(), "How to add"))
    assert len(named) > 40  # the parse finds the lists
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


# -- the dry runs ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _read(path: str) -> tuple[frozenset, frozenset]:
    """(string constants of a module, docstrings aside, split at | and ,; its identifiers: names,
    attributes, keywords, imported names, definitions) and its attribute + keyword names."""
    tree = ast.parse((ROOT / path).read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    strings = {t.strip() for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docs for t in re.split(r"[|,]", n.value)}
    names, fields = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            fields.add(n.attr)
        elif isinstance(n, ast.keyword) and n.arg:
            fields.add(n.arg)
        elif isinstance(n, ast.alias):
            names.add(n.asname or n.name.split(".")[-1])
        elif isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
    return frozenset(strings), frozenset(names | fields), frozenset(fields)


def _project_modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=None)
def _family_words(family: str) -> frozenset:
    """A family's model types, the zoo checkpoints of those types and their HF causal-LM classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CLASSES

    from engine import zoo
    from engine.families.base import load_all, registry
    load_all()
    types = {t for t, f in registry().items() if f.name == family}
    assert types, f"no registered family is named {family!r}"
    return frozenset(types | {n for n, e in zoo.ZOO.items() if e.model_type in types}
                     | {CLASSES[t] for t in types if t in CLASSES})


def scan(probe: str) -> set[str]:
    """The modules that name what a probe (`string X`, `name X`, `field X`, `family X`) looks for."""
    kind, _, word = probe.partition(" ")
    hits = set()
    for m in _project_modules():
        strings, names, fields = _read(m)
        if kind == "string":
            found = word in strings
        elif kind == "name":
            found = word in names or word in strings
        elif kind == "field":
            found = word in fields or word in strings
        elif kind == "family":
            found = bool(_family_words(word) & strings)
        else:
            raise ValueError(f"unknown probe kind {kind!r} in {probe!r}: string, name, field or family")
        if found:
            hits.add(m)
    return hits


def dry_runs(text: str) -> dict[str, dict]:
    """The rows of "The dry runs": addition -> probes, and the files of each column."""
    rows = {}
    for line in _section(text, "The dry runs").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("addition", "") or set(cells[0]) <= {"-"}:
            continue
        rows[cells[0]] = {"probes": re.findall(r"`([^`]+)`", cells[1]), "always": _named_paths(cells[2]),
                          "when": _named_paths(cells[3]), "no_edit": _named_paths(cells[4])}
    return rows


def dry_run_problems(addition: str, row: dict, found: set[str]) -> list[str]:
    """How a row's files differ from the scan of its probes, each naming the fix."""
    listed = row["always"] + row["when"] + row["no_edit"]
    out = [f"{addition}: {m} names {' / '.join(row['probes'])}; add it to the row (always, when, or no edit) "
           f"and its section, or rename" for m in sorted(found - set(listed))]
    out += [f"{addition}: {m} is in the row but no longer names {' / '.join(row['probes'])}: drop it and "
            f"lower the section's count" for m in listed if m not in found]
    out += [f"{addition}: {m} is in two columns" for m in sorted({m for m in listed if listed.count(m) > 1})]
    return out


ADDITIONS = ("family", "steering op", "vLLM mode", "runtime", "point", "readout kind")
SECTIONS = {"family": "A family", "steering op": "A steering op", "vLLM mode": "A backend of an existing runtime",
            "runtime": "A backend of a new runtime", "point": "A point", "readout kind": "A readout kind"}


def test_every_kind_of_addition_has_a_dry_run():
    assert set(dry_runs(DOC.read_text())) == set(ADDITIONS)


@pytest.mark.parametrize("addition", ADDITIONS)
def test_a_dry_run_lists_exactly_the_files_that_name_it(addition):
    text = DOC.read_text()
    row = dry_runs(text)[addition]
    found = set().union(*(scan(p) for p in row["probes"]))
    assert found, f"{addition}: the probes {row['probes']} find nothing"
    bad = dry_run_problems(addition, row, found)
    assert not bad, "\n".join(bad)
    section = _section(text, SECTIONS[addition])
    named = set(_named_paths(section))
    always = [m if not m.startswith("engine/families/") else "engine/families/<family>.py" for m in row["always"]]
    assert not [m for m in row["always"] + row["when"] if m not in named and m not in always
                and not m.startswith("engine/families/")], f"{addition}: its section does not name every file of the row"
    count = re.search(r"Always (\d+) files?", section)
    if count:  # the section's counts are the row's
        assert int(count.group(1)) == len(row["always"]), f"{addition}: 'Always {count.group(1)}' but the row has " \
                                                          f"{len(row['always'])}"
        more = re.search(r"[Uu]p to (\d+) more", section)
        assert more and int(more.group(1)) == len(row["when"]), f"{addition}: 'up to N more' but the row has " \
                                                                f"{len(row['when'])}"


def test_every_family_is_named_in_the_four_files_and_the_range_is_true():
    from engine.families.base import load_all, registry
    load_all()
    counts = {}
    for family in sorted({f.name for f in registry().values()}):
        found = scan(f"family {family}")
        counts[family] = len(found)
        always = {"engine/zoo/entries.py", "engine/zoo/real.py", "validator/engines/hf_layouts.py"}
        assert always <= found, f"{family} is not named in {sorted(always - found)}"
        assert any(m.startswith("engine/families/") for m in found), f"{family}: no family module names it"
    stated = re.search(r"finds each in (\d+) to (\d+) files \((\w+) the most; (\w+)\s+aside",
                       _section(DOC.read_text(), "A family"))
    assert stated, "the family section states no range"
    lo, hi, most, aside = int(stated.group(1)), int(stated.group(2)), stated.group(3), stated.group(4)
    assert counts.pop(aside) > hi  # the commands' default model: named wherever a command defaults to it
    assert (min(counts.values()), max(counts.values())) == (lo, hi), counts
    assert counts[most] == hi


# -- the checks fail where they should: synthetic trees and rows ------------------------------------
_TREE = """engine/
  __init__.py              the surface
  core/                    the core
    a.py                   one module
                           its description goes on
"""


def test_the_tree_parser_reads_nesting_and_descriptions():
    assert parse_tree(_TREE) == ["engine/__init__.py", "engine/core/a.py"]


@pytest.mark.parametrize("block", [_TREE + "      b.py   too deep\n", _TREE + "   odd.py  odd indent\n",
                                   _TREE + "  c.txt          not a module\n"])
def test_a_malformed_tree_line_is_named(block):
    with pytest.raises(ValueError, match=r"tree line 6 is not"):
        parse_tree(block)


@pytest.mark.parametrize("modules,expected", [
    (["engine/__init__.py", "engine/core/a.py", "engine/core/new.py"],
     "engine/core/new.py is missing from the tree in docs/architecture.md: add its line"),
    (["engine/__init__.py"], "engine/core/a.py is in the tree in docs/architecture.md, but there is no such module"),
])
def test_a_module_added_or_removed_without_the_tree_fails(modules, expected):
    bad = tree_problems(parse_tree(_TREE), modules)
    assert any(b.startswith(expected) for b in bad), bad
    assert tree_problems(parse_tree(_TREE), ["engine/__init__.py", "engine/core/a.py"]) == []


def test_a_package_marker_is_not_required_but_may_not_be_listed():
    modules = ["engine/__init__.py", "engine/core/a.py", "engine/core/__init__.py"]
    assert tree_problems(parse_tree(_TREE), modules, lambda m: m == "engine/core/__init__.py") == []
    assert tree_problems(parse_tree(_TREE), modules[:2], lambda m: m == "engine/__init__.py") == [
        "engine/__init__.py holds only a docstring: the tree lists a folder's __init__.py only where it holds code"]


def test_a_dry_run_row_that_drifted_from_the_scan_is_named():
    text = ("### The dry runs\n| addition | probe | edit always | edit when | names it, no edit |\n|---|---|---|---|---|\n"
            "| op | `string x` | `engine/a.py` | `engine/b.py` | |\n")
    row = dry_runs(text)["op"]
    assert row == {"probes": ["string x"], "always": ["engine/a.py"], "when": ["engine/b.py"], "no_edit": []}
    assert dry_run_problems("op", row, {"engine/a.py", "engine/b.py"}) == []
    assert dry_run_problems("op", row, {"engine/a.py", "engine/b.py", "engine/c.py"}) == [
        "op: engine/c.py names string x; add it to the row (always, when, or no edit) and its section, or rename"]
    assert dry_run_problems("op", row, {"engine/a.py"}) == [
        "op: engine/b.py is in the row but no longer names string x: drop it and lower the section's count"]


def test_the_scan_tells_strings_names_and_fields_apart(tmp_path, monkeypatch):
    mod = tmp_path / "engine" / "m.py"
    mod.parent.mkdir()
    mod.write_text('"""vllm-static in a docstring is prose."""\nfrom x import Max\n'
                   'A = {"vllm|vllm-static": 1}\nbounds = 3\n')
    other = tmp_path / "engine" / "n.py"
    other.write_text("def f(s):\n    return s.bounds\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    _read.cache_clear()
    try:
        assert scan("string vllm-static") == {"engine/m.py"}
        assert scan("name Max") == {"engine/m.py"}
        assert scan("field bounds") == {"engine/n.py"}  # a variable named bounds is not the field
        assert scan("string prose") == set()
    finally:
        _read.cache_clear()
