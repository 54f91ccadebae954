"""Benchmark workers for real, on the tiny zoo twin: the worker protocol in-process (load, warm up,
sample on both clocks, check), what each check proves (a no-op steer is invalid, a capture returns
every layer and row), a worker process that hangs or dies, and one small sweep end to end."""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from benchmarks import cells as cellio
from benchmarks.pool import WorkerDied, WorkerProc
from benchmarks.spec import DEFAULT_MODEL, Params, prompt_ids, steer_vector
from benchmarks.variants import VARIANTS
from benchmarks.variants import get as get_variant
from benchmarks.variants.base import generated_tokens, rows_check
from benchmarks.worker import Worker, runs_per_sample
from benchmarks.workloads import NAMES as WORKLOADS
from benchmarks.workloads import get as get_workload

FAST = dict(prompt_tokens=8, long_prompt_tokens=24, new_tokens=4, rounds=6, warmups=1, min_sample_s=0.0)


@pytest.fixture(scope="module", autouse=True)
def offline_zoo():
    from engine import zoo
    old = {k: os.environ.get(k) for k in zoo.offline_env("tiny")}
    os.environ.update(zoo.offline_env("tiny"))
    zoo.ensure_twin(DEFAULT_MODEL, "tiny")
    threads = torch.get_num_threads()  # in-process workers set one thread: give the session its own back
    yield
    torch.set_num_threads(threads)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def eager_worker():
    import psutil
    w = Worker()
    before = len(psutil.Process().children(recursive=True))  # this test process's own (e.g. multiprocessing's
    # resource tracker, which outlives any spawn an earlier test module made)
    reply = w.handle({"op": "load", "variant": "eager", "params": Params(**FAST).to_dict()})
    assert reply["ok"], reply
    reply["children_before"] = before
    yield w, reply
    w.handle({"op": "close"})


def test_load_reports_where_it_ran(eager_worker):
    _, reply = eager_worker
    assert reply["env"]["torch_threads"] == 1 and reply["env"]["versions"]["torch"].startswith(
        torch.__version__.split("+")[0])
    assert reply["model_info"]["n_layers"] == 2 and reply["model_info"]["parameters"] > 0
    assert reply["model_info"]["child_processes"] == reply["children_before"]  # loading eager starts no process


def test_sample_times_k_runs_on_both_clocks(eager_worker):
    w, _ = eager_worker
    prep = w.handle({"op": "prepare", "workload": "prefill"})
    assert prep["ok"] and prep["k"] == 1  # min_sample_s 0: one run per sample
    w.k["prefill"] = 4
    s = w.handle({"op": "sample", "workload": "prefill"})
    assert s["ok"] and s["k"] == 4
    assert 0 < s["min_seconds"] <= s["seconds"] and 0 < s["min_cpu_s"] <= s["cpu_s"]
    assert runs_per_sample(0.01, 0.25) == 25 and runs_per_sample(2.0, 0.25) == 1 and runs_per_sample(1e-9, 1) == 500


def test_a_lead_in_runs_the_job_once_untimed_before_the_sample(eager_worker):
    w, _ = eager_worker
    assert w.handle({"op": "prepare", "workload": "prefill"})["ok"]
    job, runs = w.jobs["prefill"], []
    real = job.run
    try:
        job.run = lambda: runs.append(time.time()) or real()
        w.k["prefill"] = 2
        plain = w.handle({"op": "sample", "workload": "prefill"})
        assert plain["ok"] and len(runs) == 2  # no lead-in: the k timed runs alone
        runs.clear()
        led = w.handle({"op": "sample", "workload": "prefill", "lead_in": True})
        assert led["ok"] and led["k"] == 2 and len(runs) == 3  # one more, before the timed ones
        assert runs[0] <= led["t"] <= runs[1]  # the sample's clock starts after the lead-in
    finally:
        job.run = real


@pytest.mark.parametrize("workload, layers, rows", [("capture_one", 1, 8), ("capture_all", 2, 8),
                                                    ("long_capture", 2, 24), ("capture_gen", 2, 8 + 4 - 1),
                                                    ("capture_gen8", 2, 8 + 4 - 1), ("lens", 2, 8),
                                                    ("readout_gen", 2, 8 + 4 - 1)])
