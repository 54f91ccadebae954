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


def job_cores(slot: int, jobs: int, cores: list[int]) -> list[int]:
    """The cores of job `slot` of `jobs`: the allowed cores split evenly (jobs beyond the cores share them
    round robin)."""
    if jobs >= len(cores):
        return [cores[slot % len(cores)]]
    per = len(cores) // jobs
    return cores[slot * per:(slot + 1) * per]


def bind_vllm(slot: int, jobs: int) -> None:
    """Give this job's vLLM CPU workers their own cores (VLLM_CPU_OMP_THREADS_BIND), unless the caller set
    it. vLLM's "auto" binds every engine's worker to the same cores of the first NUMA node (on 2 cores:
    core 0, the other reserved), so two jobs' vLLM forwards queued on one core and --jobs 2 ran the vLLM
    columns no faster than --jobs 1. GPU workers ignore it."""
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(
            str(c) for c in job_cores(slot, jobs, sorted(os.sched_getaffinity(0))))


def init_worker(parent: int, threads: int, slots, jobs: int) -> None:
    """Pool initializer: tie the worker to `parent`, set its torch thread count, take the next job slot
    (`slots`: a shared counter) and bind its vLLM workers to that slot's cores."""
    die_with(parent)
    with slots.get_lock():
        slot = slots.value % jobs  # a worker the pool replaces takes a slot again
        slots.value += 1
    bind_vllm(slot, jobs)
    import torch
    torch.set_num_threads(threads)


def pool(jobs: int, threads: int):
    """A spawn-context process pool whose workers die with this process."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    ctx = mp.get_context("spawn")
    return ProcessPoolExecutor(jobs, mp_context=ctx, initializer=init_worker,
                               initargs=(os.getpid(), threads, ctx.Value("i", 0), jobs))
