"""A reference engine run in a child process with its side install first on sys.path (validator/engines/side.py).

nnterp 1.3.0 needs nnsight 0.7.0 and the nnsight column runs 0.8.1: two versions of one package cannot share
a process, so the runner's adapter for such an engine is `ChildReference`, a proxy that forwards `capture`,
`steer_logits`, `versions`, `notes` and `close` over a pipe to the real adapter in a child. The child is
spawned (never forked: a fork would inherit .venv's nnsight when the parent imported it), enters the side
install before anything can import the shadowed packages, checks that they now come from there (and fails
loudly when one was imported first, e.g. by a parent `__main__` that spawn re-imports), and dies with its
parent (validator/workers.py). One child per engine serves the models of a run (a spawn and nnterp's imports
cost about 7 s): each proxy's adapter is built on `open` under its own handle and dropped on `close`; a child
that died is replaced at the next model.

Messages are plain pickles of what both sides import alike (tensors, the ModelContext with its HF model and
tokenizer, `Case`, `Missing`); nothing of nnsight or nnterp ever crosses. `EngineUnavailable` crosses as
itself; any other exception as `ChildError` under the original type's name with its message, so a row's
reason reads as it would in process.
"""
from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from validator.engines.base import Case, EngineUnavailable, ModelContext, Reference
from validator.engines.side import SideInstall


class ChildError(RuntimeError):
    """An exception raised in the child (its class is the original's name, under this base) or the child's
    own failure (it died, or could not enter its side install)."""


def _error(kind: str, text: str) -> ChildError:
    cls = ChildError if kind == "ChildError" else type(kind, (ChildError,), {})
    return cls(text)


# -- the child ------------------------------------------------------------------------------------------
def enter(side: SideInstall) -> dict[str, str]:
    """Put `side` first on sys.path and import its shadowed modules from there; {module: version}. Raises
    ChildError when a shadowed module was imported before (the .venv version would be used silently)."""
    early = [m for m in side.shadows if m in sys.modules]
    if early:
        where = {m: getattr(sys.modules[m], "__file__", "?") for m in early}
        raise ChildError(f"{', '.join(early)} already imported in the {side.folder} child before the side install "
                         f"was entered ({where}): the child would run .venv's version. Something imported it at "
                         f"start-up, most likely the parent's __main__ module, which multiprocessing's spawn "
                         f"re-imports in the child: import it inside a function or under "
                         f"`if __name__ == '__main__':`.")
    sys.path.insert(0, str(side.path))
    importlib.invalidate_caches()
    from importlib import metadata
    out = {}
    for m in side.shadows:
        mod = importlib.import_module(m)
        if not str(getattr(mod, "__file__", "")).startswith(str(side.path) + os.sep):
            raise ChildError(f"{m} resolved to {mod.__file__}, not to the side install {side.path}")
        out[m] = metadata.version(m)
    return out


def _serve(conn, side: SideInstall) -> None:
    versions = enter(side)
    _send(conn, "ok", versions)
    refs: dict[int, Reference] = {}  # every open adapter by its handle: two proxies never share one
    handles = iter(range(1, 1 << 62))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # the parent closed the pipe
            return
        try:
            op, handle, args = pickle.loads(data)  # e.g. a model class this process cannot import: said, not fatal
            value: Any = None
            if op == "open":
                module, cls, ctx = args
                ref = getattr(importlib.import_module(f"validator.engines.{module}"), cls)(ctx)
                handle = next(handles)
                refs[handle] = ref
                value = {"handle": handle, "tensors": dict(ref.TENSORS), "steers": bool(getattr(ref, "steers", True))}
            elif op == "exit":
                _send(conn, "ok", None)
                return
            elif handle not in refs:
                raise ChildError(f"{op!r} on adapter {handle}, which is not open in this child")
            elif op == "close":
                refs.pop(handle).close()
            elif op == "capture":
                value = refs[handle].capture(*args)
            elif op == "steer_logits":
                value = refs[handle].steer_logits(*args)
            elif op == "versions":
                value = refs[handle].versions()
            elif op == "notes":
                value = list(getattr(refs[handle], "notes", None) or [])
            else:
                raise ChildError(f"unknown request {op!r}")
        except EngineUnavailable as e:
            _send(conn, "unavailable", str(e))
        except Exception as e:  # noqa: BLE001  (every failure goes back to the parent, the child serves on)
            _send(conn, "error", (type(e).__name__, str(e), traceback.format_exc()[-2000:]))
        else:
            try:
                payload = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001  (a result that cannot cross: said, the child serves on)
                _send(conn, "error", (type(e).__name__, f"the {op!r} result cannot be sent to the parent: {e}", ""))
            else:
                conn.send_bytes(payload)


def main(conn, side: SideInstall, parent: int, threads: int) -> None:
    """The child's entry point (spawn): die with `parent`, enter the side install, serve requests."""
    import signal

    from validator.workers import die_with
    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; the child ends with it
    try:
        import torch
        torch.set_num_threads(threads)
        _serve(conn, side)
    except Exception as e:  # noqa: BLE001  (the side install could not be entered: said to the parent, then exit)
        try:
            _send(conn, "error", (type(e).__name__, str(e), traceback.format_exc()[-2000:]))
        except OSError:
            pass


