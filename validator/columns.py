"""One model's run, in the pieces the runner and the mutation self-test share.

    model = prepare(spec, engine_model, ctx, opts, engines)   # the plan, the tested engine's sides, hf's own
    exp = expected(engine, model)                             # one column's expected side (cacheable)
    tested = tested_for(engine, model)                        # the side that column tests
    rows = score(engine, model, tested, exp)                  # its scored rows

The tested side depends on the engine under test; the plan and every expected side do not (the plan's
values are drawn from the HF reference, the reference tokens come from HF's own generate), so the
self-test prepares a model once and re-scores each seeded bug against the same expectations.
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from validator import checks, matrix, prompts, sides
from validator.engines import ENGINES, adapter_class
from validator.engines.base import EngineUnavailable, Missing, ModelContext, split_address
from validator.plan import Plan
from validator.subject import Subject


class _Refused:
    """What stands on the tested side of a vLLM row whose backend refused (the refusal is the reference's)."""


PATTERN_POINTS = ("attn_probs", "attn_scores", "z")  # what the hf column also checks in the eager configuration


@dataclass
class Model:
    """Everything computed once per model that its columns are compared with."""
    name: str
    ctx: ModelContext
    plan: Plan
    family: str
    model_type: str
    n_layers: int
    dtype: str
    load_engine: Callable[[str], Any]
    workdir: Path
    hfa: Any  # the hf reference adapter (native configuration)
    subjects: dict = field(default_factory=dict)  # config -> Subject
    tested: dict = field(default_factory=dict)  # config -> Side
    hf_expected: sides.Side | None = None
    eager_expected: sides.Side | None = None  # HF's eager-attention captures of the pattern points (hf column)
    prompt_digest: str = ""
    engine_seconds: float | None = None

    def close(self) -> None:
        import shutil
        for config, subj in self.subjects.items():
            if config != "auto":
                subj.m.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class Expected:
    """One column's expected side and what its cell records of the reference."""
    side: sides.Side
    notes: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    unavailable: str | None = None


def configs(engines) -> set[str]:
    """The engine configurations the selected columns compare with (vLLM columns: the default one)."""
    out = {ENGINES[e].config for e in engines if e in ENGINES}
    if "hf" in engines:
        out.add("eager")  # its second configuration: patterns from HF's own eager attention
    return out


def prepare(name: str, m, ctx: ModelContext, load_engine, opts, engines) -> Model:
    """The plan (from `m`'s catalogue and the hf reference), the tested sides of `m` (config auto) and of
    the other configurations the columns need, and hf's own expectations where a column needs them."""
    from validator import plan as plans
    from validator.engines.hf_ref import HFReference
    cases = prompts.build_cases(ctx.tokenizer, m.config)
    addresses = matrix.select(m, opts.points, opts.layers)
    workdir = Path(tempfile.mkdtemp(prefix="validator-"))
    hfa = HFReference(ctx)
    ref_acts = hfa.capture(cases[0], plans.steer_addresses(m)) if opts.steer else {}
    plan = plans.build(m, cases, addresses, ref_acts, workdir, steer=opts.steer, decode=opts.decode)
    if opts.decode:
        plan.reference = sides.hf_generation(hfa, plan)
    model = Model(name, ctx, plan, m.family.name, m.config.model_type, m.n_layers, opts.dtype, load_engine, workdir,
                  hfa, subjects={"auto": Subject(m, "auto")})
    model.tested = tested_sides(model, configs(engines))
    if any(e == "hf" or e.startswith("vllm") for e in engines):
        model.hf_expected = sides.expected(hfa, plan, with_generation=True)
    seq = getattr(plan.reference, "tokens", None)
    model.prompt_digest = prompts.digest(cases + ([prompts.decode_case(seq)] if seq is not None else []))
    return model


def tested_sides(model: Model, wanted: set[str], fresh: bool = False) -> dict:
    """{config: the engine's side} for each configuration; `fresh` loads the engine anew for each (the
    self-test: every seeded bug is met by a model loaded under it)."""
    out = {}
    for config in sorted(wanted):
        if fresh or config not in model.subjects:
            subj = Subject(model.load_engine(config), config)
            if not fresh:
                model.subjects[config] = subj
        else:
            subj = model.subjects[config]
        try:
            out[config] = sides.tested(subj, model.plan)
        finally:
            if fresh:
                subj.m.close()
    return out


def _all_missing(plan: Plan, missing: Missing) -> sides.Side:
    return sides.Side(captures={c.name: {a: missing for a in plan.addresses} for c in plan.cases},
                      decode={a: missing for a in plan.addresses}, forms={f.text: missing for f in plan.forms},
                      steers={sc.name: missing for sc in plan.steers}, lens={k: missing for k in plan.lens_layers},
                      readouts={r.name: missing for r in plan.readouts}, generation=missing,
                      gen_steers={sc.name: missing for sc in plan.gen_steers})


def expected(engine: str, model: Model) -> Expected:
    """A reference column's expected side (the adapter runs every case, the decode recompute, the steering
    cases and the lens it can); a vLLM column's: the eager engine's own side (captures, forms, the decode
    recompute) and hf's (steering, lens, generation; readouts reduced from the eager engine's tensors)."""
    plan = model.plan
    if engine.startswith("vllm"):
        base, hf = model.tested["auto"], model.hf_expected
        assert hf is not None
        side = sides.Side(captures=base.captures, decode=sides.recompute(model.subjects["auto"], plan),
                          base=hf.base, steers=hf.steers, lens=hf.lens,
                          readouts=sides.readouts_from(plan, base.captures[plan.short.name], hf.lens),
                          generation=hf.generation, gen_steers=hf.gen_steers)
        return Expected(side)
    if engine == "hf":
        assert model.hf_expected is not None
        return Expected(model.hf_expected, [], model.hfa.TENSORS, model.hfa.versions())
    rctx = model.ctx if ENGINES[engine].config == "auto" else model.ctx.with_attention("eager")
    try:
        ref = adapter_class(engine)(rctx)
    except EngineUnavailable as e:
        return Expected(_all_missing(plan, Missing(str(e))), [], {}, e.versions, str(e))
    try:
        return Expected(sides.expected(ref, plan), list(getattr(ref, "notes", None) or []),
                        getattr(ref, "TENSORS", {}), ref.versions())
    finally:
        ref.close()


def eager_pairs(model: Model, eager: sides.Side | None) -> list:
    """The hf column's second configuration: attention patterns and z from HF's own eager attention (its
    captures made once per model) against `eager`, the engine loaded with attention='eager' (exact)."""
    from validator.engines.hf_ref import HFReference
    plan = model.plan
    pats = [a for a in plan.addresses if split_address(a)[0] in PATTERN_POINTS]
    if not pats or eager is None:
        return []
    if model.eager_expected is None:
        ref = HFReference(model.ctx.with_attention("eager"))
        try:
            model.eager_expected = sides.Side(captures={c.name: ref.capture(c, pats) for c in plan.cases})
        finally:
            ref.close()
    return checks.capture_pairs("hf", model.dtype, dataclasses.replace(plan, addresses=pats), eager,
                                model.eager_expected, "eager", "eager")


def score(engine: str, model: Model, tested: sides.Side, exp: Expected, eager: list | None = None) -> list[dict]:
    """A column's scored rows: `tested` against `exp` (for hf, plus its eager-configuration rows: `eager`, or
    those of the model's own eager side)."""
    cfg = ENGINES[engine].config
    pairs = checks.all_pairs(engine, model.dtype, model.plan, tested, exp.side, cfg)
    if engine.startswith("vllm"):
        for p in pairs:  # the vLLM side is tested: its refusal stands where a reference's missing value does
            if isinstance(p.ours, Missing):
                p.ours, p.ref = (p.ref if not isinstance(p.ref, Missing) else _Refused()), p.ours
    if engine == "hf":
        pairs += eager_pairs(model, model.tested.get("eager")) if eager is None else eager
    return checks.score(engine, model.model_type, model.name, pairs)


def tested_for(engine: str, model: Model, vllm_side: sides.Side | None = None) -> sides.Side:
    """The side a column tests: the eager engine in the column's configuration, or the vLLM backend's."""
    if engine.startswith("vllm"):
        return vllm_side if vllm_side is not None else _all_missing(model.plan, Missing("the vLLM side was not run"))
    return model.tested[ENGINES[engine].config]


def vllm_run(engine: str, model: Model) -> tuple[sides.Side, Expected]:
    """A vLLM column's two sides: the backend's (loaded for the plan, then closed) and its expected one, which
    carries what the cell records of the backend (notes, versions, why it did not load)."""
    vref = adapter_class(engine)(model.ctx)
    try:
        got = vref.side(model.plan)
        side = got if got is not None else _all_missing(model.plan, Missing(vref.unavailable or "did not load"))
        exp = dataclasses.replace(expected(engine, model), notes=list(vref.notes), versions=vref.versions(),
                                  unavailable=vref.unavailable, tensors=vref.TENSORS)
        return side, exp
    finally:
        vref.close()
