"""Benchmark harness: statistics and rounding, tables and ratios, refusal to mix hardware, the
README marker rewrite, report/publish --check (fresh passes, drift fails)."""
from __future__ import annotations

import json
import random
import statistics

import numpy as np
import pytest

from benchmarks import cells as cellio
from benchmarks import env, plots, publish, report, stats
from benchmarks.spec import Params
from benchmarks.table import MixedCellsError, Table
from benchmarks.workloads import BY_NAME as WORKLOADS


def fake_cell(variant, workload, samples, hardware="CPU Test CPU x2", dtype="float32", status="ok", **params):
    p = Params(**params).to_dict()
    p["dtype"] = dtype
    tokens = WORKLOADS[workload].tokens(p["prompt_tokens"], p["new_tokens"])
    fields = {"params": p, "run_id": "20260101T000000Z", "kind": "ours" if variant == "eager" else "peer",
              "env": {"hardware": hardware, "dtype": dtype, "device": "cpu", "cpu": "Test CPU", "gpu": None,
                      "cpu_count": 2, "torch_threads": 2, "versions": {"torch": "0"}, "load_avg_1m": 0.5}}
    if status in ("ok", "invalid"):
        fields.update(samples_s=samples, summary=stats.summarize(samples, tokens), notes=[])
    return cellio.make_cell(variant, workload, status, "" if status == "ok" else "because", **fields)


def sweep(hardware="CPU Test CPU x2", dtype="float32"):
    s = [0.10, 0.11, 0.12, 0.13, 0.30]
    return [fake_cell("eager", "decode", s, hardware, dtype),
            fake_cell("eager", "capture_gen", [x * 2 for x in s], hardware, dtype),
            fake_cell("eager", "prefill", [x / 4 for x in s], hardware, dtype),
            fake_cell("eager", "capture_all", [x / 2 for x in s], hardware, dtype),
            fake_cell("vllm-generate", "decode", [x / 5 for x in s], hardware, dtype),
            fake_cell("transformerlens", "capture_all", [x * 3 for x in s], hardware, dtype),
            fake_cell("nnsight", "steer", s, hardware, dtype, status="invalid"),
            cellio.make_cell("hf-generate", "steer", "n/a", "plain HF has no steering API",
                             params=Params().to_dict())]


# -- statistics and rounding -----------------------------------------------------------------------
def test_quantile_and_summary_match_numpy_and_statistics():
    rng = random.Random(0)
    for n in (1, 2, 5, 9):
        xs = [rng.uniform(0.01, 2.0) for _ in range(n)]
        for q in (0.0, 0.25, 0.5, 0.75, 1.0):
            assert stats.quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=1e-12)
        s = stats.summarize(xs, 16)
        assert s["seconds"]["median"] == pytest.approx(statistics.median(xs))
        assert s["tok_s"]["median"] == pytest.approx(16 / statistics.median(xs))
        assert s["tok_s"]["max"] == pytest.approx(16 / min(xs)) and s["tok_s"]["min"] == pytest.approx(16 / max(xs))
        assert s["tok_s"]["q1"] <= s["tok_s"]["median"] <= s["tok_s"]["q3"]


@pytest.mark.parametrize("bad, msg", [([], "no timing samples"), ([0.1, -1.0], "positive finite"),
                                       ([float("nan")], "positive finite")])
def test_summarize_rejects_bad_samples(bad, msg):
    with pytest.raises(ValueError, match=msg):
        stats.summarize(bad, 8)


def test_sig_agrees_with_python_g_format_and_keeps_plain_notation():
    rng = random.Random(1)
    for _ in range(2000):
        x = rng.choice([-1, 1]) * 10 ** rng.uniform(-5, 7)
        for d in (1, 2, 3, 4, 6):
            text = stats.sig(x, d)
            assert "e" not in text.lower()
            assert float(text) == pytest.approx(float(f"{x:.{d}g}"), rel=1e-12, abs=0), (x, d, text)
            digits = text.lstrip("-").replace(".", "").lstrip("0")
            if "." in text:  # trailing zeros after the point are kept, so precision is visible
                assert len(digits) == d, (x, d, text)


def test_sig_edge_cases():
    assert stats.sig(999.96, 3) == "1000"  # carries into the next decade
    assert stats.sig(0.0012345, 3) == "0.00123"
    assert stats.sig(2.0, 3) == "2.00"
    assert stats.sig(0.0, 3) == "0.00"
    assert stats.sig(None) == "—"
    with pytest.raises(ValueError, match="digits must be >= 1"):
        stats.sig(1.0, 0)


def test_full_precision_round_trips():
    for x in (1 / 3, 123.456789012345678, 1e-9 / 7):
        assert float(stats.full(x)) == x


