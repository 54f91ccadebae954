"""engine.harvest.saelens: a harvest exported in SAELens's cached-activations layout loads with
`datasets.load_from_disk` as SAELens's ActivationsStore loads it (torch format, its shape check
(context_size, d_in), `token_ids` of context_size), and holds the harvest's rows in order, as
SAELens flattens them back; bad requests are refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.harvest import SAMPLE, HarvestDataset, harvest
from engine.harvest.saelens import hook_name, to_saelens
from engine.loading import load_model

LLAMA = "meta-llama/Llama-3.2-1B"
REF_DIR = Path(os.environ.get("SAE_REFERENCE_DIR", Path(__file__).resolve().parents[1] / ".saelens-ref"))
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


def test_features_are_written_in_the_form_datasets_3_reads(acts, tmp_path):
    """datasets 4 renamed the fixed-length list feature Sequence to List; the export records token_ids
    as a Sequence (in dataset_info.json and every Arrow file's schema), which 4+ reads as the same List."""
    import datasets
    import pyarrow as pa
    out, _ = acts
    ex = to_saelens(out, tmp_path / "sl", point="resid_post.1", context_size=24, file_bytes=20_000)
    info = json.loads((ex.path / "dataset_info.json").read_text())["features"]
    assert info["token_ids"] == {"feature": {"dtype": "int32", "_type": "Value"}, "length": 24, "_type": "Sequence"}
    for f in sorted(ex.path.glob("*.arrow")):
        with pa.memory_map(str(f)) as src:
            meta = json.loads(pa.ipc.open_stream(src).schema.metadata[b"huggingface"])
        assert meta["info"]["features"] == info
    ds = datasets.load_from_disk(str(ex.path))
    assert ds.features["token_ids"] == datasets.List(datasets.Value("int32"), length=24)


# runs with .saelens-ref first on the path (scripts/sae_reference.sh installs datasets 3.6 there)
LOAD_WITH_DATASETS_3 = textwrap.dedent("""
    import sys
    import datasets
    from safetensors.torch import save_file
    assert datasets.__version__.startswith("3."), datasets.__version__
    ds = datasets.load_from_disk(sys.argv[1])
    assert type(ds.features["token_ids"]).__name__ == "Sequence", ds.features
    ds.set_format(type="torch", columns=[sys.argv[2], "token_ids"])  # as SAELens's ActivationsStore reads it
    got = ds[0:len(ds)]
    save_file({"acts": got[sys.argv[2]].contiguous(), "token_ids": got["token_ids"].contiguous()}, sys.argv[3])
""")


@pytest.mark.slow
def test_datasets_3_loads_the_export_with_the_same_rows(acts, tmp_path):
    """SAELens accepts datasets>=3.1; its users on 3.x could not load the export ("Feature type 'List'
    not found"). Loaded with datasets 3.6 from .saelens-ref, the folder gives the harvest's rows."""
    if not (REF_DIR / "datasets").is_dir():
        pytest.skip(f"datasets 3.x is missing from {REF_DIR}: run `bash scripts/sae_reference.sh` (CI's slow step does)")
    from safetensors.torch import load_file
    out, _ = acts
    ex = to_saelens(out, tmp_path / "sl", point="resid_post.1", context_size=24, file_bytes=20_000)
    script = tmp_path / "load3.py"
    script.write_text(LOAD_WITH_DATASETS_3)
    proc = subprocess.run([sys.executable, str(script), str(ex.path), ex.hook_name, str(tmp_path / "got.safetensors")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REF_DIR)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(str(tmp_path / "got.safetensors"))
    rows = {k: torch.cat([s[k] for s in HarvestDataset(out).iter_shards()]) for k in ("resid_post.1", "token_ids")}
    n = ex.sequences * 24
    torch.testing.assert_close(got["acts"].reshape(-1, ex.d_in), rows["resid_post.1"][:n].float(), rtol=0, atol=0)
    assert got["token_ids"].reshape(-1).tolist() == rows["token_ids"][:n].tolist()
