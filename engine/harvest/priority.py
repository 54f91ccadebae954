"""The harvest's helper threads (reader, writer) yield the CPU to the forward.

A harvest's reader (tokenizing the next batches) and writer (hashing and writing shards) have slack:
each works ahead behind a 2-deep queue. The forward has none: on CPU its OpenMP threads meet at a
barrier after every operation, so a helper that takes one of their cores for a moment stalls all
of them. Measured on the 2-core tiny twin (docs/harvest.md): helpers at nice 19 lift the eager
harvest by about 5% over helpers at the forward's priority. On a GPU machine the forward waits on
the device, cores are idle, and the niceness changes nothing.
"""
from __future__ import annotations

import os
import sys

HELPER_NICE = 19  # Flow.nice's default: the lowest priority


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (0: leave it). Linux only: there a nice value
    belongs to one thread, while elsewhere setpriority(PRIO_PROCESS, 0) would lower the whole
    process, the forward with it."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except OSError:  # a sandbox that forbids it: the harvest is the same, only slower
        pass


def thread_nice() -> int:
    """The calling thread's nice value (for tests)."""
    return os.getpriority(os.PRIO_PROCESS, 0)
