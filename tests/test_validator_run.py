"""The runner, cells, reports and CLI: a planted wrong-layer reference fails the run, an interrupted
run resumes without losing or recomputing a cell, the drift check, and bad command-line input."""
import gzip
import json
import re

import pytest
import torch

from validator import cells, cli, report, runner
from validator.engines import ENGINES, EngineSpec
from validator.engines.hf_ref import HFReference
from validator.models import zoo_spec
from validator.tolerances import TIERS

MODELS = ("openai-community/gpt2", "meta-llama/Llama-3.2-1B")
POINTS = ["resid_post", "lm_head"]


class PlantedWrongLayer(HFReference):
    """A reference with a planted bug: resid_post.L answers with layer L+1's stream."""
    name = "planted"

    def capture(self, case, addresses):
        n = self.n_layers
        extra = [f"resid_post.{int(a.split('.')[1]) + 1}" for a in addresses
                 if a.startswith("resid_post.") and int(a.split(".")[1]) + 1 < n]
        got = super().capture(case, sorted(set(addresses) | set(extra)))
        for a in addresses:
            if a.startswith("resid_post."):
                nxt = f"resid_post.{int(a.split('.')[1]) + 1}"
                if nxt in got:
                    got[a] = got[nxt]
        return {a: got[a] for a in addresses}


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setitem(ENGINES, "planted", EngineSpec("planted", "hf_ref", "HFReference", False, ("torch",),
                                                       "test engine with a planted wrong layer"))
    monkeypatch.setitem(TIERS, ("planted", "float32"), TIERS[("hf", "float32")])
    from validator import columns
    real = columns.adapter_class
    monkeypatch.setattr(columns, "adapter_class", lambda e: PlantedWrongLayer if e == "planted" else real(e))


def _opts(out, engines=("hf",), **kw):
    return runner.Options(engines=engines, out=out, points=POINTS, steer=False, **kw)


def _path(out, model, engine, **kw):
    """Where a cell of these tests' variant (POINTS, no steering) lives."""
    return runner.path_of(zoo_spec(model), engine, _opts(out, **kw))


def test_planted_wrong_layer_fails_the_run(tmp_path, planted, capsys):
    code = cli.main(["run", "--models", MODELS[0], "--engines", "hf,planted", "--points", ",".join(POINTS),
                     "--no-steer", "--out", str(tmp_path)])
    assert code == 1
    hf = cells.read(_path(tmp_path, MODELS[0], "hf"))
    bad = cells.read(_path(tmp_path, MODELS[0], "planted"))
    assert hf["summary"]["fail"] == 0 and hf["summary"]["pass"] > 0
    failing = {(r["case"], r["point"], r["layer"]) for r in bad["rows"] if r["verdict"] == "fail"}
    assert ("short", "resid_post", 0) in failing and ("long", "resid_post", 0) in failing
    assert ("short", "lm_head", None) not in failing
    assert "planted" in capsys.readouterr().out  # the summary table


def test_killed_run_resumes_without_losing_or_recomputing_cells(tmp_path, planted):
    engines = ("hf", "planted")
    written = []

    def die_after_three(path):
        written.append(path)
        if len(written) == 3:
            raise KeyboardInterrupt("simulated kill")

    opts = _opts(tmp_path, engines, decode=False, after_cell=die_after_three)
    specs = [zoo_spec(m) for m in MODELS]
    with pytest.raises(KeyboardInterrupt):
        for spec in specs:
            runner.run_model(spec, opts)
    assert sorted(p.name for p in cells.cell_dir(tmp_path).iterdir()) == sorted(p.name for p in written)
    assert all(cells.read(p)["status"] == "ok" for p in written)  # complete cells only, no temp files
    before = {p: p.stat().st_mtime_ns for p in written}
    again = []
    opts = _opts(tmp_path, engines, decode=False, after_cell=again.append)
    for spec in specs:
        runner.run_model(spec, opts)
    all_paths = {_path(tmp_path, m, e, decode=False) for m in MODELS for e in engines}
    assert set(again) == all_paths - set(written)  # only the missing cell was computed
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())
    assert {p for p in cells.cell_dir(tmp_path).iterdir()} == all_paths
    forced = []
    runner.run_model(specs[0], _opts(tmp_path, engines, decode=False, force=True, after_cell=forced.append))
    assert len(forced) == 2


def test_stale_cell_is_recomputed_when_inputs_change(tmp_path):
    spec = zoo_spec(MODELS[0])
    runner.run_model(spec, _opts(tmp_path, decode=False))
    assert runner.pending(spec, _opts(tmp_path, decode=False)) == []
    assert runner.pending(spec, _opts(tmp_path, decode=True)) == ["hf"]  # different inputs digest


