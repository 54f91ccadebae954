"""`--jobs N`: models in worker processes that die with the run.

A worker outliving its parent would go on writing cells into a directory nobody is watching and then
hang in the pool's result queue; so each worker asks the kernel for SIGKILL when its parent dies
(Linux prctl PR_SET_PDEATHSIG) and, where that is unavailable, a watchdog thread exits it within a
second of its parent's disappearance. `die_with` also ties the nnterp column's child process
(validator/engines/child.py) to the process that started it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """End this process when `parent` dies (the kernel's parent-death signal, else a watchdog thread)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def init_worker(parent: int, threads: int) -> None:
    """Pool initializer: tie the worker to `parent`, set its torch thread count."""
    die_with(parent)
    import torch
    torch.set_num_threads(threads)


def pool(jobs: int, threads: int):
    """A spawn-context process pool whose workers die with this process."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    return ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=init_worker,
                               initargs=(os.getpid(), threads))
