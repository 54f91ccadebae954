"""Benchmark harness, pure parts: the interleaving order, the interval over rounds, ratios paired per
round, every refusal to put cells in one table, and the number formatting. (Workers, sweeps and
publishing have their own files.)"""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import ci, rounds, stats
from benchmarks import ratios as R
from benchmarks.spec import Params
from benchmarks.table import MixedCellsError, Table
from tests.bench_fakes import fake_cell, fake_sweep


# -- the interleaving order -------------------------------------------------------------------------
def test_round_zero_runs_the_table_order_and_each_round_rotates_by_one():
    vs = ["eager", "vllm", "hf-generate", "nnsight"]
    assert rounds.rotated(vs, 0) == vs
    assert rounds.rotated(vs, 1) == ["vllm", "hf-generate", "nnsight", "eager"]
    assert rounds.rotated(vs, 5) == rounds.rotated(vs, 1)
    assert rounds.rotated([], 3) == []


def test_every_variant_takes_every_position_equally_often():
    vs = ["a", "b", "c", "d", "e"]
    for n_rounds in (5, 10, 15):
        seen = Counter((v, pos) for r in range(n_rounds) for pos, v in enumerate(rounds.rotated(vs, r)))
        assert set(seen.values()) == {n_rounds // len(vs)} and len(seen) == len(vs) ** 2


def _baseline(w):
    from benchmarks.workloads import get
    return get(w).baseline


CELLS = [(v, w) for v in ("eager", "vllm", "hf-generate")
         for w in ("decode", "prefill", "capture_all", "steer_all", "capture_gen")] + [("nnsight", "prefill")]


def test_round_zero_groups_cells_by_baseline_variant_by_variant():
    assert rounds.schedule(CELLS, 0, _baseline) == [
        ("eager", "decode"), ("eager", "steer_all"), ("eager", "capture_gen"),
        ("vllm", "decode"), ("vllm", "steer_all"), ("vllm", "capture_gen"),
        ("hf-generate", "decode"), ("hf-generate", "steer_all"), ("hf-generate", "capture_gen"),
        ("eager", "prefill"), ("eager", "capture_all"), ("vllm", "prefill"), ("vllm", "capture_all"),
        ("hf-generate", "prefill"), ("hf-generate", "capture_all"), ("nnsight", "prefill")]


def test_each_round_rotates_variants_and_their_workloads():
    order = rounds.schedule(CELLS, 1, _baseline)
    assert order[:3] == [("vllm", "steer_all"), ("vllm", "capture_gen"), ("vllm", "decode")]
    assert order[9:] == [("vllm", "capture_all"), ("vllm", "prefill"), ("hf-generate", "capture_all"),
                         ("hf-generate", "prefill"), ("nnsight", "prefill"), ("eager", "capture_all"),
                         ("eager", "prefill")]
    for r in range(6):  # every round runs every cell exactly once
        assert Counter(rounds.schedule(CELLS, r, _baseline)) == Counter(CELLS)


def test_a_cell_switches_in_where_its_variant_takes_over_from_another():
    for r in range(4):
        order = rounds.schedule(CELLS, r, _baseline)
        got = [pos for pos in range(len(order)) if rounds.switches_in(order, pos)]
        expected = [0] + [i for i in range(1, len(order)) if order[i][0] != order[i - 1][0]]
        assert got == expected
    assert [p for p in range(len(CELLS)) if rounds.switches_in(rounds.schedule(CELLS, 0, _baseline), p)] == \
        [0, 3, 6, 9, 11, 13, 15]  # round 0 (listed above): eager, vllm, hf-generate; then the prefill group's four


def test_the_sweep_asks_a_lead_in_for_each_cell_that_switches_in_and_records_it(tmp_path):
    from benchmarks.sweep import Sweep
    cells = [("eager", "prefill"), ("eager", "capture_all"), ("vllm", "prefill"), ("vllm", "capture_all")]
    s = Sweep(Params(rounds=6), "t", ["eager", "vllm"], ["prefill", "capture_all"], tmp_path, log=lambda *_: None)
    s.prepared = {c: {"samples": []} for c in cells}
    s.workers = {"eager": object(), "vllm": object()}
    asked = []

    def ask(v, w, req):
        asked.append((v, w, req["lead_in"]))
        return {"seconds": 0.1, "cpu_s": 0.1, "min_seconds": 0.1, "min_cpu_s": 0.1, "k": 1, "load1": 0.0, "t": 0.0}
    s._ask = ask
    s.run_rounds(cells)
    assert asked[:4] == [("eager", "prefill", True), ("eager", "capture_all", False),
                         ("vllm", "prefill", True), ("vllm", "capture_all", False)]
    assert len(asked) == 6 * 4
    assert asked[4:8] == [("vllm", "capture_all", True), ("vllm", "prefill", False),
                         ("eager", "capture_all", True), ("eager", "prefill", False)]  # round 1: rotated
    assert [x["lead_in"] for x in s.prepared[("eager", "prefill")]["samples"]] == [True, False] * 3


def test_the_two_sides_of_every_reported_ratio_share_a_group():
    from benchmarks.workloads import NAMES
    variants = ["eager", "vllm", "vllm-static", "vllm-generate", "hf-generate", "transformerlens", "nnsight",
                "interp-engine"]
    for spec in R.all_specs(variants, list(NAMES)):
        assert _baseline(spec.num[1]) == _baseline(spec.den[1]), spec.key


# -- the interval over rounds -------------------------------------------------------------------------
@pytest.mark.parametrize("n, k, coverage", [(6, 1, 1 - 2 / 64), (8, 1, 1 - 2 / 256), (9, 2, 1 - 2 * 10 / 512),
                                            (12, 3, 1 - 2 * 79 / 4096), (20, 6, 1 - 2 * 21700 / 2 ** 20)])
def test_order_statistic_ranks_are_the_widest_that_reach_95_percent(n, k, coverage):
    got_k, got_cov = ci.order_ranks(n, 0.95)
    assert (got_k, got_cov) == (k, pytest.approx(coverage))
    assert got_cov >= 0.95
    if k + 1 <= n // 2:  # one rank further in would fall below the level
        assert 1 - 2 * ci._binom_cdf_half(n, k) < 0.95


def test_five_rounds_cannot_give_a_95_percent_interval():
    with pytest.raises(ValueError, match=r"5 rounds cannot give a 95% interval for a median .* covers 93.8%"):
        ci.order_ranks(5, 0.95)


def test_median_ci_picks_the_order_statistics():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0]  # 1..9 shuffled
    iv = ci.median_ci(xs)
    assert (iv.median, iv.lo, iv.hi, iv.n) == (5.0, 2.0, 8.0, 9)
    assert iv.width == pytest.approx(6 / 5) and not iv.resolved(0.25)
    tight = ci.median_ci([1.0, 1.01, 0.99, 1.02, 0.98, 1.0])
    assert (tight.lo, tight.hi) == (0.98, 1.02) and tight.resolved(0.05)
    with pytest.raises(ValueError, match="finite values"):
        ci.median_ci([1.0, float("nan")] * 3)
    # a ratio is shown with its interval, or as "unresolved" (never a figure) past the bound
    assert ci.ratio_shown(tight) == "1.00x [0.980–1.02]" and ci.ratio_shown(iv) == "unresolved"
    assert ci.ratio_shown(tight, bound=0.01) == "unresolved"


