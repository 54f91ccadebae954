"""A finished harvest in SAELens's cached-activations layout, which its trainer reads as it is.

SAELens (6.x) trains from a `datasets` Dataset saved with `save_to_disk` (its CacheActivationsRunner
writes one; `ActivationsStore` opens it with `datasets.load_from_disk` when the training config
names it as `cached_activations_path` and sets `use_cached_activations`): one row per sequence, a
column named after the TransformerLens hook holding `Array2D((context_size, d_in))` activations and
a `token_ids` column of `context_size` int32. It checks that shape against its config's
`context_size` and `d_in`, then flattens sequences back into token rows, so a sequence here is a
storage unit: the harvest's rows in order, `context_size` at a time (the last partial one dropped,
as a fixed shape demands).

The features are written in the form every `datasets` SAELens accepts (it requires datasets>=3.1)
reads: datasets 4 renamed the fixed-length list feature `Sequence` to `List`, which 3.x does not
know, and 4+ still reads `Sequence` as `List`; so `token_ids` is recorded as a `Sequence`, in
dataset_info.json and in each Arrow file's schema (`_features_for_datasets_3`).

    from engine.harvest.saelens import to_saelens
    to_saelens("acts/", "acts-saelens/", point="resid_post.6")   # -> hook blocks.6.hook_resid_post
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.address import parse
from engine.core.points import get_point
from engine.harvest.dataset import HarvestDataset


@dataclass(frozen=True)
class Export:
    path: Path
    hook_name: str
    context_size: int
    d_in: int
    sequences: int
    dropped_rows: int  # the tail that does not fill a last sequence


def hook_name(address: str) -> str:
    """The TransformerLens hook name SAELens keys activations by (its `hook_name` setting)."""
    a = parse(address)
    tl = get_point(a.point).tl
    if a.coords or tl is None:
        raise ValueError(f"{address} has no TransformerLens hook SAELens can train on (it takes whole "
                         f"[pos, d] hooks); export a point such as resid_post.{a.layer or 0}.")
    return tl.format(L=a.layer)


def _sequence_form(features: dict) -> dict:
    """A features dict (Features.to_dict()) with each `List` of a plain value written as the `Sequence`
    that datasets 3.x knows and 4+ reads back as the same `List` (same Arrow type)."""
    out = {}
    for name, f in features.items():
        if isinstance(f, dict) and f.get("_type") == "List":
            if not (isinstance(f.get("feature"), dict) and f["feature"].get("_type") == "Value"):
                raise ValueError(f"column {name!r}: only lists of plain values have a datasets 3.x form, got {f}.")
            f = {**f, "_type": "Sequence"}
        out[name] = f
    return out


def _features_for_datasets_3(data: Path) -> None:
    """Rewrite a saved dataset's features in the `Sequence` form (see the module docstring): its
    dataset_info.json, and the schema every Arrow file carries (datasets 3.x reads the features from
    both), the files streamed batch by batch (one more pass over the data)."""
    import json

    import pyarrow as pa
    info = data / "dataset_info.json"
    meta = json.loads(info.read_text())
    meta["features"] = _sequence_form(meta["features"])
    info.write_text(json.dumps(meta, indent=2))
    for path in sorted(data.glob("*.arrow")):
        fixed = path.with_name(path.name + ".tmp")
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_stream(src)
            schema_meta = dict(reader.schema.metadata or {})
            hf = json.loads(schema_meta[b"huggingface"])
            hf["info"]["features"] = _sequence_form(hf["info"]["features"])
            schema_meta[b"huggingface"] = json.dumps(hf).encode()
            with pa.OSFile(str(fixed), "wb") as sink, \
                    pa.ipc.new_stream(sink, reader.schema.with_metadata(schema_meta)) as writer:
                for batch in reader:
                    writer.write_batch(batch)
        os.replace(fixed, path)


def to_saelens(out: str | os.PathLike[str], dest: str | os.PathLike[str], point: str | None = None,
               context_size: int | None = None, file_bytes: int = 256 << 20) -> Export:
    """Write the harvest in OUT as SAELens's cached-activations dataset at DEST (created; refused if
    it exists and is not empty). point: one harvested address (default: the only one); context_size:
    rows per sequence (default: the harvest's --context, which SAELens's context_size must equal);
    file_bytes: about how large each Arrow file grows."""
    import datasets
    ds = HarvestDataset(out)
    if point is None:
        if len(ds.points) != 1:
            raise ValueError(f"{out} holds {ds.points}; name the one to export with point=.")
        point = ds.points[0]
    ds = HarvestDataset(out, [point])
    ident = ds.manifest["identity"]
    if ident["positions"] != "all":
        raise ValueError(f"{out} holds one row per document (positions={ident['positions']!r}); SAELens "
                         f"trains on every token: harvest with positions='all'.")
    spec = ds.manifest["columns"][point]
    if len(spec["shape"]) != 1:
        raise ValueError(f"{point} rows have shape {spec['shape']}; SAELens takes [d_in] rows.")
    ctx = int(context_size or ident["context"])
    if ctx < 1:
        raise ValueError(f"context_size must be a positive number of rows, got {context_size!r}.")
    d_in, name = spec["shape"][0], hook_name(point)
    dt = "float32" if spec["dtype"] == "bfloat16" else spec["dtype"]  # Arrow has no bfloat16
    n_seq = len(ds) // ctx
    if n_seq == 0:
        raise ValueError(f"{out} has {len(ds)} rows, fewer than one sequence of context_size={ctx}.")
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not empty; give a new directory (SAELens refuses one too).")
    feats = datasets.Features({name: datasets.Array2D((ctx, d_in), dt),
                               "token_ids": datasets.List(datasets.Value("int32"), length=ctx)})

    def sequences():
        acts, toks, held = [], [], 0
        done = 0
        for shard in ds.iter_shards():
            acts.append(shard[point].to(getattr(torch, dt)))
            toks.append(shard["token_ids"])
            held += len(shard["token_ids"])
            if held < ctx:
                continue
            a, t = torch.cat(acts), torch.cat(toks)
            k = min(held // ctx, n_seq - done)
            a3, t2 = a[:k * ctx].reshape(k, ctx, d_in).numpy(), t[:k * ctx].reshape(k, ctx).numpy()
            for j in range(k):
                yield {name: a3[j], "token_ids": t2[j]}
            done += k
            acts, toks, held = [a[k * ctx:]], [t[k * ctx:]], held - k * ctx

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        built = datasets.Dataset.from_generator(sequences, features=feats, cache_dir=str(tmp / "cache"),
                                                keep_in_memory=False)
        size = n_seq * ctx * d_in * torch.empty((), dtype=getattr(torch, dt)).element_size()
        built.save_to_disk(str(tmp / "data"), num_shards=max(1, min(n_seq, -(-size // file_bytes))))
        del built
        _features_for_datasets_3(tmp / "data")
        if dest.exists():
            dest.rmdir()
        os.replace(tmp / "data", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Export(dest, name, ctx, d_in, n_seq, len(ds) - n_seq * ctx)
