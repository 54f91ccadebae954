"""benchmarks/versus.py: the engine at two commits, side by side. The table is checked against ratios
worked out by hand from synthetic rounds; bad input is refused by name; and (slow) a whole run of this
checkout against its own HEAD measures every workload on both sides, and the vLLM backend's measuring
process times the generation workloads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import versus


def _round(scale_base: float, scale_head: float) -> dict:
    """Seconds per workload: the head side is `scale_head` times as fast as a unit, the base `scale_base`."""
    unit = {"forward": 0.01, "capture": 0.02, "generate": 0.1, "capture_gen": 0.125, "steer_gen": 0.2,
            "readout_gen": 0.25}
    return {"base": {w: s / scale_base for w, s in unit.items()}, "head": {w: s / scale_head for w, s in unit.items()}}


def test_the_table_gives_tokens_per_second_and_head_over_base_per_round():
    rounds = [_round(1.0, f) for f in (1.9, 2.0, 2.0, 2.1, 2.0, 2.05)]
    table, data = versus.report(rounds, "old", "new", prompt=32, new_tokens=16)
    steer = data["workloads"]["steer_gen"]
    assert steer["base_tok_s"] == [16 / 0.2] * 6  # 16 new tokens in 0.2 s
    assert steer["head_over_base"]["median"] == pytest.approx(2.0)
    assert steer["head_over_base"]["lo"] == pytest.approx(1.9) and steer["head_over_base"]["hi"] == pytest.approx(2.1)
    assert data["workloads"]["forward"]["head_tok_s"][0] == pytest.approx(32 / 0.01 * 1.9)  # the prompt's tokens
    assert "| generation with a vector added to resid_post at every layer | 80 | 160 | 2.00x [1.90–2.10] |" in table
    # own ratios: steer 0.2 s against generate 0.1 s is 0.5x on both sides, readout 0.25 s against capture 0.125 s
    assert data["own"]["steer every layer / no steer"]["head"]["median"] == pytest.approx(0.5)
    assert "| SAE top-k readout / raw capture, during generation | 0.500x [0.500–0.500] | 0.500x [0.500–0.500] |" in table


def test_a_ratio_whose_interval_is_wide_is_unresolved():
    rounds = [_round(1.0, f) for f in (1.0, 2.0, 1.5, 1.2, 1.8, 1.4)]  # head / base from 1.0 to 2.0: median 1.45
    table, _ = versus.report(rounds, "old", "new", prompt=32, new_tokens=16)
    assert "| generation, nothing asked | 160 | 232 | unresolved |" in table


def test_a_vllm_table_has_the_generation_workloads_and_every_own_ratio():
    """vLLM has no bare forward: its rounds carry the generation workloads only, and the table leaves the
    forward rows out rather than failing on them."""
    rounds = [_round(1.0, f) for f in (1.9, 2.0, 2.0, 2.1, 2.0, 2.05)]
    for r in rounds:
        for side in r.values():
            for w in versus.FORWARDS:
                del side[w]
    table, data = versus.report(rounds, "old", "new", prompt=32, new_tokens=16)
    assert set(data["workloads"]) == set(versus.WORKLOADS) - set(versus.FORWARDS)
    assert "one forward" not in table
    assert data["own"]["steer every layer / no steer"]["base"]["median"] == pytest.approx(0.5)


def test_an_unknown_backend_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        versus.main(["--base", "HEAD", "--backend", "vllm-generate"])
    err = capsys.readouterr().err
    assert "--backend" in err and "vllm-generate" in err and "vllm-static" in err


def test_too_few_rounds_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        versus.main(["--base", "HEAD", "--rounds", "3"])
    assert "--rounds 3: a 95% interval for a median needs at least 6 rounds" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--reps", "--prompt", "--new-tokens"])
def test_a_count_below_one_is_refused_by_name_before_anything_runs(flag, capsys):
    with pytest.raises(SystemExit):
        versus.main(["--base", "HEAD", flag, "0"])
    assert f"{flag} 0: must be at least 1" in capsys.readouterr().err


def test_a_revision_that_does_not_exist_fails_before_anything_runs():
    p = subprocess.run([sys.executable, "benchmarks/versus.py", "--base", "no-such-rev-xyz", "--rounds", "6"],
                       capture_output=True, text=True, env={"PYTHONPATH": ".", "PATH": "/usr/bin:/bin"})
    assert p.returncode != 0 and "no-such-rev-xyz" in p.stderr


def test_a_killed_run_removes_its_worktrees():
    """SIGTERM as soon as a worktree is registered (while `git worktree add` may still be checking it out)
    and later, while a round runs: the run unwinds, deregisters its worktrees and removes its folder (old
    code died at once and left them in `git worktree list`; a first fix killed git mid-checkout, whose
    own child then rewrote the removed folder)."""
    import glob
    import os
    import signal
    import tempfile
    import time

    def ours() -> list[str]:
        out = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout
        return [ln for ln in out.splitlines() if "/versus-" in ln]
    def folders() -> set[str]:
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "versus-*", "")))
    before, had = ours(), folders()
    for wait in (0.0, 2.0):
        p = subprocess.Popen([sys.executable, "benchmarks/versus.py", "--base", "HEAD", "--rounds", "6"],
                             env={**os.environ, "PYTHONPATH": "."}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while len(ours()) == len(before) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.02)
        assert len(ours()) > len(before), "the run never checked out its base"
        time.sleep(wait)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM, wait
        time.sleep(0.5)  # anything still writing would have recreated the folder by now
        assert ours() == before and folders() == had, wait


@pytest.mark.slow
def test_this_tree_against_its_head_measures_every_workload_on_both_sides(tmp_path):
    out = tmp_path / "v.json"
    p = subprocess.run([sys.executable, "benchmarks/versus.py", "--base", "HEAD", "--rounds", "6", "--reps", "1",
                        "--new-tokens", "4", "--json", str(out)], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": "."}, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 6
    for r in data["rounds"]:
        for side in ("base", "head"):
            assert set(r[side]) == set(versus.WORKLOADS) and all(s > 0 for s in r[side].values())
    assert "| workload | HEAD tok/s | . tok/s | . / HEAD |" in p.stdout
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert p.stdout.startswith(f"base HEAD = {head}, head . = {head}") and "6 rounds x 1 reps" in p.stdout
    assert data["caption"] == p.stdout.split("\n")[0]
    assert not subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout.count("versus-")


@pytest.mark.slow
@pytest.mark.vllm
def test_the_vllm_side_times_the_generation_workloads():
    """The measuring process's own function on the vLLM backend: one load, every generation workload timed,
    the engine closed afterwards."""
    out = versus.measure("meta-llama/Llama-3.2-1B", "tiny", prompt=8, new_tokens=2, reps=1, backend="vllm")
    assert set(out) == set(versus.WORKLOADS) - set(versus.FORWARDS) and all(s > 0 for s in out.values())


def test_cpu_seconds_leave_out_what_the_wall_clock_counts_while_the_process_waits(monkeypatch):
    """--clock cpu: a run that waits (here: sleeps, as a process waiting for a core does) costs its wall
    time on the wall clock and almost nothing in CPU seconds."""
    import time

    import torch

    class Waits:
        d_model, n_layers, dtype = 8, 2, torch.float32

        def run_with_cache(self, *a, **k):
            time.sleep(0.05)

        generate = run_with_cache

    monkeypatch.setattr(versus, "_load", lambda *a: (Waits(), {}))
    wall = versus.measure("m", "tiny", prompt=4, new_tokens=2, reps=1, clock="wall")
    cpu = versus.measure("m", "tiny", prompt=4, new_tokens=2, reps=1, clock="cpu")
    assert set(wall) == set(cpu) == set(versus.WORKLOADS)
    assert min(wall.values()) >= 0.05 and max(cpu.values()) < 0.02


def test_cpu_seconds_on_a_vllm_backend_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        versus.main(["--base", "HEAD", "--backend", "vllm", "--clock", "cpu"])
    assert "--clock cpu with --backend vllm: vLLM runs the forward in its own processes" in capsys.readouterr().err
