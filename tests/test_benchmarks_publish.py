"""Publishing that cannot lie: every refusal by its message, all-or-nothing writes, `--check` on
fresh and drifted outputs, what the README block shows (ratios with intervals, model size, machine;
no absolute tok/s), and that the committed outputs are what the committed cells give. The site's data
file of the same cells is visualizer_data's (rendered here from the same sweeps to check its figures)."""
from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import cells as cellio
from benchmarks import plots, publish
from benchmarks.__main__ import main as cli
from tests.bench_fakes import fake_cell
from visualizer_data import benchmarks_ts

QUIET = lambda *_: None  # noqa: E731
README = f"# Project\n\n{publish.START}\nold block\n{publish.END}\n\nfooter\n"


def sweep_cells(sweep="cpu-test-tiny", scale=1.0, **params):
    s = [0.10, 0.11, 0.10, 0.12, 0.10, 0.11, 0.10, 0.13, 0.10, 0.11, 0.10, 0.12]
    return [fake_cell("eager", "decode", [x * scale for x in s], sweep=sweep, **params),
            fake_cell("eager", "steer_all", [x * 1.1 * scale for x in s], sweep=sweep, **params),
            fake_cell("eager", "prefill", [x / 4 for x in s], sweep=sweep, **params),
            fake_cell("eager", "capture_all", [x / 3.8 for x in s], sweep=sweep, **params),
            fake_cell("hf-generate", "prefill", [x / 4.2 for x in s], sweep=sweep, **params),
            fake_cell("nnsight", "capture_all", [x / 2 for x in s], sweep=sweep, **params),
            fake_cell("nnsight", "steer_all", [x * 3 for x in s], sweep=sweep, status="invalid", **params),
            cellio.make_cell(sweep, "hf-generate", "steer_all", "n/a", "plain HF has no steering API",
                             params=fake_cell("eager", "decode", s, **params)["params"], run_id="20260101T000000Z")]


@pytest.fixture
def site(tmp_path):
    """A sweeps root with two sweeps, a README with markers, and where the report and plots go."""
    root = tmp_path / "sweeps"
    for c in sweep_cells() + sweep_cells("cpu-test-real", 3.0, size="real"):
        cellio.write_cell(c, root)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    return {"root": root, "sweeps": sorted(root.iterdir()), "readme": readme, "out": tmp_path / "out"}


def run_publish(site, check=False, log=QUIET, sweeps=None):
    return publish.main(sweeps or site["sweeps"], site["readme"], site["out"], check, log)


def ts_export(root, name):
    """The JSON value of `export const name: T = ...;` in the site's TS file of the sweeps under `root`."""
    text = benchmarks_ts.render(cellio.load_cells(root)).split(f"export const {name}: ")[1]
    return json.loads(text.split(" = ", 1)[1].split(";\n", 1)[0])


def snapshot(site) -> dict:
    files = [site["readme"], *(p for p in site["out"].rglob("*") if p.is_file())] if site["out"].exists() \
        else [site["readme"]]
    return {p: p.read_bytes() for p in files if p.exists()}


# -- what gets published --------------------------------------------------------------------------------
def test_readme_block_shows_ratios_with_intervals_model_and_machine_but_no_tok_s(site):
    assert run_publish(site) == 0
    text = site["readme"].read_text()
    assert text.startswith("# Project\n\n") and text.endswith("\n\nfooter\n") and "old block" not in text
    block = text.split(publish.START)[1].split(publish.END)[0]
    assert "| ratio | `cpu-test-real` | `cpu-test-tiny` |" in block
    assert "| eager, capture at every layer / HF forward | 0.905x [0.905–0.905] | 0.905x [0.905–0.905] |" in block
    assert "| eager, steer every layer / no steer | 0.909x [0.909–0.909] | 0.909x [0.909–0.909] |" in block
    assert "meta-llama/Llama-3.2-1B (real-size zoo twin) (1M parameters, 2 layers, d_model 256)" in block
    assert "float32 on CPU Test CPU x2, 1 thread(s) per worker, timed in CPU seconds" in block
    assert "tok/s]" not in block and "153" not in block  # eager decode is 153 tok/s: never in the README
    report = (site["out"] / publish.REPORT_MD).read_text()
    assert "| eager | decode | 153 [133–160] | 1 | 1.0 |" in report  # absolute figures live in the report
    assert "invalid: because — **nnsight x steer_all**" in report
    assert "n/a: plain HF has no steering API — **hf-generate x steer_all**" in report
    rows = ts_export(site["root"], "benchmarkRatios")
    row = next(r for r in rows if r["sweep"] == "cpu-test-tiny" and r["key"] == "eager:steer_all/eager:decode")
    assert row["median"] == pytest.approx(1 / 1.1) and row["resolved"] and row["headline"]
    assert [s["name"] for s in ts_export(site["root"], "benchmarkSweeps")] == ["cpu-test-real", "cpu-test-tiny"]
    assert {p.name for p in site["out"].glob("*.png")} == {plots.RATIOS_PNG, "throughput-cpu-test-real.png",
                                                           "throughput-cpu-test-tiny.png"}


