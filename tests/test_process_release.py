"""The helper the engine-release tests rely on (test_vllm_common.children_left_running) tells a child
that can still run from one that is gone or dying, so those tests can fail and do not flake on a slow
reap (a SIGKILLed engine core not yet reaped after 20 s failed CI once)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

from test_vllm_common import children_left_running


def _sleep() -> None:
    time.sleep(60)


def test_a_running_child_is_named_and_a_killed_one_is_released():
    before = {p.pid for p in multiprocessing.active_children()}
    child = multiprocessing.get_context("fork").Process(target=_sleep)
    child.start()
    try:
        left = children_left_running(before, timeout=0.5)
        assert list(left) == [child.pid] and left[child.pid].startswith("State:")
        os.kill(child.pid, signal.SIGSTOP)  # stopped: it cannot exit until SIGKILL lands
        assert children_left_running(before, timeout=0.5) == {child.pid: left[child.pid].split()[0] + "\tT (stopped)"}
        os.kill(child.pid, signal.SIGKILL)
        assert children_left_running(before, timeout=5) == {}
    finally:
        child.kill()
        child.join(5)
    assert children_left_running(before, timeout=0) == {}