# -- tables and ratios -------------------------------------------------------------------------------
def test_ratios_are_computed_from_the_cells():
    cs = sweep()
    t = Table(cs)
    med = {c["id"]: c["summary"]["tok_s"]["median"] for c in cs if c["status"] == "ok"}
    assert t.vs_own("eager", "capture_gen") == pytest.approx(med["eager__capture_gen"] / med["eager__decode"])
    assert t.vs_own("eager", "capture_all") == pytest.approx(med["eager__capture_all"] / med["eager__prefill"])
    assert t.vs_stock("eager", "capture_gen") == pytest.approx(med["eager__capture_gen"] / med["vllm-generate__decode"])
    assert t.vs_eager("transformerlens", "capture_all") == pytest.approx(
        med["transformerlens__capture_all"] / med["eager__capture_all"])
    assert t.tok_s("nnsight", "steer") is None  # an invalid cell never has a published figure
    assert t.vs_own("eager", "decode") is None


def test_refuses_mixed_hardware_and_dtypes():
    with pytest.raises(MixedCellsError, match="different hardware or dtypes"):
        Table(sweep()[:3] + [fake_cell("nnsight", "decode", [0.1] * 5, hardware="GPU NVIDIA H100")])
    with pytest.raises(MixedCellsError, match="different hardware or dtypes"):
        Table(sweep()[:3] + [fake_cell("nnsight", "decode", [0.1] * 5, dtype="bfloat16")])
    with pytest.raises(MixedCellsError, match="'prompt_tokens'"):
        Table(sweep()[:3] + [fake_cell("nnsight", "decode", [0.1] * 5, prompt_tokens=64)])


def test_publish_cli_refuses_mixed_cells(tmp_path, capsys):
    from benchmarks.__main__ import main
    d = tmp_path / "cells"
    for c in sweep() + [fake_cell("nnsight", "decode", [0.1] * 5, hardware="GPU NVIDIA H100")]:
        cellio.write_cell(c, d)
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{publish.START}\n{publish.END}\n")
    rc = main(["publish", "--cells", str(d), "--readme", str(readme), "--ts", str(tmp_path / "b.ts"),
               "--plots", str(tmp_path)])
    assert rc == 2
    assert "refusing to mix" in capsys.readouterr().err
    assert readme.read_text() == f"x\n{publish.START}\n{publish.END}\n"  # nothing written


def test_hardware_key_prefers_the_gpu():
    assert env.hardware_key({"gpu": "NVIDIA H200", "cpu": "Xeon", "cpu_count": 16}) == "GPU NVIDIA H200"
    assert env.hardware_key({"gpu": None, "cpu": "Xeon", "cpu_count": 2}) == "CPU Xeon x2"


# -- cells --------------------------------------------------------------------------------------------
def test_cells_round_trip_and_bad_files(tmp_path):
    c = sweep()[0]
    p = cellio.write_cell(c, tmp_path)
    assert json.loads(p.read_text()) == c and not list(tmp_path.glob(".*.tmp"))
    assert cellio.load_cells(tmp_path) == [c]
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        cellio.load_cells(tmp_path)
    with pytest.raises(ValueError, match="needs a reason"):
        cellio.make_cell("eager", "decode", "n/a")
    with pytest.raises(ValueError, match="status must be one of"):
        cellio.make_cell("eager", "decode", "great")


