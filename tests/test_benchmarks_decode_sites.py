"""benchmarks/decode_sites.py and benchmarks/timers.py: the host breakdown times the decode forwards alone
(one steered site per layer, one guard and one layout per step, counted against the model's own layer count),
the table names both arms and every stage, the timers leave with the measurement, and bad arguments are
refused by name."""
from __future__ import annotations

import json
import re
import types

import pytest

from benchmarks import decode_sites, timers


def test_the_breakdown_times_each_decode_step_once_per_layer(tmp_path, capsys):
    from engine.backends.hf import eager, grid
    plain = eager.EagerModel._at_site, eager.EagerModel._guard, grid.decode_layout
    out = tmp_path / "ds.json"
    args = ["--rounds", "6", "--reps", "1", "--batch", "2", "--prompt", "5", "--new-tokens", "4", "--json", str(out)]
    assert decode_sites.main(args) == 0
    res = json.loads(out.read_text())
    from engine import load_model
    m = load_model(res["model"], source="zoo")
    n = m.n_layers
    assert res["layers"] == n and res["device"] == "cpu"
    # prefill forwards are left out: per decode step, each layer's forward and its steered site once, one guard
    # and one layout; per call, the plans and the ledger's read once
    assert res["calls"] == {"layers": n, "sites": n, "guard": 1, "layout": 1, "plans": 1, "ledger read": 1}
    assert all(len(v) == 6 and min(v) > 0 for v in res["host_s"].values())
    assert all(len(v) == 6 for v in res["per_step_s"].values())
    text = capsys.readouterr().out
    assert text.count("round ") == 6
    rows = dict(re.findall(r"^\| (generate|steer every layer) \| [\d.]+ \[[\d.]+–[\d.]+\] \| (.+) \|$", text, re.M))
    assert rows["generate"] == "1"
    assert re.fullmatch(r"[\d.]+x \[[\d.]+–[\d.]+\]|unresolved", rows["steer every layer"])
    for stage in ("HF decoder layers", "engine: the steered sites", "engine: the guard", "engine: the step's layout",
                  "engine: plans", "engine: ledger read"):
        assert re.search(rf"^\| {re.escape(stage)}.*\| [\d.]+ \[[\d.]+–[\d.]+\] \|", text, re.M), stage
    assert (eager.EagerModel._at_site, eager.EagerModel._guard, grid.decode_layout) == plain  # the timers left
    from engine.backends.hf import sites
    assert not any("forward" in vars(layer) for layer in sites.get_path(m.hf, m.family.layers))


@pytest.mark.parametrize("args", [["--rounds", "5"], ["--new-tokens", "1"], ["--prompt", "1"], ["--batch", "0"],
                                  ["--reps", "0"]])
def test_bad_arguments_are_refused(args, capsys):
    with pytest.raises(SystemExit) as e:
        decode_sites.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--rounds at least 6" in err and f"{args[0]} {args[1]}" in err


def test_timers_time_what_they_are_told_and_leave_after_a_failure():
    class Owner:
        def work(self, x):
            return x * 2

    mod = types.SimpleNamespace(f=lambda x: x + 1)
    spent: dict[str, list[float]] = {}
    with pytest.raises(RuntimeError, match="boom"):
        with timers.timing([(Owner, "work", lambda self, x: "big" if x > 5 else None), (mod, "f", "f")], spent):
            assert Owner().work(3) == 6 and Owner().work(7) == 14 and mod.f(1) == 2 and mod.f(2) == 3
            raise RuntimeError("boom")
    assert {k: len(v) for k, v in spent.items()} == {"big": 1, "f": 2}  # a None label leaves its call untimed
    assert all(t >= 0 for v in spent.values() for t in v)
    assert "work" in vars(Owner) and Owner().work(1) == 2 and not hasattr(Owner.work, "__wrapped__")
    assert mod.f(1) == 2 and not hasattr(mod.f, "__wrapped__")
