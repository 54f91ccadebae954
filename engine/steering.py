"""Steering specs and the ops they apply: add, set, scale, ablate (zero / mean), project_out.

A Steer is pure data (so the vLLM backends can ship it to their workers); `apply_steer` is the one
implementation of the ops every backend calls on a canonical `[batch, pos, ...]` tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.address import Address, parse
from engine.errors import SteeringError
from engine.points import INTEGER_POINTS

OPS = ("add", "set", "scale", "ablate", "mean_ablate", "project_out")
POSITION_WORDS = ("all", "last", "generated")


@dataclass
class Steer:
    """One intervention. `value` is a vector over the point's trailing shape (or a scalar for
    `scale`); `positions` is "all", "last", "generated" (decode steps only), an int, or a
    slice / (start, stop) over absolute token positions."""
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
        p = self.positions
        if isinstance(p, str) and p not in POSITION_WORDS:
            raise SteeringError(f"positions {p!r} is not one of {POSITION_WORDS}, an int, a slice or (start, stop).")
        if isinstance(p, tuple):
            if len(p) != 2:
                raise SteeringError(f"positions tuple must be (start, stop), got {p!r}.")
            self.positions = slice(*p)
        elif not isinstance(p, (str, int, slice)):
            raise SteeringError(f"positions must be 'all', 'last', 'generated', an int or a slice, got {p!r}.")


def check_value(steer: Steer, target: torch.Tensor) -> torch.Tensor:
    """Validate the value's width/dtype/device against the tensor it will touch; return it cast."""
    v = steer.value
    if v is None or steer.op == "scale":
        return v.to(target.device, target.dtype) if v is not None else None
    trailing = tuple(target.shape[2:])
    if steer.address.coords:  # a head/stream coordinate selects one slice of axis 2
        trailing = trailing[1:]
    if tuple(v.shape) != trailing:
        raise SteeringError(f"steering value for {steer.address} has shape {tuple(v.shape)} but the point's "
                            f"per-position shape is {trailing} (capture is {tuple(target.shape)}).")
    if v.device.type != target.device.type:
        raise SteeringError(f"steering value for {steer.address} is on {v.device}, the model runs on "
                            f"{target.device}; move it with .to({str(target.device)!r}).")
    return v.to(target.dtype)


def position_mask(positions, n_pos: int, offset: int, decoding: bool, last_index=None, device=None):
    """A [batch or 1, pos] boolean mask of the positions of this forward chunk to touch.

    offset is the absolute position of the chunk's first token; decoding is True on generation
    steps; last_index (per row) marks each row's last real token in a padded prefill."""
    idx = torch.arange(offset, offset + n_pos, device=device)
    if positions == "all":
        return torch.ones(1, n_pos, dtype=torch.bool, device=device)
    if positions == "generated":
        return torch.full((1, n_pos), decoding, dtype=torch.bool, device=device)
    if positions == "last":
        if decoding:
            return torch.ones(1, n_pos, dtype=torch.bool, device=device)
        if last_index is not None:
            return torch.arange(n_pos, device=device)[None, :] == last_index[:, None]
        return (torch.arange(n_pos, device=device) == n_pos - 1)[None, :]
    if isinstance(positions, int):
        return (idx == positions)[None, :]
    start = positions.start or 0
    stop = positions.stop if positions.stop is not None else 1 << 62
    return ((idx >= start) & (idx < stop))[None, :]


def apply_steer(steer: Steer, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return a new tensor with the op applied where mask[b, pos] (never in place)."""
    v = check_value(steer, t)
    coords = dict(steer.address.coords)
    view = t
    if coords:
        (_, idx), = coords.items()
        view = t[:, :, idx]
    if steer.op == "add":
        new = view + v
    elif steer.op == "set":
        new = v.expand_as(view)
    elif steer.op == "scale":
        new = view * v
    elif steer.op == "ablate":
        new = torch.zeros_like(view)
    elif steer.op == "mean_ablate":
        new = v.expand_as(view)
    else:  # project_out: remove the component along v
        u = v / v.norm().clamp_min(1e-12)
        flat = view.reshape(*view.shape[:2], -1)
        uf = u.reshape(-1)
        new = (flat - (flat @ uf)[..., None] * uf).reshape(view.shape)
    m = mask.reshape(*mask.shape, *([1] * (view.dim() - 2)))
    new = torch.where(m, new, view)
    if coords:
        out = t.clone()
        out[:, :, idx] = new
        return out
    return new
