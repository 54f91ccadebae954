"""How long each cell will take, from the durations earlier cells recorded: the plan's second half.

Every cell records `provenance.seconds` (its column: the reference run and the scoring) and
`provenance.engine_seconds` (its model's load and the engine's sides, shared by the model's cells).
A model's task takes its engine seconds once plus its cells' seconds. An estimate is, in order:
`measured` (the same cell, same variant, computed before), `scaled` (the median seconds per billion
parameters of the same column and variant on other models, times this model's parameters), or
`guess` (nothing of this variant was ever recorded: reading the weights at GUESS_READ plus
GUESS_CELL per cell, stated as a guess). Only cells of the same variant tag count: a CPU run of a
tiny twin says nothing about a GPU run of the real checkpoint.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

GUESS_READ = 1.0 * 2 ** 30  # bytes per second a copy of the weights loads at (disk to GPU), when nothing is recorded
GUESS_CELL = 60.0  # seconds per cell beyond loading, when nothing is recorded


@dataclass(frozen=True)
class Estimate:
    seconds: float
    how: str  # "measured" | "scaled" | "guess"

    def __str__(self) -> str:
        return f"{fmt(self.seconds)} ({self.how})"


def fmt(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Durations:
    """Earlier cells' recorded durations, looked up by (model, engine, variant tag)."""

    def __init__(self, earlier: list[dict]):
        self.cell: dict[tuple, float] = {}
        self.model: dict[tuple, float] = {}
        for c in earlier:
            prov = c.get("provenance") or {}
            tag = c.get("variant_tag", "")
            if isinstance(prov.get("seconds"), (int, float)) and c.get("status") == "ok":
                self.cell[(c["model"], c["engine"], tag)] = float(prov["seconds"])
            if isinstance(prov.get("engine_seconds"), (int, float)):
                key = (c["model"], tag)
                self.model[key] = max(self.model.get(key, 0.0), float(prov["engine_seconds"]))

    def _rates(self, params: dict[str, int]) -> tuple[dict, dict]:
        cell_rates: dict[tuple, list[float]] = defaultdict(list)
        for (m, e, tag), s in self.cell.items():
            if params.get(m):
                cell_rates[(e, tag)].append(s / (params[m] / 1e9))
        model_rates: dict[str, list[float]] = defaultdict(list)
        for (m, tag), s in self.model.items():
            if params.get(m):
                model_rates[tag].append(s / (params[m] / 1e9))
        return ({k: statistics.median(v) for k, v in cell_rates.items()},
                {k: statistics.median(v) for k, v in model_rates.items()})

    def estimates(self, params: dict[str, int], engines: tuple[str, ...], tag: str,
                  load_bytes: dict[str, int]) -> tuple[dict[tuple[str, str], Estimate], dict[str, Estimate]]:
        """({(model, engine): its cell's estimate}, {model: its load's estimate}) for the models of `params`
        (their parameter counts); `load_bytes`: each model's bytes loaded (for a guess)."""
        cell_rate, model_rate = self._rates(params)
        cells, models = {}, {}
        for m, p in params.items():
            if (m, tag) in self.model:
                models[m] = Estimate(self.model[(m, tag)], "measured")
            elif tag in model_rate:
                models[m] = Estimate(model_rate[tag] * p / 1e9, "scaled")
            else:
                models[m] = Estimate(load_bytes.get(m, 0) / GUESS_READ, "guess")
            for e in engines:
                if (m, e, tag) in self.cell:
                    cells[(m, e)] = Estimate(self.cell[(m, e, tag)], "measured")
                elif (e, tag) in cell_rate:
                    cells[(m, e)] = Estimate(cell_rate[(e, tag)] * p / 1e9, "scaled")
                else:
                    cells[(m, e)] = Estimate(GUESS_CELL, "guess")
        return cells, models
