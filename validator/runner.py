"""The per-model loop: load once, capture everything with the engine, run each reference, write cells.

Cost is dominated by loading: each model's engine copy and each reference are built once per model
and every case is one forward capturing all points. Cells are written as soon as each engine is
scored, so an interrupted run keeps everything finished so far and the next run resumes there.
A failure never destroys a result: an error cell (the model did not load, --layers does not fit it)
replaces no passing cell; the previous cell stays and the run reports the error (`Options.kept`).
"""
from __future__ import annotations

import dataclasses
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from validator import cells, known_gaps, matrix, prompts, rows
from validator.engines import ENGINES, adapter_class, adapter_source_files, availability, model_skip_reason, side_digest
from validator.engines.base import EngineUnavailable, Missing, ModelContext, split_address
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
    ctx = ModelContext(spec.name, hf_ref, tok, spec.source, DTYPES[opts.dtype])
    try:
        common = _subject_side(spec, m, ctx, opts, todo)
        common["dtype"] = opts.dtype
    except matrix.SelectionError as e:  # --points / --layers that select nothing valid on this model
        return written + _fail_all(spec, todo, opts, f"bad selection for {spec.name}: {e}")
    except Exception as e:  # noqa: BLE001  (an engine-side crash fails this model's cells, not the run)
        return written + _fail_all(spec, todo, opts, f"engine side failed: {type(e).__name__}: {e}",
                                   traceback.format_exc()[-2000:])
    common["engine_seconds"] = round(time.time() - t_model, 2)
    for engine in todo:
        if opts.progress is not None:
            opts.progress(spec.name, engine)
        path = path_of(spec, engine, opts)
        t0 = time.time()
        try:
            cell = _run_engine(engine, spec, ctx, common, opts)
        except Exception as e:  # noqa: BLE001  (a crash in one adapter fails that cell only)
            cell = _base_cell(spec, engine, opts, "error", error=f"{type(e).__name__}: {e}",
                              trace=traceback.format_exc()[-2000:], rows=[])
        cell["provenance"] = _provenance(spec, engine, opts, common, time.time() - t0,
                                         cell.get("reference_versions", {}))
        if _write(path, cell, opts):
            written.append(path)
    shutil.rmtree(common["workdir"], ignore_errors=True)
    for config, subj in common["subjects"].items():
        if config != "auto":
            subj.m.close()
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


def _configs(engines) -> set[str]:
    """The engine configurations the selected columns compare with (vLLM columns: the default one)."""
    out = {ENGINES[e].config for e in engines if e in ENGINES}
    if "hf" in engines:
        out.add("eager")  # its second configuration: patterns from HF's own eager attention
    return out


def _subject_side(spec, m, ctx, opts, todo) -> dict:
    """Everything computed once per model that every column is compared with: the plan, the tested
    engine's side in each configuration the columns need, and the hf reference's expectations (its own
    generate, steering, lens) where the hf or a vLLM column needs them."""
    import tempfile

    from validator import plan as plans
    from validator import sides
    from validator.engines.hf_ref import HFReference
    from validator.subject import Subject
    cases = prompts.build_cases(ctx.tokenizer, m.config)
    addresses = matrix.select(m, opts.points, opts.layers)
    workdir = Path(tempfile.mkdtemp(prefix="validator-"))
    hfa = HFReference(ctx)
    ref_acts = hfa.capture(cases[0], plans.steer_addresses(m)) if opts.steer else {}
    plan = plans.build(m, cases, addresses, ref_acts, workdir, steer=opts.steer, decode=opts.decode)
    if opts.decode:
        plan.reference = sides.hf_generation(hfa, plan)
    out = {"plan": plan, "family": m.family.name, "model_type": m.config.model_type, "n_layers": m.n_layers,
           "workdir": workdir, "tested": {}, "hfa": hfa, "subjects": {"auto": Subject(m, "auto")}}
    for config in sorted(_configs(todo)):
        if config not in out["subjects"]:
            out["subjects"][config] = Subject(spec.load_engine(config), config)
        out["tested"][config] = sides.tested(out["subjects"][config], plan)
    if any(e == "hf" or e.startswith("vllm") for e in todo):
        out["hf_expected"] = sides.expected(hfa, plan, with_generation=True)
    out["prompt_digest"] = prompts.digest(cases + ([prompts.decode_case(plan.reference.tokens)]
                                                   if hasattr(plan.reference, "tokens") else []))
    return out


def _reference_side(engine, ctx, common):
    """(expected Side, adapter notes, TENSORS, versions, unavailable) of one reference column."""
    from validator import sides
    plan = common["plan"]
    spec = ENGINES[engine]
    rctx = ctx if spec.config == "auto" else ctx.with_attention("eager")
    try:
        ref = common["hfa"] if engine == "hf" else adapter_class(engine)(rctx)
    except EngineUnavailable as e:
        missing = Missing(str(e))
        side = sides.Side(captures={c.name: {a: missing for a in plan.addresses} for c in plan.cases},
                          decode={a: missing for a in plan.addresses},
                          steers={sc.name: missing for sc in plan.steers}, lens={k: missing for k in plan.lens_layers},
                          readouts={r.name: missing for r in plan.readouts})
        return side, [], {}, e.versions, str(e)
    try:
        if engine == "hf":
            side = common["hf_expected"]
        else:
            side = sides.expected(ref, plan)
        return side, list(getattr(ref, "notes", None) or []), getattr(ref, "TENSORS", {}), ref.versions(), None
    finally:
        if engine != "hf":
            ref.close()