def test_interval_covers_the_median_at_its_stated_rate():
    """Simulated: skewed noise (a shared machine only ever adds time); the interval covers the true
    median at least as often as it says."""
    rng = random.Random(0)
    true_median = 1.0 + 0.3 * 0.6931471805599453  # median of 1 + Exp(mean 0.3)
    trials, hits = 2000, 0
    for _ in range(trials):
        iv = ci.median_ci([1 + rng.expovariate(1 / 0.3) for _ in range(12)])
        hits += iv.lo <= true_median <= iv.hi
    assert hits / trials >= 0.95


# -- ratios paired per round --------------------------------------------------------------------------
def test_pairing_cancels_drift_between_rounds():
    """The machine gets 3x slower over the sweep; both sides of the ratio see it in the same round, so
    the ratio is exact although each side's tok/s spreads over 3x."""
    drift = [1.0 + 0.2 * r for r in range(12)]
    cells = fake_sweep({("eager", "capture_all"): [0.010 * d for d in drift],
                        ("hf-generate", "prefill"): [0.008 * d for d in drift]})
    t = Table(cells)
    assert not t.tok_s("eager", "capture_all").resolved(Params().ci_bound)  # each side alone: unresolved
    res = R.compute(t, R.HEADLINE[0])
    assert res.interval.median == pytest.approx(0.8) and res.interval.width == pytest.approx(0, abs=1e-12)
    assert res.resolved


