"""Fault cases of the validator CLI, each by its message and exit code: empty selections, an --out that
cannot be created or written (before any model runs), files in cells/ that are not cells (named, for
run, report, report --check and show), a heatmap that does not decode, a closed stdout (`| head`), and
--help that imports nothing heavy."""
import json
import os
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from validator import cells, cli, exits, known_gaps, outputs, report

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.fixture
def no_models(monkeypatch):
    """Any model run fails the test: the faults below must stop the command first."""
    from validator import runner

    def boom(*a, **k):
        raise AssertionError("a model ran")
    monkeypatch.setattr(runner, "run_model", boom)


def _cell(model="acme/tiny", engine="hf", status="skipped", **extra):
    return {"schema": cells.SCHEMA, "model": model, "engine": engine, "status": status, "reason": "test",
            "rows": [], **extra}


def _write(out, cell, name=None):
    path = cells.cell_path(out, cell["model"], cell["engine"]) if name is None else cells.cell_dir(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell) if isinstance(cell, (dict, list)) else cell)
    return path


# -- empty selections ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [(["--models", ""], "--models"), (["--engines", ""], "--engines"),
                                        (["--engines", " , "], "--engines"), (["--models", ",", "--models", ""],
                                                                              "--models")])
def test_empty_selection_is_an_error_not_everything(argv, flag, tmp_path, capsys, no_models):
    assert cli.main(["run", *argv, "--out", str(tmp_path)]) == exits.USAGE
    err = capsys.readouterr().err
    assert f"error: {flag} names nothing" in err and f"omit {flag} for the default" in err


# -- --out -------------------------------------------------------------------------------------------------
def test_out_under_a_file_fails_before_any_model(tmp_path, capsys, no_models):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code = cli.main(["run", "--models", "openai-community/gpt2", "--out", str(blocker / "out")])
    assert code == exits.OUTPUT == 3
    err = capsys.readouterr().err
    assert f"--out {blocker / 'out'} is not usable: cannot create or write" in err
    assert "Pass a writable directory with --out." in err


def test_out_on_an_uncreatable_path_fails_before_any_model(capsys, no_models):
    assert cli.main(["run", "--models", "openai-community/gpt2", "--out", "/proc/validator-out"]) == exits.OUTPUT
    assert "--out /proc/validator-out is not usable" in capsys.readouterr().err


def test_read_only_out_fails_before_any_model(tmp_path, capsys, monkeypatch, no_models):
    from validator import outputs
    d = cells.cell_dir(tmp_path)
    d.mkdir(parents=True)
    d.chmod(0o555)
    if os.geteuid() == 0:  # permissions do not bind root: answer as the kernel would for anyone else
        real = os.access
        monkeypatch.setattr(outputs.os, "access", lambda p, m: False if Path(p) == d else real(p, m))
    try:
        assert cli.main(["run", "--models", "openai-community/gpt2", "--out", str(tmp_path)]) == exits.OUTPUT
    finally:
        d.chmod(0o755)
    assert "Permission denied" in capsys.readouterr().err