def test_atomic_write_leaves_no_partial_cell(tmp_path, monkeypatch):
    path = tmp_path / "cells" / "x__hf.json.gz"
    cells.write(path, {"a": 1})

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(cells.os, "replace", boom)
    with pytest.raises(OSError):
        cells.write(path, {"a": 2})
    assert cells.read(path) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["x__hf.json.gz"]


def test_a_cell_is_stored_gzipped_the_same_bytes_at_each_write(tmp_path):
    """The stored bytes are the cell's compact sorted JSON, gzipped without a name or time: the same cell
    writes the same bytes (a republication that changes nothing leaves git nothing to commit)."""
    cell = {"schema": cells.SCHEMA, "model": "acme/tiny", "engine": "hf", "status": "ok",
            "rows": [{"point": "embeddings", "case": "short", "verdict": "pass", "rel_err": 1.5, "reason": "é"}]}
    path = cells.cell_path(tmp_path, "acme/tiny", "hf")
    assert path.name == "acme__tiny__hf.json.gz"
    cells.write(path, cell)
    raw = path.read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[4:8] == b"\0\0\0\0"  # gzip, modification time 0
    assert gzip.decompress(raw).decode() == json.dumps(cell, sort_keys=True, separators=(",", ":")) + "\n"
    path.unlink()
    cells.write(path, dict(reversed(list(cell.items()))))
    assert path.read_bytes() == raw
    assert cells.load_all(tmp_path) == [cell]


def test_a_plain_cell_from_before_is_read_counted_up_to_date_and_replaced_at_its_next_write(tmp_path):
    """A run directory written before cells were gzipped resumes: its plain <key>.json cells are read where
    the .json.gz is looked for, a run computes nothing for them, and a write replaces the plain file."""
    opts = _opts(tmp_path, decode=False)
    spec = zoo_spec(MODELS[0])
    runner.run_model(spec, opts)
    path = _path(tmp_path, MODELS[0], "hf", decode=False)
    cell = cells.read(path)
    plain = path.with_name(path.name.removesuffix(".gz"))
    plain.write_text(json.dumps(cell))
    path.unlink()
    assert cells.read(path) == cell and cells.load_all(tmp_path) == [cell]
    assert runner.pending(spec, opts) == []
    path.write_bytes(cells.encode(cell))  # both files: named, never read twice
    with pytest.raises(cells.CellError, match=re.escape(f"{path.name}: the cell of {MODELS[0]} / hf is also in {plain.name}")):
        cells.load_all(tmp_path)
    cells.write(path, cell)
    assert [p.name for p in cells.cell_dir(tmp_path).iterdir()] == [path.name]


def test_a_damaged_gzipped_cell_is_named(tmp_path):
    path = cells.cell_path(tmp_path, "acme/tiny", "hf")
    cells.write(path, {"schema": cells.SCHEMA, "model": "acme/tiny", "engine": "hf", "status": "ok", "rows": []})
    path.write_bytes(path.read_bytes()[:-9])  # cut short, as by a full disk outside write_atomic
    assert cells.read(path) is None
    with pytest.raises(cells.CellError, match=f"{path}: unreadable \\(OSError: truncated gzip stream"):
        cells.load_all(tmp_path)


def test_drift_check_passes_fresh_and_fails_after_a_cell_changes(tmp_path):
    runner.run_model(zoo_spec(MODELS[0]), _opts(tmp_path, decode=False))
    report.render(tmp_path)
    assert report.check(tmp_path) == []
    assert cli.main(["report", "--check", "--out", str(tmp_path)]) == 0
    path = _path(tmp_path, MODELS[0], "hf", decode=False)
    cell = cells.read(path)
    cell["rows"][0]["verdict"] = "fail"
    cell["summary"] = {"pass": 0, "warn": 0, "fail": 1, "gap": 0}
    cells.write(path, cell)
    problems = report.check(tmp_path)
    assert any(p.startswith("README.md") for p in problems)
    assert any(p.startswith("details/") for p in problems) and any(p.startswith("summary.csv") for p in problems)
    assert cli.main(["report", "--check", "--out", str(tmp_path)]) == 1
    (tmp_path / "details" / "gone__model.md").write_text("stale")
    assert any("no cell" in p for p in report.check(tmp_path))
    report.render(tmp_path)
    assert report.check(tmp_path) == []


