"""benchmarks/child.py: the measuring process of step_cost and harvest_bench, answered behind a prefix
among other output; and step_cost's order of starting its sides afresh."""
from __future__ import annotations

import sys

import pytest

from benchmarks.child import Child
from benchmarks.step_cost import start_order

MARK = "TESTMARK "
SCRIPT = f"""
import json, sys, time
print("a library's own line", flush=True)
print({MARK!r} + json.dumps({{"ready": True, "pid": 1}}), flush=True)
for line in sys.stdin:
    line = line.strip()
    if line == "boom":
        sys.exit(3)
    if line == "hang":
        time.sleep(60)
    print("noise " + line, flush=True)
    print({MARK!r} + json.dumps({{"got": line}}), flush=True)
"""


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "child.py"
    p.write_text(SCRIPT)
    return [sys.executable, str(p)]


def test_a_child_answers_behind_its_prefix_and_ends_when_its_stdin_closes(script):
    c = Child("side x", script, MARK)
    assert c.ready == {"ready": True, "pid": 1}
    assert c.ask(arm="plain", streams=8) == {"got": '{"arm": "plain", "streams": 8}'}
    assert c.ask_line("cell-one") == {"got": "cell-one"}
    assert c.close() == 0


def test_a_child_that_dies_is_named_with_its_exit_code(script):
    c = Child("side before", script, MARK)
    with pytest.raises(RuntimeError, match=r"side before ended without answering \(exit 3"):
        c.ask_line("boom")


def test_a_child_that_will_not_stop_is_killed(script):
    c = Child("side after", script, MARK)
    assert c.p.stdin is not None
    c.p.stdin.write("hang\n")
    c.p.stdin.flush()
    assert c.close(timeout=0.5) == -9


def test_sides_started_afresh_take_turns_starting_first():
    names = ["after", "before"]
    assert [start_order(names, r, 2) for r in (2, 4, 6, 8)] == [names[::-1], names, names[::-1], names]
    assert start_order(names, 3, 0) == names  # never relaunched: the order they were first started in
