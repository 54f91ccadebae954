"""Reading a finished harvest: as a torch Dataset of token rows, shard by shard, or through the
`datasets` library. Only shards listed in OUT/manifest.json are read, so an unfinished harvest
is never mistaken for a complete one."""
from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from engine.harvest import manifest as mf
from engine.harvest.shards import INDEX_COLUMNS

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset


def read_manifest(out: str | os.PathLike[str]) -> dict:
    """OUT/manifest.json; a clear error when the harvest is missing or not finished."""
    out = Path(out)
    path = out / mf.MANIFEST
    if not path.is_file():
        parts = sorted(out.glob(f"part-*/{mf.PART}")) if out.is_dir() else []
        if parts:
            done = sum(mf.read(p)["complete"] for p in parts)
            of = mf.read(parts[0])["identity"]["parts"]
            raise FileNotFoundError(f"{out} is an unfinished harvest ({done} of {of} parts complete); "
                                    f"rerun the harvest command to finish it.")
        raise FileNotFoundError(f"{out} is not a harvest output (no {mf.MANIFEST}).")
    return mf.read(path)


def verify(out: str | os.PathLike[str]) -> list[str]:
    """Problems found by re-hashing every shard against the manifest ([] when all are intact)."""
    out = Path(out)
    bad = []
    for s in read_manifest(out)["shards"]:
        p = out / s["file"]
        if not p.is_file():
            bad.append(f"{s['file']}: missing")
        elif hashlib.sha256(p.read_bytes()).hexdigest() != s["sha256"]:
            bad.append(f"{s['file']}: content hash differs from the manifest")
    return bad


class HarvestDataset(torch.utils.data.Dataset):
    """Token rows of a finished harvest. Item i is {"token_ids", "doc_index", "position", and one
    [*shape] tensor per harvested address and readout column}. Shards load lazily, one at a time: read in order (or
    shuffle within `iter_shards()` blocks) for speed."""

    def __init__(self, out: str | os.PathLike[str], points: Iterable[str] | None = None) -> None:
        self.out = Path(out)
        self.manifest = read_manifest(self.out)
        have = self.manifest["resolved"]["addresses"] + self.manifest["resolved"].get("readouts", [])
        self.points = list(have if points is None else points)
        missing = [p for p in self.points if p not in have]
        if missing:
            raise KeyError(f"{missing} not in this harvest; it holds {have}.")
        self.shards = self.manifest["shards"]
        self._starts = [s["rows"][0] for s in self.shards]
        self._cached: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return self.manifest["rows"]

    def load_shard(self, k: int) -> dict[str, torch.Tensor]:
        """Shard k's columns (index columns and the selected points)."""
        from safetensors.torch import load_file
        if self._cached is None or self._cached[0] != k:
            t = load_file(str(self.out / self.shards[k]["file"]))
            self._cached = (k, {c: t[c] for c in (*INDEX_COLUMNS, *self.points)})
        return self._cached[1]

    def iter_shards(self) -> Iterator[dict[str, torch.Tensor]]:
        for k in range(len(self.shards)):
            yield self.load_shard(k)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range ({len(self)} rows).")
        k = bisect.bisect_right(self._starts, i) - 1
        shard = self.load_shard(k)
        return {c: t[i - self._starts[k]] for c, t in shard.items()}


def _features(manifest: dict, points: list[str]):
    from datasets import Array2D, Array3D, Features, List, Value
    feats = {}
    for c in (*INDEX_COLUMNS, *points):
        spec = manifest["columns"][c]
        dt = "float32" if spec["dtype"] == "bfloat16" else spec["dtype"]  # Arrow has no bfloat16
        shape = spec["shape"]
        feats[c] = (Value(dt) if not shape else List(Value(dt), length=shape[0]) if len(shape) == 1
                    else Array2D(tuple(shape), dt) if len(shape) == 2 else Array3D(tuple(shape), dt))
    return Features(feats)


def hf_dataset(out: str | os.PathLike[str], points: Iterable[str] | None = None, streaming: bool = False,
               cache_dir: str | None = None) -> Dataset | IterableDataset:
    """The harvest through the `datasets` library: an IterableDataset reading the shards (streaming)
    or a Dataset materialized into the datasets cache (Arrow; bfloat16 becomes float32)."""
    import datasets
    ds = HarvestDataset(out, points)
    points = ds.points

    def rows(shards=tuple(range(len(ds.shards)))):
        reader = HarvestDataset(out, points)
        for k in shards:
            shard = reader.load_shard(k)
            arrays = {c: (t.float() if t.dtype == torch.bfloat16 else t).numpy() for c, t in shard.items()}
            for j in range(len(arrays["token_ids"])):
                yield {c: a[j] for c, a in arrays.items()}

    feats = _features(ds.manifest, points)
    if streaming:
        return datasets.IterableDataset.from_generator(rows, features=feats)
    # the shards' hashes name the cached copy, so a rewritten harvest is never served stale
    key = hashlib.sha256(repr((points, [s["sha256"] for s in ds.shards])).encode()).hexdigest()[:32]
    return datasets.Dataset.from_generator(rows, features=feats, cache_dir=cache_dir, fingerprint=key)
