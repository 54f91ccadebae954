"""How the reports present cells (synthetic cells, no model runs): structural failures show their kind,
declared upstream failures do not fail the run, variant columns, the interp-engine drop-in table."""
from validator import cells, cli, dropin, report


def _row(point, verdict, case="short", layer=1, **kw):
    return {"case": case, "point": point, "layer": layer, "verdict": verdict, **kw}


def _cell(rows, model="acme/tiny", engine="hf", tag="", **extra):
    summary = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "warn", "fail", "gap")}
    return {"schema": cells.SCHEMA, "model": model, "engine": engine, "status": "ok", "rows": rows, "summary": summary,
            "family": "llama", "variant_tag": tag, **extra}


SHAPE = _row("attn_probs", "fail", case="decode",
             structural=["shape mismatch: ours (1, 1, 4, 21) vs reference (1, 1, 4, 23)"])


def test_structural_failure_shows_its_kind_not_a_zero_error():
    c = _cell([_row("attn_probs", "pass", rel_err=0.0), SHAPE])
    md = report.render_details("acme/tiny", [c])
    assert "| attn_probs | 1 | fail (shape mismatch) |" in md
    assert "fail 0.0e+00" not in md


def test_declared_failures_are_counted_apart_and_do_not_fail_the_run():
    leak = _row("lm_head", "fail", case="leak", structural=["padding leak: row 0's real tokens differ"],
                known="hf-deepseek-v4-padding-leak")
    declared = _cell([_row("lm_head", "pass"), leak])
    assert report.declared_failures(declared) == 1 and not report.cell_failed(declared)
    assert report.cell_failed(_cell([_row("lm_head", "pass"), SHAPE]))
    assert report.cell_failed({**_cell([]), "status": "error"})
    table = cli.summary_table([declared], ("hf",)).splitlines()
    assert table[1].split() == ["hf", "1", "1", "0", "0", "1", "0", "0", "0"]


def test_variant_cells_are_their_own_columns():
    cs = [_cell([_row("lm_head", "pass")]), _cell([_row("lm_head", "fail", rel_err=0.5)], tag="bfloat16")]
    readme = report.render_readme(cs, zoo=["acme/tiny"])
    assert "| model | family | hf | hf@bfloat16 |" in readme
    assert "| [acme/tiny](details/acme__tiny.md) | llama | 1/0/0/0 | 0/0/1/0 |" in readme
    assert "- `hf@bfloat16`: an ad-hoc variant (bfloat16), not the published configuration" in readme


def test_complete_matrix_says_so():
    readme = report.render_readme([_cell([_row("lm_head", "pass")])], zoo=["acme/tiny"])
    assert "every column covers all 1 zoo models.**" in readme


def test_dropin_table_by_point():
    rows = [
        _row("resid_post", "pass"),
        _row("q", "gap", reason="interp-engine names no point 'q'", known="ie-no-point"),
        _row("embeddings", "gap", layer=None, raw_verdict="fail", rel_err=5.8, known="ie-embeddings-token-only"),
        _row("lm_head", "fail", case="leak", layer=None, known="hf-deepseek-v4-padding-leak",
             structural=["padding leak: ..."]),  # a shared upstream bug says nothing about the pair
        _row("lm_head", "pass", layer=None),
        _row("z", "fail", rel_err=0.3),
    ]
    t = dropin.table([_cell(rows, engine="interp-engine"), _cell([_row("z", "fail")], engine="hf")])
    assert set(t["resid_post"]) == {"same"} and set(t["lm_head"]) == {"same"}
    assert t["q"]["not_served"] == {"acme/tiny": {"ie-no-point"}}
    assert t["embeddings"]["differs"] == {"acme/tiny": {"ie-embeddings-token-only"}}
    assert set(t["z"]) == {"undeclared"}
    md = "\n".join(dropin.render_dropin([_cell(rows, engine="interp-engine")]))
    assert "| embeddings |  | 1 (ie-embeddings-token-only) |  |  | no: defined differently |" in md
    assert "| q |  |  | 1 (ie-no-point) |  | ours only |" in md
    assert "| z |  |  |  | 1 | **no: undeclared failure** |" in md
    assert "| ie-embeddings-token-only | definition | embeddings | 1 | 1 |" in md
    assert dropin.render_dropin([_cell(rows)]) == []  # no interp-engine column, no section


def test_failures_section_separates_undeclared_from_declared():
    leak = _row("lm_head", "fail", case="leak", layer=None, structural=["padding leak: row 0"],
                known="hf-deepseek-v4-padding-leak")
    declared_only = report.render_readme([_cell([leak])], zoo=["acme/tiny"])
    section = declared_only.split("## Failures")[1].split("##")[0]
    assert "Undeclared (these fail the run):\n\nNone." in section
    assert "- acme/tiny: 1 rows in hf (lm_head): `hf-deepseek-v4-padding-leak`" in section
    both = report.render_readme([_cell([leak, SHAPE])], zoo=["acme/tiny"])
    assert "- acme/tiny / decode / attn_probs.1 (hf): shape mismatch: ours (1, 1, 4, 21)" in both


def test_a_column_computed_by_two_versions_of_the_code_is_called_partial_with_its_counts():
    def prov(digest, commit):
        return {"provenance": {"code_digest": digest, "commit": commit}}
    zoo = ["acme/a", "acme/b", "acme/c"]
    ok = [_cell([_row("resid_post", "pass")], model=m, engine="hf", **prov("d1", "c" * 40)) for m in zoo]
    mixed = [_cell([_row("resid_post", "pass")], model=m, engine="vllm", **prov(d, k * 40))
             for m, d, k in (("acme/a", "new", "b"), ("acme/b", "new", "b"), ("acme/c", "old", "a"))]
    skipped = _cell([], model="acme/c", engine="vllm", status="skipped")  # no provenance: it ran no code
    assert report.coverage(ok + mixed[:2] + [skipped], zoo) == []
    lines = report.coverage(ok + mixed, zoo)
    assert lines == ["- `vllm`: cells from 2 versions of the code: 2 computed by code new (at bbbbbbbb); 1 computed by "
                     "code old (at aaaaaaaa). A run on the current code recomputes the stale ones (`python -m validator "
                     "run --engines vllm`; `--check` lists them)."]
    assert report.coverage(ok, zoo) == []  # one version, every model: complete
    assert "partial matrix:" in report.render_readme(ok + mixed, zoo)


def test_only_the_publishing_script_writes_the_dated_record():
    """A plain `validator run` rewrote reports/validator/history/<date>.json (its commit changes every time), so the
    main job on a fresh clone left the checkout modified; now only `--record` writes it, and the publishing script
    passes it."""
    from pathlib import Path
    assert cli.build_parser().parse_args(["run"]).record is False
    assert cli.build_parser().parse_args(["run", "--record"]).record is True
    script = (Path(__file__).resolve().parents[1] / "scripts" / "publish_validator.sh").read_text()
    assert script.count("--record") >= 2
