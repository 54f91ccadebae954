"""`--jobs N` workers die with their parent: SIGKILL the run while its workers are busy, and every
process it started is gone within seconds (before the fix they went on writing cells, then hung at
~600 MB each)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = "openai-community/gpt2,meta-llama/Llama-3.2-1B,EleutherAI/pythia-70m-deduped,facebook/opt-125m"


def _alive(procs):
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_workers_die_with_a_killed_parent(tmp_path):
    run = subprocess.Popen([sys.executable, "-m", "validator", "run", "--jobs", "2", "--models", MODELS,
                            "--engines", "hf", "--no-decode", "--no-steer", "--out", str(tmp_path)],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    parent = psutil.Process(run.pid)
    try:
        deadline, workers = time.time() + 120, []
        while time.time() < deadline and len(workers) < 2:
            workers = [c for c in parent.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
            time.sleep(0.2)
        assert len(workers) >= 2, "the workers never started"
        time.sleep(1.0)  # let them get into their imports / first model
        family = parent.children(recursive=True)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.time() + 10
        while time.time() < deadline and _alive(family):
            time.sleep(0.2)
        assert _alive(family) == [], [" ".join(p.cmdline())[:120] for p in _alive(family)]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        for p in _alive(parent.children(recursive=True) if run.poll() is None else []):
            p.kill()


@pytest.mark.parametrize("jobs", [2])
def test_parallel_run_writes_the_same_cells_as_a_serial_one(tmp_path, jobs):
    from validator import cells, cli
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    argv = ["run", "--models", "openai-community/gpt2,meta-llama/Llama-3.2-1B", "--engines", "hf", "--points",
            "resid_post,lm_head", "--no-decode", "--no-steer"]
    assert cli.main(argv + ["--out", str(serial)]) == 0
    assert cli.main(argv + ["--jobs", str(jobs), "--out", str(parallel)]) == 0
    a, b = cells.load_all(serial), cells.load_all(parallel)
    assert [(c["model"], c["summary"]) for c in a] == [(c["model"], c["summary"]) for c in b]


def test_each_job_gets_its_own_cores_for_its_vllm_workers(monkeypatch):
    """vLLM's "auto" binding put every job's vLLM worker on core 0 of this 2-core machine (the other core
    reserved), so --jobs 2 ran the vLLM columns no faster than one job; each job now binds its own."""
    from validator import workers
    assert [workers.job_cores(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [workers.job_cores(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == [[0, 1], [2, 3]]
    assert [workers.job_cores(i, 3, [4, 5]) for i in range(3)] == [[4], [5], [4]]  # more jobs than cores
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    workers.bind_vllm(1, 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the caller's own choice stands
    workers.bind_vllm(0, 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_each_worker_of_the_pool_takes_the_next_slot(monkeypatch):
    """The pool's initializer takes slots from a shared counter: two workers bind two different cores, and a
    worker the pool starts again (one died) takes a slot again."""
    import multiprocessing as mp

    import torch

    from validator import workers
    monkeypatch.setattr(workers, "die_with", lambda parent: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this test process keeps its threads
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    slots, got = mp.get_context("spawn").Value("i", 0), []
    for _ in range(3):
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        workers.init_worker(0, 1, slots, 2)
        got.append(os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    assert got == ["0", "1", "0"]
