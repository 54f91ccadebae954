"""CI's sample of the published vLLM columns (slow): the vllm and vllm-static cells of a few zoo twins,
recomputed here, have no undeclared failure and the same verdict counts as the committed cells in
reports/validator/cells/ (tests/validator_sample.py). The full sweep that publishes them is part of
`bash scripts/publish_validator.sh` (README)."""
import pytest

from validator_sample import assert_sample_reproduces

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# one native vLLM Llama twin (RoPE, GQA, gated MLP, the most common layout), both vLLM columns: each column
# is a vLLM engine start (its own process), so one twin keeps this test near a minute on 2 cores
SAMPLE = ("meta-llama/Llama-3.2-1B",)
ENGINES = ("vllm", "vllm-static")


def test_vllm_sample_matches_the_published_cells(tmp_path):
    assert_sample_reproduces(SAMPLE, ENGINES, tmp_path)
