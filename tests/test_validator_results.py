"""Results are never clobbered: the main job run twice writes nothing the second time; ad-hoc runs go to
their own directory; cells of other variants sit beside the published ones; an error never replaces a
passing cell; --layers that do not fit one model fail that model only, and the reports still render."""
from pathlib import Path

import pytest

from validator import cells, cli, exits, outputs, report, runner
from validator.models import zoo_spec
from validator.variant import PUBLISHED, Variant

GPT2 = "openai-community/gpt2"  # 2 layers
QUICK = ["--engines", "hf", "--points", "resid_post,lm_head"]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_main_job_twice_writes_nothing_the_second_time(tmp_path, capsys):
    argv = ["run", "--models", GPT2, "--engines", "hf", "--out", str(tmp_path)]  # the published variant
    assert cli.main(argv) == exits.OK
    first = _snapshot(tmp_path)
    assert f"cells/{cells.slug(GPT2)}__hf.json.gz" in first and "README.md" in first and "heatmap.png" in first
    capsys.readouterr()
    assert cli.main(argv) == exits.OK
    assert _snapshot(tmp_path) == first  # nothing recomputed, nothing rewritten, nothing added
    err = capsys.readouterr().err
    assert "0 cells to compute, 1 up to date" in err
    assert cli.main(argv + ["--check"]) == exits.OK
    assert "validator: 0 of 1 cells" in capsys.readouterr().err
    path = cells.cell_path(tmp_path, GPT2, "hf")
    stale = cells.read(path)
    stale["inputs_digest"] = "0" * 16  # as if the code that computed it had changed
    path.write_bytes(cells.encode(stale))
    assert cli.main(argv + ["--check"]) == exits.FAILED
    assert f"stale or missing: {GPT2} / hf" in capsys.readouterr().err


def test_adhoc_run_never_touches_the_published_directory(tmp_path, monkeypatch, capsys):
    published, runs = tmp_path / "published", tmp_path / "runs"
    monkeypatch.setattr(outputs, "DEFAULT_OUT", published)
    monkeypatch.setattr(outputs, "RUNS", runs)
    assert cli.main(["run", "--models", GPT2, *QUICK, "--no-decode", "--no-steer"]) == exits.OK
    assert not published.exists()
    made = sorted(p.relative_to(runs).as_posix() for p in runs.rglob("*.json.gz"))
    assert made == ["gpt2+points-lm_head.resid_post+no-decode+no-steer/cells/"
                    "openai-community__gpt2__hf@points-lm_head.resid_post+no-decode+no-steer.json.gz"]
    assert "(ad-hoc run)" in capsys.readouterr().err


@pytest.mark.parametrize("variant, models, all_models, where", [
    (PUBLISHED, ["a/x", "b/y"], True, "published"),
    (PUBLISHED, ["a/x"], False, "runs/x"),
    (Variant.of(dtype="bfloat16"), ["a/x", "b/y"], True, "runs/zoo+bfloat16"),
    (Variant.of(device="cuda:1"), ["a/x", "b/y"], True, "runs/zoo+cuda"),
    (Variant.of(source="real"), ["a/x", "b/y", "c/z"], False, "runs/3-models-"),
    (Variant.of(layers=(0, -1)), ["a/x"], True, "runs/zoo+layers-0.-1"),
])
def test_default_output_by_selection(variant, models, all_models, where, monkeypatch, tmp_path):
    monkeypatch.setattr(outputs, "DEFAULT_OUT", tmp_path / "published")
    monkeypatch.setattr(outputs, "RUNS", tmp_path / "runs")
    got = outputs.default_out(variant, models, all_models).relative_to(tmp_path).as_posix()
    assert got.startswith(where)


def test_every_meaning_changing_option_changes_the_cell_file(tmp_path):
    spec = zoo_spec(GPT2)
    base = runner.Options(engines=("hf",), out=tmp_path)
    paths = {runner.path_of(spec, "hf", base)}
    for change in (dict(dtype="bfloat16"), dict(device="cuda"), dict(points=["lm_head"]), dict(layers=(0,)),
                   dict(decode=False), dict(steer=False)):
        paths.add(runner.path_of(spec, "hf", runner.Options(engines=("hf",), out=tmp_path, **change)))
    assert len(paths) == 7
    assert runner.path_of(spec, "hf", base).name == "openai-community__gpt2__hf.json.gz"


def test_variant_cells_sit_beside_published_ones(tmp_path):
    assert cli.main(["run", "--models", GPT2, "--engines", "hf", "--out", str(tmp_path)]) == exits.OK
    published = cells.cell_path(tmp_path, GPT2, "hf")
    before = published.read_bytes()
    assert cli.main(["run", "--models", GPT2, *QUICK, "--no-decode", "--out", str(tmp_path)]) == exits.OK
    assert published.read_bytes() == before
    readme = (tmp_path / "README.md").read_text()
    assert "| hf |" in readme and "| hf@points-lm_head.resid_post+no-decode |" in readme
    assert "an ad-hoc variant (points-lm_head.resid_post, no-decode)" in readme