def _eager_patterns(ctx, common) -> list:
    """The hf column's second configuration: attention patterns from HF's own eager attention against the
    engine loaded with attention='eager' (exact), short and padded."""
    from validator import checks, sides
    from validator.engines.hf_ref import HFReference
    plan = common["plan"]
    pats = [a for a in plan.addresses if split_address(a)[0] in ("attn_probs", "attn_scores", "z")]
    if not pats or "eager" not in common["tested"]:
        return []
    sub = dataclasses.replace(plan, addresses=pats)
    ref = HFReference(ctx.with_attention("eager"))
    try:
        exp = sides.Side(captures={c.name: ref.capture(c, pats) for c in plan.cases})
    finally:
        ref.close()
    return checks.capture_pairs("hf", common["dtype"], sub, common["tested"]["eager"], exp, "eager", "eager")


def _run_engine(engine, spec, ctx, common, opts) -> dict:
    from validator import checks, sides
    plan = common["plan"]
    cfg = ENGINES[engine].config
    notes_extra: list[str] = []
    if engine.startswith("vllm"):
        vref = adapter_class(engine)(ctx)
        try:
            ours = vref.side(plan) if vref.loaded else None
            versions, tensors, unavailable = vref.versions(), getattr(vref, "TENSORS", {}), vref.unavailable
            notes_extra = list(vref.notes)
        finally:
            vref.close()
        base = common["tested"]["auto"]
        hf = common["hf_expected"]
        exp = sides.Side(captures=base.captures, decode=sides.recompute(common["subjects"]["auto"], plan),
                         base=hf.base, steers=hf.steers, lens=hf.lens,
                         readouts=sides.readouts_from(plan, base.captures[plan.short.name], hf.lens),
                         generation=hf.generation, gen_steers=hf.gen_steers)
        if ours is None:
            missing = Missing(unavailable)
            ours = sides.Side(captures={c.name: {a: missing for a in plan.addresses} for c in plan.cases},
                              decode={a: missing for a in plan.addresses}, forms={f.text: missing for f in plan.forms},
                              steers={sc.name: missing for sc in plan.steers},
                              lens={k: missing for k in plan.lens_layers},
                              readouts={r.name: missing for r in plan.readouts}, generation=missing,
                              gen_steers={sc.name: missing for sc in plan.gen_steers})
        # the vLLM side is the tested one; what it is compared with stands on the reference side
        pairs = checks.all_pairs(engine, opts.dtype, plan, ours, exp, cfg)
        for p in pairs:  # a missing vLLM value is the backend's refusal: on the reference's side of the row
            p.ours, p.ref = (p.ref, p.ours) if isinstance(p.ours, Missing) and not isinstance(p.ref, Missing) \
                else (p.ours, p.ref)
    else:
        exp, adapter_notes, tensors, versions, unavailable = _reference_side(engine, ctx, common)
        notes_extra = adapter_notes
        pairs = checks.all_pairs(engine, opts.dtype, plan, common["tested"][cfg], exp, cfg)
        if engine == "hf":
            pairs += _eager_patterns(ctx, common)
    scored = checks.score(engine, common["model_type"], spec.name, pairs)
    known = {}
    for r in scored:  # each declared entry once per cell; rows keep its id
        if isinstance(r.get("known"), dict):
            known[r["known"]["id"]] = r["known"]
            r["known"] = r["known"]["id"]
    points = {r["point"] for r in scored}
    cell = _base_cell(spec, engine, opts, "ok", rows=scored, summary=rows.summarize(scored), known=known,
                      family=common["family"], model_type=common["model_type"], n_layers=common["n_layers"],
                      addresses=plan.addresses, configuration=cfg,
                      tensors={k: v for k, v in tensors.items() if v and k in points},
                      cases={c.name: list(c.input_ids.shape) for c in plan.cases}, reference_versions=versions)
    if unavailable:
        cell["unavailable"] = unavailable
    notes = list(plan.notes) + notes_extra
    if notes:
        cell["notes"] = notes
    return cell


def _last_line(e: Exception) -> str:
    """The informative end of an exception message (nnsight wraps the real error in a traceback)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _provenance(spec, engine, opts, common, seconds, reference_versions: dict) -> dict:
    files = adapter_source_files(engine) if engine in ENGINES else []
    side = side_digest(engine) if engine in ENGINES else []
    versions = cells.versions()
    if side:  # the reference ran in a child on its own versions of what its side install shadows (nnsight)
        versions = {**versions, **reference_versions}
    return {"versions": versions, "dtype": opts.dtype, "device": opts.device,
            "torch_threads": torch.get_num_threads(), "prompt_digest": common.get("prompt_digest"),
            "reference_digest": cells.sha(engine, spec.fingerprint, cells.files_digest(files) if files else "",
                                          cells.versions(), *side),
            "weights": spec.fingerprint, "code_digest": cells.code_digest(), **cells.git_commit(),
            "seconds": round(seconds, 2), "engine_seconds": common.get("engine_seconds")}
