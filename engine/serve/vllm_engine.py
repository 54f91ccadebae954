"""A vLLM engine's processes as the server watches them (engine/serve/supervisor.py): its steps, its
unfinished requests, whether it died, and how a dead or hung one is put away before a new one loads.

vLLM runs its engine core in a process of its own (engine/backends/vllm/runtime.start_engine keeps it
as `engine.interp_processes`), its workers in processes under that one. The client's output handler
pulls one batch of outputs per engine step while requests run; `watch_steps` counts those pulls.
A core that was killed (or whose worker was: the core then exits too) is seen at once by its exit
code; one that is stopped or stuck shows only as no step while requests wait (the supervisor's hang
timeout). Either is killed with its whole process tree (SIGKILL: a stopped process cannot act on
SIGTERM), then its client is shut down.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from engine.backends.vllm.backend import VLLMModel
    from engine.core.loop import Loop

log = logging.getLogger("engine.serve")


def _engine(model: VLLMModel):
    return model.aio.engine


def watch_steps(model: VLLMModel, stepped: Callable[[], None]) -> None:
    """Call `stepped` each time the engine's client receives a step's outputs (the output handler looks
    `get_output_async` up on the core client at every pull, so the instance's own wrapper is used)."""
    core = _engine(model).engine_core
    pull = core.get_output_async

    async def pulled():
        out = await pull()
        stepped()
        return out
    core.get_output_async = pulled


def unfinished(model: VLLMModel) -> bool:
    """Whether the engine holds requests it has not finished (queued or running, a probe included)."""
    engine = _engine(model)
    return engine is not None and engine.output_processor.has_unfinished_requests()


def exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def dead(model: VLLMModel) -> str | None:
    """Why the engine is dead: its core process exited (a killed worker takes the core down with it), or
    its client reports it dead. None while it lives."""
    engine = _engine(model)
    if engine is None:
        return "died: it was closed"
    for p in getattr(engine, "interp_processes", ()):
        code = p.exitcode  # polls without waiting
        if code is not None:
            return f"died: its engine core process (pid {p.pid}) {exit_text(code)}"
    if engine.errored:
        return "died: vLLM reports its engine core dead (EngineDeadError)"
    return None


def death_of(exc: BaseException) -> str | None:
    """The cause, when an engine call failed because the engine died under it (vLLM's EngineDeadError)."""
    if type(exc).__name__ == "EngineDeadError":
        return f"died: vLLM reports its engine core dead ({type(exc).__name__}: {exc})"
    return None


def kill_tree(pids: list[int]) -> None:
    """SIGKILL each process and everything under it (children first found, then all killed)."""
    import psutil
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


def pids(model: VLLMModel) -> list[int]:
    """The engine's own processes (its core; the workers are found under it)."""
    engine = _engine(model)
    return [p.pid for p in getattr(engine, "interp_processes", ()) if p.pid is not None] if engine else []


def kill(model: VLLMModel) -> None:
    """SIGKILL the engine's processes (a dead or hung engine the server gives up on: shutting it down
    gracefully would wait on a core that cannot answer)."""
    kill_tree(pids(model))


async def retire(old: VLLMModel, home: Loop) -> None:
    """Put a dead or hung engine away: its processes killed, its client shut down, its loop stopped
    unless it is the one the server runs on (`home`, which outlives every engine)."""
    old._finalizer.detach()  # its close would stop its loop, which may be the server's
    await asyncio.to_thread(kill, old)
    with contextlib.suppress(Exception):
        await old.aio.aclose()  # on its own loop: the client's sockets and tasks (its processes are gone)
    if old._loop is not home:
        await asyncio.to_thread(old._loop.stop)


def close(model: VLLMModel, home: Loop) -> None:
    """Shut the serving engine down once the server has stopped, and the server's loop with it."""
    model.close()
    if model._loop is not home:
        home.stop()
