"""Recompute a sample of the published matrix and compare it with the committed cells: the check that
fails when committed results are not reproducible by the code at hand, and never merely because the
code changed since they were made (their inputs digests are not compared; `validator run --check` is
the freshness check, run by scripts/publish_validator.sh at the publishing commit)."""
from validator import cells, cli, exits


def failing(cell) -> set:
    from validator.rows import where
    return {(r["case"], where(r)) for r in cell.get("rows", []) if r["verdict"] in ("fail", "warn")}


def assert_sample_reproduces(models, engines, out) -> None:
    code = cli.main(["run", "--models", ",".join(models), "--engines", ",".join(engines), "--out", str(out)])
    assert code == exits.OK, "undeclared failures in the sample (see the summary above)"
    fresh = {(c["model"], c["engine"]): c for c in cells.load_all(out)}
    assert set(fresh) == {(m, e) for m in models for e in engines}
    for (model, engine), cell in sorted(fresh.items()):
        published = cells.read(cells.cell_path(cells.DEFAULT_OUT, model, engine))
        assert published is not None, (f"reports/validator has no {engine} cell for {model}: regenerate the "
                                       f"published matrix (bash scripts/publish_validator.sh)")
        assert (cell["status"], cell.get("summary")) == (published["status"], published.get("summary")), \
            (model, engine, cell.get("summary"), published.get("summary"))
        assert failing(cell) == failing(published), (model, engine)
