"""Addresses: `resid_post.10`, `resid_post.-1`, `z.4.head-3`, `final_norm`.

An address is a point name, a layer (layer-scoped points only; negative counts from the end) and
optional coordinates that index one axis of the captured tensor (`head`, `stream`). Parsing is
strict: every error says which rule was broken and what to use instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.core.errors import AddressError, closest  # noqa: F401  (closest: importable here too)
from engine.core.points import ALIASES, BY_NAME, get_point

_COORD_RE = re.compile(r"^([a-z_]+)-(-?\d+)$")


@dataclass(frozen=True)
class Address:
    point: str
    layer: int | None = None
    coords: tuple[tuple[str, int], ...] = field(default=())

    def __init__(self, point: str, layer: int | None = None, **coords: int) -> None:
        point = ALIASES.get(point, point)
        if point not in BY_NAME:
            raise AddressError(f"unknown point {point!r}.{closest(point, list(BY_NAME) + list(ALIASES))} "
                               f"Known points: {', '.join(BY_NAME)}.")
        spec = get_point(point)
        if spec.scope == "trunk" and layer is not None:
            raise AddressError(f"{point!r} is a trunk point and takes no layer; write {point!r}.")
        if spec.scope == "layer" and layer is None:
            raise AddressError(f"{point!r} needs a layer, e.g. '{point}.0' or '{point}.-1'.")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise AddressError(f"layer must be an int, got {layer!r}.")
        for name, value in coords.items():
            if name not in spec.coords:
                allowed = ", ".join(spec.coords) or "none"
                raise AddressError(f"{point!r} takes no coordinate {name!r} (allowed: {allowed}).")
            if not isinstance(value, int) or isinstance(value, bool):
                raise AddressError(f"coordinate {name} must be an int, got {value!r}.")
        object.__setattr__(self, "point", point)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "coords", tuple(sorted(coords.items())))

    def __str__(self) -> str:
        parts = [self.point]
        if self.layer is not None:
            parts.append(str(self.layer))
        parts += [f"{k}-{v}" for k, v in self.coords]
        return ".".join(parts)

    def __repr__(self) -> str:
        return f"Address({str(self)!r})"

    def resolved(self, n_layers: int) -> "Address":
        """This address with a negative layer turned into an absolute one; checks the range."""
        if self.layer is None:
            return self
        layer = self.layer + n_layers if self.layer < 0 else self.layer
        if not 0 <= layer < n_layers:
            raise AddressError(f"layer {self.layer} is out of range for {self.point!r}: this model has "
                               f"{n_layers} layers (valid: 0..{n_layers - 1} or -{n_layers}..-1).")
        return Address(self.point, layer, **dict(self.coords))

    @property
    def base(self) -> "Address":
        """The address without coordinates (what a hook captures)."""
        return Address(self.point, self.layer)


def parse(text: "str | Address") -> Address:
    """Parse `name[.layer][.coord-value...]` strictly."""
    if isinstance(text, Address):
        return text
    if not isinstance(text, str) or not text:
        raise AddressError(f"an address is a string like 'resid_post.3' or an Address, got {text!r}.")
    parts = text.strip().split(".")
    point, rest = parts[0], parts[1:]
    layer = None
    if rest and re.fullmatch(r"-?\d+", rest[0]):
        layer = int(rest.pop(0))
    coords = {}
    for part in rest:
        m = _COORD_RE.match(part)
        if not m:
            raise AddressError(f"cannot parse {part!r} in address {text!r}: expected a layer number or a "
                               f"coordinate like 'head-3'.")
        coords[m.group(1)] = int(m.group(2))
    return Address(point, layer, **coords)