def _send(conn, kind: str, value) -> None:
    conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))


# -- the parent -----------------------------------------------------------------------------------------
@dataclass
class Child:
    """One running child: its process and the parent's end of the pipe."""
    engine: str
    process: Any  # multiprocessing.Process
    conn: Any  # multiprocessing.connection.Connection
    versions: dict

    @classmethod
    def start(cls, engine: str, side: SideInstall) -> "Child":
        import multiprocessing as mp

        import torch
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=main, args=(theirs, side, os.getpid(), torch.get_num_threads()),
                           name=f"{engine}-reference", daemon=True)
        proc.start()
        theirs.close()  # only the child holds its end: its death reads as EOF here
        child = cls(engine, proc, mine, {})
        child.versions = child.receive()
        return child

    def call(self, op: str, handle: int, *args):
        """Request `op` of the adapter `handle` (0: none) and return its value."""
        data = pickle.dumps((op, handle, args), protocol=pickle.HIGHEST_PROTOCOL)  # a pickling error is the caller's
        try:
            self.conn.send_bytes(data)
        except (OSError, ValueError) as e:
            raise self._died(f"sending {op!r}: {type(e).__name__}: {e}") from e
        return self.receive()

    def receive(self):
        try:
            kind, value = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise self._died(f"{type(e).__name__}") from e
        if kind == "ok":
            return value
        if kind == "unavailable":  # the versions it could not run this model with are the child's
            raise EngineUnavailable(value, versions=self.versions)
        name, text, trace = value
        err = _error(name, text)
        err.add_note(f"in the {self.engine} child process (pid {self.process.pid}):\n{trace}")
        raise err

    def _died(self, what: str) -> ChildError:
        self.process.join(timeout=5)
        return ChildError(f"the {self.engine} reference's child process (pid {self.process.pid}) died "
                          f"(exit code {self.process.exitcode}; {what}); the next model starts a new one")

    def alive(self) -> bool:
        return self.process.is_alive() and not self.conn.closed

    def stop(self) -> None:
        """Ask the child to exit; kill it when it does not within a minute."""
        try:
            if self.alive():
                self.call("exit", 0)
        except (ChildError, EngineUnavailable):
            pass
        self.conn.close()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


_CHILDREN: dict[str, Child] = {}  # engine -> its running child (one per engine and parent process)


def child_for(engine: str, side: SideInstall) -> Child:
    """The running child of `engine`, started (or restarted, after it died) on demand."""
    child = _CHILDREN.get(engine)
    if child is None or not child.alive():
        if child is not None:
            child.conn.close()
        child = _CHILDREN[engine] = Child.start(engine, side)
    return child


def stop_all() -> None:
    """Stop every child this process started (they also die with it)."""
    while _CHILDREN:
        _CHILDREN.popitem()[1].stop()


_RECORDER = "install_output_capuring_hook."  # transformers' name (sic) for the closures it hooks on


def unrecorded(ctx: ModelContext) -> ModelContext:
    """`ctx` with its HF model picklable: the first call asking a transformers model for hidden states or
    attentions hooks closures onto its modules (transformers/utils/output_capturing.py), which pickle cannot
    carry to the child. They are removed and the model marked unhooked, so transformers installs them again,
    lazily, the next time they are needed, here or in the child."""
    for module in ctx.hf.modules():
        for key, fn in list(module._forward_hooks.items()):
            if getattr(fn, "__qualname__", "").startswith(_RECORDER):
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False
    return ctx


class ChildReference(Reference):
    """The adapter of engine `engine` (module `module`, class `cls` under validator.engines) for one model,
    running in the engine's child process with `side` first on its path."""

    def __init__(self, engine: str, module: str, cls: str, side: SideInstall, ctx: ModelContext):
        super().__init__(ctx)
        self.name = engine
        why = side.problem()
        if why:
            raise EngineUnavailable(f"{engine}: {why}")
        self._child: Child | None = child_for(engine, side)
        try:
            info = self._child.call("open", 0, module, cls, unrecorded(ctx))
        except BaseException:
            self._child = None
            raise
        self._handle: int = info["handle"]
        self.TENSORS = info["tensors"]
        self.steers = info["steers"]

    def _call(self, op: str, *args):
        if self._child is None:
            raise ChildError(f"the {self.name} reference is closed")
        return self._child.call(op, self._handle, *args)

    def capture(self, case: Case, addresses: list[str]) -> dict:
        return self._call("capture", self.place(case), addresses)  # sent on the model's device, as plain tensors

    def steer_logits(self, case: Case, layer: int, vector):
        return self._call("steer_logits", self.place(case), layer, self.place(vector))

    def versions(self) -> dict:
        return self._call("versions")

    @property
    def notes(self) -> list[str]:
        return self._call("notes") if self._child is not None else []

    @property
    def pid(self) -> int:
        """The child's process id (tests)."""
        if self._child is None:
            raise ChildError(f"the {self.name} reference is closed")
        return self._child.process.pid

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.alive():
            try:
                child.call("close", self._handle)
            except ChildError:
                pass
