"""Stopping an eager forward after block L-1 (TransformerLens's `stop_at_layer`): a harvest or a probe
that reads layer 3 of 30 need not run the other 26 blocks, the final norm or the unembedding.

The stop is a pre-hook on block L (or on the final norm when L = n_layers) that keeps the hidden state
it receives and raises `_Stopped`, which `stopped_at` catches; the hooks the call attached come off as
usual. What runs after the stop is never computed, so reading or steering it is refused by name
before the forward starts.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.core.address import Address, parse
from engine.core.errors import AddressError
from engine.core.integers import as_int
from engine.core.points import get_point
from engine.model.paths import get_path

if TYPE_CHECKING:
    from engine.core.plan import Plan
    from engine.families.base import Family


class _Stopped(Exception):
    """Raised by the stop hook; never leaves `stopped_at`."""


@dataclass
class Stop:
    """Where a forward stops (`layer`: blocks 0..layer-1 run; `module`: the one whose input is the
    hidden state after them) and, once it ran, that hidden state."""
    layer: int
    module: torch.nn.Module
    hidden: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def checked(cls, stop_at_layer: Any, hf: torch.nn.Module, family: Family, plan: Plan) -> Stop:
        """The stop for this call, checked: an int in 1..n_layers (n_layers only where the family has a
        final norm to stop at), and nothing the plan captures, steers or reads lies past it."""
        n_layers = len(get_path(hf, family.layers))
        given = stop_at_layer
        stop_at_layer = as_int(given)  # numpy and 0-d tensor integers too; floats, bools and arrays refused
        if stop_at_layer is None:
            raise TypeError(f"stop_at_layer must be an int (blocks 0..stop_at_layer-1 run), got "
                            f"{type(given).__name__} {given!r}.")
        top = _top(n_layers, family)
        if not 1 <= stop_at_layer <= top:
            raise ValueError(f"stop_at_layer must be between 1 and {top} on this {n_layers}-layer model "
                             f"(blocks 0..stop_at_layer-1 run), got {stop_at_layer}.")
        reach: list[tuple[str, Address]] = [("capture", a) for a in plan.reads()]
        reach += [("steer", parse(st.address)) for st in plan.steers]
        reach += [("readout", parse(r.address)) for r in plan.readouts]
        for what, a in reach:
            if _past(a, stop_at_layer):
                raise AddressError(f"{what} at {a} runs after the forward stops (stop_at_layer={stop_at_layer}: "
                                   f"blocks 0..{stop_at_layer - 1} run); raise stop_at_layer or drop it.")
        module = get_path(hf, f"{family.layers}.{stop_at_layer}" if stop_at_layer < n_layers else str(family.final_norm))
        return cls(stop_at_layer, module)

    def reached(self) -> torch.Tensor:
        if self.hidden is None:
            raise RuntimeError(f"the forward never reached block {self.layer} (stop_at_layer={self.layer}).")
        return self.hidden


def _top(n_layers: int, family: Family) -> int:
    """The latest stop: before the final norm, or before the last block where the family has none."""
    return n_layers if family.final_norm is not None else n_layers - 1


def _past(a: Address, stop: int) -> bool:
    """Whether `a` is computed after a forward stopped at block `stop`."""
    return a.layer >= stop if a.layer is not None else get_point(a.point).after_blocks


def earliest_stop(addresses: list[Address], n_layers: int, family: Family) -> int | None:
    """The earliest stop that still computes every address (None: one of them needs the whole forward)."""
    stop = max(1, max((a.layer + 1 for a in addresses if a.layer is not None), default=1))
    if stop > _top(n_layers, family) or any(_past(a, stop) for a in addresses):
        return None
    return stop


@contextlib.contextmanager
def stopped_at(stop: Stop | None) -> Iterator[None]:
    """Run the body's forward up to stop.module (the whole forward when stop is None); the module's
    input lands in stop.hidden."""
    if stop is None:
        yield
        return

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        assert stop is not None
        stop.hidden = args[0] if args else kwargs["hidden_states"]
        raise _Stopped

    handle = stop.module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    except _Stopped:
        pass
    finally:
        handle.remove()
