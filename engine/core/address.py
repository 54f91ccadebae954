"""Addresses: `resid_post.10`, `resid_post.-1`, `z.4.head-3`, `final_norm`.

An address is a point name, a layer (layer-scoped points only; negative counts from the end) and
optional coordinates that index one axis of the captured tensor (`head`, `stream`). Parsing is
strict: every error says which rule was broken and what to use instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.core.errors import AddressError, closest  # noqa: F401  (closest: importable here too)
from engine.core.integers import as_int, described
from engine.core.points import ALIASES, BY_NAME, Point, get_point

# ASCII digits only (a str pattern's \d also matches '١', an Arabic-Indic one), and no '-0': layer -0
# would silently be layer 0, not the last one
_NUMBER = r"(?:0|-?[1-9][0-9]*)"
_LAYER_RE = re.compile(r"-?[0-9]+")
_COORD_RE = re.compile(r"([a-z_]+)-(-?[0-9]+)")
_CANONICAL = re.compile(_NUMBER)


@dataclass(frozen=True)
class Address:
    point: str
    layer: int | None = None
    coords: tuple[tuple[str, int], ...] = field(default=())

    def __init__(self, point: str, layer: int | None = None, **coords: int) -> None:
        spec = known_point(point)
        point = spec.name
        if spec.scope == "trunk" and layer is not None:
            raise AddressError(f"{point!r} is a trunk point and takes no layer; write {point!r}.")
        if spec.scope == "layer" and layer is None:
            raise AddressError(f"{point!r} needs a layer, e.g. '{point}.0' or '{point}.-1'.")
        if layer is not None:
            given, layer = layer, as_int(layer)
            if layer is None:
                raise AddressError(f"layer must be an int (numpy and 0-d tensor integers too), got {described(given)}.")
        for name, value in list(coords.items()):
            if name not in spec.coords:
                allowed = ", ".join(spec.coords) or "none"
                raise AddressError(f"{point!r} takes no coordinate {name!r} (allowed: {allowed}).")
            coords[name] = as_int(value)  # type: ignore[assignment]
            if coords[name] is None:
                raise AddressError(f"coordinate {name} must be an int (numpy and 0-d tensor integers too), got "
                                   f"{described(value)}.")
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


def known_point(name: object) -> Point:
    """The Point a name or alias stands for; an AddressError naming the closest names otherwise."""
    point = ALIASES.get(name, name) if isinstance(name, str) else name
    if not isinstance(point, str) or point not in BY_NAME:
        near = closest(point, list(BY_NAME) + list(ALIASES)) if isinstance(point, str) else ""
        raise AddressError(f"unknown point {point!r}.{near} Known points: {', '.join(BY_NAME)}.")
    return get_point(point)


def parse(text: "str | Address") -> Address:
    """Parse `name[.layer][.coord-value...]` strictly."""
    if isinstance(text, Address):
        return text
    if not isinstance(text, str) or not text:
        raise AddressError(f"an address is a string like 'resid_post.3' or an Address, got {text!r}.")
    parts = text.strip().split(".")
    point, rest = parts[0], parts[1:]
    layer = None
    if rest and _LAYER_RE.fullmatch(rest[0]):
        layer = _number(rest.pop(0), "layer", text)
    coords: dict[str, int] = {}
    for part in rest:
        m = _COORD_RE.fullmatch(part)
        if not m and any(c.isdigit() and not c.isascii() for c in part):
            raise AddressError(f"{part!r} in address {text!r} has a digit outside ASCII 0-9; write layers and "
                               f"coordinates with ASCII digits, e.g. 'resid_post.1', 'z.4.head-3'.")
        if not m:
            raise AddressError(f"cannot parse {part!r} in address {text!r}: expected a layer number or a "
                               f"coordinate like 'head-3' (ASCII digits).")
        if m.group(1) in coords:
            raise AddressError(f"address {text!r} gives coordinate {m.group(1)!r} twice; give it once, e.g. "
                               f"'{point}{'' if layer is None else f'.{layer}'}.{m.group(1)}-{coords[m.group(1)]}'.")
        coords[m.group(1)] = _number(m.group(2), f"coordinate {m.group(1)}", text)
    return Address(point, layer, **coords)


def _number(digits: str, what: str, text: str) -> int:
    """An address's number, written once: no '-0' (negative counts from the end, so -0 means nothing)
    and no leading zeros."""
    if not _CANONICAL.fullmatch(digits):
        n = int(digits)
        hint = "write 0 (the first) or -1 (the last)" if n == 0 else f"write {n}"
        raise AddressError(f"{what} {digits!r} in address {text!r} is not written plainly: {hint}.")
    return int(digits)