def test_ratio_uses_only_rounds_both_cells_have():
    spec = R.RatioSpec("steer", ("eager", "steer_all"), ("eager", "decode"))

    def sweep(shift):
        cells = fake_sweep({("eager", "decode"): [0.1] * 12, ("eager", "steer_all"): [0.2] * 12})
        for s in cells[1]["samples"]:
            s["round"] += shift
        return Table(cells)
    res = R.compute(sweep(6), spec)  # rounds 6..11 in common
    assert res.interval.median == pytest.approx(0.5) and res.interval.n == 6 and sorted(res.per_round) == list(
        range(6, 12))
    assert R.compute(sweep(8), spec) is None  # 4 rounds in common: no 95% interval


def test_noisy_ratio_is_unresolved():
    rng = random.Random(3)
    cells = fake_sweep({("eager", "decode"): [0.1 * rng.uniform(0.5, 2.0) for _ in range(12)],
                        ("eager", "steer_all"): [0.1 * rng.uniform(0.5, 2.0) for _ in range(12)]})
    res = R.compute(Table(cells), R.RatioSpec("steer", ("eager", "steer_all"), ("eager", "decode")))
    assert not res.resolved and res.interval.width > Params().ci_bound


def test_invalid_cells_have_no_figure_and_no_ratio():
    cells = fake_sweep({("eager", "decode"): [0.1] * 12})
    cells.append(fake_cell("eager", "steer_all", [0.1] * 12, status="invalid"))
    t = Table(cells)
    assert t.tok_s("eager", "steer_all") is None
    assert R.compute(t, R.RatioSpec("steer", ("eager", "steer_all"), ("eager", "decode"))) is None


def test_cpu_clock_uses_the_fastest_run_in_cpu_seconds():
    c = fake_cell("eager", "decode", [0.1] * 12)
    for s in c["samples"]:
        s["seconds"], s["min_seconds"] = 9.0, 9.0  # waiting for a core: not counted on the cpu clock
    assert Table([c]).tok_s("eager", "decode").median == pytest.approx(16 / 0.1)


def test_all_specs_cover_the_issue_comparisons_once_each():
    specs = R.all_specs(["eager", "vllm", "vllm-static", "vllm-generate", "hf-generate", "transformerlens",
                         "nnsight", "interp-engine"], ["decode", "prefill", "capture_all", "capture_gen", "steer_all"])
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys))
    for want in ("eager:capture_all/hf-generate:prefill", "eager:capture_all/transformerlens:capture_all",
                 "eager:capture_all/nnsight:capture_all", "eager:capture_all/interp-engine:capture_all",
                 "vllm:capture_gen/vllm-generate:decode", "vllm-static:capture_gen/vllm-generate:decode",
                 "eager:steer_all/eager:decode"):
        assert want in keys
    assert not [s for s in specs if s.num == s.den]


# -- refusals to share a table ------------------------------------------------------------------------
def _two(**changes):
    a = fake_cell("eager", "decode", [0.1] * 12)
    b = fake_cell("hf-generate", "decode", [0.1] * 12)
    for path, value in changes.items():
        target = b
        *parents, leaf = path.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return [a, b]


@pytest.mark.parametrize("change, message", [
    ({"env.torch_threads": 2}, "different 'torch_threads' in sweep 'test'"),
    ({"env.hardware": "GPU NVIDIA H200"}, "different 'hardware' in sweep 'test'"),
    ({"env.dtype": "bfloat16"}, "different 'dtype' in sweep 'test'"),
    ({"env.versions": {"torch": "9.9"}}, "different library versions in sweep 'test'"),
    ({"params.threads": 2}, "different 'threads' in sweep 'test'"),
    ({"params.prompt_tokens": 64}, "different 'prompt_tokens' in sweep 'test'"),
    ({"params.size": "real"}, "different 'size' in sweep 'test'"),
    ({"run_id": "20270101T000000Z"}, "different run ids in sweep 'test'.*Ratios pair the rounds of one run"),
    ({"sweep": "other"}, "different sweep names"),
])
def test_table_refuses_cells_that_differ(change, message):
    with pytest.raises(MixedCellsError, match=message):
        Table(_two(**change))


def test_table_refuses_a_timed_cell_without_env():
    cells = _two()
    del cells[1]["env"]
    with pytest.raises(MixedCellsError, match="test/hf-generate__decode has timing samples but no env"):
        Table(cells)


def test_untimed_cells_need_no_env():
    from benchmarks import cells as cellio
    na = cellio.make_cell("test", "hf-generate", "steer", "n/a", "plain HF has no steering API",
                          params=fake_cell("eager", "decode", [0.1] * 6)["params"], run_id="20260101T000000Z")
    assert Table(_two() + [na]).cell("hf-generate", "steer")["status"] == "n/a"


