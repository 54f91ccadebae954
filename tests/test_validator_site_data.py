"""The validation site data (visualizer-data/validation.generated.ts) shows every engine column, the
vLLM backends and the interp-engine reference included, and the interp-engine drop-in table."""
import json

from validator import cells
from visualizer_data import validation_ts


def _cell(model, engine, rows, status="ok", tag=""):
    summary = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "warn", "fail", "gap")}
    return {"schema": cells.SCHEMA, "model": model, "engine": engine, "status": status, "rows": rows,
            "summary": summary, "variant_tag": tag}


def _export(text: str, name: str):
    body = text.split(f"export const {name}: ")[1].split(" = ", 1)[1]
    return json.loads(body.split(";\n", 1)[0])


def test_engine_columns_and_dropin_table(tmp_path):
    ok = {"case": "short", "point": "resid_post", "layer": 0, "verdict": "pass"}
    leak = {"case": "leak", "point": "lm_head", "layer": None, "verdict": "fail", "known": "hf-deepseek-v4-padding-leak"}
    q = {"case": "short", "point": "q", "layer": 0, "verdict": "gap", "known": "ie-no-point"}
    written = [_cell("a/x", "hf", [ok, leak]), _cell("a/x", "vllm", [ok]), _cell("b/y", "vllm", [], "skipped"),
               _cell("a/x", "vllm-static", [ok]), _cell("a/x", "interp-engine", [ok, q]),
               _cell("a/x", "hf", [dict(ok, verdict="fail")], tag="bfloat16")]
    for c in written:
        path = cells.cell_path(tmp_path.parent, c["model"], c["engine"], c["variant_tag"])
        (tmp_path / path.name).write_text(json.dumps(c))
    text = validation_ts.render(tmp_path)
    cols = {e["column"]: e for e in _export(text, "validationEngines")}
    assert list(cols) == ["hf", "hf@bfloat16", "interp-engine", "vllm", "vllm-static"]
    assert cols["hf"]["declared"] == 1 and cols["hf"]["failing"] == 0
    assert cols["hf@bfloat16"]["failing"] == 1
    assert cols["vllm"]["cells"] == 2 and cols["vllm"]["skipped"] == 1 and "vLLM backend" in cols["vllm"]["compares"]
    per_cell = {(c["engine"], c["variant"]): c for c in _export(text, "validation")}
    assert per_cell[("hf", "")]["declared"] == 1 and per_cell[("hf", "bfloat16")]["verdict"] == "fail"
    drop = {p["point"]: p for p in _export(text, "interpEngineDropIn")}
    assert drop["resid_post"] == {"point": "resid_post", "same": 1, "definedDifferently": 0, "notServed": 0,
                                  "undeclared": 0, "causes": [], "dropIn": "yes"}
    assert drop["q"]["notServed"] == 1 and drop["q"]["causes"] == ["ie-no-point"] and drop["q"]["dropIn"] == "ours only"
