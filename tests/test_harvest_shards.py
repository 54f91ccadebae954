"""Shard files: the streamed safetensors layout equals safetensors' own bytes, and is hashed as written."""
import hashlib
import json

import pytest
import torch
from safetensors.torch import load, save

from engine.harvest import shards
from engine.harvest.shards import DTYPES, shard_parts, write_shard

META = {"part": "part-00000-of-00001", "shard": "3", "rows": "24576-32768", "note": "caf\u00e9 \u4e2d \"q\" \\ \n"}


def columns(dtype: torch.dtype, n: int = 7) -> dict[str, torch.Tensor]:
    """A shard as the harvester builds one: index columns, a stored point, a sparse readout."""
    g = torch.Generator().manual_seed(n)
    return {"token_ids": torch.randint(0, 50_000, (n,), dtype=torch.int32, generator=g),
            "doc_index": torch.randint(0, 10**12, (n,), generator=g),
            "position": torch.arange(n, dtype=torch.int32),
            "blocks.1.resid_post": torch.randn(n, 5, generator=g).to(dtype),
            "blocks.0.attn.hook_z": torch.randn(n, 2, 3, generator=g).to(dtype),
            "sae.indices": torch.randint(0, 512, (n, 4), generator=g),
            "sae.values": torch.randn(n, 4, generator=g).to(dtype)}


def reference(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    return save(tensors, metadata={"harvest": json.dumps(meta, sort_keys=True)})


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_streamed_layout_is_safetensors_own_bytes(dtype):
    t = columns(dtype)
    parts = shard_parts(t, META)
    assert len(parts) == 1 + len(t)  # a header, then each tensor's own memory
    data = b"".join(bytes(p) for p in parts)
    assert data == reference(t, META)
    back = load(data)
    assert back.keys() == t.keys()
    for k, v in t.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_the_views_are_the_tensors_memory_not_copies():
    t = columns(torch.float32)
    parts = shard_parts(t, META)
    stored = t["blocks.1.resid_post"]
    view = next(p for p in parts[1:] if memoryview(p).nbytes == stored.numel() * 4
                and bytes(p) == stored.numpy().tobytes())
    stored[0, 0] = 123.0  # written through the tensor, seen through the part
    assert bytes(view)[:4] == torch.tensor([123.0]).numpy().tobytes()


def test_a_dtype_outside_the_table_goes_through_safetensors():
    t = dict(columns(torch.float32), flags=torch.tensor([True, False, True, True, False, False, True]),
             small=torch.arange(7, dtype=torch.int16))
    parts = shard_parts(t, META)
    assert len(parts) == 1
    assert bytes(parts[0]) == reference(t, META)


def test_an_empty_and_a_one_row_shard():
    for n in (0, 1):
        t = columns(torch.bfloat16, n)
        assert b"".join(bytes(p) for p in shard_parts(t, META)) == reference(t, META)


def test_write_shard_hashes_what_it_wrote_and_never_builds_the_whole_buffer(tmp_path, monkeypatch):
    t = columns(torch.float16, 33)

    def no_whole_copies(*a, **k):
        raise AssertionError("write_shard copied the shard into one buffer")
    monkeypatch.setattr("safetensors.torch.save", no_whole_copies)
    sha, n = write_shard(tmp_path / shards.shard_name(0), t, META)
    monkeypatch.undo()
    data = (tmp_path / "shard-000000.safetensors").read_bytes()
    assert data == reference(t, META)
    assert (sha, n) == (hashlib.sha256(data).hexdigest(), len(data))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.safetensors"]
