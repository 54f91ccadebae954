"""Starting a vLLM engine for the engine's backends, and what loading cost.

The engine core runs in its own process (vLLM's default). The backends reach their workers only
through vLLM's public seams: `worker_extension_cls` (engine/backends/vllm/worker/extension.py, called with
collective_rpc), `logits_processors` (engine/backends/vllm/worker/rows.py) and, for vllm-static, a model
loader registered by load format (engine/backends/vllm/worker/loader.py). A private event loop in a daemon
thread drives the async engine for the synchronous API (`Loop`, engine/core/loop.py).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.backends.vllm.sizing import Sizing, kv_bytes_for  # noqa: F401  (kv_bytes_for: benchmarks)
from engine.core.backends import backend_for
from engine.core.environ import scoped_environ
from engine.core.errors import EngineError, OptionError
from engine.core.loop import Loop, on_home_loop  # noqa: F401  (the vLLM backends' private loop; it lives in core)
from engine.model import sources

if TYPE_CHECKING:
    from vllm.platforms import Platform
    from vllm.v1.engine.async_llm import AsyncLLM


log = logging.getLogger("engine.vllm")
if not log.handlers:  # the load report is a log line users should see without configuring logging
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)

ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_NO_USAGE_STATS": "1"}  # offline: no usage report to stats.vllm.ai either
WORKER_EXTENSION = "engine.backends.vllm.worker.extension.InterpWorker"
ROW_MAP = "engine.backends.vllm.worker.rows:RowMap"


# vLLM engine args the hooked backends (vllm, vllm-static) refuse at load, each with why; vllm-generate
# (stock vLLM, no capture or steering) takes them
REFUSED_ENGINE_ARGS = {
    "speculative_config": "speculative decoding runs draft tokens through the model and drops the rejected ones, so "
                          "a step's rows would hold tokens that never join the sequence and a steer would act on them; "
                          "backend='vllm-generate' (stock vLLM, no capture or steering) decodes speculatively",
    "enable_lora": "LoRA adapters are applied per request inside vLLM's wrapped linear layers, which the engine's "
                   "sites do not model, and a request has no adapter field here; load a merged checkpoint instead",
}


def check_engine_args(backend: str, engine_kw: dict) -> None:
    """Refuse, before anything starts, an engine arg whose feature would make captures or steers wrong
    (a backend that captures nothing takes them all)."""
    if not backend_for(backend).captures:
        return
    for name, why in REFUSED_ENGINE_ARGS.items():
        if engine_kw.get(name):
            raise OptionError(f"{name}={engine_kw[name]!r} is not served by backend {backend!r}: {why}.")


def check_executor(engine_kw: dict, platform: Platform) -> None:
    """distributed_executor_backend="ray" (vLLM's own multi-node path: its ranks as Ray actors) is
    passed on where vLLM's Ray executor can place ranks (a platform with a Ray device key: GPUs);
    elsewhere it is refused by name before anything starts (vLLM would fail after loading)."""
    if engine_kw.get("distributed_executor_backend") == "ray" and not getattr(platform, "ray_device_key", ""):
        raise OptionError(f"distributed_executor_backend='ray' is not supported by vLLM on "
                          f"{platform.device_type}: its Ray executor places one rank per Ray GPU and this platform "
                          f"has none; leave it unset (vLLM's multiprocessing executor runs tensor_parallel_size "
                          f"ranks on one machine) or use `python -m engine.harvest --ray` to spread engines over "
                          f"machines.")


GUARD = 'if __name__ == "__main__":'


def check_main_module() -> None:
    """vLLM starts its engine core as a spawned process, which imports the caller's main script again
    (multiprocessing's spawn). Refuse, by name and before an engine starts, the two ways that cannot
    work: a load run by that import (no main guard; it would start an engine from inside the engine's
    start) and a script read from stdin (the spawned process cannot read it again)."""
    main = sys.modules.get("__main__")
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own "bootstrapping" test
        raise EngineError(f"a vLLM backend was loaded while vLLM's engine process was importing "
                          f"{getattr(sys.modules.get('__mp_main__'), '__file__', None) or 'the main script'} again "
                          f"(vLLM spawns its engine core, "
                          f"which imports the script that started it): put the load under `{GUARD}`.")
    if getattr(main, "__file__", None) == "<stdin>":
        raise EngineError(f"a vLLM backend cannot start from code read on stdin: vLLM spawns its engine core, "
                          f"which imports the main script again, and stdin cannot be read twice; save the code "
                          f"to a file, with the load under `{GUARD}`, and run that file.")


def unguarded_main_load() -> str | None:
    """The main script's path when this call runs from its top level outside `if __name__ == "__main__":`
    (directly or through functions it calls there), else None. vLLM's spawned engine process imports that
    script again and runs the load a second time, so the engine's start fails with vLLM's own error; the
    load then ends with the fix instead (backend.load)."""
    import ast
    import inspect
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return None
    lines = [f.f_lineno for f in (fi.frame for fi in inspect.stack(0))
             if f.f_code.co_name == "<module>" and f.f_globals is vars(main)]
    if not lines:
        return None
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return None

    def is_guard(node: ast.AST) -> bool:
        t = node.test if isinstance(node, ast.If) else None
        if not isinstance(t, ast.Compare) or len(t.comparators) != 1 or not isinstance(t.ops[0], ast.Eq):
            return False
        sides = {ast.unparse(t.left), ast.unparse(t.comparators[0])}
        return sides in ({"__name__", "'__main__'"}, {"__name__", '"__main__"'})

    guarded = [(n.lineno, n.end_lineno or n.lineno) for n in tree.body if is_guard(n)]
    if any(not any(a <= line <= b for a, b in guarded) for line in lines):
        return path
    return None


def prepare_env() -> None:
    """Environment vLLM must see before it is imported."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def model_path(name: str, source: str) -> tuple[str, str]:
    """(local directory to hand vLLM, source used), resolved by engine.model.sources as on every backend."""
    src = sources.resolve(name, source)
    return src.path, src.source


def cpu_binding(tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for tp ranks on a CPU machine: the allowed cores split evenly, one
    group per rank (vLLM refuses several CPU ranks without it on a one-NUMA-node machine)."""
    if tp <= 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs at least {tp} CPU cores; this process may use "
                         f"{len(cores)}.")
    per = len(cores) // tp
    groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


@dataclass(frozen=True)
class LoadReport:
    """What loading cost: seconds, KV cache and tap buffer sizes, client memory."""
    backend: str
    startup_s: float
    kv_cache_bytes: int
    kv_cache_tokens: int
    tap_buffer_bytes: int = 0
    rss_gib: float = 0.0
    compiled: bool = False
    tensor_parallel_size: int = 1
    sizing: Sizing | None = None  # what each engine knob was set to, and why (engine/backends/vllm/sizing.py)
    runner: str = ""              # vLLM's model runner the workers use, and why (engine/backends/vllm/worker/runner.py)
    cudagraph_mode: str | None = None  # vllm-static compiled: the CUDA-graph mode vLLM resolved (NONE on CPU)
    proof: dict | None = None     # vllm-static: its startup proof (engine/backends/vllm/proof.py)

    @property
    def extra(self) -> dict:
        """The earlier open dict of mode-specific entries, now the fields above (read-only view)."""
        return {k: v for k, v in (("cudagraph_mode", self.cudagraph_mode), ("proof", self.proof)) if v is not None}

    def line(self) -> str:
        tp = f", tensor parallel {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        chosen = f"; {self.sizing.line()}" if self.sizing else ""
        runner = f"; {self.runner}" if self.runner else ""
        return (f"{self.backend}: startup {self.startup_s:.1f} s, KV cache {self.kv_cache_bytes / 2**20:.1f} MiB "
                f"({self.kv_cache_tokens} tokens), tap buffers {self.tap_buffer_bytes / 2**10:.1f} KiB, "
                f"client RSS {self.rss_gib:.2f} GiB, {'compiled' if self.compiled else 'eager'} forward{tp}"
                f"{runner}{chosen}")


def rss_gib() -> float:
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return float("nan")


@contextlib.contextmanager
def scoped_env(env: dict[str, str]) -> Iterator[None]:
    """Environment variables for one engine's construction (its processes inherit them). vLLM caches
    its env reads once an engine is up, so the cache is dropped first."""
    import vllm.envs
    vllm.envs.disable_envs_cache()
    with scoped_environ(env):
        yield


def start_engine(path: str, env: dict[str, str], **engine_kw: Any) -> tuple[AsyncLLM, float]:
    """An AsyncLLM (engine core in its own process). Returns (engine, seconds); the engine's child
    processes are kept as `engine.interp_processes`, for stop_engine."""
    prepare_env()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    if engine_kw.get("load_format") == "interp_static":
        import engine.backends.vllm.worker.loader as _loader  # noqa: F401  (registers the load format)
    t0 = time.perf_counter()
    before = set(multiprocessing.active_children())
    with scoped_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **env}):
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **engine_kw))
    engine.interp_processes = [p for p in multiprocessing.active_children() if p not in before]
    return engine, time.perf_counter() - t0


def stop_engine(engine: AsyncLLM, timeout: float = 60.0) -> None:
    """Shut the engine down and wait until its processes are gone (killed after `timeout`). vLLM's own
    default gives its engine core 5 s, and on a loaded CPU it needs longer to stop its worker and
    exit: killed, it left its shared-memory queues behind (the resource tracker's 'leaked
    shared_memory' warning) and a server's SIGTERM took 10 s. Idle it takes about 1 s; on a 2-core
    machine running three other jobs, 11 s, and 30 s were once not enough (a CI-like slow run)."""
    engine.shutdown(timeout=timeout)
    deadline = time.monotonic() + timeout
    for p in getattr(engine, "interp_processes", []):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