def test_unresolved_ratio_is_never_a_figure(site, tmp_path):
    root = tmp_path / "noisy"
    cells = sweep_cells("cpu-noisy")
    noisy = [0.1, 0.3, 0.1, 0.05, 0.2, 0.1, 0.4, 0.1, 0.08, 0.3, 0.1, 0.2]
    cells[1] = fake_cell("eager", "steer_all", noisy, sweep="cpu-noisy")
    for c in cells:
        cellio.write_cell(c, root)
    assert run_publish(site, sweeps=[root / "cpu-noisy"]) == 0
    block = site["readme"].read_text()
    assert "| eager, steer every layer / no steer | unresolved |" in block
    report = (site["out"] / publish.REPORT_MD).read_text()
    assert "| eager, steer every layer / no steer | unresolved ([" in report and "spans" in report
    row = next(r for r in ts_export(root, "benchmarkRatios") if r["key"] == "eager:steer_all/eager:decode")
    assert row["median"] is None and row["resolved"] is False and row["lo"] < row["hi"]


def write_rerun(site, steer_scale: float, sweep="cpu-test-tiny", **edits) -> None:
    """The sweep run again (another run id) into <tmp>/reruns/<sweep>, its steer_all cell `steer_scale`
    times as slow as the sweep's; `edits` replace env fields of every rerun cell."""
    s = [0.10, 0.11, 0.10, 0.12, 0.10, 0.11, 0.10, 0.13, 0.10, 0.11, 0.10, 0.12]
    for c in sweep_cells(sweep):
        if c["workload"] == "steer_all" and c["variant"] == "eager":
            c = fake_cell("eager", "steer_all", [x * 1.1 * steer_scale for x in s], sweep=sweep)
        c["run_id"] = "20260102T000000Z"
        if c.get("env"):
            c["env"].update(edits)
        cellio.write_cell(c, site["root"].parent / cellio.RERUNS)


def test_a_ratio_its_rerun_does_not_reproduce_is_unresolved_everywhere(site):
    """A figure a rerun on the same machine does not reproduce is never published as one: the rerun's
    median outside the sweep's interval makes the ratio unresolved in the README, the report (which says
    both figures), the site data and the plot; ratios the rerun reproduces, and the sweep without a rerun,
    keep their figures."""
    write_rerun(site, 1.2)  # steer / no steer: 0.909 in the sweep, 0.758 in the rerun
    assert run_publish(site) == 0
    block = site["readme"].read_text().split(publish.START)[1]
    assert "| eager, steer every layer / no steer | 0.909x [0.909–0.909] | unresolved |" in block  # real | tiny
    assert "| eager, capture at every layer / HF forward | 0.905x [0.905–0.905] | 0.905x [0.905–0.905] |" in block
    report = (site["out"] / publish.REPORT_MD).read_text()
    tiny = report.split("`cpu-test-tiny`:")[-1]
    assert "unresolved (not reproduced: 0.909x [0.909–0.909], its rerun 0.758x [0.758–0.758])" in tiny
    assert "- rerun 20260102T000000Z at commit abc (reports/benchmarks/reruns/cpu-test-tiny/)" in tiny
    d = benchmarks_ts.data(cellio.load_cells(site["root"]), cellio.load_cells(site["root"].parent / cellio.RERUNS))
    rows = {(r["sweep"], r["key"]): r for r in d["benchmarkRatios"]}
    assert rows[("cpu-test-tiny", "eager:steer_all/eager:decode")]["median"] is None
    assert rows[("cpu-test-real", "eager:steer_all/eager:decode")]["median"] == pytest.approx(1 / 1.1)
    assert rows[("cpu-test-tiny", "eager:capture_all/hf-generate:prefill")]["resolved"]
    assert {x[0]: x[4] for x in plots.ratios_data(publish.load_tables(site["sweeps"]))["cpu-test-tiny"]}[
        "eager, steer every layer / no steer"] is False
    assert run_publish(site, check=True) == 0


