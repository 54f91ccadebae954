"""vLLM's V2 model runner: forced off for the hooked backends, refused by name where it cannot be
(engine/backends/vllm/worker/runner.py), and the V1 step anchor around `_model_forward` that keeps working
under FULL CUDA-graph replay (engine/backends/vllm/worker/extension.py). No engine starts here; V2 cannot run on
this CPU (it needs Triton's GPU backend), so its classes and batch ordering are used directly."""
from __future__ import annotations

import pytest

from engine.backends.vllm.worker import runner as vr
from engine.backends.vllm.worker.rows import apply_update


def _bare(cls):
    return cls.__new__(cls)  # the class is what runner_kind reads; no runner is constructed


def test_runner_kind_tells_v1_from_v2_by_class():
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CPUV1
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1
    assert [vr.runner_kind(_bare(c)) for c in (V1, CPUV1, V2, CPUV2)] == ["v1", "v1", "v2", "v2"]


def test_v2_batch_order_breaks_a_v1_row_map():
    """Why V2 is refused: our row map learns persistent-batch indices from V1's BatchUpdate (request a
    added at 0, b at 1), and V1 lays a step's tokens out in that order. V2 sorts every step's batch
    (decodes first), so its row 0 is b: the V1 map would give b's rows to a, with no error."""
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    class Params:
        def __init__(self, key):
            self.extra_args = {"interp_plan": key}
    rows: dict = {}
    apply_update(rows, BatchUpdate(batch_size=2, removed=[], added=[(0, Params("a"), [], []), (1, Params("b"), [], [])],
                                   moved=[]))
    v1_order = [rows[i] for i in sorted(rows)]
    v2_order = sort_batch_req_ids({"a": 5, "b": 1}, {}, 1)  # a still prefilling 5 tokens, b decoding 1
    assert v1_order == ["a", "b"] and v2_order == ["b", "a"]


def test_force_v1_sets_the_env_and_says_so(monkeypatch):
    monkeypatch.delenv(vr.ENV, raising=False)
    env, note = vr.force_v1("vllm", {})
    assert env == {vr.ENV: "0"} and note.startswith("model runner: V1") and "overridden" not in note
    monkeypatch.setenv(vr.ENV, "1")
    env, note = vr.force_v1("vllm-static", {})
    assert env == {vr.ENV: "0"} and f"the environment's {vr.ENV}=1 is overridden" in note
    assert vr.force_v1("vllm-generate", {}) == ({}, "model runner: vLLM's own choice (stock vLLM, no row map)")


@pytest.mark.parametrize("kw, what", [({"watermark_config": {"type": "x"}}, "watermarking"),
                                      ({"attention_config": {"hisparse_config": {}}}, "HiSparse attention")])
def test_arguments_that_force_v2_are_refused_before_start(kw, what):
    with pytest.raises(vr.RunnerError, match=f"vllm needs vLLM's V1 model runner, but {what} makes vLLM 0.32 use V2"):
        vr.force_v1("vllm", kw)
    assert vr.force_v1("vllm-generate", kw)[0] == {}  # stock vLLM maps no rows: V2 is fine there


def test_a_vllm_without_the_v1_runner_is_refused_by_name_before_start(monkeypatch):
    """vLLM 0.34 removed the V1 runner (users install the newest vLLM): the hooked backends say so and
    what to install, instead of vLLM's engine failing on VLLM_USE_V2_MODEL_RUNNER=0."""
    import importlib.util
    real = importlib.util.find_spec
    assert real(vr.V1_RUNNER) is not None  # the pinned 0.32 has it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == vr.V1_RUNNER else real(name, *a))
    for backend in ("vllm", "vllm-static"):
        with pytest.raises(vr.RunnerError, match=rf"{backend} runs on vLLM's V1 model runner, which the installed vLLM "
                                                 r"0\.32\.0 no longer has \(vllm\.v1\.worker\.gpu_model_runner is gone: "
                                                 r"vLLM 0\.34 removed it\); install the pinned vLLM 0\.32"):
            vr.force_v1(backend, {})
    assert vr.force_v1("vllm-generate", {})[0] == {}  # stock vLLM needs no V1