def test_capture_checks_see_every_layer_and_row(eager_worker, workload, layers, rows):
    w, _ = eager_worker
    assert w.handle({"op": "prepare", "workload": workload})["ok"]
    reply = w.handle({"op": "check", "workload": workload})
    check = reply["check"]
    assert check["passed"], check
    assert check["layers"] == layers and check["expected"][2] == rows
    assert reply["generated"] == ({"capture_gen": 4, "capture_gen8": 32, "readout_gen": 4}.get(workload))


def test_raw_capture_and_sae_readout_count_the_bytes_they_return(eager_worker):
    """bytes per token of capture_gen: a float32 row per layer; of readout_gen: k int64 indices and k float32
    values per layer; and the readout is the SAE's own top-k of the captured row."""
    from engine.core.features import topk
    from engine.core.sae_files import load_sae
    w, reply = eager_worker
    layers, d = reply["model_info"]["n_layers"], reply["model_info"]["d_model"]
    k = get_workload("readout_gen").sae_k
    got = {}
    for wl in ("capture_gen", "readout_gen"):
        assert w.handle({"op": "prepare", "workload": wl})["ok"]
        got[wl] = w.handle({"op": "check", "workload": wl})["check"]
    rows = 8 + 4 - 1
    assert got["capture_gen"]["bytes_returned"] == layers * rows * d * 4
    assert got["capture_gen"]["bytes_per_token"] == layers * d * 4
    assert got["readout_gen"]["bytes_returned"] == layers * rows * k * (8 + 4)
    assert got["readout_gen"]["bytes_per_token"] == layers * k * (8 + 4)
    assert f"{layers * k * 12:,} per token" in got["readout_gen"]["detail"]
    raw, read = w.last["capture_gen"].cache, w.last["readout_gen"].cache.readouts
    assert torch.equal(w.last["capture_gen"].new_tokens, w.last["readout_gen"].new_tokens)
    sae = load_sae(w.runner.sae_dir)
    assert sae.d_sae == get_workload("readout_gen").sae_expansion * d
    for i in range(layers):
        idx, val = topk(sae.encode(raw[f"resid_post.{i}"][0]).float(), k)
        torch.testing.assert_close(read[f"sae.{i}"].values[0], val, rtol=1e-5, atol=1e-5)
        assert torch.equal(read[f"sae.{i}"].indices[0][val > 1e-4], idx[val > 1e-4])


def test_rows_check_says_what_is_missing():
    bad = rows_check([(1, 8, 256), (1, 7, 256)], 2, 1, 8, 256)
    assert not bad["passed"] and bad["detail"] == "expected 2 layers of [1, 8, 256], got 2 layers, shapes [(1, 7, 256)]"
    short = rows_check([(1, 8, 256)], 2, 1, 8)
    assert not short["passed"] and short["detail"] == "expected 2 layers of [1, 8], got 1 layers"


def test_noop_steer_is_caught_and_real_steer_changes_tokens():
    w = Worker()
    assert w.handle({"op": "load", "variant": "eager", "params": Params(steer_scale=0.0, **FAST).to_dict()})["ok"]
    for wl in ("steer", "steer_all"):
        w.handle({"op": "prepare", "workload": wl})
        check = w.handle({"op": "check", "workload": wl})["check"]
        assert not check["passed"] and check["changed_tokens"] == 0 and "no-op" in check["detail"]
    w2 = Worker()
    assert w2.handle({"op": "load", "variant": "eager", "params": Params(steer_scale=8.0, **FAST).to_dict()})["ok"]
    w2.handle({"op": "prepare", "workload": "steer_all"})
    check = w2.handle({"op": "check", "workload": "steer_all"})["check"]
    # the same steer, done independently through the engine, changes the same number of tokens
    from engine.core.steering import Steer
    from engine.loading import load_model
    m = load_model(DEFAULT_MODEL, source="zoo")
    ids = prompt_ids(m.tokenizer, 8, 1)
    v = steer_vector(m.d_model, 8.0)
    plain = m.generate(ids, max_new_tokens=4).new_tokens
    steered = m.generate(ids, max_new_tokens=4, steer=[Steer(f"resid_post.{i}", "add", v) for i in range(2)]).new_tokens
    assert check["passed"] and check["changed_tokens"] == int((plain != steered).sum()) > 0


