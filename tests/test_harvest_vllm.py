"""engine.harvest on the vLLM backends (one engine per backend for the module): harvested rows equal
the same engine's run_with_cache on every point of every shard (and eager's up to float32 kernel
noise); a crash then resume writes the very bytes of an uninterrupted run; vllm-static refuses
points it did not declare."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine.core.errors import UnsupportedPointError
from engine.harvest import SAMPLE, HarvestDataset, harvest, read_manifest, runner, shards, verify
from engine.harvest import manifest as mf
from engine.harvest.runner import Flow
from test_vllm_common import STATIC_TAPS, eager_model, vllm_model

pytestmark = pytest.mark.vllm

LLAMA = "meta-llama/Llama-3.2-1B"
POINTS = {"vllm": ["resid_post.1", "mlp_out.0", "z.0.head-1"], "vllm-static": ["resid_post.1", "mlp_out.1"]}
LINES = SAMPLE.read_text().splitlines()
DOCS = LINES[:10] + [" ".join(LINES[10:16])] + LINES[16:22]  # one ~120-token document: several windows
KW = dict(shard_tokens=96, context=32, batch_tokens=160, progress=False)


@pytest.fixture(scope="module")
def engines():
    # both shared: the default Llama engine for the session (tests/conftest.py), the vllm-static one with the
    # modules of test_vllm_common.STATIC_TAPS (its tap set holds POINTS["vllm-static"])
    return {"vllm": vllm_model(LLAMA), "vllm-static": vllm_model(LLAMA, "vllm-static", static_points=STATIC_TAPS)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "docs.txt"
    p.write_text("\n".join(DOCS) + "\n")
    return p


def tree(out) -> dict:
    out_files = sorted(p for p in out.rglob("*") if p.is_file())
    return {str(p.relative_to(out)): p.read_bytes() for p in out_files}


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_rows_equal_run_with_cache_every_point_every_shard(engines, data, tmp_path, backend):
    vm, em = engines[backend], eager_model(LLAMA)
    points = POINTS[backend]
    out = tmp_path / backend
    s = harvest(vm, points, data, out, **KW)
    m = read_manifest(out)
    assert m["identity"]["backend"] == backend and len(m["shards"]) >= 3 and verify(out) == []
    rows = {k: torch.cat([sh[k] for sh in HarvestDataset(out).iter_shards()]) for k in ("doc_index", "position",
                                                                                        "token_ids", *points)}
    windows = []  # (doc, start, ids) of every window, as the harvester cuts them
    for doc, text in enumerate(DOCS):
        ids = vm.tokenizer(text)["input_ids"]
        windows += [(doc, s0, ids[s0:s0 + KW["context"]]) for s0 in range(0, len(ids), KW["context"])]
    _, ref = vm.run_with_cache([w for _, _, w in windows], points)  # one prefill per window
    at = 0
    for i, (doc, s0, w) in enumerate(windows):
        n = len(w)
        assert rows["doc_index"][at:at + n].tolist() == [doc] * n
        assert rows["position"][at:at + n].tolist() == list(range(s0, s0 + n))
        assert rows["token_ids"][at:at + n].tolist() == w
        _, eref = em.run_with_cache(torch.tensor([w]), points)
        for p in points:
            got = rows[p][at:at + n]
            torch.testing.assert_close(got, ref[p][i, -n:])  # the batch comes back left-padded
            # vLLM against eager: float32 kernels differ in the last bits (max abs ~5e-6 here)
            torch.testing.assert_close(got, eref[p][0], rtol=1e-3, atol=1e-4)
        at += n
    assert at == len(rows["doc_index"]) == m["rows"] and s.tokens_per_s > 0
    assert [sh["rows"] for sh in m["shards"]][:2] == [[0, 96], [96, 192]]  # every shard is covered above


def test_crash_then_resume_writes_the_bytes_of_an_uninterrupted_run(engines, data, tmp_path, monkeypatch):
    vm = engines["vllm"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    harvest(vm, POINTS["vllm"], data, ref, **KW)
    real, calls = shards.write_shard, []

    def dies_on_the_fourth(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 4:
            raise OSError("disk vanished")
        return real(path, tensors, metadata)
    monkeypatch.setattr(shards, "write_shard", dies_on_the_fourth)
    with pytest.raises(RuntimeError, match="disk vanished"):
        harvest(vm, POINTS["vllm"], data, out, **KW)
    monkeypatch.setattr(shards, "write_shard", real)
    part = json.loads((mf.part_dir(out, 0, 1) / mf.PART).read_text())
    assert len(part["shards"]) == 3 and not part["complete"]
    s = harvest(vm, POINTS["vllm"], data, out, **KW)
    assert s.shards == len(read_manifest(ref)["shards"]) - 3
    a, b = tree(ref), tree(out)
    assert a.keys() == b.keys()

    def strip(m: dict) -> dict:
        return {k: v for k, v in m.items() if k not in mf.TIMESTAMPS}
    for name in a:
        if name.endswith(".json"):
            assert strip(json.loads(a[name])) == strip(json.loads(b[name])), name
        else:
            assert a[name] == b[name], name


def test_static_refuses_points_it_did_not_declare(engines, data, tmp_path):
    with pytest.raises(UnsupportedPointError, match="mlp_out.0 cannot be served by backend 'vllm-static'.*declared"):
        harvest(engines["vllm-static"], ["mlp_out.0"], data, tmp_path / "o", **KW)
    assert not (tmp_path / "o").exists()


def test_every_flow_writes_the_same_bytes_and_leaves_no_shared_memory(engines, data, tmp_path, monkeypatch):
    """Batches in flight and the shared-memory handoff change how rows travel, never a written byte:
    the issue-13 path (one batch at a time, rows inline in the RPC reply) is the reference."""
    from engine.backends.vllm.worker import wire
    vm = engines["vllm"]
    made, mapped = [], []
    real_mkdtemp, real_from_file = runner.tempfile.mkdtemp, wire.from_file

    def mkdtemp(**kw):
        made.append(real_mkdtemp(**kw))
        return made[-1]

    def from_file(d):
        mapped.append(d["__file__"])
        return real_from_file(d)
    monkeypatch.setattr(runner.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(wire, "from_file", from_file)
    trees = {}
    for f in (Flow(1, "rpc"), Flow(1, "shm"), Flow(3, "shm"), Flow(2, "rpc")):
        out = tmp_path / f"{f.inflight}-{f.handoff}"
        harvest(vm, POINTS["vllm"], data, out, flow=f, **KW)
        assert verify(out) == []
        trees[f] = {k: v for k, v in tree(out).items() if k.endswith(".safetensors")}
    ref = trees[Flow(1, "rpc")]
    assert len(ref) >= 3
    for f, t in trees.items():
        assert t == ref, f
    # the two shm runs each made their directory in /dev/shm, every capture came through it, and
    # nothing is left there
    assert len(made) == 2 and all(m.startswith("/dev/shm/interp-harvest-") for m in made), made
    assert all(not os.path.exists(m) for m in made)
    assert mapped and all(p.startswith(tuple(made)) and not os.path.exists(p) for p in mapped)
    with pytest.raises(ValueError, match="handoff must be one of"):
        Flow(2, "pipe")
    with pytest.raises(ValueError, match="inflight must be a positive"):
        Flow(0)
