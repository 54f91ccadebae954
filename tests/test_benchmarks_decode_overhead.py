"""benchmarks/decode_overhead.py: the bare loop's tokens are checked against HF's generate before anything is
timed, and the table names each arm with a per-token figure and its ratio to HF's generate."""
from __future__ import annotations

import re

import pytest

from benchmarks import decode_overhead


def test_the_table_has_each_arm_and_its_ratio(capsys):
    decode_overhead.main(["--rounds", "6", "--reps", "1", "--new-tokens", "2", "--prompt", "5"])
    out = capsys.readouterr().out
    assert out.count("round ") == 6
    rows = dict(re.findall(r"^\| (HF generate|bare loop|engine generate) \| (.+) \|$", out, re.M))
    assert set(rows) == {"HF generate", "bare loop", "engine generate"}
    assert rows["HF generate"].endswith("| 1")
    for arm in ("bare loop", "engine generate"):
        # a ratio is a figure with its interval, or "unresolved" when that is wider than 25% (benchmarks/ci.py)
        assert re.fullmatch(r"[\d.]+ \[[\d.]+–[\d.]+\] \| ([\d.]+x \[[\d.]+–[\d.]+\]|unresolved)", rows[arm]), rows[arm]


def test_a_loop_whose_tokens_differ_is_not_timed(monkeypatch):
    import torch
    real = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **k: real(self, *a, **k) * 0 + 1)
    with pytest.raises(SystemExit, match="the bare loop's tokens differ from HF's generate"):
        decode_overhead.main(["--rounds", "6", "--reps", "1", "--new-tokens", "2", "--prompt", "5"])


@pytest.mark.parametrize("args", [["--rounds", "5"], ["--new-tokens", "1"], ["--reps", "0"]])
def test_too_few_rounds_tokens_or_reps_are_refused(args, capsys):
    with pytest.raises(SystemExit):
        decode_overhead.main(args)
    assert "--rounds at least 6" in capsys.readouterr().err
