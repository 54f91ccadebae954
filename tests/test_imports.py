"""The import graph of the code (engine/, validator/, benchmarks/, visualizer_data/), read from the source
with ast: no cycle, counting imports inside functions too (a deferred import only hides a cycle), and the
layer rules of docs/architecture.md. A regression here means a module imports upward: move the shared
piece down a layer instead of deferring the import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "validator", "benchmarks", "visualizer_data")
HEAVY = ("transformers", "vllm")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[str]:
    """Every module `name` imports (absolute names; `from pkg import sub` counts as pkg.sub when sub is a
    module), at module level and inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(sub if sub in MODULES else base)
    return out


GRAPH = {m: sorted({i for i in _imports(m, p) if i in MODULES and i != m}) for m, p in MODULES.items()}
EXTERNAL = {m: {i.split(".")[0] for i in _imports(m, p)} for m, p in MODULES.items()}


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_walker_sees_real_edges():
    # the graph is read from the source: a known module-level and a known deferred edge are there
    assert "engine.core.errors" in GRAPH["engine.core.address"]
    assert "engine.backends.hf.eager" in GRAPH["engine.loading"]  # imported inside load_model
    assert len(MODULES) > 150


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (module-level or deferred): " + "; ".join(" <-> ".join(c) for c in cycles)


def _violations(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{m} imports {i}" for m in GRAPH if _under(m, source) for i in GRAPH[m]
            if any(_under(i, f) for f in forbidden)]


LAYER_RULES = [
    # (who, may not import, why)
    ("engine.core", ("engine.model", "engine.families", "engine.backends", "engine.workflows", "engine.interop",
                     "engine.serve", "engine.harvest", "engine.loading", "engine.zoo", "engine.remote"),
     "core is the bottom layer"),
    ("engine.zoo", ("engine.model", "engine.families", "engine.backends", "engine.workflows", "engine.interop",
                    "engine.serve", "engine.harvest", "engine.remote", "engine.loading"),
     "the zoo builds twins from its own table, below every model class"),
    ("engine.model", ("engine.backends", "engine.workflows", "engine.interop", "engine.serve", "engine.harvest",
                      "engine.loading"), "the model surface is backend-free"),
    ("engine.families", ("engine.model", "engine.backends", "engine.workflows", "engine.interop", "engine.serve",
                         "engine.harvest", "engine.loading"), "families are tables over core"),
    ("engine.backends.vllm.worker", ("engine.backends.vllm.backend", "engine.backends.vllm.client",
                                     "engine.backends.vllm.runtime", "engine.backends.vllm.catalogue",
                                     "engine.backends.vllm.proof", "engine.backends.hf", "engine.loading"),
     "the worker runs inside vLLM's processes and never imports the client side"),
    ("engine.interop", ("engine.backends", "engine.workflows", "engine.loading", "engine.serve", "engine.harvest"),
     "interop maps names on any model passed in (the backends use its mappers)"),
    ("engine.backends.vllm", ("engine.backends.hf",), "the two backends are siblings"),
    ("engine.backends.hf", ("engine.backends.vllm",), "the two backends are siblings"),
    ("engine.workflows", ("engine.backends", "engine.loading", "engine.serve", "engine.harvest"),
     "workflows take any model"),
    ("engine", ("validator", "benchmarks", "visualizer_data"), "the engine never imports the harness"),
    ("engine.remote", ("engine.backends", "engine.loading", "engine.families", "engine.harvest", "engine.zoo",
                       "engine.workflows", "engine.interop",
                       *[m for m in MODULES if _under(m, "engine.serve")
                         and m not in ("engine.serve", "engine.serve.wire", "engine.serve.encoding")]),
     "a client of a model server imports the engine's core and the server's wire pieces, never a backend"),
    ("engine.loading", ("engine.serve", "engine.harvest", "engine.remote", "engine.workflows"),
     "load_model sits below the server, the harvester and the remote client"),
    ("engine.serve", ("engine.harvest", "engine.remote"), "the server and the harvester are siblings; remote is its client"),
    ("engine.harvest", ("engine.serve", "engine.remote"), "the harvester and the server are siblings"),
    ("validator", ("benchmarks", "visualizer_data"), "the validator is a harness of its own; visualizer_data renders it"),
    ("benchmarks", ("visualizer_data",), "visualizer_data renders what benchmarks hands it, not the reverse"),
]


# the only edges that cross a rule, each with its reason (none: benchmarks publishes its report, README
# block and plots; the site's data file of the same cells is visualizer_data's own command)
ALLOWED: set[str] = set()


@pytest.mark.parametrize("who,forbidden,why", LAYER_RULES, ids=[r[0] for r in LAYER_RULES])
def test_layer_rule(who, forbidden, why):
    bad = [v for v in _violations(who, forbidden) if v not in ALLOWED]
    assert not bad, f"{why}: " + "; ".join(bad)


def test_core_imports_no_model_library():
    bad = [f"{m} imports {x}" for m in EXTERNAL if _under(m, "engine.core") for x in EXTERNAL[m] & set(HEAVY)]
    assert not bad, "engine/core must not import transformers or vllm (not even inside a function): " + "; ".join(bad)


def test_layer_rule_checker_catches_an_upward_import(monkeypatch):
    monkeypatch.setitem(GRAPH, "engine.core.points", [*GRAPH["engine.core.points"], "engine.backends.hf.sites"])
    assert _violations("engine.core", ("engine.backends",)) == ["engine.core.points imports engine.backends.hf.sites"]


def test_no_pre_move_path_is_forwarded():
    """No release had the pre-move paths (issue 36): importing engine installs no alias finder, an
    old path fails to import, and engine.model forwards no old names."""
    import importlib
    import sys

    import engine
    import engine.model
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("engine")]
    for old in ("engine.steering", "engine.backends.vllm_backend", "engine.points"):
        with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
            importlib.import_module(old)
    assert not hasattr(engine.model, "EagerModel") and hasattr(engine, "load_model")
