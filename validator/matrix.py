"""Which points at which layers each model is checked at.

Every point the loaded family has (`m.points()`), at its early, middle and late layers among those
where it exists (`m.point_layers(p)`), plus the first layer of each layer kind of hybrid trunks
(`config.layer_types`: sliding/full attention, linear attention, convolution ...). `--points`
and `--layers` narrow this; both are checked against the catalogue and the model.
"""
from __future__ import annotations

from engine.core.address import closest
from engine.core.points import ALIASES, BY_NAME, get_point
from validator.variant import DEFAULT_LAYERS, LAYER_WORDS

__all__ = ["DEFAULT_LAYERS", "LAYER_WORDS", "SelectionError", "check_layers", "parse_layers", "parse_points",
           "select"]


class SelectionError(ValueError):
    """--points / --layers that do not fit one model (an error of that model, not of the run)."""


def parse_points(text: str | None) -> list[str] | None:
    """Comma-separated point names (aliases allowed) -> canonical names; None means all."""
    if not text:
        return None
    out = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        if name not in BY_NAME and name not in ALIASES:
            raise ValueError(f"unknown point {name!r} in --points.{closest(name, list(BY_NAME) + list(ALIASES))} "
                             f"Known points: {', '.join(BY_NAME)}.")
        out.append(get_point(name).name)
    return out


def parse_layers(text: str | None) -> tuple:
    """Comma-separated layer words (early, mid, late, kinds, all) and/or integers (negative from the end)."""
    if not text:
        return DEFAULT_LAYERS
    out = []
    for part in (s.strip() for s in text.split(",") if s.strip()):
        if part in LAYER_WORDS:
            out.append(part)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"bad --layers entry {part!r}: use integers (negative counts from the end) or "
                             f"{', '.join(LAYER_WORDS)}.{closest(part, LAYER_WORDS)}") from None
    return tuple(out)


def check_layers(spec: tuple, n_layers: int) -> None:
    """SelectionError when a layer number of `spec` does not exist in an `n_layers`-layer model."""
    bad = [s for s in spec if isinstance(s, int) and not -n_layers <= s < n_layers]
    if bad:
        raise SelectionError(f"--layers {', '.join(map(str, bad))} out of range for a {n_layers}-layer model "
                             f"(use 0..{n_layers - 1}, or -{n_layers}..-1 from the end).")


def layer_kinds(cfg) -> dict[str, int]:
    """First layer of each kind named by config.layer_types (empty for uniform trunks)."""
    kinds: dict[str, int] = {}
    for i, kind in enumerate(getattr(cfg, "layer_types", None) or []):
        kinds.setdefault(str(kind), i)
    return kinds


def choose_layers(available: list[int], n_layers: int, spec: tuple, kinds: dict[str, int]) -> list[int]:
    """The layers of `available` picked by `spec`."""
    if not available:
        return []
    picked = set()
    for s in spec:
        if s == "all":
            picked.update(available)
        elif s == "early":
            picked.add(available[0])
        elif s == "late":
            picked.add(available[-1])
        elif s == "mid":
            picked.add(min(available, key=lambda x: (abs(x - (n_layers - 1) / 2), x)))
        elif s == "kinds":
            picked.update(k for k in kinds.values() if k in available)
        else:
            check_layers((s,), n_layers)
            layer = s + n_layers if s < 0 else s
            if layer in available:
                picked.add(layer)
    return sorted(picked)


def select(model, points: list[str] | None = None, layers: tuple = DEFAULT_LAYERS) -> list[str]:
    """Address strings ("resid_post.3", "final_norm") to check on one loaded engine model."""
    have = model.points()
    if points is not None:
        unknown = [p for p in points if p not in have]
        if unknown and not [p for p in points if p in have]:
            raise SelectionError(f"none of --points {', '.join(points)} exists on {model.name} "
                             f"({model.family.name} family); it has: {', '.join(have)}.")
        wanted = [p for p in have if p in points]
    else:
        wanted = have
    kinds = layer_kinds(model.config)
    out = []
    for p in wanted:
        if get_point(p).scope == "trunk":
            out.append(p)
            continue
        for layer in choose_layers(model.point_layers(p), model.n_layers, layers, kinds):
            out.append(f"{p}.{layer}")
    return out


def mid_layer(model) -> int:
    """The layer steering parity adds at (resid_post at the middle of the trunk)."""
    avail = model.point_layers("resid_post") or list(range(model.n_layers))
    return min(avail, key=lambda x: (abs(x - (model.n_layers - 1) / 2), x))
