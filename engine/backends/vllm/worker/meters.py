"""The worker's three meters of its steps, each on only while the client asks: the host reads inside a
step (engine/core/syncs.py, `interp_syncs`), the ops dispatched around each forward and inside the hooked
backend's hooks (engine/core/opcount.py, `interp_ops`) and the host time spent there (`interp_timing`).
Off, a step pays one attribute test per window.

The windows, by label: STEP (before and after each forward of ours) and HOOKS (inside the hooked backend's
hooks) are a step's; REGISTER (the scheduler hook: new requests' plans admitted, the sites rebuilt) and
COLLECT (a finished request's results read and encoded) are a call's, paid once per request or per batch of
them, whatever its length (benchmarks/step_cost.py reports both)."""
from __future__ import annotations

import contextlib
from typing import ContextManager

from engine.core.opcount import OpCounter, StepTimer
from engine.core.syncs import SyncCounter

STEP, HOOKS = "step", "hooks"  # a step's windows
REGISTER, COLLECT = "register", "collect"  # a call's windows, outside its steps


class Meters:
    """What WorkerState measures of its steps and calls: `window(label)` around the host work (STEP, HOOKS,
    REGISTER, COLLECT), `begin` / `end` around each step of ours."""

    def __init__(self) -> None:
        self.syncs: SyncCounter | None = None
        self.ops: OpCounter | None = None
        self.timer: StepTimer | None = None
        self.op_steps: list[int] = []  # while counting ops: each step's count ("step" windows)
        self.op_start: int | None = None  # the count when this step began
        self.steps = 0  # steps that ran a registered plan since a meter was switched on

    def window(self, label: str) -> ContextManager:
        """A window of the op counter and of the step timer, while either runs."""
        if self.ops is None and self.timer is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if self.timer is not None:
            stack.enter_context(self.timer.window(label))
        if self.ops is not None:
            stack.enter_context(self.ops.window(label))
        return stack

    def begin(self) -> None:
        """A step of ours begins: host reads counted from here to `end`; the op count taken."""
        if self.syncs is not None:
            self.syncs.__enter__()
        if self.syncs is not None or self.ops is not None or self.timer is not None:
            self.steps += 1
        if self.ops is not None:
            self.op_start = self.ops.count(STEP)

    def end(self) -> None:
        """The step ends (whether or not it failed): its host reads and its op count closed."""
        if self.syncs is not None and self.syncs.active:
            self.syncs.__exit__(None, None, None)
        if self.ops is not None and self.op_start is not None:
            self.op_steps.append(self.ops.count(STEP) - self.op_start)
        self.op_start = None

    def count_syncs(self, on: bool) -> dict:
        """Start (on) or stop counting the engine's host reads inside steps; stopping returns {"syncs",
        "steps", "sites"} since the start."""
        if on:
            self.syncs, self.steps = SyncCounter(), 0
            return {}
        c, self.syncs = self.syncs, None
        steps, self.steps = self.steps, 0
        if c is None:
            return {"syncs": 0, "steps": 0, "sites": {}}
        return {"syncs": c.count, "steps": steps, "sites": dict(c.sites)}

    def count_ops(self, on: bool) -> dict:
        """Start (on) or stop counting the ops dispatched around this rank's steps and calls, by window label;
        stopping returns {"steps", "per_step" (each step's STEP count, in order), "labels", "ops", "sites"}
        since the start."""
        if on:
            self.ops, self.steps, self.op_steps = OpCounter(), 0, []
            return {}
        c, self.ops = self.ops, None
        steps, self.steps = self.steps, 0
        per_step, self.op_steps = self.op_steps, []
        return {"steps": steps, "per_step": per_step,
                **(c.report() if c is not None else {"labels": {}, "ops": {}, "sites": {}})}

    def time_steps(self, on: bool) -> dict:
        """Start (on) or stop timing the host work around this rank's steps and calls; stopping returns
        {"steps", "seconds": {window label: seconds}}."""
        if on:
            self.timer, self.steps = StepTimer(), 0
            return {}
        t, self.timer = self.timer, None
        steps, self.steps = self.steps, 0
        return {"steps": steps, "seconds": dict(t.seconds) if t is not None else {}}
