"""engine.harvest.saelens: a harvest exported in SAELens's cached-activations layout loads with
`datasets.load_from_disk` as SAELens's ActivationsStore loads it (torch format, its shape check
(context_size, d_in), `token_ids` of context_size), and holds the harvest's rows in order, as
SAELens flattens them back; bad requests are refused by name."""
from __future__ import annotations

import pytest
import torch

from engine.harvest import SAMPLE, HarvestDataset, harvest
from engine.harvest.saelens import hook_name, to_saelens
from engine.loading import load_model

LLAMA = "meta-llama/Llama-3.2-1B"
KW = dict(shard_tokens=100, context=32, batch_tokens=128, progress=False)


@pytest.fixture(scope="module")
def acts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saelens")
    data = tmp / "docs.txt"
    data.write_text("\n".join(SAMPLE.read_text().splitlines()[:24]) + "\n")
    model = load_model(LLAMA, source="zoo")
    out = tmp / "acts"
    harvest(model, ["resid_post.1", "z.0.head-1"], data, out, dtype="bf16", **KW)
    last = tmp / "last"
    harvest(model, ["resid_post.1"], data, last, positions="last", **KW)
    return out, last


def test_loads_as_saelens_loads_it_and_holds_the_rows_in_order(acts, tmp_path):
    import datasets
    out, _ = acts
    rows = {k: torch.cat([s[k] for s in HarvestDataset(out).iter_shards()]) for k in ("resid_post.1", "token_ids")}
    ex = to_saelens(out, tmp_path / "sl", point="resid_post.1", context_size=24, file_bytes=20_000)
    n = len(rows["token_ids"])
    assert ex.hook_name == "blocks.1.hook_resid_post" and ex.context_size == 24
    assert ex.sequences == n // 24 and ex.dropped_rows == n % 24 and ex.d_in == rows["resid_post.1"].shape[1]
    ds = datasets.load_from_disk(str(tmp_path / "sl"))
    assert len(ds.cache_files) > 1  # split into several Arrow files, read as one dataset
    ds.set_format(type="torch", columns=[ex.hook_name, "token_ids"], dtype=torch.float32)
    assert ds.features[ex.hook_name].shape == (24, ex.d_in) and len(ds) == ex.sequences
    got = ds[0:len(ds)]
    acts_flat = got[ex.hook_name].reshape(-1, ex.d_in)
    torch.testing.assert_close(acts_flat, rows["resid_post.1"][:ex.sequences * 24].float(), rtol=0, atol=0)
    assert got["token_ids"].shape == (ex.sequences, 24)
    assert got["token_ids"].reshape(-1).long().tolist() == rows["token_ids"][:ex.sequences * 24].tolist()
    # the default sequence length is the harvest's context
    assert to_saelens(out, tmp_path / "sl2", point="resid_post.1").context_size == KW["context"]


def test_bad_requests_are_refused_by_name(acts, tmp_path):
    out, last = acts
    with pytest.raises(ValueError, match="name the one to export with point="):
        to_saelens(out, tmp_path / "a")
    with pytest.raises(ValueError, match="z.0.head-1 has no TransformerLens hook SAELens can train on"):
        to_saelens(out, tmp_path / "a", point="z.0.head-1")
    with pytest.raises(KeyError, match="not in this harvest"):
        to_saelens(out, tmp_path / "a", point="resid_post.0")
    with pytest.raises(ValueError, match="positions='last'"):
        to_saelens(last, tmp_path / "a")
    with pytest.raises(ValueError, match="fewer than one sequence of context_size=100000"):
        to_saelens(out, tmp_path / "a", point="resid_post.1", context_size=100000)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty"):
        to_saelens(out, tmp_path / "full", point="resid_post.1")
    assert not (tmp_path / "a").exists() and hook_name("mlp_out.3") == "blocks.3.mlp.hook_out"
    assert [p.name for p in tmp_path.iterdir()] == ["full"]  # no temp directory left behind
