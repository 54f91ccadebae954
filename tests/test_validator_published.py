"""The committed matrix (reports/validator): its reports render from its cells, it covers every zoo model
in every published column (the default engines, vllm and vllm-static), and nothing in it fails
without a declared cause, so the main job on a fresh clone exits 0; and a one-twin sample recomputed now
reproduces it (tests/validator_sample.py)."""
from validator import cells, report
from validator.engines import DEFAULT_ENGINES
from validator.report import cell_failed

PUBLISHED_COLUMNS = (*DEFAULT_ENGINES, "vllm", "vllm-static")


def _published():
    return [c for c in cells.load_all(cells.DEFAULT_OUT) if not c.get("variant_tag")]


def test_committed_reports_render_from_the_committed_cells():
    assert report.check(cells.DEFAULT_OUT) == []


def test_committed_matrix_covers_the_zoo_in_every_published_column():
    from engine.zoo import ZOO
    have = {(c["model"], c["engine"]) for c in _published()}
    missing = sorted((m, e) for m in ZOO for e in PUBLISHED_COLUMNS if (m, e) not in have)
    assert missing == [], f"{len(missing)} cells missing, e.g. {missing[:5]}"


def test_committed_matrix_has_no_undeclared_failure():
    bad = sorted((c["model"], c["engine"]) for c in _published() if cell_failed(c))
    assert bad == []


def test_vllm_columns_skip_only_what_the_zoo_marks_unserved():
    from engine.zoo import ZOO
    for c in _published():
        if c["engine"].startswith("vllm") and c["status"] == "skipped":
            assert not ZOO[c["model"]].vllm, c["model"]


def test_a_sample_of_the_main_job_reproduces_the_committed_cells(tmp_path):
    """Recomputed now, one twin's cells in every default column equal the committed ones (verdict counts
    and failing rows): red when the committed results are not what this code computes, not merely
    because the code changed since they were made."""
    from validator_sample import assert_sample_reproduces
    assert_sample_reproduces(["openai-community/gpt2"], DEFAULT_ENGINES, tmp_path)
