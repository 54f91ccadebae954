"""worker/sink.py: a tensor written by a worker comes back equal (every dtype the harvester stores,
empty ones too), mapped from a file that is gone as soon as it is read; a worker that cannot see the
directory answers inline."""
from __future__ import annotations

import os

import pytest
import torch

from engine.backends.vllm.worker import sink, wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_file_round_trip_equals_the_tensor_and_unlinks(tmp_path, dtype):
    t = (torch.randn(7, 3, 5) * 100).to(dtype)
    ref = sink.to_file(t[:, 1], str(tmp_path))  # a non-contiguous view is written contiguously
    assert set(ref) == {sink.FILE, "dtype", "shape"} and ref["shape"] == [7, 5]
    assert os.path.getsize(ref[sink.FILE]) == t[:, 1].numel() * t.element_size()
    back = wire.tensor_in(ref)
    assert back.dtype == dtype and torch.equal(back, t[:, 1])
    assert not os.path.exists(ref[sink.FILE]) and list(tmp_path.iterdir()) == []


def test_empty_tensor_and_inline_fallback(tmp_path):
    ref = sink.to_file(torch.empty(0, 4), str(tmp_path))
    assert wire.tensor_in(ref).shape == (0, 4)
    enc = sink.encoder(str(tmp_path / "on-another-machine"), wire.tensor_out)
    d = enc(torch.arange(6.0).reshape(2, 3))
    assert sink.FILE not in d and torch.equal(wire.tensor_in(d), torch.arange(6.0).reshape(2, 3))
    assert sink.encoder(None, wire.tensor_out) is wire.tensor_out
    assert sink.FILE in sink.encoder(str(tmp_path), wire.tensor_out)(torch.ones(2))


def test_sweep_removes_only_dead_harvests_directories(tmp_path):
    import subprocess
    import sys

    from engine.harvest.runner import sweep
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead, live = tmp_path / f"interp-harvest-{p.pid}-abc", tmp_path / f"interp-harvest-{os.getpid()}-def"
    other = tmp_path / "interp-harvest-xyz"
    for d in (dead, live, other):
        d.mkdir()
    (dead / "rows.bin").write_bytes(b"x" * 10)
    assert sweep(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()