def test_a_rerun_that_reproduces_changes_no_figure(site):
    assert run_publish(site) == 0
    before = site["readme"].read_text()
    write_rerun(site, 1.0)
    assert run_publish(site) == 0
    assert site["readme"].read_text() == before


def test_refuses_a_rerun_older_than_its_sweep(site, capsys):
    write_rerun(site, 1.0)
    for p in (site["root"].parent / cellio.RERUNS / "cpu-test-tiny").glob("*.json"):
        c = json.loads(p.read_text())
        c["run_id"] = "20251231T000000Z"  # before the sweep's 20260101T000000Z: a rerun of an older sweep
        p.write_text(json.dumps(c))
    refuses(site, capsys, site["sweeps"], "the rerun of sweep 'cpu-test-tiny' (20251231T000000Z) ran before the sweep")


def test_refuses_a_rerun_from_another_machine_naming_the_field(site, capsys):
    write_rerun(site, 1.0, hardware="CPU Other CPU x2")
    refuses(site, capsys, site["sweeps"], "the rerun of sweep 'cpu-test-tiny' ran with hardware 'CPU Other CPU x2'")


# -- refusals, by message, and nothing written ----------------------------------------------------------
def refuses(site, capsys, argv_sweeps, message):
    before = snapshot(site)
    rc = cli(["publish", "--sweeps", *map(str, argv_sweeps), "--readme", str(site["readme"]), "--out",
              str(site["out"])])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert snapshot(site) == before  # nothing published


def test_refuses_a_sweeps_folder_that_does_not_exist(site, capsys):
    refuses(site, capsys, [site["root"] / "no-such-sweep"], "no such benchmark sweep folder")


def test_refuses_an_empty_sweep_folder(site, capsys):
    (site["root"] / "empty").mkdir()
    refuses(site, capsys, [site["root"] / "empty"], "holds no cells")


