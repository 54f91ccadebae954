"""Starting a vLLM engine for the engine's backends, and what loading cost.

The engine core runs in its own process (vLLM's default). The backends reach their workers only
through vLLM's public seams: `worker_extension_cls` (engine/backends/vllm/worker/extension.py, called with
collective_rpc), `logits_processors` (engine/backends/vllm/worker/rows.py) and, for vllm-static, a model
loader registered by load format (engine/backends/vllm/worker/loader.py). A private event loop in a daemon
thread drives the async engine for the synchronous API (`Loop`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from engine.backends.vllm.sizing import Sizing, kv_bytes_for  # noqa: F401  (kv_bytes_for: benchmarks)
from engine.core.backends import backend_for
from engine.core.errors import OptionError
from engine.model import sources

if TYPE_CHECKING:
    from vllm.platforms import Platform
    from vllm.v1.engine.async_llm import AsyncLLM

_T = TypeVar("_T")
_P = ParamSpec("_P")

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
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Loop:
    """A private event loop in a daemon thread, where the async model and vLLM's AsyncLLM live.

    `run(coro)` runs a coroutine there from a plain thread and waits for it; `hop(coro)` awaits it
    from any other event loop; `relay(agen)` iterates an async generator there from any loop. Each
    carries the caller's context (so `steering()` blocks apply). Ctrl-C while `run` waits cancels
    the call on the loop and lets it unwind before KeyboardInterrupt goes on. Once stopped, every
    call raises the closed error at once (never a wait on a loop that no longer runs)."""

    def __init__(self, label: str = "the model") -> None:
        self.label = label  # "<name> (<backend>)", for the closed error
        self.loop = asyncio.new_event_loop()
        self._guard = threading.Lock()
        self._stopped = False
        self._pending: set = set()  # futures of calls not yet finished (failed with the closed error on stop)
        self.thread = threading.Thread(target=self.loop.run_forever, name="interp-vllm-loop", daemon=True)
        self.thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def closed_error(self) -> Exception:
        from engine.core.errors import EngineError
        return EngineError(f"{self.label} was closed; load it again with load_model().")

    def here(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self.thread

    def _submit(self, coro):
        """Start `coro` on the loop in the caller's context: (concurrent future, cancel), where
        cancel() (any thread) cancels the running task."""
        ctx = contextvars.copy_context()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        task = []

        def done(t):
            if fut.done():
                return
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if t.cancelled():
                    _cancel(fut)
                elif t.exception() is not None:
                    fut.set_exception(t.exception())
                else:
                    fut.set_result(t.result())

        def start():
            if fut.done():  # cancelled or failed before it started
                coro.close()
                return
            task.append(ctx.run(self.loop.create_task, coro))
            task[0].add_done_callback(done)

        def cancel():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self.loop.call_soon_threadsafe(lambda: task[0].cancel() if task else _cancel(fut))
        with self._guard:
            if self._stopped:
                coro.close()  # never started: no "was never awaited" warning on top of the error
                raise self.closed_error()
            self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self.loop.call_soon_threadsafe(start)
        return fut, cancel

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self.here():
            coro.close()
            raise RuntimeError("a synchronous model call was made from the model's own event loop; await the "
                               "async API (model.aio) there instead.")
        fut, cancel = self._submit(coro)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._stopped:
                raise self.closed_error() from None
            raise
        except BaseException:
            if not fut.done():  # interrupted while waiting (Ctrl-C): stop the call, let it unwind, go on
                cancel()
                concurrent.futures.wait([fut], timeout=30)
            raise

    async def hop(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await `coro` on this loop from another running loop (cancelling the caller cancels it)."""
        if self.here():
            return await coro
        fut, cancel = self._submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except BaseException:
            cancel()
            me = asyncio.current_task()
            if self._stopped and fut.cancelled() and not (me and me.cancelling()):  # closed under the call
                raise self.closed_error() from None
            raise

    async def relay(self, agen: AsyncGenerator[_T, None]) -> AsyncGenerator[_T, None]:
        """`agen` (an async generator that lives on this loop) iterated from whichever loop iterates
        this one; closing this one closes it, after a step cancelled under it has unwound."""
        cursor = _Cursor(agen)
        try:
            while True:
                try:
                    item = await self.hop(cursor.next())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if self.here():
                await cursor.close()
            elif not self._stopped:
                with contextlib.suppress(Exception):
                    await self.hop(cursor.close())

    def iterate(self, agen: AsyncGenerator[_T, None]) -> Generator[_T, None, None]:
        """`agen` (an async generator that lives on this loop) iterated from a plain thread, as a
        generator; closing it (or Ctrl-C while it waits) closes `agen` once its step has unwound."""
        cursor = _Cursor(agen)
        try:
            while True:
                try:
                    item = self.run(cursor.next())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._stopped:  # dropped after stop (or at exit): the engine is gone, nothing to abort
                from engine.core.errors import EngineError
                with contextlib.suppress(EngineError):
                    self.run(cursor.close())

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop (a call interrupted by Ctrl-C, vLLM's output handler) and
        let it unwind before the loop stops: a task left pending is reported as destroyed at exit.
        Calls still waiting get the closed error."""
        with self._guard:
            self._stopped = True
        if not self.loop.is_running():
            return
        if self.here():
            self.loop.stop()
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_pending(timeout), self.loop).result(timeout + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        for fut in list(self._pending):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(self.closed_error())


@dataclass
class _Cursor:
    """An async generator stepped by calls that run on its loop, one at a time. `close()` cancels a
    step still in flight and waits for it to unwind before `aclose()`: a step cancelled by a caller
    who stopped waiting (Ctrl-C, a timeout, a cancelled task) can still be running when the close
    arrives, and `aclose()` on a running generator raises "asynchronous generator is already
    running" and leaves the request unaborted. Both coroutines run on the generator's loop, so
    the close always sees the step it must wait for."""
    agen: object
    step: asyncio.Task | None = None

    async def next(self) -> Any:
        self.step = asyncio.current_task()
        try:
            return await self.agen.__anext__()  # type: ignore[attr-defined]
        finally:
            self.step = None

    async def close(self) -> None:
        step = self.step
        if step is not None and step is not asyncio.current_task():
            if not step.cancelling():  # cancel once: a second cancel would cut the step's own cleanup short
                step.cancel()
            await asyncio.wait([step])
        await self.agen.aclose()  # type: ignore[attr-defined]


def on_home_loop(method: Callable[Concatenate[Any, _P], Coroutine[Any, Any, _T]],
                 ) -> Callable[Concatenate[Any, _P], Coroutine[Any, Any, _T]]:
    """A coroutine method of a model with a `_home` Loop (and `_live()`): it runs on that loop (where
    vLLM's AsyncLLM and its output handler live), awaited from whichever event loop calls it."""
    @functools.wraps(method)
    async def call(self: Any, *args: _P.args, **kw: _P.kwargs) -> _T:
        if self._home is None:
            return await method(self, *args, **kw)
        self._live()
        return await self._home.hop(method(self, *args, **kw))
    return call


def _cancel(fut: concurrent.futures.Future) -> None:
    """Cancel a pending future so that `concurrent.futures.wait` sees it: `cancel()` alone leaves it
    CANCELLED but not notified, and a wait on it sat out its whole timeout (Ctrl-C took 30 s)."""
    if fut.cancel():
        with contextlib.suppress(RuntimeError, concurrent.futures.InvalidStateError):
            fut.set_running_or_notify_cancel()


async def _cancel_pending(timeout: float) -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


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


def stop_engine(engine: AsyncLLM, timeout: float = 30.0) -> None:
    """Shut the engine down and wait until its processes are gone (killed after `timeout`)."""
    engine.shutdown()
    deadline = time.monotonic() + timeout
    for p in getattr(engine, "interp_processes", []):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