def test_an_error_never_replaces_a_passing_cell(tmp_path, monkeypatch, capsys):
    argv = ["run", "--models", GPT2, *QUICK, "--no-decode", "--no-steer", "--out", str(tmp_path)]
    assert cli.main(argv) == exits.OK
    path = cells.files(tmp_path)[0]
    before = path.read_bytes()
    real = zoo_spec

    def broken(name, dtype="float32", device="cpu"):
        spec = real(name, dtype, device)

        def fail(config="auto"):
            raise MemoryError("simulated: out of memory while loading")
        spec.load_engine = fail
        return spec
    monkeypatch.setattr("validator.models.zoo_spec", broken)
    assert cli.main(argv + ["--force"]) == exits.FAILED
    assert path.read_bytes() == before and cells.decode(before)["status"] == "ok"
    err = capsys.readouterr().err
    assert f"error (kept the previous passing cell {path}): model failed to load: MemoryError: simulated" in err


def test_layers_out_of_range_fail_that_model_only(tmp_path, capsys):
    deep = "deepseek-ai/DeepSeek-V4-Flash"  # 4 layers; gpt2 has 2
    code = cli.main(["run", "--models", f"{GPT2},{deep}", "--engines", "hf", "--points", "attn_out",
                     "--layers", "3", "--no-decode", "--no-steer", "--out", str(tmp_path)])
    assert code == exits.FAILED
    by_model = {c["model"]: c for c in cells.load_all(tmp_path)}
    assert by_model[GPT2]["status"] == "error"
    assert by_model[GPT2]["error"] == (f"bad --layers for {GPT2}: --layers 3 out of range for a 2-layer model "
                                       f"(use 0..1, or -2..-1 from the end).")
    assert by_model[deep]["status"] == "ok" and by_model[deep]["summary"]["pass"] > 0
    assert report.check(tmp_path) == []  # the reports were rendered, with the error in them
    assert f"**{GPT2}**: ERROR: bad --layers" in (tmp_path / "README.md").read_text()
    assert "undeclared failures or errors in 1 model(s): openai-community/gpt2" in capsys.readouterr().err


