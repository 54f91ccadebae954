"""benchmarks/step_cost.py's figures from its samples: the worker's host time split by step (the prefill
step, the first decode step, each later one) from the call and its two short cuts, against the same
arithmetic done by hand here, and a base without the worker's timer shown as n/a with no split."""
from __future__ import annotations

import statistics

import pytest

from benchmarks.step_cost import ARMS, figures, phases, table


def call(seconds: float, steps: int, wall: float = 2.0, hooks: float = 0.0) -> dict:
    """One answer of the measuring process: its wall time, its steps and the host seconds per window."""
    got = {"wall": wall, "steps": steps, "seconds": {"step": seconds}}
    if hooks:
        got["seconds"]["hooks"] = hooks
    return got


def sample(full: float, one: float, two: float, steps: int = 32, hooks: float = 0.0) -> dict:
    got = call(full, steps, hooks=hooks)
    got["short"] = {"1": call(one, 1), "2": call(two, 2)}
    return got


# per round: (the whole call's host seconds, cut at 1 new token, cut at 2)
ROUNDS = [(0.010, 0.003, 0.005), (0.012, 0.004, 0.0055), (0.011, 0.0035, 0.006), (0.0105, 0.003, 0.0052),
          (0.013, 0.005, 0.007), (0.0098, 0.0029, 0.0049), (0.0111, 0.0031, 0.0051)]


def test_phases_split_the_host_time_by_step_as_by_hand():
    got = phases([sample(*r) for r in ROUNDS])
    prefill = statistics.median(one * 1e6 for _, one, _ in ROUNDS)
    first = statistics.median((two - one) * 1e6 for _, one, two in ROUNDS)
    later = statistics.median((full - two) * 1e6 / 30 for full, _, two in ROUNDS)
    assert got["prefill_us"].median == pytest.approx(prefill)
    assert got["first_us"].median == pytest.approx(first)
    assert got["later_us"].median == pytest.approx(later)
    for iv in got.values():  # 7 rounds: the interval is the sorted values' 1st and 7th (sign test, 98.4%)
        assert iv.lo <= iv.median <= iv.hi


def test_phases_count_the_hooks_window_and_the_steps_each_call_ran():
    # eight streams may take more steps: "later" divides by the extra steps of the whole call over the cut at 2
    ss = [sample(0.020, 0.004, 0.006, steps=40, hooks=0.002) for _ in range(6)]
    got = phases(ss)
    assert got["later_us"].median == pytest.approx((0.022 - 0.006) * 1e6 / 38)
    assert got["prefill_us"].median == pytest.approx(4000)


def out_of(sides: dict) -> dict:
    samples = {side: {1: {arm: [sample(*r) if timed else {**call(0, 0), "short": {"1": call(0, 0), "2": call(0, 0)}}
                                for r in ROUNDS] for arm in ARMS}} for side, timed in sides.items()}
    ops = {side: {1: {arm: {"steps": 32, "per_step": [2] * 32, "labels": {"step": 64}} for arm in ARMS}}
           for side in sides}
    return {"backend": "vllm-static", "model": "m", "size": "real", "layers": 30, "streams": [1], "new_tokens": 32,
            "prompt": 32, "rounds": len(ROUNDS), "relaunch": 2, "load": [1.0, 2.0], "samples": samples, "ops": ops}


def test_the_report_splits_timed_arms_and_leaves_a_base_without_the_timer_out():
    out = out_of({"after": True, "before": False})
    rows = {(r["side"], r["arm"]): r for r in figures(out)}
    assert rows[("after", "steer")]["later_us"].median == pytest.approx(
        statistics.median((f - t) * 1e6 / 30 for f, _, t in ROUNDS))
    assert rows[("before", "steer")]["timed"] is False
    text = table(out)
    assert "started afresh every 2" in text
    split = text.split("Where the worker's host us go")[1]
    assert "| after | 1 | steer |" in split and "| before |" not in split  # the base has no timer to split
    assert "| after | 1 | plain |" not in split  # plain runs nothing of ours around the forward
    assert "| before | 1 | steer | " in text.split("Where")[0] and "n/a" in text.split("Where")[0]


def test_samples_from_before_the_split_still_make_a_report():
    # a JSON written before the short calls existed (reports/benchmarks/step-cost/*-vs-249a962e.json)
    out = out_of({"after": True})
    for arm in ARMS:
        for s in out["samples"]["after"][1][arm]:
            del s["short"]
    assert "Where the worker's host us go" not in table(out)
    assert all("later_us" not in r for r in figures(out))


