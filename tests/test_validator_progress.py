"""The validator's progress says the time left (issue 51: it printed `[k/N cells, t s]` only), from the durations
earlier cells recorded, scaled by the run's own pace."""
from __future__ import annotations

import io

from validator.progress import Progress, expected_seconds


def _cell(model: str, engine: str, seconds: float, load: float) -> dict:
    return {"model": model, "engine": engine, "provenance": {"seconds": seconds, "engine_seconds": load}}


def test_expected_seconds_come_from_the_recorded_cells_and_the_engines_median_where_none_was():
    recorded = [_cell("a", "hf", 2.0, 1.0), _cell("a", "nnsight", 4.0, 1.0), _cell("b", "hf", 6.0, 3.0),
                {"model": "c", "engine": "hf", "status": "skipped"}]  # a skipped cell records no duration
    got = expected_seconds({"a": ["hf", "nnsight"], "b": ["hf", "nnsight"], "c": ["hf"]}, recorded)
    assert got == {"a": 1.0 + 2.0 + 4.0, "b": 3.0 + 6.0 + 4.0, "c": 2.0 + 4.0}  # c: the median load and hf cell
    assert expected_seconds({"a": ["hf"]}, []) == {}


def test_the_line_per_model_says_the_time_left_at_this_runs_pace(monkeypatch):
    out = io.StringIO()
    now = [1000.0]
    monkeypatch.setattr("validator.progress.time.time", lambda: now[0])
    p = Progress(6, out, tty=False, expected={"a": 10.0, "b": 10.0, "c": 20.0})
    assert p.left() is None  # nothing finished: no pace yet
    now[0] += 5.0  # twice as fast as recorded
    p.finish("a", 2)
    now[0] += 5.0
    p.finish("b", 2)
    lines = out.getvalue().splitlines()
    assert lines == ["[2/6 cells, 5 s, about 15 s left] a", "[4/6 cells, 10 s, about 10 s left] b"]
    now[0] += 10.0
    p.finish("c", 2)
    assert out.getvalue().splitlines()[-1] == "[6/6 cells, 20 s, about 0 s left] c"


def test_without_a_record_the_line_is_as_before():
    out = io.StringIO()
    p = Progress(2, out, tty=False)
    p.finish("a", 2)
    assert out.getvalue().startswith("[2/2 cells, ") and "left" not in out.getvalue()