def test_default_sweeps_root_must_exist(monkeypatch, tmp_path):
    monkeypatch.setattr(cellio, "CELLS_DIR", tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no such benchmark sweeps folder"):
        publish.load_tables(None)
    (tmp_path / "missing").mkdir()
    with pytest.raises(ValueError, match="no benchmark sweeps under .*nothing to publish"):
        publish.load_tables(None)


def test_refuses_a_duplicate_cell_file(site, capsys):
    d = site["sweeps"][0]
    shutil.copy(d / "eager__decode.json", d / "eager__decode (copy).json")
    refuses(site, capsys, site["sweeps"], "holds cell 'eager__decode' of sweep 'cpu-test-real': a copied or renamed")


def test_refuses_a_cell_filed_under_another_sweep(site, capsys):
    shutil.copy(site["sweeps"][0] / "eager__decode.json", site["sweeps"][1] / "eager__decode.json")
    refuses(site, capsys, site["sweeps"], "holds cell 'eager__decode' of sweep 'cpu-test-real'")


def _edit(site, cell_file, fn):
    p = site["sweeps"][1] / cell_file
    c = json.loads(p.read_text())
    fn(c)
    p.write_text(json.dumps(c))


def test_refuses_a_timed_cell_without_env(site, capsys):
    _edit(site, "eager__decode.json", lambda c: c.pop("env"))
    refuses(site, capsys, site["sweeps"], "cpu-test-tiny/eager__decode has timing samples but no env")


def test_refuses_a_cell_with_other_threads(site, capsys):
    _edit(site, "eager__decode.json", lambda c: c["env"].update(torch_threads=2))
    refuses(site, capsys, site["sweeps"], "refusing to mix cells with different 'torch_threads'")


def test_refuses_a_cell_with_other_library_versions(site, capsys):
    _edit(site, "nnsight__capture_all.json", lambda c: c["env"]["versions"].update(nnsight="0.8.1"))
    refuses(site, capsys, site["sweeps"], "refusing to mix cells with different library versions")


def test_refuses_an_old_schema_cell(site, capsys):
    _edit(site, "eager__decode.json", lambda c: c.update(schema=1))
    refuses(site, capsys, site["sweeps"], "has schema 1 / status 'ok'; expected schema 2")


def test_refuses_a_readme_without_markers(site):
    site["readme"].write_text("# Project\n")
    with pytest.raises(publish.MarkerError, match="Add the two marker lines"):
        run_publish(site)
    assert site["readme"].read_text() == "# Project\n" and not site["out"].exists()


def test_a_plot_error_publishes_nothing(site, monkeypatch):
    assert run_publish(site) == 0
    before = snapshot(site)
    for c in sweep_cells("cpu-test-tiny", 2.0):  # new figures, so every output would change
        cellio.write_cell(c, site["root"])

    def broken(tables):
        raise RuntimeError("matplotlib exploded")
    monkeypatch.setattr(plots, "plot_ratios", broken)
    with pytest.raises(RuntimeError, match="matplotlib exploded"):
        run_publish(site)
    assert snapshot(site) == before


@pytest.mark.parametrize("text, msg", [
    ("no markers here\n", "must contain exactly one"),
    (f"{publish.START}\n{publish.START}\n{publish.END}\n", "found 2 and 1"),
    (f"{publish.END}\nx\n{publish.START}\n", "comes before"),
])
def test_replace_block_errors_say_how_to_fix(text, msg):
    with pytest.raises(publish.MarkerError, match=msg):
        publish.replace_block(text, "x")


# -- --check ---------------------------------------------------------------------------------------------
def test_check_passes_fresh_and_catches_each_drifted_file(site):
    assert run_publish(site) == 0
    assert run_publish(site, check=True) == 0
    victims = [site["readme"], site["out"] / publish.REPORT_MD, site["out"] / plots.RATIOS_PNG,
               site["out"] / "throughput-cpu-test-tiny.png"]
    for victim in victims:
        saved = victim.read_bytes()
        if victim.suffix == ".png":
            shutil.copy(site["out"] / "throughput-cpu-test-real.png", victim)  # a plot of other data
        else:
            victim.write_text(victim.read_text().replace("eager", "eagre", 1))
        msgs = []
        assert run_publish(site, check=True, log=msgs.append) == 1
        assert any(victim.name in m for m in msgs) and "python -m benchmarks publish" in msgs[-1]
        victim.write_bytes(saved)
    assert run_publish(site, check=True) == 0


def test_committed_outputs_match_committed_cells():
    """The committed report, README block and plots are what the committed cells give (the site's TS
    file: tests/test_visualizer_data.py). The sweeps are committed: their absence is a failure, not a skip."""
    assert cellio.CELLS_DIR.is_dir() and cellio.sweep_dirs(), f"no committed benchmark sweeps under {cellio.CELLS_DIR}"
    msgs = []
    rc = publish.main(None, cellio.ROOT / "README.md", cellio.REPORT_DIR, True, msgs.append)
    assert rc == 0, msgs


# -- the dated record and the comparison with the previous publication ------------------------------------
def test_publish_records_each_night_and_marks_a_regression_where_intervals_do_not_overlap(site, monkeypatch):
    from benchmarks import history
    monkeypatch.setattr(history, "today", lambda: "2026-12-01")
    assert run_publish(site) == 0
    first = json.loads((site["out"] / "history" / "2026-12-01.json").read_text())
    tiny = first["sweeps"]["cpu-test-tiny"]
    steer = tiny["ratios"]["eager:steer_all/eager:decode"]
    assert steer["median"] == pytest.approx(1 / 1.1) and steer["lo"] == steer["hi"]  # every round alike
    assert tiny["tok_s"]["eager:decode"]["median"] > 0 and tiny["hardware"]
    report = (site["out"] / publish.REPORT_MD).read_text()
    assert "## Since the previous publication" in report and "No earlier publication is recorded" in report
    # the next night: steering got twice as slow on one sweep, decode twice as fast on the other
    shutil.rmtree(site["root"])
    base = sweep_cells()
    slow = [s["seconds"] * 2 for s in base[1]["samples"]]
    worse = [fake_cell("eager", "steer_all", slow, sweep="cpu-test-tiny") if c is base[1] else c for c in base]
    for c in worse + sweep_cells("cpu-test-real", 3.0, size="real"):
        cellio.write_cell(c, site["root"])
    monkeypatch.setattr(history, "today", lambda: "2026-12-02")
    assert run_publish(site) == 0
    report = (site["out"] / publish.REPORT_MD).read_text()
    assert "Compared with the publication of 2026-12-01" in report
    line = next(ln for ln in report.splitlines() if ln.startswith("- **regression**"))
    assert "`cpu-test-tiny`" in line and "0.909x [0.909–0.909] -> 0.455x [0.455–0.455]" in line
    assert not any("cpu-test-real" in ln for ln in report.splitlines() if ln.startswith("- **regression**"))
    assert run_publish(site, check=True) == 0  # the newest record is the one checked, compared with the one before
    rec = site["out"] / "history" / "2026-12-02.json"
    rec.write_text(rec.read_text().replace("0.45", "0.46", 1))
    msgs = []
    assert run_publish(site, check=True, log=msgs.append) == 1 and any("2026-12-02.json" in m for m in msgs)


def test_a_sweep_that_ran_on_other_hardware_is_not_compared_with_its_previous_record():
    """A ratio moves with the CPU: a night on another machine is named, never flagged as a regression (on the
    2026-12-07 publication, an AMD EPYC night against an Intel Xeon one flagged 20 ratios of code that did not
    change)."""
    from benchmarks import history

    def rec(hardware: dict, median: float) -> dict:
        iv = {"median": median, "lo": median * 0.98, "hi": median * 1.02}
        return {"sweeps": {s: {"hardware": hw, "node": "vm", "model": "m", "tok_s": {},
                               "ratios": {"eager:steer_all/eager:decode": {"title": "eager steer_all / eager decode",
                                                                          "group": "own", "headline": False,
                                                                          "resolved": True, **iv}}}
                           for s, hw in hardware.items()}}
    before = rec({"cpu-a": "CPU Intel x2", "cpu-b": "CPU Intel x2"}, 0.9)
    after = rec({"cpu-a": "CPU AMD x2", "cpu-b": "CPU Intel x2"}, 0.6)  # both far below their old interval
    assert history.moved(before, after) == {"cpu-a": ("CPU Intel x2", "CPU AMD x2")}
    changes = history.compare(before, after)
    assert [(c.sweep, c.kind) for c in changes] == [("cpu-b", "regression")]
    text = "\n".join(history.section(("2026-12-06", before), after))
    assert "sweeps in both, on the same hardware: `cpu-b`)" in text
    assert "Not compared, because the hardware changed" in text
    assert "`cpu-a` ran on CPU Intel x2 then, on CPU AMD x2 now" in text
    assert "- **regression**: `cpu-b` eager steer_all / eager decode: 0.9x [0.882–0.918] -> 0.6x [0.588–0.612]" in text
    assert not any(ln.startswith("- ") and "cpu-a" in ln for ln in text.splitlines())
    alone = "\n".join(history.section(("2026-12-06", before), rec({"cpu-a": "CPU AMD x2"}, 0.6)))
    assert "on the same hardware: none)" in alone and "No ratio was compared." in alone
    unnamed = rec({"cpu-a": None}, 0.9)  # a record from before sweeps named their machine
    assert history.moved(unnamed, after) == {"cpu-a": (None, "CPU AMD x2")} and history.compare(unnamed, after) == []
    text = "\n".join(history.section(("2026-12-01", unnamed), after))
    assert "`cpu-a` ran on hardware it did not record then, on CPU AMD x2 now" in text and "None" not in text
