"""Harvesting readouts instead of raw rows (engine.harvest, readouts=): each readout column equals the
readout computed from the raw rows harvested beside it (a probe's projection, an SAE's top-k
features), readouts alone need no points, resume is keyed on them, reductions are refused by name."""
from __future__ import annotations

import pytest
import torch

import test_harvest
from engine import Mean, Project, Readout, SAEFeatures
from engine.core.readouts import ReadoutError
from engine.core.sae_files import load_sae, write_random_sae
from engine.harvest import SAMPLE, HarvestDataset, MixingError, harvest
from test_harvest import KW  # the small-shard settings

model = test_harvest.model  # the eager twin fixture, shared with test_harvest (pytest finds it by its name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hr")
    data = root / "docs.txt"
    data.write_text("\n".join(SAMPLE.read_text().splitlines()[:12]) + "\n")
    sae = str(write_random_sae(root / "sae", "standard", 256, 512, seed=1))
    return data, sae


def _all(out) -> dict:
    shards = list(HarvestDataset(out).iter_shards())
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def test_readout_columns_equal_the_readout_of_the_raw_rows(model, setup, tmp_path):
    data, sae_dir = setup
    W = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    reads = [Readout("resid_post.1", Project(W), name="probe"), Readout("resid_post.1", SAEFeatures(sae_dir, k=6),
                                                                         name="feats")]
    harvest(model, ["resid_post.1"], data, tmp_path / "a", readouts=reads, **KW)
    rows = _all(tmp_path / "a")
    x = rows["resid_post.1"]
    assert x.shape[0] > 100 and set(rows) >= {"probe", "feats.indices", "feats.values"}
    torch.testing.assert_close(rows["probe"], x @ W.T, atol=1e-4, rtol=1e-4)
    top = load_sae(sae_dir).encode(x).topk(6)
    assert torch.equal(rows["feats.indices"], top.indices) and rows["feats.indices"].dtype == torch.int64
    torch.testing.assert_close(rows["feats.values"], top.values, atol=1e-5, rtol=1e-5)
    # readouts alone: no raw rows stored, the same readout rows
    harvest(model, [], data, tmp_path / "b", readouts=reads[1:], **KW)
    only = _all(tmp_path / "b")
    assert "resid_post.1" not in only and torch.equal(only["feats.indices"], rows["feats.indices"])
    with pytest.raises(MixingError):  # a rerun with other readouts into the same folder
        harvest(model, [], data, tmp_path / "b", readouts=reads[:1], **KW)


def test_a_reduced_readout_is_refused_by_name(model, setup, tmp_path):
    data, _ = setup
    with pytest.raises(ReadoutError, match=r"'resid_post.1:mean' is reduced over positions; a harvest stores one "
                                           r"row per token \(Norm, Project, LensTopK, SAEFeatures\)"):
        harvest(model, [], data, tmp_path / "c", readouts=[Readout("resid_post.1", Mean())], **KW)
