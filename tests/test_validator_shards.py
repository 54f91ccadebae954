"""Shards, merge, the plan's command, and what changed since a reference run (validator/shards.py,
validator/history.py, validator/cli_scale.py): a two-shard run merged equals a one-shard run; merge
refuses mixed versions and digests by name and writes nothing then; `report --since` lists a seeded
regression and exits 1 on it (and reads a git ref as well as a directory)."""
import json
import re
import shutil

import pytest

from validator import cells, cli, history, shards
from validator.shards import comparable

MODELS = ("openai-community/gpt2", "meta-llama/Llama-3.2-1B")
RUN = ["--engines", "hf", "--points", "resid_post,lm_head", "--no-steer", "--no-decode"]


def _run(out, *extra) -> int:
    return cli.main(["run", "--models", ",".join(MODELS), *RUN, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A one-shard run, and the same matrix as shards 1/2 and 2/2 merged."""
    root = tmp_path_factory.mktemp("shards")
    assert _run(root / "whole") == 0
    assert _run(root / "s1", "--shard", "1/2") == 0
    assert _run(root / "s2", "--shard", "2/2") == 0
    assert cli.main(["merge", str(root / "s1"), str(root / "s2"), "--out", str(root / "merged"),
                     "--date", "2026-12-05"]) == 0
    return root


def _by_key(out):
    return {cells.key_of(c): c for c in cells.load_all(out)}


def test_two_shards_merged_equal_one_shard(runs):
    whole, merged = _by_key(runs / "whole"), _by_key(runs / "merged")
    s1, s2 = _by_key(runs / "s1"), _by_key(runs / "s2")
    assert s1 and s2 and not set(s1) & set(s2)  # each model in one shard only
    assert set(merged) == set(whole) == set(s1) | set(s2) and len(whole) == len(MODELS)
    assert {k: comparable(c) for k, c in merged.items()} == {k: comparable(c) for k, c in whole.items()}
    assert (runs / "merged" / "README.md").is_file()  # the publication's reports
    rec = json.loads((runs / "merged" / "history" / "2026-12-05.json").read_text())
    assert rec["columns"]["hf@points-lm_head.resid_post+no-decode+no-steer"]["cells"] == 2
    assert set(rec["cells"]) == set(merged) and all(v["status"] == "ok" for v in rec["cells"].values())


def test_the_split_is_deterministic_and_balanced_by_cost():
    costs = {"a": 10.0, "b": 9.0, "c": 8.0, "d": 1.0}
    assert shards.split(costs, 2) == [["a", "d"], ["b", "c"]]  # longest first, each to the least loaded
    assert shards.split(dict(reversed(list(costs.items()))), 2) == [["d", "a"], ["c", "b"]]  # same sets
    parts = shards.split({f"m{i}": float(i % 7) for i in range(40)}, 3)
    assert sorted(sum(parts, [])) == sorted(f"m{i}" for i in range(40))
    loads = [sum(i % 7 for i in range(40) if f"m{i}" in p) for p in parts]
    assert max(loads) - min(loads) <= 6  # within the largest single cost
    assert shards.split({"x": 1.0}, 3) == [["x"], [], []]


@pytest.mark.parametrize("spec, message", [("0/2", "shard 0 does not exist"), ("3/2", "shard 3 does not exist"),
                                           ("1/0", "at least 1"), ("two/4", "expected i/N"), ("", "expected i/N"),
                                           ("1-2", "expected i/N")])
def test_a_bad_shard_spec_is_refused_by_name(spec, message, capsys, tmp_path):
    with pytest.raises(shards.ShardError, match=message):
        shards.parse(spec)
    assert cli.main(["run", "--models", MODELS[0], "--shard", spec, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--shard {spec!r}" in err and message in err


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit(out, fn):
    """Apply fn to the first cell of `out` and write it back."""
    path = cells.files(out)[0]
    c = cells.read(path)
    fn(c)
    cells.write(path, c)
    return path


def test_merge_refuses_mixed_versions_and_digests_by_name(runs, tmp_path, capsys):
    s1, s2 = runs / "s1", runs / "s2"
    target = tmp_path / "pub"
    cases = [
        (lambda c: c["provenance"]["versions"].update(torch="9.9.9"), "mixed versions of torch in column hf"),
        (lambda c: c["provenance"].update(code_digest="0" * 16), "mixed code digests"),
    ]
    for i, (fn, message) in enumerate(cases):
        bad = _copy(s2, tmp_path / f"bad{i}")
        _edit(bad, fn)
        assert cli.main(["merge", str(s1), str(bad), "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert message in err and str(bad) in err and str(s1) in err
        assert not target.exists()  # nothing written
    twin = _copy(s1, tmp_path / "twin")  # the same cells again: an overlap that agrees is fine
    assert shards.check([s1, twin]).keys() == _by_key(s1).keys()
    _edit(twin, lambda c: c.update(inputs_digest="f" * 16))
    with pytest.raises(shards.ShardError, match="mixed inputs digests for cell"):
        shards.check([s1, twin])
    twin2 = _copy(s1, tmp_path / "twin2")
    _edit(twin2, lambda c: c["rows"][0].update(rel_err=1.0))
    with pytest.raises(shards.ShardError, match="different results"):
        shards.check([s1, twin2])
    (tmp_path / "empty").mkdir()
    with pytest.raises(shards.ShardError, match="holds no cells/ directory"):
        shards.check([s1, tmp_path / "empty"])


def _regress(out, known: str = ""):
    """Seed a regression into one cell of `out`: a passing row now fails, with a 1000x error."""
    def fn(c):
        r = next(r for r in c["rows"] if r["verdict"] == "pass" and r.get("rel_err") is not None)
        r.update(verdict="fail", mismatch="tolerance", rel_err=max(r["rel_err"], 1e-7) * 1000)
        if known:
            r["known"] = known
        c["summary"] = {**c["summary"], "pass": c["summary"]["pass"] - 1, "fail": c["summary"]["fail"] + 1}
    return _edit(out, fn)


def test_report_since_lists_a_seeded_regression_and_exits_1(runs, tmp_path, capsys):
    now = _copy(runs / "whole", tmp_path / "now")
    assert cli.main(["report", "--since", str(runs / "whole"), "--out", str(now)]) == 0
    assert "no cell changed status" in capsys.readouterr().out
    path = _regress(now)
    assert cli.main(["report", "--since", str(runs / "whole" / "cells"), "--out", str(now)]) == 1
    out = capsys.readouterr().out
    name = cells.key_of_file(path)
    assert f"NEW FAILURE newly failing: {name}: " in out and "(was pass; undeclared; tolerance)" in out
    grew = re.search(rf"error grew: {re.escape(name)}: .*relative error \S+ -> \S+ \((\d+)x\)", out)
    assert grew and int(grew.group(1)) >= 1000
    declared = _copy(runs / "whole", tmp_path / "declared")
    _regress(declared, known="some-declared-gap")
    assert cli.main(["report", "--since", str(runs / "whole"), "--out", str(declared)]) == 0  # listed, not new
    assert "declared: some-declared-gap" in capsys.readouterr().out
    broken = _copy(runs / "whole", tmp_path / "broken")
    _edit(broken, lambda c: c.update(status="error", error="model failed to load: boom", rows=[], summary={}))
    assert cli.main(["report", "--since", str(runs / "whole"), "--out", str(broken)]) == 1
    assert "status: " in capsys.readouterr().out


def test_report_since_reads_a_git_ref(capsys):
    """The published cells at HEAD, read through git, against those on disk: the same (where the checkout
    has not touched them), and a ref that does not exist is refused by name."""
    import subprocess
    touched = subprocess.run(["git", "status", "--porcelain", "--", "reports/validator/cells"], cwd=cells.REPO,
                             capture_output=True, text=True).stdout
    at_head = {cells.key_of(c): c for c in history.load("HEAD", cells.DEFAULT_OUT)}
    on_disk = {k: c for k, c in _by_key(cells.DEFAULT_OUT).items() if f"{k}{cells.SUFFIX}" not in touched}
    assert len(at_head) >= 600 and len(on_disk) >= 600 and on_disk.keys() <= at_head.keys()
    assert history.changes([at_head[k] for k in on_disk], list(on_disk.values())) == []
    assert cli.main(["report", "--since", "no-such-ref-anywhere"]) == 2
    assert "'no-such-ref-anywhere' is neither a directory nor a git ref" in capsys.readouterr().err


def test_plan_prints_gpus_and_time_per_model_and_the_shards(runs, capsys):
    assert cli.main(["plan", "--models", ",".join(MODELS), "--engines", "hf,nnsight", "--real", "--dtype",
                     "bfloat16", "--out", str(runs / "whole"), "--shard", "2/2"]) == 0
    out = capsys.readouterr().out
    assert "GPUs at hand per node: 1 x 80 GiB" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("meta-llama/Llama-3.2-1B"))
    assert line.split()[1:3] == ["1.24B", "2.3"] and line.split()[3:5] == ["1", "1"]  # bf16: 2.3 GiB a copy
    assert "shard 2/2: " in out and "<- this shard" in out
    assert cli.main(["plan", "--models", MODELS[0], "--gpus", "-1"]) == 2


def test_time_estimates_come_from_earlier_cells_of_the_same_variant():
    from validator.costs import GUESS_CELL, GUESS_READ, Durations
    earlier = [{"model": "A", "engine": "hf", "variant_tag": "", "status": "ok",
                "provenance": {"seconds": 10.0, "engine_seconds": 4.0}},
               {"model": "A", "engine": "hf", "variant_tag": "bfloat16", "status": "ok",
                "provenance": {"seconds": 99.0, "engine_seconds": 99.0}},
               {"model": "C", "engine": "hf", "variant_tag": "", "status": "error", "provenance": {"engine_seconds": 6.0}}]
    cells_, loads = Durations(earlier).estimates({"A": int(1e9), "B": int(2e9)}, ("hf", "nnsight"), "",
                                                 {"A": 3 * 2 ** 30, "B": 6 * 2 ** 30})
    assert (cells_[("A", "hf")].seconds, cells_[("A", "hf")].how) == (10.0, "measured")
    assert (cells_[("B", "hf")].seconds, cells_[("B", "hf")].how) == (20.0, "scaled")  # 10 s per billion parameters
    assert (cells_[("A", "nnsight")].seconds, cells_[("A", "nnsight")].how) == (GUESS_CELL, "guess")
    assert (loads["A"].seconds, loads["A"].how) == (4.0, "measured")
    assert (loads["B"].seconds, loads["B"].how) == (8.0, "scaled")  # an error cell's seconds are not a rate
    _, other = Durations(earlier).estimates({"B": int(2e9)}, ("hf",), "float16", {"B": 6 * 2 ** 30})
    assert (other["B"].seconds, other["B"].how) == (6 * 2 ** 30 / GUESS_READ, "guess")
