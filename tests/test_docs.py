"""docs/points.md is generated from the catalogue and its --check catches drift."""
from engine.core.points import POINTS
from engine.interop import docs


def test_render_covers_every_point_and_backend():
    text = docs.render()
    for p in POINTS:
        assert f"## `{p.name}`" in text and p.definition in text
    assert "- vllm-generate: refused: vllm-generate is stock vLLM" in text


def test_committed_docs_are_current():
    assert docs.main(["--check"]) == 0, "run `python -m engine.interop.docs` and commit docs/points.md"


def test_check_fails_on_drift(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs, "OUT", tmp_path / "points.md")
    assert docs.main([]) == 0
    assert docs.main(["--check"]) == 0
    (tmp_path / "points.md").write_text(docs.render().replace("Residual stream leaving", "Residual leaving"))
    assert docs.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
