"""The per-model loop: load once, capture everything with the engine, run each reference, write cells.

Cost is dominated by loading: each model's engine copy and each reference are built once per model
and every case is one forward capturing all points. Cells are written as soon as each engine is
scored, so an interrupted run keeps everything finished so far and the next run resumes there.
A failure never destroys a result: an error cell (the model did not load, --layers does not fit it)
replaces no passing cell; the previous cell stays and the run reports the error (`Options.kept`).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from validator import cells, known_gaps, matrix, rows
from validator.engines import ENGINES, adapter_source_files, availability, model_skip_reason, side_digest
from validator.engines.base import ModelContext
from validator.variant import DEFAULT_LAYERS, Variant

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """How to get one model: `load_engine(config)` -> EagerModel ("auto": as load_model gives it; "eager":
    attention="eager"), `load_reference(attention)` -> (hf, tokenizer) (a separate instance with that
    attention implementation, never touched by the engine)."""
    name: str
    source: str  # "zoo" | "real" | "config"
    fingerprint: str  # identifies the weights (zoo snapshot hash, real snapshot commit, ...)
    load_engine: Callable
    load_reference: Callable
    n_layers: int | None = None  # known before loading (zoo entries): --layers is checked against it
    model_type: str = "?"  # known before loading: the declared gaps a cell depends on are chosen by it
    vllm_parallel: tuple[int, int] = (1, 1)  # (tensor, pipeline) sizes of a vLLM column's engine (the run's plan)


@dataclass
class Options:
    engines: tuple[str, ...]
    out: Path = cells.DEFAULT_OUT
    dtype: str = "float32"
    device: str = "cpu"
    points: list[str] | None = None
    layers: tuple = DEFAULT_LAYERS
    force: bool = False
    decode: bool = True
    steer: bool = True
    after_cell: Callable | None = None  # test hook: called with each written cell path
    progress: Callable | None = None  # called with (model, engine) as each engine starts
    kept: list = field(default_factory=list)  # (path, error) of error cells not written over a passing cell


def variant(spec: ModelSpec, opts: Options) -> Variant:
    return Variant.of(spec.source, opts.dtype, opts.device, opts.points, opts.layers, opts.decode, opts.steer)


def path_of(spec: ModelSpec, engine: str, opts: Options) -> Path:
    return cells.cell_path(opts.out, spec.name, engine, variant(spec, opts).tag())


def inputs_digest(spec: ModelSpec, engine: str, opts: Options) -> str:
    files = adapter_source_files(engine) if engine in ENGINES else []
    return cells.sha(spec.name, spec.source, spec.fingerprint, variant(spec, opts).as_dict(), engine,
                     cells.code_digest(), cells.files_digest(files) if files else "", cells.versions(),
                     known_gaps.digest(engine, spec.model_type), *(side_digest(engine) if engine in ENGINES else []))


def pending(spec: ModelSpec, opts: Options) -> list[str]:
    """Engines of this model whose cell is missing or stale (all with --force)."""
    return [e for e in opts.engines if opts.force or not cells.up_to_date(
        path_of(spec, e, opts), inputs_digest(spec, e, opts))]


def _base_cell(spec, engine, opts, status, **extra) -> dict:
    v = variant(spec, opts)
    return {"schema": cells.SCHEMA, "model": spec.name, "engine": engine, "status": status,
            "source": spec.source, "variant": v.as_dict(), "variant_tag": v.tag(),
            "inputs_digest": inputs_digest(spec, engine, opts),
            "engine_what": ENGINES[engine].what if engine in ENGINES else "", **extra}


def _write(path: Path, data: dict, opts: Options) -> bool:
    """Write a cell; an error cell never replaces a passing one (returns False and records it)."""
    if data.get("status") == "error":
        old = cells.read(path)
        if old and old.get("status") == "ok":
            opts.kept.append((path, data.get("error", "")))
            return False
    cells.write(path, data)
    if opts.after_cell:
        opts.after_cell(path)
    return True


def write_cell(path: Path, data: dict, opts: Options) -> bool:
    """Write a cell computed elsewhere (a cluster task) as run_model writes its own (validator/cluster.py)."""
    return _write(path, data, opts)


def bare_cell(spec: ModelSpec, engine: str, opts: Options, status: str, **extra) -> dict:
    """A cell without rows made outside run_model: a cluster task's error, a declared does-not-fit gap."""
    return _base_cell(spec, engine, opts, status, rows=[], **extra)


def _fail_all(spec, todo, opts, error: str, trace: str = "") -> list[Path]:
    written = []
    for engine in todo:
        path = path_of(spec, engine, opts)
        if _write(path, _base_cell(spec, engine, opts, "error", error=error, trace=trace, rows=[]), opts):
            written.append(path)
    return written


