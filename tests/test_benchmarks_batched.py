"""The batched GPU workloads (benchmarks/workloads.py batch_*) on the tiny twin, on the CPU: what each
timed run returns is checked against the engine called directly, a no-op steer is caught, the peers
run the same batch, and a small sweep answers issue 33's GPU ratios with intervals."""
from __future__ import annotations

import pytest
import torch

from benchmarks import ratios as R
from benchmarks.spec import DEFAULT_MODEL, Params, prompt_ids, steer_vector
from benchmarks.worker import Worker
from benchmarks.workloads import BATCH, GPU_GENERATION, GPU_PREFILL, PROBE
from benchmarks.workloads import get as get_workload

FAST = dict(prompt_tokens=8, long_prompt_tokens=24, new_tokens=3, rounds=6, warmups=1, min_sample_s=0.0)
ALL = GPU_PREFILL + GPU_GENERATION


@pytest.fixture(scope="module", autouse=True)
def offline_zoo():
    """The zoo's offline environment, also in an already-imported huggingface_hub (whose constants
    are read at import: setting os.environ alone left the peers looking online for the twin when an
    earlier test had imported it)."""
    from engine import zoo
    zoo.ensure_twin(DEFAULT_MODEL, "tiny")
    threads = torch.get_num_threads()
    with zoo.offline_session():
        yield
    torch.set_num_threads(threads)


def _worker(variant: str, **kw) -> Worker:
    w = Worker()
    reply = w.handle({"op": "load", "variant": variant, "params": Params(**{**FAST, **kw}).to_dict()})
    assert reply["ok"], reply
    return w


def _checked(w: Worker, workload: str) -> dict:
    prep = w.handle({"op": "prepare", "workload": workload})
    assert prep["ok"], prep
    reply = w.handle({"op": "check", "workload": workload})
    assert reply["ok"], reply
    return reply


@pytest.fixture(scope="module")
def eager():
    w = _worker("eager")
    yield w
    w.handle({"op": "close"})


def test_the_batched_workloads_are_named_not_run_by_default():
    from benchmarks.sweep import plan
    vs, ws = plan()
    assert not set(ws) & set(ALL)
    assert plan(["eager", "hf-generate"], ["batch_prefill"]) == (["eager", "hf-generate"], ["batch_prefill"])
    for name in ALL:
        wl = get_workload(name)
        assert wl.batch == BATCH and wl.tokens(Params(**FAST)) == BATCH * (3 if wl.generates else 8)


@pytest.mark.parametrize("workload, width, generated", [("batch_capture", None, None), ("batch_readout", PROBE, None),
                                                         ("batch_capture_gen", None, BATCH * 3),
                                                         ("batch_readout_gen", PROBE, BATCH * 3)])
def test_captures_and_readouts_cover_every_layer_row_and_stream(eager, workload, width, generated):
    reply = _checked(eager, workload)
    check, m = reply["check"], eager.runner.m
    rows = 8 + (3 - 1 if get_workload(workload).generates else 0)
    assert check["passed"], check
    assert check["expected"] == [m.n_layers, BATCH, rows, width or m.d_model]
    assert reply["generated"] == generated


def test_the_probe_readout_is_the_probe_applied_to_the_captured_rows(eager):
    """What batch_readout returns equals W @ resid_post of a plain capture, at every layer and row."""
    _checked(eager, "batch_readout")
    m, ids = eager.runner.m, eager.runner.prompt(get_workload("batch_readout"))
    _, got = eager.last["batch_readout"]
    _, cache = m.run_with_cache(ids, ["resid_post"])
    W = torch.randn(PROBE, m.d_model, generator=torch.Generator().manual_seed(0))
    for i in range(m.n_layers):
        torch.testing.assert_close(got.readouts[f"probe.{i}"], cache[f"resid_post.{i}"] @ W.T, rtol=1e-4, atol=1e-4)


def test_the_batched_steer_is_the_engines_own_add_at_every_layer(eager):
    """batch_steer's logits equal a steered forward made here; its check counts the positions it moved."""
    from engine.core.steering import Steer
    reply = _checked(eager, "batch_steer")
    m = eager.runner.m
    ids = prompt_ids(m.tokenizer, 8, BATCH)
    v = steer_vector(m.d_model, Params().steer_scale)
    want, _ = m.run_with_cache(ids, [], steer=[Steer(f"resid_post.{i}", "add", v) for i in range(m.n_layers)])
    torch.testing.assert_close(eager.last["batch_steer"][0], want, rtol=0, atol=0)
    plain, _ = m.run_with_cache(ids, [])
    moved = int((want != plain).flatten(2).any(-1).sum())
    assert reply["check"]["passed"] and reply["check"]["changed_positions"] == moved == BATCH * 8
    gen = _checked(eager, "batch_steer_gen")
    assert gen["check"]["passed"] and gen["generated"] == BATCH * 3


