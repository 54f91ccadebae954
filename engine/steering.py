"""Steering specs and the ops they apply: add, set, scale, ablate (zero / mean), project_out.

A Steer is pure data (so the vLLM backends can ship it to their workers); `apply_steer` is the one
implementation of the ops every backend calls, on the `[n, ...]` rows of one sequence at one site.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import positions as pos
from engine.address import Address, parse
from engine.errors import SteeringError
from engine.points import INTEGER_POINTS

OPS = ("add", "set", "scale", "ablate", "mean_ablate", "project_out")


@dataclass(eq=False)
class Steer:
    """One intervention. `value` is a vector over the point's per-token shape (or a scalar for
    `scale`); `positions` is a spec of engine.positions ("all", "last", "generated", an int, a slice
    or (start, stop)). Steers compare by identity: two equal-looking steers are two interventions."""
    address: "str | Address"
    op: str = "add"
    value: "torch.Tensor | float | None" = None
    positions: "str | int | slice | tuple" = "all"

    def __post_init__(self):
        self.address = parse(self.address)
        if self.op not in OPS:
            from engine.address import closest
            raise SteeringError(f"unknown steering op {self.op!r}.{closest(self.op, OPS)} Ops: {', '.join(OPS)}.")
        if self.address.point in INTEGER_POINTS:
            raise SteeringError(f"{self.address.point!r} holds integer expert indices and cannot be steered; "
                                f"steer router_logits or expert_weights instead.")
        needs_value = self.op in ("add", "set", "scale", "mean_ablate", "project_out")
        if needs_value and self.value is None:
            raise SteeringError(f"op {self.op!r} at {self.address} needs a value "
                                f"({'a scalar' if self.op == 'scale' else 'a vector'}).")
        if self.op == "ablate" and self.value is not None:
            raise SteeringError("op 'ablate' zeroes the point and takes no value; use 'mean_ablate' "
                                "with value=<mean vector> for mean ablation.")
        if self.value is not None and not isinstance(self.value, torch.Tensor):
            if self.op != "scale":
                raise SteeringError(f"op {self.op!r} needs a torch.Tensor value, got {type(self.value).__name__}.")
            self.value = torch.tensor(float(self.value))
        if isinstance(self.value, torch.Tensor):
            if not torch.is_floating_point(self.value):
                raise SteeringError(f"steering value for {self.address} must be a floating tensor, "
                                    f"got dtype {self.value.dtype}.")
            if self.value.device.type != "meta" and not torch.isfinite(self.value).all():
                raise SteeringError(f"steering value for {self.address} contains NaN or inf.")
        self.positions = pos.normalize(self.positions)

    def at(self, address: Address, value=None) -> "Steer":
        """The same intervention at a resolved address (and value cast for the model)."""
        return Steer(address, self.op, self.value if value is None else value, self.positions)


def check_value(steer: Steer, rows: torch.Tensor) -> torch.Tensor:
    """Validate the value's shape/device against the [n, ...] rows it will touch; return it cast."""
    v = steer.value
    if v is None or steer.op == "scale":
        return v.to(rows.device, rows.dtype) if v is not None else None
    per_token = tuple(rows.shape[1:])
    if steer.address.coords:  # a head/stream coordinate selects one slice of the first per-token axis
        per_token = per_token[1:]
    if tuple(v.shape) != per_token:
        raise SteeringError(f"steering value for {steer.address} has shape {tuple(v.shape)} but the point's "
                            f"per-position shape is {per_token}.")
    if v.device.type != rows.device.type:
        raise SteeringError(f"steering value for {steer.address} is on {v.device}, the model runs on "
                            f"{rows.device}; move it with .to({str(rows.device)!r}).")
    return v.to(rows.dtype)


def apply_steer(steer: Steer, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows [n, ...] with the op applied where mask[n] (a new tensor, never in place)."""
    v = check_value(steer, rows)
    coords = dict(steer.address.coords)
    view = rows
    if coords:
        (_, idx), = coords.items()
        view = rows[:, idx]
    if steer.op == "add":
        new = view + v
    elif steer.op in ("set", "mean_ablate"):
        new = v.expand_as(view)
    elif steer.op == "scale":
        new = view * v
    elif steer.op == "ablate":
        new = torch.zeros_like(view)
    else:  # project_out: remove the component along v
        u = (v / v.norm().clamp_min(1e-12)).reshape(-1)
        flat = view.reshape(view.shape[0], -1)
        new = (flat - (flat @ u)[:, None] * u).reshape(view.shape)
    m = mask.to(view.device).reshape(-1, *([1] * (view.dim() - 1)))
    new = torch.where(m, new, view)
    if coords:
        out = rows.clone()
        out[:, idx] = new
        return out
    return new