def test_reports_render_counts_and_heatmap(tmp_path):
    runner.run_model(zoo_spec(MODELS[0]), _opts(tmp_path, decode=False))
    report.render(tmp_path)
    cell = cells.read(_path(tmp_path, MODELS[0], "hf", decode=False))
    s = cell["summary"]
    readme = (tmp_path / "README.md").read_text()
    assert f"{s['pass']}/{s['warn']}/{s['fail']}/{s['gap']}" in readme
    import pandas as pd
    df = pd.read_csv(tmp_path / "summary.csv")  # one line per point x layer, counts over the cases
    assert len(df) == len({(r["point"], r["layer"]) for r in cell["rows"]})
    assert int(df[["n_pass", "n_warn", "n_fail", "n_gap"]].to_numpy().sum()) == len(cell["rows"])
    assert set(df["verdict"]) <= {"pass", "warn", "fail", "gap"}
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.png_digest(tmp_path / "heatmap.png") == report.heat_digest(report.heat_data(cells.load_all(tmp_path))[0])
    details = (tmp_path / "details" / f"{cells.slug(MODELS[0])}.md").read_text()
    assert "| resid_post | 1 |" in details and "Which tensor" in details
    assert cli.main(["show", MODELS[0], "--out", str(tmp_path)]) == 0


def test_provenance_is_recorded(tmp_path):
    runner.run_model(zoo_spec(MODELS[0]), _opts(tmp_path, decode=False))
    prov = cells.read(_path(tmp_path, MODELS[0], "hf", decode=False))["provenance"]
    assert prov["versions"]["torch"] == torch.__version__.split("+")[0] or prov["versions"]["torch"].startswith(
        torch.__version__.split("+")[0])
    for key in ("dtype", "device", "torch_threads", "prompt_digest", "reference_digest", "commit", "code_digest",
                "weights"):
        assert prov.get(key) not in (None, ""), key


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["run", "--models", "meta-llama/Llama-3.2-1b-instruct"], "meta-llama/Llama-3.2-1B"),
    (["run", "--models", "gemma-2-2"], "google/gemma-2-2b"),
    (["run", "--engines", "nnsite"], "'nnsight'"),
    (["run", "--points", "resid_psot"], "'resid_post'"),
    (["run", "--layers", "middle"], "'mid'"),
    (["run", "--jobs", "0"], "--jobs"),
])
def test_cli_bad_input_names_the_fix(argv, needle, capsys, tmp_path):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err


def test_cli_show_and_report_without_cells(tmp_path, capsys):
    assert cli.main(["report", "--out", str(tmp_path)]) == 2
    assert "no cells" in capsys.readouterr().err
    assert cli.main(["show", "nope/model", "--out", str(tmp_path)]) == 2
    assert "no cells for model" in capsys.readouterr().err


def test_cli_real_without_cached_checkpoint(capsys, tmp_path):
    from engine import zoo
    if zoo.real_checkpoint_available(MODELS[0]):
        pytest.skip("the real checkpoint is cached here")
    assert cli.main(["run", "--real", "--models", MODELS[0], "--out", str(tmp_path)]) == 2
    assert "not in the local HF model cache" in capsys.readouterr().err


def test_cells_record_the_configuration_users_run_and_the_eager_one(tmp_path):
    """Issue 48: the engine is validated as load_model gives it (sdpa here), the reference on the same
    kernels (rows exact); TransformerLens, which computes attention itself, against attention='eager'; the hf
    column's patterns also in the eager configuration, rows marked so."""
    opts = runner.Options(engines=("hf", "transformer_lens"), out=tmp_path, points=["resid_post", "attn_probs", "z"],
                          steer=False, decode=False)
    got = {cells.read(p)["engine"]: cells.read(p) for p in runner.run_model(zoo_spec(MODELS[1]), opts)}
    assert got["hf"]["configuration"] == "auto" and got["transformer_lens"]["configuration"] == "eager"
    eager = [r for r in got["hf"]["rows"] if r.get("config") == "eager"]
    assert {r["point"] for r in eager} == {"attn_probs", "z"} and all(r["max_abs"] == 0 for r in eager)
    auto = [r for r in got["hf"]["rows"] if r["case"] == "short" and "config" not in r]
    assert all(r["max_abs"] == 0 for r in auto if r["point"] != "attn_probs")  # the same sdpa kernels: exact
    assert all(r["verdict"] == "pass" for c in got.values() for r in c["rows"])
    from validator.runner import native_attention
    assert native_attention(zoo_spec(MODELS[1]).load_engine("auto")) == "sdpa"
    assert native_attention(zoo_spec(MODELS[1]).load_engine("eager")) == "eager"
