"""benchmarks/harvest_costs.py, harvest_threads.py and harvest_bench.py: each variant changes what it says and
the change is undone after it, the ratios are the rounds' own, threads are compared by digest, bad arguments
are refused by name, a process's first cell after another process's is led in by an untimed run."""
from __future__ import annotations

import json
import statistics
import threading

import pytest
import torch

from benchmarks import harvest_bench, harvest_costs, harvest_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_costs_variants_change_one_thing_each_and_leave_nothing_behind(tmp_path, monkeypatch, two_threads):
    import engine.harvest.batches as batches
    import engine.harvest.shards as shards
    monkeypatch.setenv("INTERP_ZOO_SIZE", "tiny")
    plain = (shards.write_shard, batches.prefetch, threading.Thread.run)
    out = tmp_path / "costs.json"
    assert harvest_costs.main(["--tokens", "1200", "--rounds", "6", "--variants", "fwd,harvest,no-write,read-inline,spare-1",
                               "--out", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (shards.write_shard, batches.prefetch, threading.Thread.run) == plain
    assert torch.get_num_threads() == 2
    assert res["spared"] == {"fwd": [0], "harvest": [0], "no-write": [0], "read-inline": [0], "spare-1": [1]}
    assert res["threads"] == 2 and res["tokens"] >= 1200 and len(res["rounds"]) == 6
    for name in ("harvest", "no-write", "spare-1"):  # harvests have helper threads; the bare forward has none
        assert res["cpu_s"][name]["writer"] > 0 and res["cpu_s"][name]["reader"] > 0
    assert "writer" not in res["cpu_s"]["fwd"] and "reader" not in res["cpu_s"]["read-inline"]  # read inline
    ratio = res["ratios"]["harvest / fwd"]
    assert ratio["median"] == pytest.approx(statistics.median(r["harvest"]["tok_s"] / r["fwd"]["tok_s"]
                                                              for r in res["rounds"]))
    assert ratio["lo"] <= ratio["median"] <= ratio["hi"]
    assert not list(tmp_path.glob("harvest-costs-*"))  # its corpus and harvests are gone


def test_inline_variants_write_the_same_shards_on_the_calling_thread(tmp_path, monkeypatch):
    """write-inline and serial move the writer's (and reader's) work onto the harvest's own thread; the
    shards are the default harvest's, byte for byte, and the writer is back on its thread afterwards."""
    import engine.harvest.shards as shards
    from engine import load_model
    from engine.harvest import SAMPLE, harvest, read_manifest, verify
    monkeypatch.setenv("INTERP_ZOO_SIZE", "tiny")
    m = load_model("meta-llama/Llama-3.2-1B")
    spy, where = shards.write_shard, []

    def recorded(*a, **kw):
        where.append(threading.current_thread().name)
        return spy(*a, **kw)

    monkeypatch.setattr(shards, "write_shard", recorded)
    digests = {}
    for name in ("harvest", "write-inline", "serial"):
        where.clear()
        with harvest_costs.applied(harvest_costs.VARIANTS[name]):
            harvest(m, "resid_post.0", SAMPLE, tmp_path / name, shard_tokens=256, progress=False)
        assert where and set(where) == {"harvest-writer" if name == "harvest" else threading.current_thread().name}
        assert verify(tmp_path / name) == []
        digests[name] = [s["sha256"] for s in read_manifest(tmp_path / name)["shards"]]
    assert len(digests["harvest"]) > 1 and digests["write-inline"] == digests["serial"] == digests["harvest"]
    assert shards.ShardWriter.submit is not harvest_costs._written_now


@pytest.mark.parametrize("args, message", [
    (["--rounds", "5"], "--rounds must be at least 6"),
    (["--variants", "fwd,nope"], "unknown variant(s) ['nope']"),
])
def test_costs_refuses_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        harvest_costs.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_threads_compares_the_shards_of_every_thread_count(tmp_path, monkeypatch, two_threads):
    monkeypatch.setenv("INTERP_ZOO_SIZE", "tiny")
    out = tmp_path / "threads.json"
    code = harvest_threads.main(["--tokens", "900", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["threads"] == [1, 2] and torch.get_num_threads() == 2
    one, two = res["digests"]["1"], res["digests"]["2"]
    assert len(one) == len(two) >= 1 and all(len(d) == 64 for d in one + two)
    assert res["same"] == (one == two) and code == (0 if res["same"] else 1)


def test_vllm_costs_refuses_bad_arguments(capsys):
    from benchmarks import harvest_vllm_costs
    with pytest.raises(SystemExit):
        harvest_vllm_costs.main(["--rounds", "5"])
    assert "--rounds must be at least 6" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_costs_steps_and_differences_are_the_rounds_own(tmp_path, monkeypatch):
    """One hooked engine runs every step each round; each difference is the median of the rounds' own
    differences, inside its interval; every step forwarded the corpus (the harvest checks its rows)."""
    pytest.importorskip("vllm")
    from benchmarks import harvest_vllm_costs
    monkeypatch.setenv("INTERP_ZOO_SIZE", "tiny")
    out = tmp_path / "costs.json"
    assert harvest_vllm_costs.main(["--tokens", "1500", "--rounds", "6", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["point"] == "resid_post.1"  # the middle of the tiny twin's two layers, as the bench's vllm-one
    assert len(res["rounds"]) == 6 and all(set(r) == set(harvest_vllm_costs.STEPS) for r in res["rounds"])
    assert all(v > 0 for r in res["rounds"] for v in r.values())
    for x, y in harvest_vllm_costs.DIFFERENCES:
        d = res["differences"][f"{x} - {y}"]
        assert d["median"] == pytest.approx(statistics.median(r[x] - r[y] for r in res["rounds"]))
        assert d["lo"] <= d["median"] <= d["hi"]


def test_device_script_asks_only_for_variants_harvest_costs_has():
    """benchmarks/device_harvest.sh runs on a lent machine with minutes to spare: a variant the tool
    no longer has (its `spare` part still asked for `no-spare`) would spend them on an argparse error."""
    import re
    from pathlib import Path
    script = (Path(__file__).resolve().parent.parent / "benchmarks" / "device_harvest.sh").read_text()
    asked = re.findall(r"harvest_costs\.py[^;]*?--variants ([\w,-]+)", script, re.S)
    assert len(asked) == 4
    assert [v for names in asked for v in names.split(",") if v not in harvest_costs.VARIANTS] == []


def test_harvest_bench_leads_in_each_process_that_switches_in_and_keeps_the_timed_run():
    calls: list[str] = []

    def run(cell: str) -> dict:  # each call's own number: the sample must be the second of a led-in pair
        calls.append(cell)
        return {"tok_s": float(len(calls))}

    cells = ["prefill", "vllm-one", "vllm-all", "eager-one"]  # vllm-one and vllm-all share the "vllm" process
    first = harvest_bench.one_round(cells, 0, run)
    assert calls == ["prefill", "prefill", "vllm-one", "vllm-one", "vllm-all", "eager-one", "eager-one"]
    assert list(first) == cells
    assert {c: (r["tok_s"], r["lead_in"]) for c, r in first.items()} == {
        "prefill": (2.0, True), "vllm-one": (4.0, True), "vllm-all": (5.0, False), "eager-one": (7.0, True)}
    calls.clear()
    second = harvest_bench.one_round(cells, 1, run)  # rotated a place: vllm-all now follows vllm-one still
    assert calls == ["vllm-one", "vllm-one", "vllm-all", "eager-one", "eager-one", "prefill", "prefill"]
    assert [c for c, r in second.items() if r["lead_in"]] == ["vllm-one", "eager-one", "prefill"]
    calls.clear()
    third = harvest_bench.one_round(cells, 2, run)  # the two vllm cells apart: each leads its process in
    assert calls == ["vllm-all", "vllm-all", "eager-one", "eager-one", "prefill", "prefill", "vllm-one", "vllm-one"]
    assert all(r["lead_in"] for r in third.values())
