"""The harvest's helper threads (reader, writer) yield the CPU to the forward.

A harvest's reader (tokenizing the next batches) and writer (hashing and writing shards) have slack:
each works ahead behind a 2-deep queue. The forward has none: on CPU its OpenMP threads meet at a
barrier after every operation, so a helper that takes one of their cores for a moment stalls all
of them. Measured on the 2-core tiny twin (docs/harvest.md): helpers at nice 19 lift the eager
harvest by about 5% over helpers at the forward's priority. On a GPU machine the forward waits on
the device, cores are idle, and the niceness changes nothing.

Niceness cannot stop the stalls: whenever a helper runs on a core of the forward, every thread of
the forward waits for it, so each second of helper CPU costs about a second of forward time, however
many cores there are. Leaving the helpers a core of their own (`forward_threads`, the harvest's
`spare_threads`) costs about 1/threads of the forward instead, so it pays once the helpers' CPU time
is above that share of the forward's time (`spare_pays`). Measured with benchmarks/harvest_costs.py
(docs/harvest.md): on 16 cores the tiny twin's harvest went from 0.74x to 0.83x of its own forward with
one thread spared; on 2 cores a spare thread halves the forward. It is not automatic because the thread
count can change the last bits of the rows (16, 8 and 1 threads agreed, 15 did not:
benchmarks/harvest_threads.py), and a harvest's bytes must not depend on a timing.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

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


@dataclass
class ThreadCPU:
    """The CPU seconds one helper thread has used so far; only that thread writes it."""
    seconds: float = 0.0

    def update(self) -> None:
        self.seconds = time.thread_time()


def spare_pays(helper_cpu_s: float, forward_s: float, threads: int) -> bool:
    """Whether one intra-op thread left to the helpers would likely have made the harvest faster: their
    CPU seconds (each stalling the whole forward) exceed the forward's share of one thread."""
    return threads > 1 and forward_s > 0 and helper_cpu_s * threads > forward_s


@contextlib.contextmanager
def forward_threads(spare: int) -> Iterator[int]:
    """Torch's intra-op threads lowered by `spare` for the block (one at least is kept) and restored
    after it (torch's setting is per process); yields how many threads were left to the helpers."""
    threads = torch.get_num_threads()
    if spare <= 0:
        yield 0
        return
    torch.set_num_threads(max(1, threads - spare))
    try:
        yield threads - torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
