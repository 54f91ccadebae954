"""`validator run --ray` on a local Ray cluster whose custom resource `fake_gpu` stands in for GPUs: a slice of
the matrix computed as Ray tasks gives cells identical to a plain run (timings aside); a task whose worker is
killed mid-run is retried and gives the same cells; a driver killed after its first task leaves that task's
cells on disk, and the next run computes only the rest. Slow: a local cluster and its workers start here."""
import os
import signal
import threading

import pytest

from validator import cells, cli, cluster, runner
from validator.models import zoo_spec
from validator.shards import comparable

pytestmark = pytest.mark.slow

MODELS = ("openai-community/gpt2", "meta-llama/Llama-3.2-1B")
RUN = ["--engines", "hf", "--points", "resid_post,lm_head", "--no-steer", "--no-decode"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from engine.harvest.cluster import connect
    if ray.is_initialized():
        ray.shutdown()
    connect(None, 2, {"fake_gpu": 2})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    assert cli.main(["run", "--models", ",".join(MODELS), *RUN, "--out", str(out)]) == 0
    return {cells.key_of(c): comparable(c) for c in cells.load_all(out)}


def _cells(out):
    return {cells.key_of(c): comparable(c) for c in cells.load_all(out)}


def _opts(out):
    return runner.Options(engines=("hf",), out=out, points=["lm_head", "resid_post"], decode=False, steer=False)


def test_a_ray_run_of_a_slice_equals_a_plain_run(ray_cluster, plain, tmp_path, capsys):
    assert cli.main(["run", "--models", ",".join(MODELS), *RUN, "--out", str(tmp_path), "--ray"]) == 0
    assert _cells(tmp_path) == plain and len(plain) == len(MODELS)
    assert (tmp_path / "README.md").is_file()  # the driver rendered the reports
    assert "plan: 2 models x 1 columns" in capsys.readouterr().err


def test_a_killed_worker_is_retried_and_its_cells_are_the_same(ray_cluster, plain, tmp_path):
    announce = tmp_path / "started"
    announce.mkdir()
    victim = MODELS[1].replace("/", "__")
    killed = []

    def kill_first_attempt():
        found = cluster.wait_for(f"{victim}.*", str(announce), timeout=300)
        if found:
            pid = int(found[0].suffix[1:])
            os.kill(pid, signal.SIGKILL)  # held before computing (cluster.compute waits for `go`)
            killed.append(pid)
        (announce / "go").touch()  # the retry and the other task compute
    t = threading.Thread(target=kill_first_attempt)
    t.start()
    out = tmp_path / "out"
    opts = _opts(out)
    specs = {m: zoo_spec(m) for m in MODELS}
    tasks = [cluster.Task(m, ("hf",), gpus=1) for m in MODELS]  # one fake GPU each
    cluster.run(tasks, specs, False, opts, gpu_resource="fake_gpu", announce=str(announce))
    t.join(10)
    assert killed, "the task never started"
    attempts = sorted(p.suffix for p in announce.glob(f"{victim}.*"))
    assert len(attempts) == 2 and f".{killed[0]}" in attempts  # killed once, run again in a new worker
    assert len(list(announce.glob(f"{MODELS[0].replace('/', '__')}.*"))) == 1
    assert _cells(out) == plain and not opts.kept


def test_a_killed_driver_leaves_finished_cells_and_the_next_run_resumes(ray_cluster, plain, tmp_path):
    out = tmp_path / "out"
    specs = {m: zoo_spec(m) for m in MODELS}
    done = []

    def die_after_first(model, n):
        done.append(model)
        raise KeyboardInterrupt("the driver is killed")
    with pytest.raises(KeyboardInterrupt):
        cluster.run([cluster.Task(m, ("hf",)) for m in MODELS], specs, False, _opts(out), on_done=die_after_first)
    first, other = done[0], next(m for m in MODELS if m != done[0])
    assert runner.pending(specs[first], _opts(out)) == [] and runner.pending(specs[other], _opts(out)) == ["hf"]
    assert cli.main(["run", "--models", ",".join(MODELS), *RUN, "--out", str(out), "--ray"]) == 0
    assert _cells(out) == plain
