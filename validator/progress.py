"""Run progress on the console: one bar over the run's cells, labelled with the model and engine at
work (on a terminal); one line per finished model otherwise (CI logs, pipes), never a stream of \\r.
Both say the time left, from the durations earlier cells recorded (provenance.seconds and the model's
engine_seconds), scaled by this run's own pace once a model has finished."""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable


def expected_seconds(todo: dict[str, list[str]], recorded: Iterable[dict]) -> dict[str, float]:
    """{model: seconds its pending cells took when last recorded}: the model's load and preparation
    (engine_seconds) plus each pending engine's cell; an engine a model never recorded counts as that
    engine's median over the other models. Empty when nothing was recorded."""
    cell_s: dict[tuple[str, str], float] = {}
    load_s: dict[str, float] = {}
    for c in recorded:
        p = c.get("provenance") or {}
        if "seconds" in p:
            cell_s.setdefault((c["model"], c["engine"]), float(p["seconds"]))
        if "engine_seconds" in p:
            load_s.setdefault(c["model"], float(p["engine_seconds"] or 0.0))
    if not cell_s:
        return {}
    by_engine: dict[str, list[float]] = {}
    for (_, e), s in cell_s.items():
        by_engine.setdefault(e, []).append(s)
    overall = statistics.median(cell_s.values())
    median = {e: statistics.median(v) for e, v in by_engine.items()}
    load = statistics.median(load_s.values()) if load_s else 0.0
    return {m: load_s.get(m, load) + sum(cell_s.get((m, e), median.get(e, overall)) for e in engines)
            for m, engines in todo.items()}


def _clock(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class Progress:
    def __init__(self, total: int, stream, tty: bool | None = None, expected: dict[str, float] | None = None):
        self.stream, self.total, self.done, self.t0 = stream, total, 0, time.time()
        self.tty = stream.isatty() if tty is None and hasattr(stream, "isatty") else bool(tty)
        self.expected, self.finished = dict(expected or {}), set()
        self.bar = None
        if self.tty and total:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=stream, unit="cell", dynamic_ncols=True, leave=False, disable=False)

    def left(self, now: float | None = None) -> float | None:
        """Seconds left: the recorded seconds of the models still to run, times this run's elapsed time over
        the recorded seconds of the models it finished. None before the first model or without a record."""
        done = sum(self.expected.get(m, 0.0) for m in self.finished)
        if not self.expected or done <= 0:
            return None
        pace = ((now or time.time()) - self.t0) / done
        return pace * sum(s for m, s in self.expected.items() if m not in self.finished)

    def start(self, model: str, engine: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"{model.split('/')[-1][:32]} / {engine}")

    def finish(self, model: str, n_cells: int, note: str = "") -> None:
        self.done += n_cells
        self.finished.add(model)
        left = self.left()
        eta = "" if left is None else f", about {_clock(left)} left"
        if self.bar is not None:
            self.bar.set_postfix_str(eta.lstrip(", "))
            self.bar.update(n_cells)
        elif self.total:
            print(f"[{self.done}/{self.total} cells, {time.time() - self.t0:.0f} s{eta}] {model}{note}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
