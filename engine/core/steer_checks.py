"""The one validation of a call's steers, which every backend runs before anything is moved.

    steers = check_steers(steer, context, model=self._steer, together=mode.check_steers)

in this order: the `steer=` argument's form and each steer's data (validate_steers: a Steer, a list
of Steers, or None -> list[Steer]; a Steer's own fields were checked when it was built, against its
op's row in engine/core/ops.py); each steer, with the steers of the enclosing `steering()` blocks,
against the model (`model`: its address resolved and servable, its value's shape, and the backend
mode's extra rules for one steer); then the mode's rules for the request's steers together
(`together`, e.g. vllm-static's order at a tap).

Refused by name: entries that are not engine.core.steering.Steer objects (saying what was passed and how
to build one) and values on the meta device (no data to steer with). A direction with no length is
refused when the Steer is made (engine.core.steering: checked once, not per call).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from engine.core.errors import SteeringError
from engine.core.steering import Steer

_HOW = "pass engine.Steer objects, e.g. Steer('resid_post.3', 'add', vector)"


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} item{'s' if len(x) != 1 else ''}"
    return f"{type(x).__name__} {x!r:.60}"


def _fix(x) -> str:
    if isinstance(x, dict):
        return f"build it with Steer(**that_dict) or {_HOW}"
    if isinstance(x, (list, tuple)) and x and all(isinstance(s, Steer) for s in x):
        return "pass the Steers themselves, not a nested list (model.steering(*steers) takes them one by one)"
    if isinstance(x, (list, tuple)) and len(x) >= 2 and isinstance(x[0], str):
        return f"build it with Steer(*that_tuple) or {_HOW}"
    return _HOW


def validate_steers(steer: object) -> list[Steer]:
    """The steers of a `steer=` argument (one Steer, an iterable of them, or None), checked."""
    if steer is None:
        return []
    if isinstance(steer, Steer):
        items = [steer]
    elif isinstance(steer, (str, bytes, dict, torch.Tensor)) or not hasattr(steer, "__iter__"):
        raise SteeringError(f"steer must be a Steer or a list of Steers, got {_describe(steer)}; {_fix(steer)}.")
    else:
        items = list(steer)
        if items and isinstance(items[0], str) and not any(isinstance(s, Steer) for s in items):
            shown = steer if isinstance(steer, (list, tuple)) else items
            raise SteeringError(f"steer got {_describe(shown)} starting with {items[0]!r}, not Steer objects; "
                                f"{_fix(shown)}.")
    for i, st in enumerate(items):
        where = "the steer" if len(items) == 1 else f"steer entry {i}"
        if not isinstance(st, Steer):
            raise SteeringError(f"{where} is {_describe(st)}, not a Steer; {_fix(st)}.")
        v = st.value
        if isinstance(v, torch.Tensor) and v.device.type == "meta":
            raise SteeringError(f"the value of {where} ({st.op} at {st.address}) is on meta, the device of tensors "
                                f"with a shape but no data (e.g. made under init_empty_weights or with "
                                f"device='meta'); compute it on a real device (cpu or cuda) first.")
        p = st.positions
        if isinstance(p, torch.Tensor) and not bool(p.any()):
            raise SteeringError(f"the positions mask of {where} ({st.op} at {st.address}) selects no position.")
    return items


def check_steers(steer: object, context: Iterable[Steer] = (), model: Callable[[Steer], Steer] | None = None,
                 together: Callable[[list[Steer]], None] | None = None) -> list[Steer]:
    """The steers of a call (`context`: those of the enclosing steering() blocks, already checked in
    form when the block opened, then the `steer=` argument's), checked once, in the order of the
    module docstring, each at its resolved address."""
    steers = [*context, *validate_steers(steer)]
    if model is not None:
        steers = [model(s) for s in steers]
    if together is not None:
        together(steers)
    return steers
