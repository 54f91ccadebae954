"""A harvest on a Ray cluster (`--ray [ADDRESS]`): one actor per engine, parts streamed to actors.

Each actor loads the model once (its own vLLM instance, tensor parallel inside it: `--engine-arg
tensor_parallel_size=N` asks Ray for N GPUs per actor) and runs whole parts, the same parts as
`--workers P` (part i of P is a pure function of (input, i, P)), into the one output directory every
node sees (a shared filesystem). Parts go to whichever actor is free. When an actor dies, its part
goes back to the queue and the next free actor resumes it from the part's manifest (the shards it
recorded stay; the lock a dead process held is gone with it), and a replacement actor is started
while `restarts` lasts. The driver shows one progress bar for the whole job (actors report each
batch to a small tally actor) and merges the manifest at the end: the output is byte for byte that
of a local run with the same options and part count.

Ray Data's vLLM integration fits generation (one output per prompt), not this: a harvest's output
is ordered shards with a resumable manifest per part, which whole parts on actors keep as they are.
"""
from __future__ import annotations

import collections
import contextlib
import os
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from engine.core.environ import scoped_environ
from engine.harvest import manifest as mf

if TYPE_CHECKING:
    from ray.actor import ActorHandle

RAY_HINT = "pip install ray==2.60.0 (pinned in pyproject.toml; scripts/setup.sh installs it)"


class Tally:
    """Tokens forwarded by every actor (a Ray actor; the driver polls it for the one bar)."""

    def __init__(self) -> None:
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += n

    def total(self) -> int:
        return self.tokens


class Harvester:
    """One engine on one Ray worker: loads the model once, then runs the parts it is given."""

    def __init__(self, kwargs: dict, index: int, actors: int) -> None:
        from engine.harvest.workers import device_env
        tp = int((kwargs.get("load_kw") or {}).get("tensor_parallel_size", 1))
        import ray
        if not ray.get_gpu_ids():  # Ray hands GPUs out itself; on CPU, give each actor its own cores
            os.environ.update(device_env(index % actors, actors, tp))
        from engine.harvest.runner import load_for
        self.kwargs = kwargs
        self.model = load_for(**kwargs)

    def pids(self) -> list[int]:
        """This actor's process and its engine's child processes."""
        import multiprocessing
        return [os.getpid(), *(p.pid for p in multiprocessing.active_children() if p.pid is not None)]

    def run(self, part: tuple[int, int], tally: ActorHandle[Tally]) -> dict:
        from engine.harvest.runner import run_part
        kw = {k: v for k, v in self.kwargs.items() if k not in ("model", "progress", "merge")}
        s = run_part(self.model, part=(int(part[0]), int(part[1])), progress=lambda n: tally.add.remote(n), merge=False, **kw)
        return {"part": list(s.part), "status": s.status, "rows": s.rows, "tokens": s.tokens, "shards": s.shards,
                "seconds": s.seconds, "tokens_per_s": s.tokens_per_s}

    def close(self) -> None:
        if hasattr(self.model, "close"):
            self.model.close()


def connect(address: str | None, num_cpus: int | None, resources: dict[str, float] | None = None) -> ModuleType:
    """Ray, connected to the cluster at `address` or, with none, to a local cluster started here with
    `num_cpus` and custom `resources` (what stands in for GPUs in CPU tests); the cluster already
    connected to when there is one. The validator's --ray uses it too."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs Ray: {RAY_HINT}.") from None
    if not ray.is_initialized():
        with _local_cluster_env():
            ray.init(address=address or None, num_cpus=num_cpus if not address else None,
                     resources=resources if not address else None, include_dashboard=False, log_to_driver=False)
    return ray


# a local cluster started here puts each worker in its own process group and kills the group when the
# worker exits, so a killed actor's vLLM engine core process goes with it. Not Ray's older
# RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper: every core worker reading it, the
# driver's own included, made itself a subreaper and ignored SIGCHLD, so the driver's children were
# reaped behind its back for the rest of the process (subprocess return codes read 0, and a vLLM
# server started later could not see its engine exit at shutdown and force-killed it)
CLUSTER_ENV = {"RAY_process_group_cleanup_enabled": "true"}


def _local_cluster_env() -> contextlib.AbstractContextManager[None]:
    """CLUSTER_ENV (where this process does not set a variable itself) for the processes ray.init
    starts; this process's environment as it was afterwards (the variables are the cluster's)."""
    return scoped_environ({k: os.environ.get(k, v) for k, v in CLUSTER_ENV.items()})


def runtime_env() -> dict:
    """Environment of every Ray worker: the repository first on its path, the zoo's and HF's variables."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("INTERP_", "HF_", "TRANSFORMERS_"))})
    # the engine as this driver imports it (a checkout is on no path a Ray worker starts with); on
    # other machines the same path must hold the same engine (a shared filesystem or the same install)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    return {"env_vars": env}