def test_run_summary_and_log_are_named(tmp_path, capsys):
    assert cli.main(["run", "--models", GPT2, *QUICK, "--no-decode", "--no-steer", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["engine", "cells", "pass", "warn", "fail", "declared", "gap", "errors",
                                           "skipped"]
    log = Path(err.split("third-party output in ")[1].split(";")[0])
    assert log.name.startswith("run-") and (log if log.is_absolute() else Path.cwd() / log).is_file()
    assert "Loading weights" not in err and "Traceback" not in err
    assert "exit 0 (pass (failures only where declared))" in err


def test_partial_matrix_says_so(tmp_path):
    assert cli.main(["run", "--models", GPT2, "--engines", "hf", "--out", str(tmp_path)]) == exits.OK
    readme = (tmp_path / "README.md").read_text()
    from engine.zoo import ZOO
    assert "partial matrix:**" in readme and f"- `hf`: 1 of {len(ZOO)} zoo models; missing" in readme


def test_code_digest_covers_what_decides_a_cell_and_nothing_else():
    names = {p.relative_to(cells.REPO).as_posix() for p in cells.code_files()}
    assert {"engine/model/__init__.py", "engine/backends/hf/attention.py", "engine/backends/hf/eager.py", "engine/core/plan.py",
            "engine/core/results.py", "validator/scoring.py", "validator/tolerances.py", "validator/subject.py"} <= names
    assert "validator/known_gaps.py" not in names  # per cell: known_gaps.digest(engine, model_type)
    assert not {n for n in names if n.startswith(("engine/backends/vllm/", "engine/serve/", "engine/harvest/",
                                                  "validator/report", "validator/cli"))}
    assert not {n for n in names if n.endswith("__main__.py")}
    from validator.engines import adapter_source_files
    vllm = {Path(p).relative_to(cells.REPO).as_posix() for p in adapter_source_files("vllm")}
    assert "engine/backends/vllm/backend.py" in vllm and "validator/engines/vllm_ref.py" in vllm
    assert "validator/engines/interp_align.py" in {Path(p).relative_to(cells.REPO).as_posix()
                                                   for p in adapter_source_files("interp-engine")}


# validator modules a run imports that decide no cell's content, each with why (the rest must be digested)
NOT_DECIDING = {"cells": "the file format itself", "known_gaps": "digested per cell (known_gaps.digest)",
                "engines": "each adapter's files are digested per column (adapter_source_files)",
                "outputs": "where a run writes", "quiet": "where third-party output goes", "progress": "the console bar",
                "workers": "process pools", "order": "the reports' point order", "report": "rendering",
                "dropin": "rendering", "exits": "exit codes", "usage": "argument errors", "budget": "the GPU plan",
                "schedule": "the GPU plan", "costs": "time estimates", "cluster": "where a cell runs",
                "shards": "which runner computes a cell", "history": "dated summaries", "pipes": "closed stdout"}


def test_every_validator_module_a_cell_is_computed_with_is_digested():
    """Issue 48's new modules (plan, maths, sides, checks, columns) decide every row: a change to one must stale
    the cells. Every validator module the runner reaches (its imports, transitively, lazy ones included) is
    in the digest or says why it decides nothing."""
    import ast
    root = cells.REPO / "validator"
    seen, todo = set(), ["runner"]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = root / f"{mod}.py" if (root / f"{mod}.py").exists() else root / mod / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                if n.startswith("validator.") and n.count(".") == 1:
                    todo.append(n.split(".")[1])
    digested = {p.stem for p in cells.code_files() if p.parent == root}
    assert seen - digested - set(NOT_DECIDING) == set(), "add them to validator/cells.py CELL_MODULES"
    assert {"plan", "maths", "sides", "checks", "columns"} <= digested


MODULE = '''"""A module that decides results."""
SCALE = 0.5  # the factor


class Op:
    """What the op does."""

    def apply(self, x):
        """Scale x."""
        return x * SCALE
'''
EDITS = {  # (edit, whether it changes what decides a cell)
    "comment": (lambda t: t.replace("# the factor", "# the factor, from the paper"), False),
    "module docstring": (lambda t: t.replace("decides results", "decides every result"), False),
    "class docstring": (lambda t: t.replace("What the op does.", "What the op does, in full."), False),
    "method docstring": (lambda t: t.replace("Scale x.", "Scale x by SCALE."), False),
    "blank lines": (lambda t: t.replace("\n\n\nclass", "\n\nclass"), False),
    "a constant": (lambda t: t.replace("0.5", "0.7"), True),
    "an operator": (lambda t: t.replace("x * SCALE", "x + SCALE"), True),
    "a string that is not a docstring": (lambda t: t.replace("return x * SCALE", "return x * SCALE, 'a'"), True),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_files_digest_counts_code_not_comments_or_docstrings(tmp_path, edit):
    f = tmp_path / "mod.py"
    f.write_text(MODULE)
    before = cells.files_digest([f])
    change, counts = EDITS[edit]
    f.write_text(change(MODULE))
    assert f.read_text() != MODULE
    assert (cells.files_digest([f]) != before) is counts
    other = tmp_path / "data.json"  # not Python: byte for byte
    other.write_text('{"a": 1}')
    before = cells.files_digest([other])
    other.write_text('{"a":  1}')
    assert cells.files_digest([other]) != before


@pytest.fixture
def extra_code(tmp_path, monkeypatch):
    """A module that code_digest counts, beside the engine's own files (the cached digest is dropped
    before and after, so no other test sees it)."""
    f = tmp_path / "decides.py"
    f.write_text(MODULE)
    real = cells.code_files
    monkeypatch.setattr(cells, "code_files", lambda: real() + [f])
    cells.code_digest.cache_clear()
    yield f
    cells.code_digest.cache_clear()


def test_run_check_stales_cells_on_a_code_change_but_not_on_a_comment(tmp_path, extra_code, capsys):
    out = tmp_path / "out"
    argv = ["run", "--models", GPT2, *QUICK, "--no-decode", "--no-steer", "--out", str(out)]
    assert cli.main(argv) == exits.OK
    capsys.readouterr()
    for edit in ("comment", "method docstring"):
        extra_code.write_text(EDITS[edit][0](extra_code.read_text()))
        cells.code_digest.cache_clear()
        assert cli.main(argv + ["--check"]) == exits.OK, edit
        assert "validator: 0 of 1 cells" in capsys.readouterr().err
    extra_code.write_text(EDITS["a constant"][0](extra_code.read_text()))
    cells.code_digest.cache_clear()
    assert cli.main(argv + ["--check"]) == exits.FAILED
    assert f"stale or missing: {GPT2} / hf" in capsys.readouterr().err


def test_a_declaration_makes_only_the_cells_it_can_apply_to_stale(monkeypatch, tmp_path):
    from validator import known_gaps
    specs = {m: zoo_spec(m) for m in (GPT2, "google/gemma-2-2b")}
    before = {(m, e): runner.inputs_digest(s, e, runner.Options(engines=(e,), out=tmp_path))
              for m, s in specs.items() for e in ("hf", "vllm")}
    extra = known_gaps.Known("test-entry", "bug", "vllm", "lm_head", "r", "e", numeric=True, model_types="gemma2")
    monkeypatch.setattr(known_gaps, "KNOWN", known_gaps.KNOWN + (extra,))
    after = {k: runner.inputs_digest(specs[k[0]], k[1], runner.Options(engines=(k[1],), out=tmp_path)) for k in before}
    assert {k for k in before if before[k] != after[k]} == {("google/gemma-2-2b", "vllm")}
