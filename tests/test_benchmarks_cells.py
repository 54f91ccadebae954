"""Benchmark cells for real, on the tiny zoo twin: a no-op steer is flagged invalid, a real steer is
checked against an independent unsteered/steered generation, and one cell runs end to end in its
own process and lands atomically as JSON."""
from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import cells as cellio
from benchmarks import sweep, worker
from benchmarks.spec import DEFAULT_MODEL, Params, prompt_ids, steer_vector
from benchmarks.variants import VARIANTS
from benchmarks.variants import get as get_variant
from benchmarks.workloads import NAMES as WORKLOADS

FAST = dict(prompt_tokens=8, new_tokens=4, warmups=0, repeats=5, min_time_s=0.0)


@pytest.fixture(scope="module", autouse=True)
def offline_zoo():
    from engine import zoo
    old = {k: os.environ.get(k) for k in zoo.offline_env()}
    os.environ.update(zoo.offline_env())
    zoo.ensure_twin(DEFAULT_MODEL)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_noop_steer_is_flagged_invalid():
    cell = worker.run_cell("eager", "steer", Params(steer_scale=0.0, **FAST), "t")
    assert cell["status"] == "invalid", cell["reason"]
    assert "no-op" in cell["reason"] and cell["check"]["changed_tokens"] == 0
    assert len(cell["samples_s"]) == 5  # it was timed, but the figure is never published
    from benchmarks.table import Table
    assert Table([cell]).tok_s("eager", "steer") is None


def test_real_steer_check_matches_an_independent_generation():
    p = Params(steer_scale=8.0, **FAST)
    cell = worker.run_cell("eager", "steer", p, "t")
    assert cell["status"] == "ok", cell["reason"]
    from engine.loading import load_model
    from engine.steering import Steer
    m = load_model(DEFAULT_MODEL, source="zoo")
    ids = prompt_ids(m.tokenizer, p.prompt_tokens, 1)
    L = m.n_layers // 2
    plain = m.generate(ids, max_new_tokens=p.new_tokens).new_tokens
    steered = m.generate(ids, max_new_tokens=p.new_tokens,
                         steer=[Steer(f"resid_post.{L}", "add", steer_vector(m.d_model, 8.0))]).new_tokens
    assert cell["check"]["changed_tokens"] == int((plain != steered).sum()) > 0


def test_prompt_ids_have_exact_length_and_distinct_rows():
    from engine import zoo
    _, tok = zoo.load_twin(DEFAULT_MODEL)
    ids = prompt_ids(tok, 37, 8)
    assert ids.shape == (8, 37)
    assert len({tuple(r.tolist()) for r in ids}) == 8


def test_time_job_adds_runs_for_short_workloads():
    class J:
        n = 0

        def run(self):
            J.n += 1
    samples, _ = worker.time_job(J(), 1, 5, "cpu", min_time_s=0.05)
    assert len(samples) >= 5 and J.n == len(samples) + 1
    samples, _ = worker.time_job(J(), 0, 5, "cpu")
    assert len(samples) == 5


def test_registry_states_every_na_and_skip():
    for v in VARIANTS:
        for w in WORKLOADS:
            reason = v.supports(w)
            assert reason is None or len(reason) > 20
    assert get_variant("vllm-generate").supports("steer").startswith("stock vLLM")
    with pytest.raises(ValueError, match="unknown variant 'eagr'. Did you mean 'eager'"):
        get_variant("eagr")


def test_static_cells_need_no_process(tmp_path):
    p = Params(**FAST)
    cell = sweep.run_one("hf-generate", "steer", p, "t", tmp_path)
    assert cell["status"] == "n/a" and "steering" in cell["reason"]
    assert json.loads((tmp_path / "hf-generate__steer.json").read_text()) == cell


def test_one_cell_in_its_own_process(tmp_path):
    cell = sweep.run_one("eager", "prefill", Params(**FAST), "t", tmp_path)
    assert cell["status"] == "ok", cell["reason"]
    on_disk = cellio.load_cells(tmp_path)
    assert on_disk == [cell]
    s = cell["summary"]
    assert len(cell["samples_s"]) == s["n"] >= 5 and s["tokens_per_run"] == 8
    assert s["tok_s"]["median"] == pytest.approx(8 / s["seconds"]["median"])
    assert cell["env"]["hardware"] and cell["env"]["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert cell["model_info"]["source"] == "zoo"


def test_generated_token_counts_from_every_output_kind():
    from types import SimpleNamespace as NS

    from benchmarks.variants.base import generated_tokens
    prompt = 5
    seq = torch.zeros(3, prompt + 4, dtype=torch.long)
    assert generated_tokens(NS(new_tokens=torch.zeros(3, 4)), prompt) == 12  # engine result
    assert generated_tokens(NS(new_tokens=[torch.zeros(4), torch.zeros(2)]), prompt) == 6  # ragged vLLM
    assert generated_tokens(seq, prompt) == 12  # HF / TL token ids
    assert generated_tokens(NS(sequences=seq), prompt) == 12  # HF GenerateOutput
    assert generated_tokens((seq, {"cache": 1}), prompt) == 12  # TL return_cache / nnsight (out, saved)
    assert generated_tokens(NS(), prompt) is None


def test_every_generation_cell_checks_its_token_count():
    for v in ("eager", "hf-generate"):
        cell = worker.run_cell(v, "decode", Params(**FAST), "t")
        assert cell["status"] == "ok" and cell["generated_tokens_checked"] == FAST["new_tokens"]
    cell = worker.run_cell("eager", "prefill", Params(**FAST), "t")
    assert cell["generated_tokens_checked"] is None
