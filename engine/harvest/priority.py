"""The harvest's helper threads (reader, writer) yield the CPU to the forward.

A harvest's reader (tokenizing the next batches) and writer (hashing and writing shards) have slack:
each works ahead behind a 2-deep queue. The forward has none: on CPU its OpenMP threads meet at a
barrier after every operation, so a helper that takes one of their cores for a moment stalls all
of them. Measured on the 2-core tiny twin (docs/harvest.md): helpers at nice 19 lift the eager
harvest by about 5% over helpers at the forward's priority. On a GPU machine the forward waits on
the device, cores are idle, and the niceness changes nothing.

Niceness cannot stop the stalls: whenever a helper runs on a core of the forward, every thread of
the forward waits for it, so each second of helper CPU costs about a second of forward time, however
many cores there are. `ForwardThreads` leaves the helpers a core of their own instead when that is
cheaper: one intra-op thread fewer costs about 1/threads of the forward, so it pays once the helpers'
CPU time is above that share of the forward's time (measured on 16 cores, benchmarks/harvest_costs.py:
the tiny twin's harvest went from 0.73x to 0.91x of its own forward).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

HELPER_NICE = 19  # Flow.nice's default: the lowest priority
log = logging.getLogger("engine.harvest")


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


@dataclass
class ThreadCPU:
    """The CPU seconds one helper thread has used so far; only that thread writes it."""
    seconds: float = 0.0

    def update(self) -> None:
        self.seconds = time.thread_time()


class ForwardThreads:
    """Torch's intra-op thread count during one eager CPU harvest. `spare` threads are left to the
    helpers: a number fixes it from the start; None decides once, at the first `update` with helper
    time to go by: one spare thread when helper CPU seconds x threads > forward seconds (see the module
    docstring), none otherwise. `restore` puts the caller's count back (torch's setting is per process)."""

    def __init__(self, spare: int | None, active: bool) -> None:
        self.threads = torch.get_num_threads()  # the caller's, restored at the end
        self.spared = 0
        self.decided = not active or spare is not None
        if active and spare:
            self._spare(spare)

    def update(self, helper_cpu_s: float, forward_s: float) -> None:
        """Decide (once) from what the helpers and the forward used so far; nothing before the helpers
        have used any CPU."""
        if self.decided or helper_cpu_s <= 0 or forward_s <= 0:
            return
        self.decided = True
        if self.threads > 1 and helper_cpu_s * self.threads > forward_s:
            self._spare(1)
        log.info("helpers used %.3f CPU s beside %.3f s of forward on %d threads: %d thread(s) left to them",
                 helper_cpu_s, forward_s, self.threads, self.spared)

    def _spare(self, n: int) -> None:
        torch.set_num_threads(max(1, self.threads - n))
        self.spared = self.threads - torch.get_num_threads()

    def restore(self) -> None:
        if self.spared:
            torch.set_num_threads(self.threads)
