"""What changes a cell's meaning besides its model and engine, in one place.

A `Variant` is the weights source, dtype, device and the point/layer/case selection a cell was
computed with. Cells of different variants never share a file: the published variant (the main
job's defaults) keeps the plain name `<model>__<engine>.json`, every other one adds its tag
(`<model>__<engine>@bfloat16+points-resid_post.json`), and the reports label its columns with it.
Light on purpose (no torch): `--help` and the report read it.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass

LAYER_WORDS = ("early", "mid", "late", "kinds", "all")
DEFAULT_LAYERS = ("early", "mid", "late", "kinds")
_SAFE = re.compile(r"[^A-Za-z0-9_.+-]")


@dataclass(frozen=True)
class Variant:
    source: str = "zoo"  # zoo | real | config
    dtype: str = "float32"
    device: str = "cpu"  # device type only: cuda:1 computes what cuda:0 does
    points: tuple[str, ...] | None = None  # None: every point the family has
    layers: tuple = DEFAULT_LAYERS
    decode: bool = True
    steer: bool = True

    @classmethod
    def of(cls, source="zoo", dtype="float32", device="cpu", points=None, layers=DEFAULT_LAYERS, decode=True,
           steer=True) -> "Variant":
        """Normalized: device type only, points as a sorted tuple, layers as a tuple."""
        return cls(source, dtype, str(device).split(":")[0], tuple(sorted(points)) if points else None,
                   tuple(layers), bool(decode), bool(steer))

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        return cls.of(**{k: d[k] for k in ("source", "dtype", "device", "points", "layers", "decode", "steer")
                         if k in d})

    def as_dict(self) -> dict:
        d = asdict(self)
        d["points"] = list(self.points) if self.points else None
        d["layers"] = list(self.layers)
        return d

    @property
    def published(self) -> bool:
        return self == PUBLISHED

    def tag(self) -> str:
        """'' for the published variant, else its differences joined by '+' (file-name safe)."""
        parts = []
        if self.source != PUBLISHED.source:
            parts.append(self.source)
        if self.dtype != PUBLISHED.dtype:
            parts.append(self.dtype)
        if self.device != PUBLISHED.device:
            parts.append(self.device)
        if self.points is not None:
            parts.append("points-" + _short(self.points))
        if tuple(self.layers) != DEFAULT_LAYERS:
            parts.append("layers-" + _short(tuple(str(x) for x in self.layers)))
        if not self.decode:
            parts.append("no-decode")
        if not self.steer:
            parts.append("no-steer")
        return _SAFE.sub("_", "+".join(parts))

    def describe(self) -> str:
        """One line for humans: what differs from the published variant."""
        return "published configuration" if self.published else self.tag().replace("+", ", ")


PUBLISHED = Variant()


def _short(items: tuple[str, ...]) -> str:
    """Up to three names verbatim ('resid_post.lm_head'), else a count and a digest."""
    if len(items) <= 3 and sum(len(i) for i in items) <= 40:
        return ".".join(items)
    return f"{len(items)}-{hashlib.sha256(','.join(items).encode()).hexdigest()[:6]}"


def label(engine: str, tag: str) -> str:
    """A matrix column: the engine, with the variant tag when it is not the published one."""
    return f"{engine}@{tag}" if tag else engine