# -- files in cells/ that are not cells ------------------------------------------------------------------
BAD = {
    "truncated": ("acme__tiny__hf.json", '{"schema": 1, "model": "acme/t', "not valid JSON"),
    "empty object": ("acme__tiny__hf.json", {}, "not a validator cell (missing schema, model, engine, status)"),
    "a list": ("acme__tiny__hf.json", [1, 2], "a JSON list, not a cell object"),
    "other schema": ("acme__tiny__hf.json", _cell(schema=99), "cell schema 99, this validator reads schema 1"),
    "wrong name": ("acme__other__hf.json", _cell(), "holds the cell of acme/tiny / hf, whose file is acme__tiny__hf.json"),
    # valid JSON, wrongly typed: the reports would crash on these (AttributeError / TypeError) mid-render
    "summary a list": ("acme__tiny__hf.json", _cell(status="ok", summary=[1]),
                       "not a validator cell of this schema (summary is list [1], not an object)"),
    "summary count a string": ("acme__tiny__hf.json", _cell(status="ok", summary={"pass": "3"}),
                               "not a validator cell of this schema (summary['pass'] is str \"3\", not an integer"),
    "a row not an object": ("acme__tiny__hf.json", _cell(status="ok", summary={"pass": 1}, rows=[1]),
                            "not a validator cell of this schema (rows[0] is int, not an object"),
    "a row without a verdict": ("acme__tiny__hf.json", _cell(rows=[{"case": "short", "point": "embeddings"}]),
                                "not a validator cell of this schema (rows[0].verdict is NoneType, not a string"),
    "variant tag a number": ("acme__tiny__hf.json", _cell(variant_tag=3), "not a validator cell of this schema (variant_tag is int 3, not a string"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("argv", [["report"], ["report", "--check"], ["show", "acme/tiny"],
                                  ["run", "--models", "openai-community/gpt2"]])
def test_foreign_or_corrupt_cell_is_named(case, argv, tmp_path, capsys, no_models):
    _write(tmp_path, _cell(model="acme/good"))  # a good cell beside it is not enough to hide it
    name, content, why = BAD[case]
    path = _write(tmp_path, content, name)
    assert cli.main([*argv, "--out", str(tmp_path)]) == exits.CELLS == 4
    err = capsys.readouterr().err
    assert f"{path}: {why}" in err and "are not validator cells" in err


def test_loader_reports_every_bad_file(tmp_path):
    for i, (name, content, _) in enumerate(BAD.values()):
        _write(tmp_path, content, f"{i}-{name}")
    with pytest.raises(cells.CellError) as e:
        cells.load_all(tmp_path)
    assert len(e.value.problems) == len(BAD)


# -- reports ---------------------------------------------------------------------------------------------
def test_heatmap_that_does_not_decode_is_drift_and_render_repairs_it(tmp_path):
    _write(tmp_path, _cell())
    report.render(tmp_path)
    assert report.check(tmp_path) == []
    png = tmp_path / report.HEAT_NAME
    png.write_bytes(png.read_bytes()[:120])  # header and metadata survive, the image data does not
    problems = report.check(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("heatmap.png: does not decode")
    assert cli.main(["report", "--check", "--out", str(tmp_path)]) == exits.FAILED
    report.render(tmp_path)
    assert report.check(tmp_path) == [] and report.png_problem(png) == ""


# -- pipes and --help ------------------------------------------------------------------------------------
CLIS = [["validator", "show", "deepseek-ai/DeepSeek-V4-Flash"], ["validator", "--help"],
        ["validator", "run", "--help"], ["engine.zoo", "list"], ["visualizer_data", "--help"],
        ["benchmarks", "--help"], ["engine.interop.docs", "--help"], ["engine.serve", "--help"], ["engine.harvest", "--help"],
        ["benchmarks.serve_load", "--help"]]


@pytest.mark.parametrize("argv", CLIS, ids=lambda a: " ".join(a))
def test_closed_stdout_prints_no_traceback(argv):
    """What `| head` does to a long output: the reader is gone before the writer finishes."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([PY, "-m", *argv], stdout=w, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr[-800:]
    assert p.returncode in (0, 141)


def test_help_is_fast_and_imports_nothing_heavy():
    code = "import sys, validator.cli as c; c.build_parser(); print(sorted(m for m in ('torch', 'transformers', " \
           "'pandas', 'engine', 'interp_engine') if m in sys.modules))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    for argv in (["--help"], ["run", "--help"], ["report", "--help"]):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run([PY, "-m", "validator", *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # wall time is the load's
        assert p.returncode == 0 and "exit codes: 0 pass" in p.stdout
        assert cpu < 0.5, f"validator {' '.join(argv)} took {cpu:.2f} s of CPU"


# -- hints that work ---------------------------------------------------------------------------------------
def _commands(hint: str) -> list[list[str]]:
    """`python -m validator A && python -m validator B` -> [[A...], [B...]]."""
    out = []
    for part in hint.split("&&"):
        argv = shlex.split(part)
        assert argv[:3] == ["python", "-m", "validator"], part
        out.append(argv[3:])
    return out


def test_show_hint_computes_and_shows_the_model(tmp_path, capsys):
    model = "openai-community/gpt2"
    assert cli.main(["show", model, "--out", str(tmp_path)]) == exits.USAGE
    err = capsys.readouterr().err
    hint = err.split("Compute them with `")[1].split("`")[0]
    run, show = _commands(hint)
    assert run[:3] == ["run", "--models", model] and show[:2] == ["show", model]
    assert run[run.index("--out") + 1] == show[show.index("--out") + 1]
    # the hint as printed (narrowed to one cheap engine and two points so the test stays fast)
    assert cli.main(run + ["--engines", "hf", "--points", "resid_post,lm_head", "--no-decode", "--no-steer"]) == 0
    assert cli.main(show) == 0
    assert f"# {model}" in capsys.readouterr().out


def test_show_takes_a_short_name_and_never_suggests_writing_into_the_published_results(capsys):
    """`validator show gpt2` found no cells and suggested `run --models 'gpt2' --out reports/validator`, a run into
    the folder only the published job writes: the name resolves as --models resolves it, and a model with no
    published cell is computed into its own run folder."""
    assert cli.main(["show", "gpt2"]) == exits.OK
    assert "# openai-community/gpt2" in capsys.readouterr().out
    run, show = _commands(cli.show_hint("openai-community/gpt2", cells.DEFAULT_OUT))
    out = Path(run[run.index("--out") + 1]).resolve()
    assert out != cells.DEFAULT_OUT.resolve() and out.parent == outputs.RUNS.resolve()
    assert show[show.index("--out") + 1] == run[run.index("--out") + 1]


def test_declared_entries_reproduce_with_commands_that_parse():
    parser = cli.build_parser()
    for k in known_gaps.KNOWN:
        run, show = _commands(k.repro.format(model="openai-community/gpt2", engine="hf"))
        a, b = parser.parse_args(run), parser.parse_args(show)
        assert a.cmd == "run" and b.cmd == "show" and a.out == b.out, k.id


def test_backend_load_errors_name_their_root_cause():
    """torch.compile hides the real error behind hints; the cell must carry the cause (the evidence)."""
    from validator.engines.vllm_ref import _root_cause
    try:
        try:
            raise ValueError("too many values to unpack (expected 3)")
        except ValueError as inner:
            raise RuntimeError("Observed exception\n  Hint: Your code may result in an error") from inner
    except RuntimeError as e:
        text = _root_cause(e)
    assert text.startswith("ValueError: too many values to unpack (expected 3) (surfacing as RuntimeError: Observed")
    assert "\n" not in text


def test_vllm_static_falls_back_to_auto_taps_only_when_its_taps_do_not_install():
    """Declaring the compared addresses as taps may fail to install (an architecture whose q / k never reach a
    tap): the column falls back to "auto" and says so. When the taps installed and the engine's own startup
    proof refused them (a TapProofError anywhere in the chain the load's error was raised from: a fill, read or
    table bug), the load fails: fewer taps would hide it. The class decides, not the words of the message."""
    from types import SimpleNamespace

    from engine.core.errors import TapProofError, UnsupportedPointError
    from validator.engines.base import EngineUnavailable
    from validator.engines.vllm_ref import VllmStaticEngine
    plan = SimpleNamespace(addresses=["resid_post.0", "q.0"], steers=[], gen_steers=[])
    refused = TapProofError("vllm-static refuses to serve m under cudagraph_mode=NONE: an add steer at embeddings "
                            "moved the tap by the vector up to 4.52")
    wrapped = RuntimeError("Engine core initialization failed")
    wrapped.__cause__ = refused
    cases = ((UnsupportedPointError("q.0 cannot be a tap of OlmoForCausalLM"), True),
             (ValueError("a TapProofError-like message that is not one"), True),
             (refused, False), (wrapped, False))
    for cause, falls_back in cases:
        loads = []

        def load(**kw):
            loads.append(kw)
            if "static_points" in kw or not falls_back:
                raise EngineUnavailable(f"load_model(backend='vllm-static') failed: {cause}") from cause
            return "auto-taps model"
        ref = VllmStaticEngine.__new__(VllmStaticEngine)
        ref.notes, ref.m = [], None
        ref._load = load
        if falls_back:
            ref._load_for(plan)
            assert ref.m == "auto-taps model" and "fell back to static_points='auto'" in ref.notes[0]
            assert [sorted(kw) for kw in loads] == [["static_points"], []]
        else:
            with pytest.raises(EngineUnavailable, match="refuses to serve m|Engine core initialization failed"):
                ref._load_for(plan)
            assert len(loads) == 1 and ref.m is None