def run_model(spec: ModelSpec, opts: Options) -> list[Path]:
    """Compute and write every pending cell of one model; returns the paths written."""
    todo = pending(spec, opts)
    if not todo:
        return []
    written = []
    skips = {e: why for e in todo if (why := _skip_reason(spec, e))}
    for engine, why in skips.items():  # engines that cannot run this model at all: no load needed
        path = path_of(spec, engine, opts)
        if _write(path, _base_cell(spec, engine, opts, "skipped", reason=why, rows=[]), opts):
            written.append(path)
    todo = [e for e in todo if e not in skips]
    if not todo:
        return written
    if opts.layers != DEFAULT_LAYERS and spec.n_layers is not None:
        try:  # --layers that do not fit this model: its error, before anything loads
            matrix.check_layers(opts.layers, spec.n_layers)
        except ValueError as e:
            return written + _fail_all(spec, todo, opts, f"bad --layers for {spec.name}: {e}")
    t_model = time.time()
    try:
        m = spec.load_engine("auto")
        hf_ref, tok = spec.load_reference(native_attention(m))
    except Exception as e:  # noqa: BLE001  (a model that does not load fails all its cells)
        return written + _fail_all(spec, todo, opts, f"model failed to load: {type(e).__name__}: {e}",
                                   traceback.format_exc()[-2000:])
    ctx = ModelContext(spec.name, hf_ref, tok, spec.source, DTYPES[opts.dtype], vllm_parallel=spec.vllm_parallel)
    from validator import columns
    try:
        model = columns.prepare(spec.name, m, ctx, spec.load_engine, opts, todo)
    except matrix.SelectionError as e:  # --points / --layers that select nothing valid on this model
        return written + _fail_all(spec, todo, opts, f"bad selection for {spec.name}: {e}")
    except Exception as e:  # noqa: BLE001  (an engine-side crash fails this model's cells, not the run)
        return written + _fail_all(spec, todo, opts, f"engine side failed: {type(e).__name__}: {e}",
                                   traceback.format_exc()[-2000:])
    model.engine_seconds = round(time.time() - t_model, 2)
    for engine in todo:
        if opts.progress is not None:
            opts.progress(spec.name, engine)
        path = path_of(spec, engine, opts)
        t0 = time.time()
        try:
            cell = _run_engine(engine, spec, model, opts)
        except Exception as e:  # noqa: BLE001  (a crash in one adapter fails that cell only)
            cell = _base_cell(spec, engine, opts, "error", error=f"{type(e).__name__}: {e}",
                              trace=traceback.format_exc()[-2000:], rows=[])
        cell["provenance"] = _provenance(spec, engine, opts, model, time.time() - t0,
                                         cell.get("reference_versions", {}))
        if _write(path, cell, opts):
            written.append(path)
    model.close()
    return written


def _skip_reason(spec, engine) -> str:
    if engine not in ENGINES:
        return f"unknown engine {engine!r}"
    ok, why = availability(engine)
    return why if not ok else model_skip_reason(engine, spec.name, spec.source)


def native_attention(model) -> str:
    """The attention implementation the engine model runs its forwards with (what HF loaded, unless the
    engine runs the family's eager attention): the references of an `auto` column load the same one, so
    both sides use the same kernels."""
    impl = str(getattr(model.hf.config, "_attn_implementation", None) or "eager")
    return "eager" if impl == "interp" else impl.removeprefix("interp_")


def _run_engine(engine, spec, model, opts) -> dict:
    from validator import columns
    if engine.startswith("vllm"):
        tested, exp = columns.vllm_run(engine, model)
    else:
        tested, exp = columns.tested_for(engine, model), columns.expected(engine, model)
    return _cell(engine, spec, model, opts, columns.score(engine, model, tested, exp), exp)


def _cell(engine, spec, model, opts, scored: list, exp) -> dict:
    known = {}
    for r in scored:  # each declared entry once per cell; rows keep its id
        if isinstance(r.get("known"), dict):
            known[r["known"]["id"]] = r["known"]
            r["known"] = r["known"]["id"]
    points = {r["point"] for r in scored}
    plan = model.plan
    cell = _base_cell(spec, engine, opts, "ok", rows=scored, summary=rows.summarize(scored), known=known,
                      family=model.family, model_type=model.model_type, n_layers=model.n_layers,
                      addresses=plan.addresses, configuration=ENGINES[engine].config,
                      tensors={k: v for k, v in exp.tensors.items() if v and k in points},
                      cases={c.name: list(c.input_ids.shape) for c in plan.cases}, reference_versions=exp.versions)
    if exp.unavailable:
        cell["unavailable"] = exp.unavailable
    notes = list(plan.notes) + list(exp.notes)
    if notes:
        cell["notes"] = notes
    return cell


def _last_line(e: Exception) -> str:
    """The informative end of an exception message (nnsight wraps the real error in a traceback)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _provenance(spec, engine, opts, model, seconds, reference_versions: dict) -> dict:
    files = adapter_source_files(engine) if engine in ENGINES else []
    side = side_digest(engine) if engine in ENGINES else []
    versions = cells.versions()
    if side:  # the reference ran in a child on its own versions of what its side install shadows (nnsight)
        versions = {**versions, **reference_versions}
    return {"versions": versions, "dtype": opts.dtype, "device": opts.device,
            "torch_threads": torch.get_num_threads(), "prompt_digest": model.prompt_digest,
            "reference_digest": cells.sha(engine, spec.fingerprint, cells.files_digest(files) if files else "",
                                          cells.versions(), *side),
            "weights": spec.fingerprint, "code_digest": cells.code_digest(), **cells.git_commit(),
            "seconds": round(seconds, 2), "engine_seconds": model.engine_seconds}
