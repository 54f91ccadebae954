"""benchmarks/eager_breakdown.py: the per-call stages it times are nested where the code nests them, its
ratio is the ratio of its own rates, and bad arguments are refused by name."""
from __future__ import annotations

import json

import pytest

from benchmarks import eager_breakdown


def test_breakdown_times_nested_stages_of_one_call(tmp_path, monkeypatch):
    from engine.backends.hf import eager
    plain = eager.EagerModel.run_with_cache, eager.padded
    monkeypatch.setenv("INTERP_ZOO_SIZE", "tiny")
    out = tmp_path / "bd.json"
    assert eager_breakdown.main(["--tokens", "2500", "--batches", "1024", "--reps", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["source"] == "zoo"
    size = res["sizes"]["1024"]
    assert size["tokens"] >= 2500 and size["batches"] * 1024 >= size["tokens"]
    assert size["capture / hf"] == pytest.approx(size["capture_tok_s"] / size["hf_tok_s"])
    ms = size["ms_per_call"]
    for stage in ("_inputs", "_plans", "prefill_layout", "hf forward inside run_with_cache", "padded"):
        # every call holds its stage, so the stage's median cannot pass the call's (order statistics)
        assert 0 < ms[stage] <= ms["run_with_cache"], stage
    assert ms["hf forward inside run_with_cache"] > ms["_inputs"]
    assert (eager.EagerModel.run_with_cache, eager.padded) == plain  # the timers left with the call


@pytest.mark.parametrize("args", [["--batches", "100"], ["--batches", ""], ["--reps", "0"], ["--tokens", "0"]])
def test_breakdown_refuses_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as e:
        eager_breakdown.main(args)
    assert e.value.code == 2
    assert "--batches needs sizes of at least one 256-token window" in capsys.readouterr().err
