"""benchmarks/remote_cost.py without a server: its arguments are checked before anything starts, and its
table shows each ratio as serve_stats renders it (an interval, unresolved when wide) and the load warning."""
from __future__ import annotations

import pytest

from benchmarks import remote_cost, serve_stats


@pytest.mark.parametrize("argv, fragment", [(["--rounds", "3"], "--rounds must be >= 6"),
                                            (["--calls", "0"], "--calls and --tokens >= 1"),
                                            (["--tokens", "0"], "--calls and --tokens >= 1")])
def test_bad_arguments_stop_before_a_server_starts(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        remote_cost.main(argv)
    assert fragment in capsys.readouterr().err


def test_the_table_shows_the_ratios_per_round_with_their_intervals():
    def rounds(rps):
        return [{"round": i, "rps": x} for i, x in enumerate(rps)]
    client, raw, js = rounds([9.0, 9.1, 8.9, 9.0, 9.2, 9.0, 8.8]), rounds([10.0] * 7), rounds([5.0, 20.0] * 3 + [5.0])
    ratios = {}
    for (n, d, what), (a, b) in zip(remote_cost.RATIOS, [(client, raw), (raw, js)]):
        r = serve_stats.ratio(a, b, "rps")
        ratios[f"{n}/{d}"] = r.to_dict() | {"text": r.text(), "what": what}
    per = {v: {"rps_median": 9.0, "ms_per_call_median": 111.0, "server_cpu_ms_per_call_median": 30.0,
               "client_cpu_ms_per_call_median": 4.0} for v in remote_cost.VARIANTS}
    res = {"model": "m", "source": "zoo", "tokens": 512, "points": ["resid_post"], "rounds": 7, "calls": 2,
           "answer_bytes": {"frame": 3, "json": 4}, "variants": per, "ratios": ratios,
           "load": {"warning": "other work ran"}, "machine": {"cpu": "cpu", "cpus": 2}, "commit": "abc",
           "versions": {"torch": "2"}, "command": "python -m benchmarks.remote_cost"}
    text = remote_cost.table(res)
    assert "| client/raw-frame | 0.900x [" in text  # the median of the per-round ratios, with its interval
    assert "| raw-frame/raw-json | unresolved [" in text  # 0.5x and 2x rounds: too wide to quote
    assert "Warning: other work ran." in text and "commit abc" in text