class FakeSide:
    """A measuring process that records what it is asked and answers like step_cost's child."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def ask(self, **cmd) -> dict:
        self.log.append((self.name, cmd.get("arm"), cmd.get("streams"), cmd.get("new")))
        return {"wall": 1.0, "steps": cmd.get("new", 32), "seconds": {"step": 0.001}, "tokens": [[1]]}


def test_a_round_leads_each_side_in_with_an_untimed_call_then_rotates_the_arms():
    from benchmarks.step_cost import one_round
    log: list = []
    sides = [FakeSide("after", log), FakeSide("before", log)]
    samples = {s.name: {k: {arm: [] for arm in ARMS} for k in (1, 8)} for s in sides}
    one_round(sides, 1, [1, 8], samples)
    per_side = 1 + 2 * len(ARMS) * 3  # the lead-in, then each stream count's arms, each with its two short cuts
    assert len(log) == 2 * per_side
    assert log[0] == ("after", "plain", 1, None) and log[per_side] == ("before", "plain", 1, None)
    timed = [x for x in log[1:per_side] if x[3] is None]
    assert [x[1] for x in timed] == list(ARMS[1:] + ARMS[:1]) * 2  # round 1: rotated one place
    assert log[2:4] == [("after", "capture", 1, 1), ("after", "capture", 1, 2)]  # each call's short cuts follow it
    for side in samples.values():  # the lead-in is not a sample
        assert all(len(v) == 1 for by_arm in side.values() for v in by_arm.values())
    assert samples["after"][8]["steer"][0]["short"]["2"]["steps"] == 2


@pytest.mark.parametrize("new", ["1", "2"])
def test_too_few_new_tokens_to_split_are_refused_before_anything_starts(new, capsys):
    from benchmarks.step_cost import main
    with pytest.raises(SystemExit) as e:
        main(["--new-tokens", new, "--rounds", "6"])
    assert e.value.code == 2
    assert f"--new-tokens must be more than 2, got {new}" in capsys.readouterr().err


def with_call_windows(out: dict, register: float, collect: float, arm_extra: dict) -> dict:
    """Give every timed sample call windows: `register` and `collect` seconds, plus arm_extra[arm] on collect."""
    for by_k in out["samples"].values():
        for by_arm in by_k.values():
            for arm, ss in by_arm.items():
                for s in ss:
                    if s["steps"]:
                        s["seconds"].update(register=register, collect=collect + arm_extra.get(arm, 0.0))
    return out


def test_the_whole_call_figure_adds_registration_and_collect_to_the_steps_per_token():
    out = with_call_windows(out_of({"after": True}), 0.001, 0.002, {"steer": 0.0032})
    rows = {r["arm"]: r for r in figures(out)}
    # per round: (steps + register + collect) us over 32 tokens; plain and steer share the step samples here,
    # so the steer adds exactly its extra collect: 3200 us / 32 tokens = 100 us a token
    want = statistics.median((full + 0.001 + 0.002) * 1e6 / 32 for full, _, _ in ROUNDS)
    assert rows["plain"]["call_us"].median == pytest.approx(want)
    assert rows["steer"]["added_call_us"].median == pytest.approx(100.0)
    assert rows["capture"]["added_call_us"].median == pytest.approx(0.0)
    assert rows["plain"]["added_call_us"] is None
    # the step figures stay the steps' alone
    assert rows["steer"]["host_us"].median == pytest.approx(statistics.median(f * 1e6 / 32 for f, _, _ in ROUNDS))
    text = table(out).split("whole call |")[1].split("Where")[0]
    assert rows["steer"]["call_us"].median == pytest.approx(want + 100.0)
    (line,) = [x for x in text.splitlines() if x.startswith("| after | 1 | steer |")]
    assert line.endswith("| 100 [100–100] (goal met) |"), line


def test_a_base_without_the_call_windows_shows_no_whole_call_figure():
    out = with_call_windows(out_of({"after": True, "before": True}), 0.001, 0.002, {})
    for s in (s for ss in out["samples"]["before"][1].values() for s in ss):
        s["seconds"] = {"step": s["seconds"]["step"]}
    rows = {(r["side"], r["arm"]): r for r in figures(out)}
    assert rows[("before", "steer")]["call_us"] is None and rows[("after", "steer")]["call_us"] is not None
    text = table(out).split("whole call |")[1].split("Where")[0]
    assert "| after | 1 | steer |" in text and "| before |" not in text
