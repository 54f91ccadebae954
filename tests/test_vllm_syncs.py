"""Host reads of device values inside the vLLM worker's steps (engine/core/syncs.py), counted in the worker
through the engine's extension (`interp_syncs`): at most 2 per step, however many requests, layers, steers
or readouts the step carries, on vllm (hooks) and vllm-static (taps). The step's row map comes from the
runner's host copies; captures, receipts and the guard stay on the device until collect."""
from __future__ import annotations

import pytest
import torch

from engine.core.readouts import LensTopK, Mean, Norm, Readout
from engine.core.results import Request
from engine.core.steering import Steer
from test_vllm_common import STATIC_TAPS, drop, random_vector, vllm_model

pytestmark = pytest.mark.vllm
LLAMA = "meta-llama/Llama-3.2-1B"
PER_STEP = 2


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(backend):
        if backend not in made:
            kw = {"static_points": STATIC_TAPS} if backend == "vllm-static" else {}  # the shared engine
            made[backend] = vllm_model(LLAMA, backend, **kw)
        return made[backend]
    yield get
    for backend, m in made.items():
        if backend != "vllm":  # the last module of the shared static engine (test_vllm_common.STATIC_TAPS)
            drop(m)


def _requests(m, n: int, steer_layers: int, new: int = 4) -> list:
    d = m.d_model
    return [Request(f"Prompt number {i} says hello to the world", new,
                    points=[f"resid_post.{L}" for L in range(m.n_layers)],
                    steer=[Steer(f"resid_post.{L}", "add", random_vector((d,), L + 1, 0.5)) for L in range(steer_layers)]
                    + [Steer("mlp_out.1", "scale", 1.5, positions="last")],
                    readouts=[Readout(f"resid_post.{m.n_layers - 1}", Mean()), Readout("resid_post.0", Norm())]
                    + ([Readout("resid_post.1", LensTopK(3))] if m.backend == "vllm" else []))
            for i in range(n)]


def _per_step(m, reqs) -> tuple[float, dict]:
    m.generate_batch(reqs)  # warm: sites resolved, graphs captured
    m.worker_syncs(True)
    m.generate_batch(reqs)
    (rank,) = m.worker_syncs(False)
    assert rank["steps"] >= 4, rank
    return rank["syncs"] / rank["steps"], rank["sites"]


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_a_worker_step_reads_back_at_most_two_values(engines, backend):
    m = engines(backend)
    few, few_sites = _per_step(m, _requests(m, 1, 1))
    many, many_sites = _per_step(m, _requests(m, 4, m.n_layers))
    assert few <= PER_STEP and many <= PER_STEP, (few_sites, many_sites)


def test_counting_is_off_unless_asked(engines):
    m = engines("vllm")
    (rank,) = m.worker_syncs(False)
    assert rank == {"syncs": 0, "steps": 0, "sites": {}}
    out = m.generate("Hello there", 3, steer=[Steer("resid_post.0", "add", torch.zeros(m.d_model))])
    assert out.new_tokens.shape == (1, 3)
