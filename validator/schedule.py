"""The plan before a run (`python -m validator plan`, and the first lines of `run`): per cell its memory and
GPUs (validator/budget.py), its expected time (validator/costs.py), and whether it runs here at all.

A cell whose GPUs exceed what one node at hand has is a declared gap: `run` writes it as a skipped cell
whose reason says what it needs ("needs 4 x 80 GiB GPUs on one node ...; run it with a cluster") and marks it
`unplaced`, so it never ends as an out-of-memory error, and a later run on bigger nodes computes it
(an unplaced cell is not up to date once it fits). The cells of one model run as one task (they
share its loads: the engine, the reference and the expected sides): a task needs the most GPUs of
its cells and takes its load once plus each cell's time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from validator import budget
from validator.budget import Devices, GiB, Need, Shape
from validator.costs import Durations, Estimate, fmt

UNPLACED = "unplaced"  # the cell field that marks a declared does-not-fit gap (holds what the cell needs)
SHORT = {"hf": "hf", "transformer_lens": "tl", "nnsight": "nns", "nnterp": "nnt", "interp-engine": "ie"}  # headers


@dataclass(frozen=True)
class CellPlan:
    model: str
    engine: str
    need: Need
    estimate: Estimate
    gap: str = ""  # why it does not run on the devices at hand ("" when it does)

    def gpus_text(self) -> str:
        if not self.need.gpus:
            return "cpu"
        own = f"+{self.need.tp * self.need.pp}" if self.need.vllm else ""
        return f"{self.need.gpus}{own}"


@dataclass
class MatrixPlan:
    """Every selected cell's plan, and each model's load estimate and shape."""
    devices: Devices
    dtype: str
    tag: str
    on_gpu: bool
    cells: list[CellPlan] = field(default_factory=list)
    loads: dict[str, Estimate] = field(default_factory=dict)
    shapes: dict[str, Shape] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed after the header (a --history that could not be read)

    def of(self, model: str) -> list[CellPlan]:
        return [c for c in self.cells if c.model == model]

    def models(self) -> list[str]:
        return list(dict.fromkeys(c.model for c in self.cells))

    def model_seconds(self, model: str, gaps: bool = False) -> float:
        """Its task's time: the load once, plus each of its cells that runs here (`gaps`: and those that do
        not, as on nodes where they fit)."""
        run = [c for c in self.of(model) if gaps or not c.gap]
        return (self.loads[model].seconds if run else 0.0) + sum(c.estimate.seconds for c in run)

    def model_gpus(self, model: str) -> int:
        """GPUs its task asks for: the most of its cells that run here (0 on a CPU run)."""
        return max([c.need.all_gpus for c in self.of(model) if not c.gap] or [0])

    def placement(self, model: str) -> str:
        """How the model's copies are loaded: "auto" (accelerate's device map over the task's GPUs) when its
        cells need more than one GPU in the validator's process, else "single"."""
        return "auto" if max([c.need.gpus for c in self.of(model) if not c.gap] or [0]) > 1 else "single"

    def vllm_parallel(self, model: str) -> tuple[int, int]:
        """(tensor, pipeline) sizes its vLLM columns load with ((1, 1) when it has none, or on a CPU run)."""
        own = [(c.need.tp, c.need.pp) for c in self.of(model) if c.need.vllm and c.need.gpus]
        return max(own) if own else (1, 1)

    def gaps(self) -> list[CellPlan]:
        return [c for c in self.cells if c.gap]

    def lines(self, engines: tuple[str, ...], detail: bool = True) -> list[str]:
        head = [f"plan: {len(self.models())} models x {len(engines)} columns = {len(self.cells)} cells, {self.dtype}"
                f"{', variant ' + self.tag if self.tag else ''}; GPUs at hand per node: {self.devices.describe()}; "
                f"each GPU keeps {budget.HEADROOM:.0%} free"]
        sources = sorted({s.config_from for s in self.shapes.values()})
        head.append(f"plan: sizes from {', '.join(sources)}; times from earlier cells of this variant "
                    f"(measured: the same cell; scaled: per parameter from other models; guess: none recorded)")
        head += self.notes
        if not detail:
            return head + self._summary()
        cols = "  ".join(f"{SHORT.get(e, e.replace('vllm-', 'v-'))[:5]:>5s}" for e in engines)
        rows = [f"{'model':44s} {'params':>8s} {'GiB/copy':>8s}  {cols}  {'time':>8s}  how"]
        for m in self.models():
            s = self.shapes[m]
            by = {c.engine: c for c in self.of(m)}
            gp = "  ".join(f"{('gap' if by[e].gap else by[e].gpus_text()) if e in by else '-':>5s}" for e in engines)
            hows = {c.estimate.how for c in self.of(m)} | ({self.loads[m].how} if m in self.loads else set())
            rows.append(f"{m[:44]:44s} {s.params / 1e9:7.2f}B {s.weight_bytes(self.dtype) / GiB:8.1f}  {gp}  "
                        f"{fmt(self.model_seconds(m, gaps=True)):>8s}  {'/'.join(sorted(hows))}")
        return head + rows + self._summary()

    def _summary(self) -> list[str]:
        multi = [c for c in self.cells if c.need.all_gpus > 1]
        out = [f"plan: {len(multi)} of {len(self.cells)} cells need more than one GPU "
               f"({len({c.model for c in multi})} models); {len(self.gaps())} do not fit the GPUs at hand and are "
               f"declared gaps; serial time of the rest {fmt(sum(self.model_seconds(m) for m in self.models()))}, of all "
               f"{fmt(sum(self.model_seconds(m, gaps=True) for m in self.models()))}"]
        for c in self.gaps()[:6]:
            out.append(f"  gap: {c.model} / {c.engine}: {c.gap}")
        if len(self.gaps()) > 6:
            out.append(f"  ... and {len(self.gaps()) - 6} more gaps")
        return out


