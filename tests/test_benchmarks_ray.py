"""`python -m benchmarks run --ray`: a sweep as one task on a local Ray cluster; every cell (and so every ratio)
comes from one node, the driver writes the cells as a local run does, the report names the node, and a table
refuses cells of two nodes. The sweep is slow: a local cluster and a sweep's workers start there."""
from __future__ import annotations

import platform

import pytest

from benchmarks import cells as cellio
from benchmarks import report
from benchmarks.__main__ import main as cli
from benchmarks.spec import DEFAULT_MODEL, Params
from benchmarks.table import MixedCellsError, Table


@pytest.mark.slow
def test_a_sweep_on_ray_runs_on_one_node_and_the_report_says_which(tmp_path):
    ray = pytest.importorskip("ray")
    from engine import zoo
    from engine.harvest.cluster import connect
    zoo.ensure_twin(DEFAULT_MODEL, "tiny")
    if ray.is_initialized():
        ray.shutdown()
    connect(None, 2)
    try:
        assert cli(["run", "--model", DEFAULT_MODEL, "--variants", "eager", "--workloads", "prefill,capture_all",
                    "--prompt-tokens", "8", "--long-prompt-tokens", "24", "--new-tokens", "4", "--rounds", "6",
                    "--warmups", "1", "--min-sample", "0", "--sweeps", str(tmp_path), "--sweep", "cpu-ray",
                    "--ray"]) == 0
    finally:
        ray.shutdown()
    got = cellio.load_sweep(tmp_path / "cpu-ray")
    assert {(c["variant"], c["workload"]) for c in got} == {("eager", "prefill"), ("eager", "capture_all")}
    assert all(c["status"] == "ok" for c in got), [c.get("reason") for c in got]
    assert {c["env"]["node"] for c in got} == {platform.node()}  # the local cluster's one node
    t = Table(got)
    assert f"(node `{platform.node()}`)" in report.sweep_line(t)
    other = [dict(got[0], env=dict(got[0]["env"], node="elsewhere")), *got[1:]]
    with pytest.raises(MixedCellsError, match="'node'"):
        Table(other)


def test_a_sweeps_task_asks_for_a_gpu_on_cuda_and_its_threads_in_cpus():
    from benchmarks.cluster import resources
    assert resources(Params(device="cpu", threads=1)) == {"num_cpus": 1, "num_gpus": 0}
    assert resources(Params(device="cuda", threads=0, clock="wall")) == {"num_cpus": 1, "num_gpus": 1}