# -- params and formatting -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(rounds=5), "rounds must be >= 6"),
    (dict(threads=2, clock="cpu"), "clock 'cpu' needs threads=1"),
    (dict(device="cuda", clock="cpu"), "would time the host"),
    (dict(source="real", size="real"), "size applies to zoo twins"),
    (dict(dtype="fp8"), "dtype must be one of"),
    (dict(warmups=0), "warmups must be >= 1"),
])
def test_params_refuse_what_cannot_be_measured(kw, message):
    with pytest.raises(ValueError, match=message):
        Params(**kw)


def test_clock_follows_the_device_and_the_variants():
    assert Params(device="cuda", threads=0).clock == "wall"
    assert Params.from_dict(Params(device="cuda").to_dict()).clock == "wall"
    assert Params(threads=2).clock == "wall"  # CPU time would add a multi-threaded worker's threads up
    assert Params().for_variants([]).clock == "cpu"  # eager and peers: one thread each, CPU time is work
    assert Params().for_variants(["vllm"]).clock == "wall"  # one clock for every cell of a sweep with vLLM
    assert Params(clock="wall").for_variants([]).clock == "wall"


def test_cpu_clock_is_refused_for_variants_that_busy_wait():
    from benchmarks.variants import VARIANTS
    waits = [v.name for v in VARIANTS if v.busy_waits]
    assert waits == ["vllm", "vllm-static", "vllm-generate"]
    with pytest.raises(ValueError, match="clock 'cpu' cannot time vllm, vllm-static, vllm-generate: their processes "
                                         "busy-wait"):
        Params(clock="cpu").for_variants(waits)


def test_a_sweep_with_vllm_variants_is_timed_on_the_wall_clock(monkeypatch, tmp_path):
    """run_sweep decides the clock from its variants before any worker starts."""
    from benchmarks import sweep as sweepmod
    seen = {}

    class Stop(Exception):
        pass

    def fake_sweep(params, *a, **k):
        seen["clock"] = params.clock
        raise Stop
    monkeypatch.setattr(sweepmod, "Sweep", fake_sweep)
    for variants, clock in ((["eager", "vllm-generate"], "wall"), (["eager", "hf-generate"], "cpu")):
        with pytest.raises(Stop):
            sweepmod.run_sweep(Params(rounds=6), variants, ["decode"], tmp_path, "t", log=lambda *_: None)
        assert seen["clock"] == clock


def test_sig_agrees_with_python_g_format_and_keeps_plain_notation():
    rng = random.Random(1)
    for _ in range(2000):
        x = rng.choice([-1, 1]) * 10 ** rng.uniform(-5, 7)
        for d in (1, 2, 3, 4, 6):
            text = stats.sig(x, d)
            assert "e" not in text.lower()
            assert float(text) == pytest.approx(float(f"{x:.{d}g}"), rel=1e-12, abs=0), (x, d, text)


def test_formatting_edge_cases():
    assert stats.sig(999.96, 3) == "1000" and stats.sig(0.0012345, 3) == "0.00123" and stats.sig(2.0) == "2.00"
    assert stats.fmt_interval(1.2345, 1.1, 1.41, 3, "x") == "1.23x [1.10–1.41]"
    assert float(stats.full(1 / 3)) == 1 / 3
    with pytest.raises(ValueError, match="digits must be >= 1"):
        stats.sig(1.0, 0)


def test_others_running_reads_the_runnable_count_less_the_reader():
    from benchmarks.env import others_running
    lines = iter(["0.50 0.40 0.30 1/300 99", "3.10 0.40 0.30 3/300 99"])
    assert others_running(samples=2, every_s=0, read=lambda: next(lines)) == 1.0  # (0 + 2) / 2
    assert others_running(samples=1, read=lambda: "garbage") is None
    here = others_running(samples=3, every_s=0)  # the real file parses wherever it exists
    if Path("/proc/loadavg").exists():
        assert here is not None and here >= 0
    else:
        assert here is None


def test_a_sweep_is_not_dirty_because_of_its_own_outputs(tmp_path, monkeypatch):
    """cpu.sh runs two sweeps: the second finds the first's cells changed in reports/, which is not a
    change to what it runs."""
    import subprocess

    from benchmarks import cells, sweep
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    for f in ("reports/x.json", "code.py", "README.md"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("a")
    git("add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    monkeypatch.setattr(cells, "ROOT", tmp_path)
    (tmp_path / "reports/x.json").write_text("b")
    (tmp_path / "README.md").write_text("b")
    assert not sweep.git_commit().endswith("+dirty")
    (tmp_path / "code.py").write_text("b")
    assert sweep.git_commit().endswith("+dirty")
