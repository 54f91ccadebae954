"""The per-model loop: load once, capture everything with the engine, run each reference, write cells.

Cost is dominated by loading: each model's engine copy and each reference are built once per model
and every case is one forward capturing all points. Cells are written as soon as each engine is
scored, so an interrupted run keeps everything finished so far and the next run resumes there.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from validator import cells, matrix, prompts, rows
from validator.engines import ENGINES, adapter_class, adapter_source_files, availability
from validator.engines.base import EngineUnavailable, Missing, ModelContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """How to get one model: `load_engine()` -> EagerModel, `load_reference()` -> (hf, tokenizer)
    (a separate instance, eager attention, never touched by the engine)."""
    name: str
    source: str  # "zoo" | "real" | "config"
    fingerprint: str  # identifies the weights (zoo snapshot hash, real snapshot commit, ...)
    load_engine: Callable
    load_reference: Callable


@dataclass
class Options:
    engines: tuple[str, ...]
    out: Path = cells.DEFAULT_OUT
    dtype: str = "float32"
    device: str = "cpu"
    points: list[str] | None = None
    layers: tuple = matrix.DEFAULT_LAYERS
    force: bool = False
    decode: bool = True
    steer: bool = True
    after_cell: Callable | None = None  # test hook: called with each written cell path
    progress: object = None  # a tqdm bar to describe per-engine progress on
    log: list = field(default_factory=list)


def inputs_digest(spec: ModelSpec, engine: str, opts: Options) -> str:
    files = adapter_source_files(engine) if engine in ENGINES else []
    return cells.sha(spec.name, spec.source, spec.fingerprint, opts.dtype, opts.device, engine, opts.points,
                     list(opts.layers), opts.decode, opts.steer, cells.code_digest(),
                     cells.files_digest(files) if files else "", cells.versions())


def pending(spec: ModelSpec, opts: Options) -> list[str]:
    """Engines of this model whose cell is missing or stale (all with --force)."""
    return [e for e in opts.engines if opts.force or not cells.up_to_date(
        cells.cell_path(opts.out, spec.name, e), inputs_digest(spec, e, opts))]


def _base_cell(spec, engine, opts, status, **extra) -> dict:
    return {"schema": cells.SCHEMA, "model": spec.name, "engine": engine, "status": status,
            "source": spec.source, "inputs_digest": inputs_digest(spec, engine, opts),
            "engine_what": ENGINES[engine].what if engine in ENGINES else "", **extra}


def _write(path: Path, data: dict, opts: Options) -> None:
    cells.write_atomic(path, data)
    if opts.after_cell:
        opts.after_cell(path)


def run_model(spec: ModelSpec, opts: Options) -> list[Path]:
    """Compute and write every pending cell of one model; returns the paths written."""
    todo = pending(spec, opts)
    if not todo:
        return []
    written = []
    t_model = time.time()
    try:
        m = spec.load_engine()
        hf_ref, tok = spec.load_reference()
    except Exception as e:  # noqa: BLE001  (a model that does not load fails all its cells)
        err = f"{type(e).__name__}: {e}"
        for engine in todo:
            path = cells.cell_path(opts.out, spec.name, engine)
            _write(path, _base_cell(spec, engine, opts, "error", error=f"model failed to load: {err}",
                                    trace=traceback.format_exc()[-2000:], rows=[]), opts)
            written.append(path)
        return written
    ctx = ModelContext(spec.name, hf_ref, tok, spec.source, DTYPES[opts.dtype])
    common = _subject_side(m, ctx, opts)
    common["engine_seconds"] = round(time.time() - t_model, 2)
    inner = None
    if opts.progress is not None:  # a per-model bar under the overall one
        from tqdm import tqdm
        inner = tqdm(total=len(todo), desc=spec.name.split("/")[-1][:28], unit="engine", position=1, leave=False,
                     dynamic_ncols=True)
    for engine in todo:
        if inner is not None:
            inner.set_postfix_str(engine)
            inner.update(0)
        path = cells.cell_path(opts.out, spec.name, engine)
        ok, why = availability(engine) if engine in ENGINES else (False, f"unknown engine {engine!r}")
        if not ok:
            _write(path, _base_cell(spec, engine, opts, "skipped", reason=why, rows=[]), opts)
            written.append(path)
            continue
        t0 = time.time()
        try:
            cell = _run_engine(engine, spec, ctx, common, opts)
        except Exception as e:  # noqa: BLE001  (a crash in one adapter fails that cell only)
            cell = _base_cell(spec, engine, opts, "error", error=f"{type(e).__name__}: {e}",
                              trace=traceback.format_exc()[-2000:], rows=[])
        cell["provenance"] = _provenance(spec, engine, opts, common, time.time() - t0)
        _write(path, cell, opts)
        written.append(path)
        if inner is not None:
            inner.update(1)
    if inner is not None:
        inner.close()
    return written


def _subject_side(m, ctx, opts) -> dict:
    """Everything the engine computes once per model and every reference is compared with."""
    from engine.steering import Steer
    cases = prompts.build_cases(ctx.tokenizer, m.config)
    addresses = matrix.select(m, opts.points, opts.layers)
    from validator.subject import Subject
    subj = Subject(m)
    ours = {c.name: subj.capture(c, addresses) for c in cases}
    out = {"cases": cases, "addresses": addresses, "ours": ours, "family": m.family.name,
           "model_type": m.config.model_type, "n_layers": m.n_layers}
    short = cases[0]
    if opts.decode:
        try:
            out["decode_case"], out["decode_ours"] = subj.decode(short, addresses)
        except Exception as e:  # noqa: BLE001
            out["decode_error"] = f"engine generate failed: {type(e).__name__}: {str(e)[:300]}"
    if opts.steer and "resid_post" not in m.points():
        out["notes"] = [f"no steering parity: the {m.family.name} family has no resid_post to add at"]
    elif opts.steer:
        layer = matrix.mid_layer(m)
        try:
            v = subj.steer_vector(short, layer)
            out["steer"] = {"layer": layer, "vector": v, "base": subj.logits(short),
                            "ours": subj.logits(short, [Steer(f"resid_post.{layer}", "add", v)])}
        except Exception as e:  # noqa: BLE001
            out["steer_error"] = f"engine steering failed: {type(e).__name__}: {str(e)[:300]}"
    out["prompt_digest"] = prompts.digest(cases + ([out["decode_case"]] if "decode_case" in out else []))
    return out


def _run_engine(engine, spec, ctx, common, opts) -> dict:
    cases, addresses = common["cases"], common["addresses"]
    unavailable = None
    try:
        ref = adapter_class(engine)(ctx)
    except EngineUnavailable as e:
        ref, unavailable = None, str(e)
    try:
        def capture(case):
            if ref is None:
                return {a: Missing(unavailable) for a in addresses}
            try:
                return ref.capture(case, addresses)
            except Exception as e:  # noqa: BLE001  (a crashing forward fails the case, with its text)
                return {a: Missing(f"reference forward failed: {type(e).__name__}: {_last_line(e)}") for a in addresses}
        refs = {c.name: capture(c) for c in cases}
        decode = None
        if "decode_case" in common:
            decode = (common["decode_ours"], capture(common["decode_case"]))
        steer = None
        if "steer" in common:
            st = common["steer"]
            if ref is None:
                r = Missing(unavailable)
            elif not getattr(ref, "steers", True):
                r = Missing(f"{engine} does not steer")
            else:
                r = rows.as_missing(ref.steer_logits, cases[0], st["layer"], st["vector"])
            steer = {"layer": st["layer"], "ours": st["ours"], "base": st["base"], "ref": r}
        scored = rows.score_engine(engine, opts.dtype, common["model_type"], spec.name, cases, addresses,
                                   common["ours"], refs, decode, steer)
        for key in ("decode_error", "steer_error"):
            if key in common:
                scored.append({"case": key.split("_")[0], "point": key.split("_")[0], "layer": None,
                               "verdict": "fail", "reason": common[key]})
        versions = ref.versions() if ref is not None else {}
        tensors = {p: getattr(ref, "TENSORS", {}).get(p, "") for p in {r["point"] for r in scored}} if ref else {}
    finally:
        if ref is not None:
            ref.close()
    known = {}
    for r in scored:  # each declared entry once per cell; rows keep its id
        if isinstance(r.get("known"), dict):
            known[r["known"]["id"]] = r["known"]
            r["known"] = r["known"]["id"]
    cell = _base_cell(spec, engine, opts, "ok", rows=scored, summary=rows.summarize(scored), known=known,
                      family=common["family"], model_type=common["model_type"], n_layers=common["n_layers"],
                      addresses=addresses, tensors={k: v for k, v in tensors.items() if v},
                      cases={c.name: list(c.input_ids.shape) for c in cases}, reference_versions=versions)
    if unavailable:
        cell["unavailable"] = unavailable
    if common.get("notes"):
        cell["notes"] = common["notes"]
    return cell


def _last_line(e: Exception) -> str:
    """The informative end of an exception message (nnsight wraps the real error in a traceback)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _provenance(spec, engine, opts, common, seconds) -> dict:
    files = adapter_source_files(engine) if engine in ENGINES else []
    return {"versions": cells.versions(), "dtype": opts.dtype, "device": opts.device,
            "torch_threads": torch.get_num_threads(), "prompt_digest": common.get("prompt_digest"),
            "reference_digest": cells.sha(engine, spec.fingerprint, cells.files_digest(files) if files else "",
                                          cells.versions()),
            "weights": spec.fingerprint, "code_digest": cells.code_digest(), **cells.git_commit(),
            "seconds": round(seconds, 2), "engine_seconds": common.get("engine_seconds")}
