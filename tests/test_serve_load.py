"""The server benchmark's statistics (benchmarks/serve_stats.py) and its report: ratios paired per
round, the median and its 95% interval checked against an order statistic computed here from the
binomial, the unresolved rule at the bound, and the other-work warning. No servers start."""
from __future__ import annotations

import math
import random
import statistics
from argparse import Namespace

import pytest

from benchmarks import serve_load, serve_stats
from benchmarks.stats import sig


def _samples(values: list[float], key: str = "rps", rounds=None) -> list[dict]:
    return [{"round": r, key: v} for r, v in zip(rounds or range(len(values)), values)]


def _k(n: int, level: float = 0.95) -> int:
    """The largest k with P(x_(k) <= median <= x_(n-k+1)) >= level, from the binomial directly."""
    best = 0
    for k in range(1, n // 2 + 1):
        miss = sum(math.comb(n, i) for i in range(k)) / 2 ** n  # P(B <= k-1)
        if 1 - 2 * miss >= level:
            best = k
    return best


@pytest.mark.parametrize("n", [6, 9, 12])
def test_ratio_is_the_median_of_per_round_ratios_with_an_order_statistic_interval(n):
    rng = random.Random(n)
    num = [rng.uniform(20, 40) for _ in range(n)]
    den = [rng.uniform(20, 40) for _ in range(n)]
    r = serve_stats.ratio(_samples(num), _samples(den), "rps")
    per = sorted(a / b for a, b in zip(num, den))
    k = _k(n)
    assert r.interval.median == pytest.approx(statistics.median(per))
    assert (r.interval.lo, r.interval.hi) == (pytest.approx(per[k - 1]), pytest.approx(per[n - k]))
    assert r.interval.n == n and r.per_round == {i: pytest.approx(a / b) for i, (a, b) in enumerate(zip(num, den))}


def test_ratio_pairs_samples_by_round_not_by_list_order():
    num = _samples([10, 20, 30, 40, 50, 60, 70], rounds=[6, 5, 4, 3, 2, 1, 0])  # reversed order
    den = _samples([1, 2, 3, 4, 5, 6], rounds=[0, 1, 2, 3, 4, 5])  # round 6 missing
    r = serve_stats.ratio(num, den, "rps")
    assert r.per_round == {0: 70 / 1, 1: 60 / 2, 2: 50 / 3, 3: 40 / 4, 4: 30 / 5, 5: 20 / 6}
    assert r.interval.n == 6


def test_fewer_paired_rounds_than_an_interval_needs_give_no_figure():
    r = serve_stats.ratio(_samples([1.0] * 5), _samples([1.0] * 5), "rps")
    assert r.interval is None and not r.resolved
    assert r.text().startswith("n/a (5 paired rounds") and "needs 6" in r.text()


def _with_width(width: float, n: int = 6) -> list[float]:
    """Per-round ratios around 1 whose [min, max] (the 95% interval at n=6) spans `width` of the median."""
    lo, hi = 1 - width / 2, 1 + width / 2
    return [lo, 0.99, 1.0, 1.0, 1.01, hi][:n]


@pytest.mark.parametrize("width", [0.20, 0.249, 0.251, 0.40])
def test_unresolved_when_the_interval_spans_more_than_the_bound(width):
    per = _with_width(width)
    r = serve_stats.ratio(_samples(per), _samples([1.0] * 6), "rps")
    measured = (max(per) - min(per)) / statistics.median(per)
    assert r.interval.width == pytest.approx(measured)
    text = r.text()
    if measured > serve_stats.BOUND:
        # never a single figure: only the interval's two ends
        assert not r.resolved and text == f"unresolved [{sig(min(per))}–{sig(max(per))}]"
    else:
        assert r.resolved and text == f"{sig(statistics.median(per))}x [{sig(min(per))}–{sig(max(per))}]"


def test_other_work_is_machine_busy_less_ours_per_wall_second():
    assert serve_stats.OtherWork.of(machine_s=3.0, ours_s=1.0, wall_s=4.0).cores == pytest.approx(0.5)
    # tick rounding can make ours exceed the machine's count by a tick: never negative
    assert serve_stats.OtherWork.of(machine_s=1.0, ours_s=1.01, wall_s=2.0).cores == 0.0


def test_machine_busy_counts_every_busy_field_and_leaves_idle_and_iowait_out():
    import os
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = 500, 7, 300, 9000, 40, 3, 11, 2
    line = f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert serve_stats.machine_busy(read=lambda: line) == pytest.approx(
        (user + nice + system + irq + softirq + steal) / tick)
    assert serve_stats.machine_busy() > 0  # the real /proc/stat parses


def test_load_summary_warns_only_when_other_work_ran():
    quiet = serve_stats.load_summary([0.0, 0.05, 0.3, 0.1], 2)
    assert quiet["quiet"] and quiet["warning"] is None and quiet["median"] == pytest.approx(0.075)
    busy_cores = [0.9, 1.2, 0.1, 1.5, 0.8]
    busy = serve_stats.load_summary(busy_cores, 2)
    assert not busy["quiet"] and busy["max"] == 1.5
    assert f"{statistics.median(busy_cores):.2f} cores busy" in busy["warning"] and "max 1.50" in busy["warning"]
    assert serve_stats.load_summary([], 2)["quiet"] is None
    one_busy = [0.02, 0.05, 1.1, 0.03, 0.04]  # a quiet median, but one cell shared its cores
    s = serve_stats.load_summary(one_busy, 2)
    assert statistics.median(one_busy) <= serve_stats.QUIET_CORES and not s["quiet"] and s["busy_cells"] == 1
    assert "in 1 of 5 cells" in s["warning"]


def _results(rng: random.Random, rounds: int, other: float, conc=(8,)) -> dict:
    res: dict = {}
    for c in conc:
        for name, _, _ in serve_load.VARIANTS:
            res[(c, name)] = [{"round": r, "rps": rng.uniform(10, 30), "cpu_ms_per_request": rng.uniform(20, 40),
                               "latency_s": [rng.uniform(0.1, 0.3) for _ in range(4)], "other_cores": other,
                               "errors": 0, "n": 4} for r in range(rounds)]
    res["idle_cpu"] = {"settle_s": 10.0, "window_s": 5.0, "windows": {"stock": [0.01] * 3, "ours": [0.02] * 3},
                       "other_cores": [0.0] * 3, "stock": 0.01, "ours": 0.02}
    return res


_ARGS = Namespace(model="HuggingFaceTB/SmolLM2-135M", max_model_len=256, max_num_seqs=32, max_tokens=16,
                  concurrency=[8])
_ENV = {"command": "python -m benchmarks.serve_load", "commit": "abc", "cpu": "AMD", "cores": 2, "load": "0.1",
        "size": "real"}


def test_report_rows_are_the_computed_ratios_and_unresolved_ones_show_no_figure():
    res = _results(random.Random(3), 6, other=0.0)
    text = serve_load.report(_ARGS, res, [], _ENV)
    assert "Warning" not in text
    for name, (num, den, key) in {"ours / stock": ("ours", "stock vllm serve", "rps"),
                                  "ours + capture / ours": ("ours + capture", "ours", "rps"),
                                  "CPU ours / stock": ("ours", "stock vllm serve", "cpu_ms_per_request")}.items():
        per = sorted(a[key] / b[key] for a, b in zip(res[(8, num)], res[(8, den)]))
        med = statistics.median(per)
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| 8 | {name} |"))
        if (per[-1] - per[0]) / med > 0.25:
            assert f"| unresolved [{sig(per[0])}–{sig(per[-1])}] |" in row and f"{sig(med)}x" not in row
        else:
            assert f"| {sig(med)}x [{sig(per[0])}–{sig(per[-1])}] |" in row


def test_report_warns_when_other_work_ran_and_states_the_cores():
    text = serve_load.report(_ARGS, _results(random.Random(4), 6, other=1.1), [], _ENV)
    assert text.splitlines()[2].startswith("**Warning: other work ran") and "1.10 cores busy" in text


def test_too_few_rounds_are_refused_at_the_command_line(capsys):
    with pytest.raises(SystemExit):
        serve_load.main(["--rounds", "3"])
    assert "needs at least 6 rounds" in capsys.readouterr().err


# -- benchmarks/serve_hostile.py: the report of normal clients beside hostile ones (issue 50) --------------
def _hostile(rng: random.Random, rounds: int, other: float) -> dict:
    from benchmarks import serve_hostile
    res: dict = {}
    for c in serve_hostile.CELLS:
        res[c] = []
        for r in range(rounds):
            lat = [rng.uniform(0.05, 0.2) for _ in range(40)]
            res[c].append({"round": r, "latency_s": lat, "p50": statistics.median(lat), "p99": max(lat),
                           "rps": rng.uniform(50, 90), "errors": 0, "health_max_s": 0.05, "other_cores": other,
                           "metrics": {'interp_connections_timed_out_total{phase="headers"}': 3.0}})
    base = {"server": 700.0, "VLLM::EngineCor": 720.0, "VLLM::Worker": 760.0}
    res["baseline_rss"] = base
    res["rss_samples"] = [{"t": 0.0, "phase": c, **{k: v + 10 for k, v in base.items()}} for c in serve_hostile.CELLS]
    res["bursts"] = [{"burst": 0, "after_storm": {k: v + 5 for k, v in base.items()},
                      "after_stalled": {**base, "VLLM::Worker": 900.0}}]
    res["attack_opened"] = {"idle": 400, "loris": 600, "reader": 8}
    return res


_HOSTILE_ARGS = Namespace(model="meta-llama/Llama-3.2-1B", size="tiny", backend="vllm", max_model_len=256, stall=30.0,
                          concurrency=8, requests=40, held=400, loris=600, slow_readers=8, rounds=6, settle=8.0,
                          long_tokens=200, attack_lead=8.0, queued=16)


def test_hostile_report_rows_are_the_per_round_p99_ratios_and_memory_is_shown_against_the_baseline():
    from benchmarks import serve_hostile
    res = _hostile(random.Random(5), 6, other=0.0)
    stop = {"exit_s": 7.5, "exit_status": 0, "answers": {"200": 10, "503": 6}, "grace_s": 5.0}
    text = serve_hostile.report(_HOSTILE_ARGS, res, stop, {**_ENV, "command": "python -m benchmarks.serve_hostile"})
    assert "Warning" not in text
    per = sorted(d["p99"] / u["p99"] for d, u in zip(res["disturbed"], res["undisturbed"]))
    med = statistics.median(per)
    row = next(ln for ln in text.splitlines() if ln.startswith("| p99 disturbed / undisturbed |"))
    if (per[-1] - per[0]) / med > 0.25:
        assert f"| unresolved [{sig(per[0])}–{sig(per[-1])}] |" in row
    else:
        assert f"| {sig(med)}x [{sig(per[0])}–{sig(per[-1])}] |" in row
    assert "| 0 | 2195 (+15) | 2320 (+140) | 700 (+0) | 720 (+0) | 900 (+140) |" in text
    assert "the process exited 7.5 s later with status 0; the requests got 200: 10, 503: 6." in text
    assert "SIGTERM with 16 requests of 200 tokens" in text
    assert "| disturbed |" in text and "| 0 / 18 / 0 |" in text  # 6 rounds of 3 header timeouts each


def test_hostile_report_warns_when_other_work_ran_and_refuses_too_few_rounds(capsys):
    from benchmarks import serve_hostile
    text = serve_hostile.report(_HOSTILE_ARGS, _hostile(random.Random(6), 6, other=1.2), {}, _ENV)
    assert text.splitlines()[2].startswith("**Warning: other work ran") and "the server and the client" in text
    with pytest.raises(SystemExit):
        serve_hostile.main(["--rounds", "3"])
    assert "needs at least 6 rounds" in capsys.readouterr().err
