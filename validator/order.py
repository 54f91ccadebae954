"""The order points are listed in by every validator table: the registry's order, then the steering
and decode rows. Its own module so that the report and the drop-in table both import it downward."""
from __future__ import annotations


def point_rank(point: str) -> int:
    from engine.core.points import POINTS
    names = [p.name for p in POINTS] + ["steer", "decode"]
    return names.index(point) if point in names else len(names)
