"""Count the tensor operations the engine dispatches around a forward, and time the host work: on a GPU
each op is a kernel launch (or an allocation), paid on the host every step whether the forward itself is a
replayed CUDA graph or not.

    c = OpCounter()
    with c.window("step"):       # any number of windows, each adds to its label
        ...                      # (the worker opens one before and one after each forward)
    c.count("step"), c.sites     # how many, and where (engine file:line -> count)

A TorchDispatchMode sees every aten op that reaches the dispatcher, from any caller. Views (slicing,
reshape, expand, split: metadata only, no kernel on any device) are not counted; everything else is
(factories, copies, reductions, index_put / index_select, fills). The forward itself runs outside
the windows: under CUDA graphs it is one replay, and on a CPU the compiled graph's own ops are what a
graph would replay, so they are left out the same way. Host arrays (numpy) are host work, not ops.
The sync counter (engine/core/syncs.py) counts the host reads among them. `StepTimer` times the same
windows on the host clock (without the counter, whose own dispatch would be timed too).
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from torch.utils._python_dispatch import TorchDispatchMode

_ENGINE = str(Path(__file__).resolve().parents[1])  # .../engine


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside its windows, per window label (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: Counter = Counter()  # window label -> ops
        self.ops: Counter = Counter()  # "label aten.op" -> count
        self.sites: Counter = Counter()  # "label engine/file.py:line" -> count
        self._label: str | None = None

    def count(self, label: str) -> int:
        return self.labels[label]

    @contextlib.contextmanager
    def window(self, label: str) -> Iterator[None]:
        """Count the ops dispatched in this block under `label` (a window inside another counts under
        the inner label, then the outer one goes on)."""
        outer = self._label
        self._label = label
        try:
            if outer is None:
                with self:
                    yield
            else:
                yield
        finally:
            self._label = outer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        label = self._label
        if label is not None and not func.is_view:
            self.labels[label] += 1
            self.ops[f"{label} {func.overloadpacket.__name__}"] += 1
            f: Any = sys._getframe(1)
            while f is not None and not (f.f_code.co_filename.startswith(_ENGINE) and f.f_code.co_filename != __file__):
                f = f.f_back
            if f is not None:
                self.sites[f"{label} {Path(f.f_code.co_filename).relative_to(Path(_ENGINE).parent)}:{f.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))

    def report(self) -> dict:
        """{"labels", "ops", "sites"} as plain dicts (for an RPC reply)."""
        return {"labels": dict(self.labels), "ops": dict(self.ops), "sites": dict(self.sites)}


class StepTimer:
    """Host seconds spent inside its windows, per label (the worker's before / after a forward, its hooks)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def window(self, label: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t
