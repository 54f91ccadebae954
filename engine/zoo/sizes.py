"""Twin sizes: ``tiny`` (the default, built by engine/zoo/build.py) and ``real`` (the checkpoint's
own dimensions from engine/zoo/real.py, for throughput at real shape).

Each size has its own hub cache, so the two never replace each other's snapshot or ``refs/main``:

    tiny  <zoo home>/hub/models--org--name/...               (unchanged)
    real  <zoo home>/sizes/real/hub/models--org--name/...

A process picks its size with ``$INTERP_ZOO_SIZE`` (``tiny`` when unset), read on every call, so
``engine.zoo.ensure_twin`` / ``zoo_hub_cache`` / ``offline_env`` (and through them the engine, the
TransformerLens bridge, nnsight and vLLM) all load the twin of that size by repo id. Real-size
twins are built from the tiny recipe (same config builder, init and calibration, so the family's
quirks are the same) with the real dimensions on top, and saved in bfloat16 (half the disk of
float32; a float32 run upcasts them on load).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.files import write_atomic

from . import build
from .entries import ZooEntry
from .real import REAL, RealDims

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SIZES = ("tiny", "real")
SIZE_ENV = "INTERP_ZOO_SIZE"
REAL_DTYPE = "bfloat16"


def check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"zoo size must be one of {SIZES}, got {size!r} (from ${SIZE_ENV} or --size).")
    return size


def current_size() -> str:
    """The size this process loads: ``$INTERP_ZOO_SIZE`` or ``tiny``."""
    return check_size(os.environ.get(SIZE_ENV) or "tiny")


def hub_cache(size: str | None = None) -> Path:
    """The hub cache that holds twins of ``size`` (default: this process's size)."""
    size = check_size(size or current_size())
    if size == "tiny":
        return build.zoo_hub_cache()
    return build.zoo_home() / "sizes" / size / "hub"


def real_dims(name: str) -> RealDims:
    entry = build.get_entry(name)
    if entry.name not in REAL:
        raise ValueError(f"{entry.name} has no real-size row in engine/zoo/real.py; add one to build it at real size.")
    return REAL[entry.name]


def real_entry(name: str) -> ZooEntry:
    """The zoo entry with the real layer count and the real size fields over the tiny overrides."""
    entry, dims = build.get_entry(name), real_dims(name)
    return dataclasses.replace(entry, layers=dims.layers, overrides={**entry.overrides, **dims.overrides})


def real_config(name: str) -> PretrainedConfig:
    cfg = build.build_config(real_entry(name))
    cfg.dtype = REAL_DTYPE
    return cfg


@functools.lru_cache(maxsize=1)
def _recipe_digest() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in ("build.py", "tokenizer.py", "sizes.py"):
        h.update((here / f).read_bytes())
    return h.hexdigest()


def snapshot_hash(name: str, size: str | None = None) -> str:
    size = check_size(size or current_size())
    if size == "tiny":
        return build.snapshot_hash(build.get_entry(name))
    text = json.dumps({"zoo_version": build.ZOO_VERSION, "size": size, "entry": real_entry(name).canonical(),
                       "real": real_dims(name).canonical(), "dtype": REAL_DTYPE, "recipe": _recipe_digest(),
                       "libs": build._lib_versions()}, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()


def snapshot_dir(name: str, size: str | None = None) -> Path:
    entry = build.get_entry(name)
    return hub_cache(size) / entry.repo_folder / "snapshots" / snapshot_hash(name, size)


def ensure(name: str, size: str | None = None, force: bool = False) -> Path:
    """Build the twin of ``name`` at ``size`` if missing (or always with ``force``); its snapshot dir."""
    size = check_size(size or current_size())
    if size == "tiny":
        return build.build_twin(build.get_entry(name).name, force=force)
    return build_real(name, force=force)


def build_real(name: str, force: bool = False) -> Path:
    """The real-size twin of ``name``, built atomically into the real-size hub cache."""
    import torch

    entry, dims = real_entry(name), real_dims(name)
    hub = hub_cache("real")
    rev = snapshot_hash(name, "real")
    repo = hub / entry.repo_folder
    snap, ref = repo / "snapshots" / rev, repo / "refs" / "main"
    if not force and build.is_complete(snap):
        if not ref.is_file() or ref.read_text().strip() != rev:
            write_atomic(ref, rev)
        return snap
    tmp_root = hub.parent / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    build._sweep_tmp(tmp_root)
    work = tmp_root / f"{entry.repo_folder}-{rev[:12]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        model = build.make_model(entry)  # float32: the tiny recipe's init and calibration, at real size
        model.to(getattr(torch, REAL_DTYPE))
        model.config.dtype = REAL_DTYPE
        model.save_pretrained(work)
        build.build_tokenizer().save_pretrained(work)
        marker = {"synthetic_twin": True, "size": "real", "name": entry.name, "model_type": entry.model_type,
                  "revision": rev, "zoo_version": build.ZOO_VERSION, "seed": build._seed(entry.name),
                  "dtype": REAL_DTYPE, "parameters": sum(p.numel() for p in model.parameters()),
                  "published_parameters_b": dims.params_b, "uncertain": dims.uncertain,
                  "entry": json.loads(entry.canonical()), "notes": entry.notes, "libs": build._lib_versions()}
        del model
        (work / build.MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True, default=repr))
        build.install_snapshot(work, repo, rev, tmp_root)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return snap


def meta_parameters(name: str, size: str = "real") -> int:
    """Parameter count of the twin's config, instantiated on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = real_config(name) if check_size(size) == "real" else build.build_config(build.get_entry(name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())
