"""Harvest: activations to disk at serving speed, sharded and resumable, for SAE and probe training.

    from engine.harvest import harvest, HarvestDataset
    harvest("meta-llama/Llama-3.2-1B", "resid_post.1,mlp_out.1", "docs.jsonl", "acts/", backend="vllm")
    ds = HarvestDataset("acts/")          # ds[i] -> {"token_ids", "doc_index", "position", "resid_post.1", ...}

Modules, one job each: inputs (documents from text / JSONL / parquet / Arrow, split into parts),
settings (a harvest's options, checked once), batches (tokens -> context windows -> forward batches,
resume cursors), capture (the one model call),
shards (row buffers, atomic writes on a writer thread), manifest (identity, mixing guard, merge),
runner (one part's loop), workers (N local processes), dataset (reading it back), __main__ (CLI).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from engine.harvest.dataset import HarvestDataset, hf_dataset, read_manifest, verify
from engine.harvest.inputs import InputError
from engine.harvest.manifest import MixingError, merge
from engine.harvest.runner import Summary, run_part
from engine.harvest.settings import Flow, HarvestSettings

if TYPE_CHECKING:
    from engine.backends.hf.eager import EagerModel
    from engine.backends.vllm.backend import VLLMModel

SAMPLE = Path(__file__).with_name("sample.txt")


def harvest(model: str | EagerModel | VLLMModel, points: str | Iterable[str], data: str | os.PathLike[str],
            out: str | os.PathLike[str], *, workers: int = 1, part: tuple[int, int] | None = None,
            **kw: Any) -> Summary | list[Summary] | list[dict]:
    """Harvest `points` of `model` over the documents in `data` into `out`. One part: `part=(i, n)`
    (default (0, 1)); `workers=n`: every part, each in its own process when `model` is a name (one
    after another in this process when it is an already loaded model). kw: see run_part."""
    if part is not None and workers != 1:
        raise ValueError("give either part=(i, n) (this process runs part i) or workers=n (run all n parts).")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}.")
    if workers == 1:
        return run_part(model, points, data, out, part=part or (0, 1), **kw)
    HarvestSettings.of(model, **kw)  # a bad option is refused before any process starts
    if isinstance(model, str):
        from engine.harvest.workers import launch
        points = points if isinstance(points, str) else ",".join(points)
        return launch(dict(kw, model=model, points=points, data=str(data), out=str(out)), workers)
    return [run_part(model, points, data, out, part=(i, workers), **kw) for i in range(workers)]


__all__ = ["harvest", "run_part", "Summary", "HarvestSettings", "Flow", "HarvestDataset", "hf_dataset", "read_manifest", "verify", "merge",
           "MixingError", "InputError", "SAMPLE"]