def test_a_noop_batched_steer_is_invalid():
    w = _worker("eager", steer_scale=0.0)
    for wl in ("batch_steer", "batch_steer_gen"):
        check = _checked(w, wl)["check"]
        assert not check["passed"] and "no-op" in check["detail"]


def test_the_hf_peer_runs_hfs_own_attention_and_returns_every_layer():
    """The GPU goals price the engine against the forward a user of plain HF gets: its default attention."""
    w = _worker("hf-generate")
    assert w.runner.model_info["attn_implementation"] == "sdpa"
    check = _checked(w, "batch_capture")["check"]
    assert check["passed"] and check["expected"][:3] == [2, BATCH, 8]
    assert _checked(w, "batch_generate")["generated"] == BATCH * 3


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["transformerlens", "nnsight", "interp-engine"])
def test_the_peers_capture_and_steer_the_same_batch(variant):
    from benchmarks.variants import get as get_variant
    w = _worker(variant)
    var = get_variant(variant)
    for wl in ALL:
        if var.supports(wl):
            continue
        reply = _checked(w, wl)
        assert reply["check"] is None or reply["check"]["passed"], (wl, reply["check"])
        if get_workload(wl).generates:
            assert reply["generated"] == BATCH * 3
    steer = _checked(w, "batch_steer")["check"]
    assert steer["changed_positions"] == BATCH * 8  # every position moved, as on eager


def test_a_batched_sweep_answers_the_gpu_ratios(tmp_path):
    """Two workers in their own processes, interleaved rounds: every GPU-group ratio whose cells ran has its
    median and interval over the six rounds."""
    from benchmarks.report import render
    from benchmarks.sweep import run_sweep
    from benchmarks.table import Table
    work = ["batch_prefill", "batch_capture", "batch_steer", "batch_generate", "batch_steer_gen"]
    out = run_sweep(Params(**FAST), ["eager", "hf-generate"], work, tmp_path, "cpu-batched", log=lambda *_: None)
    by = {(c["variant"], c["workload"]): c for c in out}
    assert by[("hf-generate", "batch_steer")]["status"] == "n/a"
    ok = [k for k, c in by.items() if c["status"] == "ok"]
    assert len(ok) == 8, {k: c["reason"] for k, c in by.items() if c["status"] != "ok"}
    t = Table(out)
    keys = {s.key: s for s in R.GPU}
    for key in ("eager:batch_prefill/hf-generate:batch_prefill", "eager:batch_capture/hf-generate:batch_capture",
                "eager:batch_steer/eager:batch_prefill", "eager:batch_steer_gen/eager:batch_generate"):
        res = R.compute(t, keys[key])
        assert res is not None and res.interval.n == 6 and res.interval.lo <= res.interval.median <= res.interval.hi
        per = [t.per_round(*keys[key].num)[r] / t.per_round(*keys[key].den)[r] for r in range(6)]
        assert sorted(per) == sorted(res.per_round.values())  # paired round by round
    text = render([t])
    assert "Batched (16 prompts or streams): the GPU goals of issue 33" in text
    assert "eager forward / HF forward (its default attention, SDPA), batched (goal ≥ 0.98)" in text


def test_a_sweep_past_its_time_starts_no_more_rounds_and_says_so(tmp_path):
    """--max-seconds: a round that the last one's duration says would end past the deadline is not started;
    the rounds that ran keep their samples (the cells are written either way)."""
    import time

    from benchmarks.sweep import Sweep
    logs: list[str] = []
    s = Sweep(Params(**FAST), "t", ["eager"], ["batch_prefill"], tmp_path, log=logs.append)
    s.prepared = {("eager", "batch_prefill"): {"samples": []}}
    s.workers = {"eager": object()}

    def ask(v, w, req):
        time.sleep(0.3)
        return {"seconds": 0.3, "cpu_s": 0.3, "min_seconds": 0.3, "min_cpu_s": 0.3, "k": 1, "load1": 0.0, "t": 0.0}
    s._ask = ask
    s.run_rounds([("eager", "batch_prefill")], deadline=time.perf_counter() + 0.75)
    ran = len(s.prepared[("eager", "batch_prefill")]["samples"])
    assert 1 <= ran < FAST["rounds"]
    assert f"round {ran + 1}/6 and later: not started, the sweep's time is up (--max-seconds); {ran} rounds ran" \
        in logs
