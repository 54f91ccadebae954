"""benchmarks/profile_hot.py: `summarize` splits py-spy's collapsed stacks per process, leaves waiting
samples out of the busy shares and lists the engine's frames apart; `micro` still drives the engine's
per-site work (engine/core plan, step, site) after a change to their signatures. `run` and `serve`
need py-spy's ptrace rights and a loaded variant: outside the tests."""
from __future__ import annotations

import re

from benchmarks import profile_hot

R = profile_hot.ROOT  # frames under the repository are shortened to repo-relative paths
STACKS = [
    f'process 11:"python -m x";thread (0x1);main ({R}/bench.py:5);run_site ({R}/engine/core/site.py:40) 6',
    f'process 11:"python -m x";thread (0x1);main ({R}/bench.py:9);copy_ (/sp/site-packages/torch/_ops.py:3) 2',
    'process 11:"python -m x";thread (0x1);sched_yield (libc.so:1) 2',
    'process 12:"engine core";thread (0x2);sched_yield (libc.so:1) 5',
    "not a stack line",
]


def _share(block: str, frame: str) -> float:
    m = re.search(rf"^\s+([\d.]+)%\s+{re.escape(frame)}$", block, re.M)
    assert m, f"{frame!r} missing from:\n{block}"
    return float(m.group(1))


def test_summarize_counts_per_process_and_leaves_waiting_out():
    out = profile_hot.summarize(STACKS, top=10)
    first, second = out.split("## ")[1:]
    # process 11: 10 samples, 2 waiting, so shares are of 8 busy samples
    assert first.startswith("python -m x: 10 samples, 20% waiting for work; shares below are of the 8 busy")
    inclusive = first.split("the engine's own frames")[0]
    assert _share(inclusive, "main (bench.py)") == 100.0  # lines merged: both main frames count once each
    assert _share(inclusive, "run_site (engine/core/site.py)") == 75.0
    engine_own = first.split("the engine's own frames, inclusive:")[1].split("self")[0]
    assert _share(engine_own, "run_site (engine/core/site.py)") == 75.0 and "bench.py" not in engine_own
    own = first.split("self (top of the stack):")[1]
    assert _share(own, "copy_ (torch/_ops.py)") == 25.0
    assert second.startswith("engine core: 5 samples, 100% waiting for work; shares below are of the 0 busy")


def test_micro_runs_the_engine_site_work(capsys):
    assert profile_hot.main(["micro", "--width", "8", "--layers", "2", "--steps", "2", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(":")[0].strip() for ln in lines] == ["capture", "steer"]
    for ln in lines:
        ms = float(re.search(r"([\d.]+) ms CPU per step of 1 row\(s\) over 2 sites of width 8", ln).group(1))
        assert ms > 0