def test_params_validate():
    with pytest.raises(ValueError, match="repeats must be >= 5"):
        Params(repeats=3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        Params(dtype="fp8")


# -- README marker rewrite --------------------------------------------------------------------------
def test_replace_block_touches_only_the_block():
    before, after = "# Title\n\nintro text\n", "\n## Later\nmore text\n"
    text = before + publish.START + "\nold table\n" + publish.END + after
    out = publish.replace_block(text, "new table\nline 2")
    assert out == before + publish.START + "\nnew table\nline 2\n" + publish.END + after
    assert publish.replace_block(out, "new table\nline 2") == out  # idempotent


@pytest.mark.parametrize("text, msg", [
    ("no markers here\n", "must contain exactly one"),
    (f"{publish.START}\n{publish.START}\n{publish.END}\n", "found 2 and 1"),
    (f"{publish.END}\nx\n{publish.START}\n", "comes before"),
])
def test_replace_block_errors_say_how_to_fix(text, msg):
    with pytest.raises(publish.MarkerError, match=msg) as e:
        publish.replace_block(text, "x")
    assert "marker" in str(e.value).lower() or "START" in str(e.value)


def test_publish_fails_without_markers(tmp_path):
    d = tmp_path / "cells"
    for c in sweep():
        cellio.write_cell(c, d)
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n")
    with pytest.raises(publish.MarkerError, match="Add the two marker lines"):
        publish.main(d, readme, tmp_path / "b.ts", tmp_path, check=False, log=lambda *_: None)
    assert readme.read_text() == "# Project\n"


# -- report / publish: fresh passes --check, drift fails -----------------------------------------------
def _published(tmp_path):
    d = tmp_path / "cells"
    for c in sweep():
        cellio.write_cell(c, d)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Project\n\n{publish.START}\n{publish.END}\n\nfooter\n")
    ts, out = tmp_path / "benchmarks.generated.ts", tmp_path / "results.md"
    quiet = lambda *_: None  # noqa: E731
    assert publish.main(d, readme, ts, tmp_path, check=False, log=quiet) == 0
    assert report.main(d, out, check=False) == 0
    return d, readme, ts, out, quiet


def test_report_and_publish_check_fresh_then_drift(tmp_path):
    d, readme, ts, out, quiet = _published(tmp_path)
    assert publish.main(d, readme, ts, tmp_path, check=True, log=quiet) == 0
    assert report.main(d, out, check=True) == 0
    text = readme.read_text()
    assert text.startswith("# Project\n\n") and text.endswith("\n\nfooter\n")
    # the README block carries the median of every ok cell, 3 significant figures
    t = Table(cellio.load_cells(d))
    assert f"| eager | {stats.sig(t.tok_s('eager', 'decode'), 3)} |" in text
    # a cell changes: every output drifts
    c = json.loads((d / "eager__decode.json").read_text())
    c["samples_s"] = [x * 2 for x in c["samples_s"]]
    c["summary"] = stats.summarize(c["samples_s"], c["summary"]["tokens_per_run"])
    cellio.write_cell(c, d)
    assert publish.main(d, readme, ts, tmp_path, check=True, log=quiet) == 1
    assert report.main(d, out, check=True) == 1


@pytest.mark.parametrize("victim", ["README.md", "benchmarks.generated.ts", plots.THROUGHPUT_PNG,
                                    plots.OVERHEAD_PNG])
def test_publish_check_catches_each_edited_file(tmp_path, victim):
    d, readme, ts, out, quiet = _published(tmp_path)
    path = tmp_path / victim
    if victim.endswith(".png"):
        other = tmp_path / "other.png"
        plots.plot_throughput(Table(cellio.load_cells(d)[:2]), other)  # a plot of different data
        other.replace(path)
    else:
        path.write_text(path.read_text().replace("eager", "eagre", 1))
    msgs = []
    assert publish.main(d, readme, ts, tmp_path, check=True, log=msgs.append) == 1
    assert any(victim in m for m in msgs) and "python -m benchmarks publish" in msgs[-1]


def test_report_states_every_row_that_ran_differently(tmp_path):
    text = report.render(sweep())
    section = text.split("## Rows that ran differently")[1].split("## Full precision")[0]
    assert "- invalid: because — **nnsight x steer**" in section
    assert "- n/a: plain HF has no steering API — **hf-generate x steer**" in section
    # full precision: the exact median appears unrounded
    med = Table(sweep()).tok_s("eager", "decode")
    assert repr(med) in text


def test_committed_outputs_match_committed_cells():
    """The committed report, README block, TS file and plots are what the committed cells give."""
    if not list(cellio.CELLS_DIR.glob("*.json")):
        pytest.skip("no committed benchmark cells yet (run `python -m benchmarks run`)")
    assert report.main(cellio.CELLS_DIR, cellio.REPORT_DIR / "results-latest.md", check=True) == 0
    readme = cellio.ROOT / "README.md"
    assert publish.main(cellio.CELLS_DIR, readme, cellio.ROOT / "visualizer-data" / "benchmarks.generated.ts",
                        cellio.REPORT_DIR, check=True) == 0


def test_noisy_cells_are_run_again_and_the_tighter_run_is_kept(tmp_path, monkeypatch):
    from benchmarks import sweep as sw
    wild = fake_cell("eager", "decode", [0.1, 0.1, 0.3, 0.5, 0.9])
    wild2 = fake_cell("eager", "capture_gen", [0.1, 0.1, 0.3, 0.5, 0.9])
    tight = fake_cell("eager", "prefill", [0.1, 0.1, 0.1, 0.1, 0.1])
    for c in (wild, wild2, tight):
        cellio.write_cell(c, tmp_path)
    assert sw.noisy(wild) and not sw.noisy(tight)
    calls = []
    reruns = {"decode": [0.2, 0.2, 0.21, 0.2, 0.2], "capture_gen": [0.1, 0.9, 0.1, 2.0, 3.0]}

    def fake_run_one(variant, workload, params, run_id, cells_dir):
        calls.append(workload)
        c = fake_cell(variant, workload, reruns[workload])
        cellio.write_cell(c, cells_dir)
        return c
    monkeypatch.setattr(sw, "run_one", fake_run_one)
    sw.rerun_noisy(tmp_path, log=lambda *_: None)
    assert sorted(calls) == ["capture_gen", "decode"]
    dec = json.loads((tmp_path / "eager__decode.json").read_text())  # the rerun is tighter: kept
    assert dec["samples_s"] == reruns["decode"] and dec["other_run"]["samples_s"] == wild["samples_s"]
    gen = json.loads((tmp_path / "eager__capture_gen.json").read_text())  # the rerun is wilder: first kept
    assert gen["samples_s"] == wild2["samples_s"] and gen["other_run"]["samples_s"] == reruns["capture_gen"]
    assert any("kept the second run" in n for n in dec["notes"])
    assert any("kept the first run" in n for n in gen["notes"])
    assert "run twice" in report.render(cellio.load_cells(tmp_path))