def test_a_v2_worker_is_refused_by_name():
    vr.check("vllm", ["v1", "v1"])
    with pytest.raises(vr.RunnerError, match="vllm-static: vLLM started its V2 model runner although "
                                              "VLLM_USE_V2_MODEL_RUNNER=0 was set"):
        vr.check("vllm-static", ["v1", "v2"])


def test_the_env_name_is_what_vllm_reads(monkeypatch):
    import vllm.envs as envs
    monkeypatch.setenv(vr.ENV, "0")
    envs.disable_envs_cache()
    assert getattr(envs, vr.ENV) is False


# -- the step anchor around V1's _model_forward ------------------------------------------------------
class _Runner:
    """Stands for V1's runner: _model_forward is its one call per step; `replay` stands for a FULL
    CUDA graph, which runs the captured kernels without calling any module (no hook can fire)."""

    def __init__(self, replay):
        self.replay, self.calls = replay, []

    def _model_forward(self, input_ids=None, positions=None, **kw):
        self.calls.append("forward")
        return self.replay(positions)


def test_step_anchor_wraps_model_forward_and_survives_replay():
    from engine.backends.vllm.worker.seams import wrap_model_forward
    seen = []
    runner = _Runner(lambda positions: positions * 2)
    begin = lambda m, args, kw: seen.append(("begin", kw["positions"].tolist()))  # noqa: E731
    end = lambda m, args, out: seen.append(("end", out.tolist()))  # noqa: E731
    assert wrap_model_forward(runner, begin, end)
    import torch
    out = runner._model_forward(input_ids=None, positions=torch.tensor([3, 4]))
    assert out.tolist() == [6, 8] and runner.calls == ["forward"]
    assert seen == [("begin", [3, 4]), ("end", [6, 8])]
    assert wrap_model_forward(runner, begin, end)  # a second setup replaces, never nests
    seen.clear()
    runner._model_forward(positions=torch.tensor([1]))
    assert seen == [("begin", [1]), ("end", [2])]


def test_no_model_forward_means_module_hooks():
    from engine.backends.vllm.worker.seams import wrap_model_forward
    assert not wrap_model_forward(object(), None, None)


# -- what load() hands vLLM (no engine: the start is intercepted) ------------------------------------
class _Started(Exception):
    pass


def _engine_args(monkeypatch, backend, **kw):
    from engine.backends.vllm import backend as vllm_backend

    async def start(path, env, engine_kw):
        raise _Started(env, engine_kw)
    monkeypatch.setattr(vllm_backend, "_start", start)
    with pytest.raises(_Started) as e:
        vllm_backend.load("meta-llama/Llama-3.2-1B", backend=backend, source="zoo", **kw)
    return e.value.args


@pytest.mark.parametrize("backend", ["vllm", "vllm-static", "vllm-generate"])
def test_load_hands_vllm_the_runner_env_and_cpu_defaults(monkeypatch, backend):
    monkeypatch.delenv(vr.ENV, raising=False)
    env, kw = _engine_args(monkeypatch, backend)
    assert env.get(vr.ENV) == (None if backend == "vllm-generate" else "0")
    # the CPU twin numbers the project always used
    assert (kw["dtype"], kw["max_model_len"], kw["max_num_seqs"]) == ("float32", 512, 8)
    assert "gpu_memory_utilization" not in kw
    # vllm-static no longer pins PIECEWISE: vLLM's own CUDA-graph mode (FULL_AND_PIECEWISE on CUDA)
    assert "compilation_config" not in kw


def test_load_passes_a_callers_graph_mode_and_refuses_forced_v2(monkeypatch):
    _, kw = _engine_args(monkeypatch, "vllm-static", compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    from engine.backends.vllm import backend as vllm_backend
    with pytest.raises(vr.RunnerError, match="watermarking makes vLLM 0.32 use V2"):
        vllm_backend.load("meta-llama/Llama-3.2-1B", backend="vllm", source="zoo", watermark_config={"type": "x"})
