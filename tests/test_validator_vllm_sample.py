"""CI's sample of the published vLLM columns (slow): the vllm and vllm-static cells of a few zoo twins,
recomputed here, have no undeclared failure and the same verdict counts as the committed cells in
reports/validator/cells/. The full sweep that publishes them is a separate command (README):
`python -m validator run --engines vllm,vllm-static` (about 1.5 h on 2 cores)."""
import pytest

from validator import cells, cli, exits

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# one native vLLM Llama twin (RoPE, GQA, gated MLP, the most common layout), both vLLM columns: each column
# is a vLLM engine start (its own process), so one twin keeps this test near a minute on 2 cores
SAMPLE = ("meta-llama/Llama-3.2-1B",)
ENGINES = ("vllm", "vllm-static")


def test_vllm_sample_matches_the_published_cells(tmp_path):
    code = cli.main(["run", "--models", ",".join(SAMPLE), "--engines", ",".join(ENGINES), "--out", str(tmp_path)])
    assert code == exits.OK, "undeclared failures in the vLLM sample (see the summary above)"
    fresh = {(c["model"], c["engine"]): c for c in cells.load_all(tmp_path)}
    assert set(fresh) == {(m, e) for m in SAMPLE for e in ENGINES}
    for (model, engine), cell in sorted(fresh.items()):
        published = cells.read(cells.cell_path(cells.DEFAULT_OUT, model, engine))
        assert published is not None, (f"reports/validator has no {engine} cell for {model}: publish the vLLM sweep "
                                       f"(python -m validator run --engines vllm,vllm-static)")
        assert cell["summary"] == published["summary"], (model, engine, cell["summary"], published["summary"])
        failing = {(r["case"], r["point"], r["layer"]) for r in cell["rows"] if r["verdict"] in ("fail", "warn")}
        assert failing == {(r["case"], r["point"], r["layer"]) for r in published["rows"]
                           if r["verdict"] in ("fail", "warn")}, (model, engine)