def test_a_refusal_is_na_and_an_unknown_request_an_error(eager_worker):
    w, _ = eager_worker
    assert w.handle({"op": "fly"}) == {"ok": False, "status": "error", "reason": "unknown worker request 'fly'"}
    hf = Worker()
    assert hf.handle({"op": "load", "variant": "hf-generate", "params": Params(**FAST).to_dict()})["ok"]
    reply = hf.handle({"op": "prepare", "workload": "lens"})
    assert reply["ok"] is False and reply["status"] == "error" and "no 'lens' workload" in reply["reason"]


def test_generated_token_counts_from_every_output_kind():
    from types import SimpleNamespace as NS
    seq = torch.zeros(3, 5 + 4, dtype=torch.long)
    assert generated_tokens(NS(new_tokens=torch.zeros(3, 4)), 5) == 12  # engine result
    assert generated_tokens(NS(new_tokens=[torch.zeros(4), torch.zeros(2)]), 5) == 6  # ragged vLLM
    assert generated_tokens(seq, 5) == 12  # HF / TL token ids
    assert generated_tokens(NS(sequences=seq), 5) == 12  # HF GenerateOutput
    assert generated_tokens((seq, {"cache": 1}), 5) == 12  # TL return_cache / nnsight (out, saved)
    assert generated_tokens([7, 8, 9], 5) == 3  # interp-engine token ids
    assert generated_tokens((NS(token_ids=[1, 2]), {}), 5) == 2  # interp-engine (completion, cache)
    assert generated_tokens(NS(), 5) is None


def test_every_variant_implements_every_workload_it_does_not_declare_na():
    for v in VARIANTS:
        cls = v.load_runner()
        missing = [w for w in WORKLOADS if not v.supports(w) and not hasattr(cls, get_workload(w).runs)]
        assert not missing, f"{v.name} lacks {missing}"
        for w in WORKLOADS:
            assert v.supports(w) is None or len(v.supports(w)) > 20
    with pytest.raises(ValueError, match="unknown variant 'eagr'. Did you mean 'eager'"):
        get_variant("eagr")


# -- worker processes --------------------------------------------------------------------------------
def test_a_worker_that_hangs_is_killed_and_named(tmp_path):
    wp = WorkerProc("eager", Params(**FAST), tmp_path, argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(WorkerDied, match=r"eager worker gave no reply to load  within 1 s \(raise --timeout\)"):
        wp.request({"op": "load"}, timeout_s=1)
    assert wp.proc.poll() is not None
    wp.close()


def test_a_worker_that_dies_says_why(tmp_path):
    code = "import sys; print('boom: no model', file=sys.stderr); sys.exit(3)"
    wp = WorkerProc("nnsight", Params(**FAST), tmp_path, argv=[sys.executable, "-c", code])
    with pytest.raises(WorkerDied, match="nnsight worker exited with code 3.*boom: no model"):
        wp.request({"op": "load"}, timeout_s=30)
    wp.close()


@pytest.mark.slow
def test_a_small_sweep_end_to_end(tmp_path):
    """Two variants in their own worker processes, interleaved rounds, cells on disk, ratios."""
    from benchmarks import ratios as R
    from benchmarks.sweep import run_sweep
    from benchmarks.table import Table
    out = run_sweep(Params(**FAST), ["eager", "hf-generate"], ["prefill", "capture_all", "steer"], tmp_path,
                    "cpu-e2e", log=lambda *_: None)
    by = {(c["variant"], c["workload"]): c for c in out}
    assert by[("hf-generate", "steer")]["status"] == "n/a"
    for key in (("eager", "prefill"), ("eager", "capture_all"), ("hf-generate", "prefill"), ("eager", "steer")):
        assert by[key]["status"] == "ok", by[key]["reason"]
        assert [s["round"] for s in by[key]["samples"]] == list(range(6))
    assert cellio.load_sweep(tmp_path / "cpu-e2e") == sorted(out, key=lambda c: c["id"])
    t = Table(out)
    res = R.compute(t, R.HEADLINE[0])  # eager capture_all / HF forward
    assert res is not None and res.interval.n == 6 and res.interval.lo <= res.interval.median <= res.interval.hi
