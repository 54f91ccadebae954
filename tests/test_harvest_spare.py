"""spare_threads: an eager CPU harvest can leave intra-op threads to its reader and writer. The forward
really runs on fewer threads and the caller's count comes back, the rows are the forward's, the option
is part of the harvest's identity (a resume with another value is refused), bad values and backends
where it means nothing are refused by name, and the summary says when it would likely have paid."""
from __future__ import annotations

import pytest
import torch

from engine.harvest import SAMPLE, MixingError, capture, harvest, read_manifest
from engine.harvest import __main__ as cli
from engine.harvest.priority import forward_threads, spare_pays
from engine.harvest.runner import Summary
from engine.loading import load_model

LLAMA = "meta-llama/Llama-3.2-1B"
KW = dict(shard_tokens=100, context=32, batch_tokens=128, progress=False)


@pytest.fixture
def two_threads():
    """Torch on 2 intra-op threads for the test (a 1-core runner still lowers 2 -> 1), then as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_model(LLAMA, source="zoo")


@pytest.fixture
def data():
    return SAMPLE  # the bundled sample: 60 documents


def test_forward_threads_lowers_for_the_block_and_restores_even_after_an_error(two_threads):
    with forward_threads(1) as spared:
        assert (spared, torch.get_num_threads()) == (1, 1)
    assert torch.get_num_threads() == 2
    with forward_threads(5) as spared:  # one thread at least stays with the forward
        assert (spared, torch.get_num_threads()) == (1, 1)
    with pytest.raises(RuntimeError, match="boom"), forward_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    with forward_threads(0) as spared:
        assert (spared, torch.get_num_threads()) == (0, 2)


@pytest.mark.parametrize("helper_s, forward_s, threads, pays", [
    (0.24, 1.69, 16, True),  # the 16-core tiny twin (docs/harvest.md): 0.24 x 16 = 3.8 s > 1.69 s
    (0.12, 1.45, 2, False),  # the 2-core tiny twin: 0.24 s < 1.45 s
    (0.09, 7.7, 16, False),  # the real-size twin on 16 cores: 1.4 s < 7.7 s
    (5.0, 1.0, 1, False),  # one thread: nothing to spare
    (0.5, 0.0, 8, False),  # no forward measured
])
def test_spare_pays_when_helper_cpu_outweighs_one_threads_share(helper_s, forward_s, threads, pays):
    assert spare_pays(helper_s, forward_s, threads) is pays
    s = Summary(SAMPLE, (0, 1), "written", forward_s=forward_s, threads=threads, helper_cpu_s=helper_s)
    assert s.spare_would_pay is pays
    assert Summary(SAMPLE, (0, 1), "written", forward_s=forward_s, threads=threads, helper_cpu_s=helper_s,
                   spared_threads=1).spare_would_pay is False  # already spared
    if pays:
        assert s.spare_advice == (f"the reader and writer used {helper_s:.2f} CPU s beside {forward_s:.2f} s of "
                                  f"forward on {threads} threads, and each of their seconds stalls the whole "
                                  f"forward: spare_threads=1 (--spare-threads 1) would likely be faster")
    else:
        assert s.spare_advice == ""


def test_harvest_forward_runs_on_fewer_threads_and_the_rows_are_its_own(model, data, tmp_path, two_threads,
                                                                          monkeypatch):
    seen = []
    plain = capture.forward

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return plain(*args, **kw)
    monkeypatch.setattr(capture, "forward", spy)
    s = harvest(model, "resid_post.1", data, tmp_path / "spare", spare_threads=1, **KW)
    assert set(seen) == {1} and (s.spared_threads, s.threads) == (1, 1)
    assert torch.get_num_threads() == 2  # the caller's count is back
    assert s.writer.shards > 0 and 0 < s.writer.cpu.seconds < s.helper_cpu_s  # the writer's part and the reader's
    seen.clear()
    s0 = harvest(model, "resid_post.1", data, tmp_path / "all", **KW)
    assert set(seen) == {2} and (s0.spared_threads, s0.threads) == (0, 2)
    held, ref = read_manifest(tmp_path / "spare"), read_manifest(tmp_path / "all")
    assert held["identity"]["spare_threads"] == 1 and "spare_threads" not in ref["identity"]
    from engine.harvest import HarvestDataset
    a, b = HarvestDataset(tmp_path / "spare"), HarvestDataset(tmp_path / "all")
    assert len(a) == len(b) == held["rows"]
    for i in range(0, len(a), 7):  # the same rows, up to the last bits a thread count may change
        ra, rb = a[i], b[i]
        assert torch.equal(ra["token_ids"], rb["token_ids"]) and torch.equal(ra["position"], rb["position"])
        torch.testing.assert_close(ra["resid_post.1"], rb["resid_post.1"], rtol=1e-5, atol=1e-5)


def test_an_interrupted_harvest_gives_the_threads_back(model, data, tmp_path, two_threads, monkeypatch):
    calls = []
    plain = capture.forward

    def interrupted(*args, **kw):
        calls.append(torch.get_num_threads())
        if len(calls) == 2:
            raise KeyboardInterrupt  # a Ctrl-C in the middle of the forward loop
        return plain(*args, **kw)
    monkeypatch.setattr(capture, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        harvest(model, "resid_post.1", data, tmp_path / "o", spare_threads=10**9, **KW)
    assert calls == [1, 1] and torch.get_num_threads() == 2  # a huge spare keeps one thread; all come back


def test_a_resume_with_another_spare_is_refused(model, data, tmp_path):
    harvest(model, "resid_post.1", data, tmp_path / "o", spare_threads=1, **KW)
    with pytest.raises(MixingError, match="spare_threads: held 1, asked None"):
        harvest(model, "resid_post.1", data, tmp_path / "o", **KW)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1", None])
def test_bad_spare_values_are_refused(model, data, tmp_path, bad):
    with pytest.raises(ValueError, match=f"spare_threads must be a whole number of threads .*got {bad!r}"):
        harvest(model, "resid_post.1", data, tmp_path / "o", spare_threads=bad, **KW)
    assert not (tmp_path / "o").exists()


def test_spare_is_refused_where_the_forward_is_not_on_this_cpu(model, data, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="the vllm backend runs its forward in its own processes"):
        harvest(LLAMA, "resid_post.1", data, tmp_path / "v", backend="vllm", spare_threads=1, **KW)
    monkeypatch.setattr(model, "device", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="this model runs on cuda:0. Drop spare_threads"):
        harvest(model, "resid_post.1", data, tmp_path / "g", spare_threads=1, **KW)


def test_cli_takes_spare_threads(data, tmp_path, capsys):
    out = tmp_path / "cli"
    args = [LLAMA, "--backend", "eager", "--points", "resid_post.1", "--data", str(data), "--out", str(out),
            "--context", "32", "--batch-tokens", "128", "--shard-tokens", "100", "--no-progress"]
    assert cli.main(args + ["--spare-threads", "1"]) == 0
    assert read_manifest(out)["identity"]["spare_threads"] == 1
    assert cli.main(args + ["--spare-threads", "-1"]) == 2
    assert "spare_threads must be a whole number of threads (0: the forward keeps them all), got -1" in \
        capsys.readouterr().err
