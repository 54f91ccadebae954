"""The validator's proof of its own power: seed each bug of validator/mutations.py into the engine, one at a
time, in process, and check that the validator's verdict is fail and that a failing row names the bug.

Each model is prepared once, unmutated (validator/columns.py: its plan and every expected side do not
depend on the engine under test), and must pass clean; then every mutation that applies to it reloads
the engine under the seeded bug, recomputes only the tested side and re-scores it. The score "caught N of
M" is what a pass of the matrix is worth; `python -m validator selftest` prints it and, in full, writes
it to reports/validator/selftest.json, which the report renders.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from validator import cells
from validator.mutations import Mutation, catalogue

RESULT = cells.DEFAULT_OUT / "selftest.json"
QUICK = ("mlp_out-off-by-5e-4", "project_out-sign", "int-position-next-token", "negative-layer-early",
         "lens-skips-final-norm", "sdpa-pattern-mask-leak", "mean-over-n-minus-1",
         "decode-drops-first-generated")


@dataclass
class Outcome:
    """One seeded bug on one model: whether the run failed (any undeclared failing row), whether a failing row
    names the bug, and the first such rows (their where-text) as evidence."""
    mutation: str
    category: str
    model: str
    column: str
    failed: bool
    named: bool
    rows: list = field(default_factory=list)
    error: str = ""

    @property
    def caught(self) -> bool:
        return self.failed and self.named


def _failing(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["verdict"] == "fail" and not r.get("known")]


class _Prepared:
    """One model prepared once: its plan, the expected side of each column, a vLLM model loaded once."""

    def __init__(self, name: str, columns_wanted: set[str]):
        from validator import columns
        self.columns = set(columns_wanted)
        from validator.engines.base import ModelContext
        from validator.models import zoo_spec
        from validator.runner import DTYPES, Options, native_attention
        self.spec = zoo_spec(name)
        m = self.spec.load_engine("auto")
        hf, tok = self.spec.load_reference(native_attention(m))
        ctx = ModelContext(name, hf, tok, "zoo", DTYPES["float32"])
        engines = sorted(columns_wanted)
        self.model = columns.prepare(name, m, ctx, self.spec.load_engine, Options(engines=tuple(engines)), engines)
        self.expected = {e: columns.expected(e, self.model) for e in engines}
        self.vllm = None
        if "vllm" in columns_wanted:
            from validator.engines.vllm_ref import VllmEngine
            self.vllm = VllmEngine(ctx)
            self.vllm._load_for(self.model.plan)

    def rows(self, column: str, fresh: bool) -> list[dict]:
        """The column's scored rows, its tested side recomputed (fresh: the engine reloaded under whatever
        is patched now)."""
        from validator import columns, sides
        from validator.engines import ENGINES
        from validator.subject import Subject
        model = self.model
        if column == "vllm":
            tested = sides.tested(Subject(self.vllm.m), model.plan)
            return columns.score(column, model, tested, self.expected[column])
        if column == "vllm-static":  # loaded each time, as a run loads it: its startup proof runs under the bug
            tested, exp = columns.vllm_run(column, model)
            return columns.score(column, model, tested, exp)
        wanted = columns.configs([column])
        tested = columns.tested_sides(model, wanted, fresh=fresh) if fresh else model.tested
        eager = None
        if column == "hf":
            eager = columns.eager_pairs(model, tested.get("eager"))
        return columns.score(column, model, tested[ENGINES[column].config], self.expected[column], eager)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()
        self.model.close()


class Models:
    """Models prepared once and kept (a test module shares them across its self-test runs); closed on exit.
    A model is prepared with the columns first asked of it."""

    def __init__(self) -> None:
        self.prepared: dict[str, _Prepared] = {}
        self.problems: dict[str, list[str]] = {}

    def get(self, name: str, wanted: set[str], say: Callable[[str], None]) -> "_Prepared":
        have = self.prepared.get(name)
        if have is not None and wanted <= have.columns:
            return have
        if have is not None:
            have.close()
        say(f"{name}: preparing ({', '.join(sorted(wanted))})")
        prep = self.prepared[name] = _Prepared(name, wanted)
        self.problems[name] = []
        for column in sorted(wanted):  # the clean run must pass: a self-test on a failing baseline proves nothing
            clean = _failing(prep.rows(column, fresh=False))
            if clean:
                self.problems[name].append(f"{name} / {column} fails before any bug is seeded: "
                                           f"{clean[0].get('reason', '')[:200]}")
        return prep

    def close(self) -> None:
        while self.prepared:
            self.prepared.popitem()[1].close()

    def __enter__(self) -> "Models":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run(mutations: list[Mutation], progress: Callable[[str], None] | None = None,
        models: Models | None = None) -> tuple[list[Outcome], list[str]]:
    """(an outcome per mutation and model, problems: a model whose clean run already fails). `models`: kept
    prepared models to reuse (else prepared here and closed at the end)."""
    say = progress or (lambda s: None)
    by_model: dict[str, list[Mutation]] = {}
    for mut in mutations:
        for name in mut.models:
            by_model.setdefault(name, []).append(mut)
    outcomes, problems = [], []
    own = models is None
    keep = Models() if models is None else models
    try:
        for name, muts in by_model.items():
            prep = keep.get(name, {"hf"} | {m.column for m in muts}, say)
            problems += keep.problems[name]
            for mut in muts:
                t0 = time.time()
                try:
                    with mut.applied():
                        rows = prep.rows(mut.column, fresh=True)
                    bad = _failing(rows)
                    named = [r for r in bad if mut.names(r)]
                    from validator.rows import where
                    o = Outcome(mut.name, mut.category, name, mut.column, bool(bad), bool(named),
                                [f"{r['case']} {where(r)}" for r in (named or bad)[:3]])
                except Exception as e:  # noqa: BLE001  (a bug that crashes the run is reported as such)
                    o = Outcome(mut.name, mut.category, name, mut.column, False, False,
                                error=f"{type(e).__name__}: {str(e)[:300]}")
                outcomes.append(o)
                say(f"{'caught' if o.caught else 'MISSED'} {mut.name} on {name} ({time.time() - t0:.1f} s)"
                    f"{': ' + (o.rows[0] if o.rows else o.error) if o.rows or o.error else ''}")
    finally:
        if own:
            keep.close()
    return outcomes, problems


def summary(outcomes: list[Outcome]) -> dict:
    """Per mutation (caught when caught on every model it applies to), and the score."""
    per: dict[str, bool] = {}
    for o in outcomes:
        per[o.mutation] = per.get(o.mutation, True) and o.caught
    return {"caught": sum(per.values()), "total": len(per), "missed": sorted(k for k, v in per.items() if not v)}


def write(outcomes: list[Outcome], problems: list[str], path: Path = RESULT) -> Path:
    """The published result (the report's "what a pass is worth")."""
    from engine.core.files import write_atomic
    data = {"schema": 1, **summary(outcomes), "problems": problems, "code_digest": cells.code_digest(),
            **cells.git_commit(), "outcomes": [asdict(o) for o in outcomes]}
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n", mode=0o644)
    return path


def read(path: Path = RESULT) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def select(names: list[str] | None, quick: bool) -> list[Mutation]:
    """The mutations to run: named ones, the quick subset, or all."""
    every = catalogue()
    if names:
        by = {m.name: m for m in every}
        unknown = [n for n in names if n not in by]
        if unknown:
            from engine.core.address import closest
            raise ValueError(f"unknown mutation {unknown[0]!r}.{closest(unknown[0], list(by))} "
                             f"Mutations: {', '.join(by)}.")
        return [by[n] for n in names]
    return [m for m in every if m.name in QUICK] if quick else every