def gap_reason(need: Need, devices: Devices) -> str:
    """'' when the cell fits one node of `devices`, else what it needs and how to run it."""
    if need.all_gpus <= devices.count:
        return ""
    n = need.all_gpus
    more = f"more than {budget.MAX_GPUS}" if need.gpus > budget.MAX_GPUS else str(n)
    return (f"needs {more} x {devices.bytes_each / GiB:.0f} GiB GPUs on one node ({need.what()}), {devices.count} at "
            f"hand; run it with a cluster that has such a node (python -m validator run --ray ADDRESS)")


def build(names: list[str], engines: tuple[str, ...], dtype: str, tag: str, devices: Devices, real: bool,
          on_gpu: bool, earlier: list[dict]) -> MatrixPlan:
    """The plan of `names` x `engines` (zoo names; a model directory is planned from its own config)."""
    plan = MatrixPlan(devices, dtype, tag, on_gpu)
    needs: dict[str, dict[str, Need]] = {}
    for n in names:
        shape, by = budget.needs(n, engines, dtype, devices, real, on_gpu=on_gpu)
        plan.shapes[n], needs[n] = shape, by
    durations = Durations(earlier)
    load_bytes = {n: s.weight_bytes(dtype) * max(nd.copies for nd in needs[n].values()) for n, s in plan.shapes.items()}
    est, plan.loads = durations.estimates({n: s.params for n, s in plan.shapes.items()}, engines, tag, load_bytes)
    for n in names:
        for e in engines:
            need = needs[n][e]
            plan.cells.append(CellPlan(n, e, need, est[(n, e)], gap_reason(need, devices) if on_gpu else ""))
    return plan


def earlier_cells(out: Path, history: str | None) -> tuple[list[dict], list[str]]:
    """(the cells durations are read from, notes): those in `out`, then `history`'s (a cells directory or a git
    ref) where `out` has none of that key; a git ref that does not exist is a note, not an error."""
    notes: list[str] = []
    from validator import cells
    from validator import history as hist
    found = {(c["model"], c["engine"], c.get("variant_tag", "")): c for c in
             (cells.load_all(out) if cells.cell_dir(out).is_dir() else [])}
    if history:
        try:
            earlier = hist.load(history, out)
        except hist.HistoryError as e:
            if Path(history).exists():
                raise
            # a reference run that does not exist yet (the first night): estimates from `out` alone
            notes.append(f"plan: --history {history}: {e} The time estimates use {out}'s cells only.")
            earlier = []
        for c in earlier:
            found.setdefault((c["model"], c["engine"], c.get("variant_tag", "")), c)
    return list(found.values()), notes
