"""The harvest's reader and writer threads run below the forward's priority; the caller's stays."""
import sys

import pytest
import torch

from engine.harvest import priority
from engine.harvest.batches import prefetch
from engine.harvest.runner import Flow
from engine.harvest.shards import Pending, ShardWriter

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value is per thread on Linux only")


@linux
def test_the_reader_thread_runs_lower_and_the_caller_does_not_change():
    before = priority.thread_nice()
    seen = []

    def items():
        for i in range(3):
            seen.append(priority.thread_nice())
            yield i
    assert list(prefetch(items(), nice=7)) == [0, 1, 2]
    assert seen == [min(19, before + 7)] * 3
    assert priority.thread_nice() == before
    seen.clear()
    assert list(prefetch(items())) == [0, 1, 2]  # nice=0: the caller's priority
    assert seen == [before] * 3


@linux
def test_the_writer_thread_runs_lower(tmp_path):
    before = priority.thread_nice()
    seen = []
    w = ShardWriter(tmp_path, lambda entry, final: seen.append(priority.thread_nice()), {"part": "p"}, nice=19)
    w.submit(Pending(0, {"x": torch.zeros(2, 3)}, {"rows": [0, 2]}, final=True))
    w.close()
    assert seen == [19]
    assert priority.thread_nice() == before
    assert (tmp_path / "shard-000000.safetensors").is_file()


def test_flow_nice_defaults_to_the_lowest_and_refuses_bad_values():
    assert Flow().nice == priority.HELPER_NICE == 19
    assert Flow(nice=0).nice == 0
    for bad in (-1, 20, "19", 2.0, None):
        with pytest.raises(ValueError, match=f"nice must be a whole number from 0 to 19, got {bad!r}"):
            Flow(nice=bad)


def test_lowering_is_a_no_op_off_linux(monkeypatch):
    calls = []
    monkeypatch.setattr(priority.sys, "platform", "darwin")
    monkeypatch.setattr(priority.os, "setpriority", lambda *a: calls.append(a))
    priority.lower_this_thread(19)  # on macOS this would lower the whole process, the forward with it
    assert calls == []
