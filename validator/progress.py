"""Run progress on the console: one bar over the run's cells, labelled with the model and engine at
work (on a terminal); one line per finished model otherwise (CI logs, pipes), never a stream of \\r."""
from __future__ import annotations

import time


class Progress:
    def __init__(self, total: int, stream, tty: bool | None = None):
        self.stream, self.total, self.done, self.t0 = stream, total, 0, time.time()
        self.tty = stream.isatty() if tty is None and hasattr(stream, "isatty") else bool(tty)
        self.bar = None
        if self.tty and total:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=stream, unit="cell", dynamic_ncols=True, leave=False, disable=False)

    def start(self, model: str, engine: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"{model.split('/')[-1][:32]} / {engine}")

    def finish(self, model: str, n_cells: int, note: str = "") -> None:
        self.done += n_cells
        if self.bar is not None:
            self.bar.update(n_cells)
        elif self.total:
            print(f"[{self.done}/{self.total} cells, {time.time() - self.t0:.0f} s] {model}{note}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