def _actor_options(kwargs: dict) -> dict:
    tp = int((kwargs.get("load_kw") or {}).get("tensor_parallel_size", 1))
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        gpus = 0
    return {"num_cpus": 1, "num_gpus": tp if gpus else 0, "max_concurrency": 2, "runtime_env": runtime_env()}


def run_on_ray(kwargs: dict, actors: int, parts: int | None = None, address: str | None = None,
               restarts: int | None = None, num_cpus: int | None = None, progress: bool = True,
               name_prefix: str = "harvest", busy_wait: float = 120.0) -> list[dict]:
    """Run every part of the harvest described by run_part's kwargs (model, points, data, out, ...)
    on `actors` Ray actors; `parts` (default: actors) is the split, as --workers would make it.
    restarts: replacement actors started for dead ones (default: actors); busy_wait: how long a dead
    actor's part may stay locked by its dying process before that counts as an error. Returns each
    part's summary as run on the cluster (parts already complete say so)."""
    if actors < 1:
        raise ValueError(f"actors must be at least 1, got {actors}.")
    parts = parts or actors
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}.")
    restarts = actors if restarts is None else restarts
    # actors start in their own working directories: every path they get is absolute
    kwargs = dict(kwargs, out=str(Path(kwargs["out"]).resolve()), data=str(Path(kwargs["data"]).resolve()))
    out = Path(kwargs["out"])
    todo = collections.deque(i for i in range(parts)
                             if not (mf.part_dir(out, i, parts) / mf.PART).is_file()
                             or not mf.read(mf.part_dir(out, i, parts) / mf.PART)["complete"])
    results = [{"part": [i, parts], "status": "complete"} for i in range(parts) if i not in todo]
    if not todo:
        mf.merge(out)
        return results
    ray = connect(address, num_cpus)
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
    died = (RayActorError, ActorDiedError, ActorUnavailableError)
    tally = ray.remote(Tally).options(num_cpus=0, runtime_env=runtime_env()).remote()
    made = 0

    def start():
        nonlocal made
        opts = dict(_actor_options(kwargs), name=f"{name_prefix}-{made}")
        a = ray.remote(Harvester).options(**opts).remote(kwargs, made, actors)
        made += 1
        return a
    idle = [start() for _ in range(min(actors, len(todo)))]
    running: dict = {}
    orphaned: dict[int, float] = {}  # part -> when its actor died
    from tqdm.auto import tqdm
    bar = tqdm(total=None, unit="tok", unit_scale=True, disable=not progress, desc=f"harvest on Ray ({parts} parts)")
    try:
        while todo or running:
            while todo and idle:
                a, i = idle.pop(0), todo.popleft()
                running[a.run.remote((i, parts), tally)] = (a, i)
            if not running:
                raise RuntimeError(f"every Ray actor died and no restarts are left ({restarts}); rerun the same "
                                   f"command to resume parts {sorted(todo)}.")
            done, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            bar.update(ray.get(tally.total.remote()) - bar.n)
            for ref in done:
                a, i = running.pop(ref)
                try:
                    results.append(ray.get(ref))
                    idle.append(a)
                except died:  # the actor (its node, its engine) is gone: its part goes to another one
                    todo.appendleft(i)
                    orphaned[i] = time.monotonic()
                    if restarts > 0:
                        restarts -= 1
                        idle.append(start())
                except RayTaskError as e:
                    cause = e.cause if isinstance(e.cause, BaseException) else e
                    # a part taken from a dead actor whose process has not let go of the part's lock yet
                    if not isinstance(cause, mf.PartBusyError) or time.monotonic() - orphaned.get(i, -1e9) > busy_wait:
                        raise cause from None
                    todo.append(i)
                    idle.append(a)
                    time.sleep(1.0)
        bar.update(ray.get(tally.total.remote()) - bar.n)
    finally:
        bar.close()
        for a in idle + [a for a, _ in running.values()]:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 (a dead or stuck actor: killed below)
                pass
            ray.kill(a)
        ray.kill(tally)
    mf.merge(out)
    return sorted(results, key=lambda r: r["part"][0])


def wait_dead(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still alive after `timeout` seconds (for tests and cleanup)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.2)
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
