"""Site data: every generated file is what its source gives, `build --check` passes fresh and
fails after drift, and the TypeScript compiles (tsc, when node_modules is installed)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from visualizer_data import architectures_ts, points_ts, ts, validation_ts
from visualizer_data.__main__ import FILES, main, outputs

VIS = ts.OUT_DIR
TSC = VIS / "node_modules" / "typescript" / "bin" / "tsc"


def _export(text: str, name: str):
    """Parse the JSON literal of `export const name: T = <literal>;` back into Python."""
    m = re.search(rf"^export const {name}: [^=]+ = (.*?);$", text, re.S | re.M)
    assert m, f"no export {name}"
    return json.loads(m.group(1))


def test_points_cover_the_catalogue_exactly():
    from engine.core.backends import BACKENDS
    from engine.core.points import POINTS, backend_status
    got = _export(points_ts.render(), "points")
    assert [p["name"] for p in got] == [p.name for p in POINTS]
    for g, p in zip(got, POINTS):
        assert g["definition"] == p.definition and g["shape"] == p.shape
        assert g["equivalents"] == {"transformerLens": p.tl, "nnsight": p.nnsight, "nnterp": p.nnterp}
        assert [(b["backend"], b["status"], b["reason"]) for b in g["backends"]] == [
            (b, *backend_status(p.name, b)) for b in BACKENDS]
        assert g["width"] == p.shape[1:-1].split(", ", 2)[2]


def test_width_rejects_a_shape_without_batch_and_pos():
    with pytest.raises(ValueError, match="must start with 'b, pos'"):
        points_ts.width("[d]")


def test_architecture_layers_come_from_the_engine():
    """The gpt2 family entry lists the layers an independently loaded eager model reports."""
    from engine import zoo
    from engine.loading import load_model
    got = _export(architectures_ts.render(["gpt2"], progress=False), "architectures")
    assert [a["family"] for a in got] == ["gpt2"]
    fam = got[0]
    names = sorted(m["name"] for m in fam["models"])
    assert names == sorted(n for n, e in zoo.ZOO.items() if e.model_type in fam["modelTypes"])
    m = load_model(names[0], source="zoo")
    entry = next(x for x in fam["models"] if x["name"] == names[0])
    assert entry["error"] is None and entry["nLayers"] == m.n_layers
    assert {p["point"]: p["layers"] for p in entry["points"]} == {p: m.point_layers(p) for p in m.points()}
    src = {s["point"]: s for s in entry["sources"]}
    assert src["resid_post"]["module"] == f"{m.family.layers}.{{L}}"
    assert src["final_norm"]["module"] == m.family.final_norm


def test_architecture_layout_and_other_engines_names_come_from_the_engine():
    """Per model: the block layout is the model's own, and each TransformerLens / nnterp / nnsight name,
    with {L} filled in at ANY layer (not only the one it was read at), is what engine.interop.mappers gives there."""
    from engine.core.errors import AddressError
    from engine.interop import mappers
    from engine.loading import load_model
    entry = architectures_ts.inspect_model("EleutherAI/pythia-70m-deduped")
    assert entry["error"] is None
    m = load_model(entry["name"], source="zoo")
    lay = m.block_layout()
    assert entry["layout"]["kind"] == lay.kind and entry["layout"]["streams"] == lay.streams
    assert [x for xs in entry["layout"]["mixerLayers"] for x in xs] == sorted(range(m.n_layers))
    last = m.n_layers - 1
    checked = 0
    for src in entry["sources"]:
        layer = None if m.point_layers(src["point"])[0] == -1 else last
        addr = src["point"] if layer is None else f"{src['point']}.{layer}"
        eq = {e["engine"]: e for e in src["equivalents"]}
        assert sorted(eq) == ["nnsight", "nnterp", "transformerLens"]
        for name, fn in (("transformerLens", mappers.to_tl), ("nnterp", mappers.to_nnterp)):
            try:
                want = str(fn(m, addr))
            except AddressError as e:
                assert eq[name]["name"] is None and eq[name]["why"].replace("{L}", str(layer)) == str(e)
                continue
            assert eq[name]["name"].replace("{L}", str(layer)) == want and eq[name]["why"] == ""
            checked += 1
        try:
            acc = mappers.to_nnsight(m, addr)
        except AddressError:
            assert eq["nnsight"]["name"] is None
            continue
        assert eq["nnsight"]["name"].split(" (")[0].replace("{L}", str(layer)) == str(acc)
    assert checked > 20


def test_validation_cell_detail_worst_rows_tolerance_and_causes(tmp_path):
    from validator import known_gaps
    from validator.tolerances import tier_for
    kid = known_gaps.KNOWN[0]
    rows = [{"point": "q", "layer": 0, "case": "short", "verdict": "gap", "known": kid.id, "reason": "no hook"},
            {"point": "k", "layer": 0, "case": "short", "verdict": "gap", "known": {"id": kid.id}, "reason": "x"},
            {"point": "mlp_out", "layer": 1, "case": "long", "verdict": "pass", "rel_err": 1e-7, "token_rel_err": 3e-7,
             "cosine": 1.0, "max_abs": 2e-6},
            {"point": "z", "layer": 1, "case": "short", "verdict": "warn", "rel_err": 2e-5, "token_rel_err": 1e-5,
             "cosine": 0.99, "max_abs": 1e-3},
            {"point": "resid_post", "layer": 0, "case": "short", "verdict": "pass", "rel_err": 5e-7,
             "token_rel_err": 4e-7, "cosine": 1.0, "max_abs": 1e-6},
            {"point": "attn_out", "layer": 0, "case": "short", "verdict": "fail", "structural": ["all-zero"]}]
    (tmp_path / "c.json").write_text(json.dumps({"model": "m/x", "engine": "hf", "status": "ok", "rows": rows,
                                                 "provenance": {"dtype": "float32"}}))
    text = validation_ts.render(tmp_path)
    cell = _export(text, "validation")[0]
    assert [(r["point"], r["verdict"], r["relErr"]) for r in cell["worst"]] == [
        ("attn_out", "fail", None), ("z", "warn", 2e-5), ("resid_post", "pass", 5e-7), ("mlp_out", "pass", 3e-7)]
    assert cell["worst"][0]["reason"] == "all-zero"
    t = tier_for("hf", "float32")
    assert cell["tolerance"] == {"passRel": t.pass_rel, "warnRel": t.warn_rel, "why": t.why}
    assert cell["causes"] == [{"id": kid.id, "rows": 2, "points": ["k", "q"]}]
    assert _export(text, "validationCauses") == [{"id": kid.id, "kind": kid.kind, "engine": kid.engine,
                                                  "reason": kid.reason, "evidence": kid.evidence}]
    (tmp_path / "c.json").write_text(json.dumps({"model": "m/x", "engine": "hf", "status": "ok", "rows": rows,
                                                 "provenance": {"dtype": "int3"}}))
    assert _export(validation_ts.render(tmp_path), "validation")[0]["tolerance"] is None


def test_architectures_unknown_family_is_named():
    with pytest.raises(ValueError, match="unknown families \\['nope'\\]"):
        architectures_ts.data(["nope"], progress=False)


def test_validation_reads_whatever_cells_exist(tmp_path):
    assert _export(validation_ts.render(tmp_path), "validation") == []
    (tmp_path / "a.json").write_text(json.dumps({
        "model": "m/one", "engine": "transformerlens", "provenance": {"dtype": "float32", "device": "cpu"},
        "results": [{"point": "resid_post.0", "verdict": "pass"}, {"point": "q.0", "verdict": "fail"},
                    {"nested": [{"verdict": "pass"}]}]}))
    (tmp_path / "b.json").write_text(json.dumps({"model": "m/one", "engine": "hf", "verdict": "pass",
                                                 "results": [{"verdict": "pass"}, {"verdict": "explained"}]}))
    got = _export(validation_ts.render(tmp_path), "validation")
    assert [(c["engine"], c["verdict"], c["counts"]) for c in got] == [
        ("hf", "pass", {"explained": 1, "pass": 1}), ("transformerlens", "fail", {"fail": 1, "pass": 2})]
    assert got[1]["dtype"] == "float32"
    (tmp_path / "c.json").write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="c.json names no model/engine"):
        validation_ts.data(tmp_path)


def test_literal_is_json_and_wraps_long_values():
    v = {"a": [1, 2.5, None], "b": ["x" * 70, "y" * 70], "c": {}}
    text = ts.literal(v)
    assert json.loads(text) == v
    assert '"a": [1, 2.5, null]' in text and "\n" in text
    assert json.loads(ts.literal(1 / 3)) == 1 / 3


def _fast_outputs(out_dir, bench_cells):
    files = outputs(out_dir, ["points", "validation", "benchmarks", "history"], validator_cells=out_dir / "none",
                    benchmark_cells=bench_cells)
    files.update(outputs(out_dir, ["architectures"], families=["gpt2"]))
    return files


def test_build_check_passes_fresh_and_fails_on_drift(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    files = _fast_outputs(tmp_path, bench)
    assert sorted(p.name for p in files) == sorted(f"{n}.generated.ts" for n in FILES)
    quiet = []
    assert ts.check_or_write(files, False, "fix", log=quiet.append) == 0
    assert ts.check_or_write(_fast_outputs(tmp_path, bench), True, "fix", log=quiet.append) == 0
    victim = tmp_path / "points.generated.ts"
    victim.write_text(victim.read_text().replace('"resid_post"', '"resid_postt"', 1))
    msgs = []
    assert ts.check_or_write(_fast_outputs(tmp_path, bench), True, "fix", log=msgs.append) == 1
    assert any("points.generated.ts" in m for m in msgs) and msgs[-1] == "regenerate with `fix`"
    victim.unlink()
    assert ts.check_or_write(_fast_outputs(tmp_path, bench), True, "fix", log=msgs.append) == 1


def test_cli_rejects_unknown_file(capsys):
    assert main(["build", "--only", "pointz"]) == 2
    assert "unknown generated file 'pointz'" in capsys.readouterr().err


@pytest.mark.slow
def test_committed_site_data_matches_sources():
    """`python -m visualizer_data build --check` on the committed files (builds every zoo twin)."""
    assert main(["build", "--check"]) == 0


def test_committed_fast_site_data_matches_sources():
    """points (engine/core/points.py) and benchmarks (the committed cells); validation and architectures
    change with other people's files (validator cells, family tables), so they are checked in the
    slow run above."""
    assert main(["build", "--check", "--only", "points,benchmarks,history"]) == 0


def _tsc(cwd: Path):
    return subprocess.run(["node", str(TSC), "--noEmit", "-p", str(cwd)], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.skipif(not TSC.exists() or shutil.which("node") is None,
                    reason="TypeScript not installed: run `npm ci --prefix visualizer-data` (CI does)")
def test_typescript_compiles_and_tsc_catches_a_type_error(tmp_path):
    proc = _tsc(VIS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    copy = tmp_path / "vis"
    shutil.copytree(VIS, copy, ignore=shutil.ignore_patterns("node_modules"))
    (copy / "bad.ts").write_text('import { points } from "./points.generated";\n'
                                 'export const n: number = points[0].name;\n')
    bad = _tsc(copy)
    assert bad.returncode != 0 and "bad.ts" in bad.stdout


def test_the_cpu_sweep_rebuilds_every_site_file_its_publish_feeds():
    """benchmarks/cpu.sh publishes into cells.REPORT_DIR, which leaves a dated record under history/ that
    history.generated.ts reads; a build of `--only benchmarks` alone left that file stale (CI went red on the
    first fast check after a sweep). Every visualizer build in the script must name both files."""
    import shlex

    from benchmarks import cells, history
    from visualizer_data import history_ts

    assert history_ts.BENCHMARKS == cells.REPORT_DIR / history.HISTORY  # the records publish writes feed history
    script = (ts.ROOT / "benchmarks" / "cpu.sh").read_text()
    assert re.search(r"-m benchmarks publish\s*$", script, re.M), "cpu.sh publishes into the default folder"
    builds = [shlex.split(line.split("#")[0]) for line in script.splitlines()
              if "-m visualizer_data build" in line and not line.lstrip().startswith("#")]
    assert builds, "cpu.sh builds the site data"
    for argv in builds:
        only = set(argv[argv.index("--only") + 1].split(","))
        assert {"benchmarks", "history"} <= only, argv
