"""What every backend's model shares about its point catalogue: where each point exists, listing
the points it serves and expanding capture lists. Each backend supplies `_probe(point, layer)`
(raise UnsupportedPointError when it cannot serve the point there), `address(a)`, `n_layers` and
a `_point_layers` dict used as the cache; `_live()` (ModelBase) refuses a closed model before any of
them, even where the answer is cached."""
from __future__ import annotations

from typing import Iterable

from engine.core.address import Address, known_point
from engine.core.errors import UnsupportedPointError
from engine.core.points import ALIASES, BY_NAME, POINTS, get_point


class PointCatalogue:
    def _probe(self, point: str, layer: int | None) -> None:
        raise NotImplementedError

    def _live(self) -> None:
        raise NotImplementedError

    def point_layers(self, point: str) -> list[int]:
        """Layers at which this backend serves `point` on this model ([-1] stands for a trunk point)."""
        self._live()
        point = known_point(point).name
        if point not in self._point_layers:
            layers = [None] if get_point(point).scope == "trunk" else range(self.n_layers)
            found = []
            for layer in layers:
                try:
                    self._probe(point, layer)
                    found.append(-1 if layer is None else layer)
                except UnsupportedPointError:
                    pass
            self._point_layers[point] = found
        return self._point_layers[point]

    def points(self) -> list[str]:
        """Names of every point this model serves at one layer or more, in catalogue order."""
        return [p.name for p in POINTS if self.point_layers(p.name)]

    def expand(self, points: Iterable[Address | str] | Address | str) -> list[Address]:
        """Addresses from strings/Addresses; a layer-scoped name without a layer means every layer
        that has it. Duplicates ('resid_post.-1' and 'resid_post.2' on 3 layers) are one capture."""
        self._live()
        if isinstance(points, (str, Address)):
            points = [points]
        out = []
        for p in points:
            if isinstance(p, str) and "." not in p and (p in BY_NAME or p in ALIASES) \
                    and get_point(p).scope == "layer":
                layers = self.point_layers(p)
                if not layers:
                    self.address(f"{p}.0")  # raises with the reason
                out += [Address(get_point(p).name, layer) for layer in layers]
            else:
                out.append(self.address(p))
        return list(dict.fromkeys(out))
