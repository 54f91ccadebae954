"""The two sides of every comparison, gathered once per model: what the tested backend computes, and what
the reference says it should be.

`tested(subject, plan)` runs the engine's public API (validator/subject.py) for every check of the plan.
`expected(ref, plan)` gathers the reference's side: its captures, the decode recompute of the
reference tokens, and, where the adapter can replace a tensor mid-forward (`intervene`), every steering
case (the validator's own maths, validator/maths.py, applied in the reference's own hook) and the logit
lens (the reference's own final norm and unembedding, reached by putting an earlier layer's residual in
place of the last layer's output). Readouts are reduced from the reference's tensors here too. The
hf reference also runs its own greedy `generate`, plain and steered.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from validator import maths
from validator.engines.base import Missing, split_address
from validator.plan import Plan, SteerCase
from validator.prompts import decode_case
from validator.subject import Generation, Subject


@dataclass
class Side:
    """One side's values, keyed as the plan keys them. Any entry may be a Missing (with the reason)."""
    captures: dict = field(default_factory=dict)  # {case name: {address: tensor}}
    decode: dict = field(default_factory=dict)  # tested: the generation's captures; expected: the recompute
    forms: dict = field(default_factory=dict)  # {form text: tensor} (tested only)
    base: object = None  # short-prompt logits, unsteered
    steers: dict = field(default_factory=dict)  # {steer case name: logits}
    lens: dict = field(default_factory=dict)  # {layer: logits}
    readouts: dict = field(default_factory=dict)  # {readout name: tensor | (indices, values)}
    generation: object = None  # Generation | Missing (tokens and step logits)
    gen_steers: dict = field(default_factory=dict)  # {steer case name: Generation | Missing}
    notes: list = field(default_factory=list)


def _missing(e: BaseException, what: str) -> Missing:
    return Missing(f"{what}: {type(e).__name__}: {str(e)[:300]}")


def tested(subj: Subject, plan: Plan) -> Side:
    """Everything the plan checks, computed by the tested backend."""
    side = Side()
    short = plan.short
    side.captures = {c.name: subj.capture(c, plan.addresses) for c in plan.cases}
    side.forms = subj.forms(short, plan.forms) if plan.forms else {}
    if plan.steers or plan.readouts or plan.lens_layers:
        try:
            side.base = subj.logits(short)
        except Exception as e:  # noqa: BLE001
            side.base = _missing(e, "engine forward failed")
    side.steers = subj.steered(short, plan.steers)
    side.lens = subj.lens(short, plan.lens_layers) if plan.lens_layers else {}
    side.readouts = subj.readouts(short, plan.readouts, plan.sae_dir) if plan.readouts else {}
    if plan.decode_tokens:
        gen = subj.generate(short, plan.decode_tokens, plan.addresses)
        side.generation = gen
        side.decode = gen.cache if isinstance(gen, Generation) else {a: gen for a in plan.addresses}
        side.gen_steers = {sc.name: subj.generate(short, plan.decode_tokens, [], steer=sc) for sc in plan.gen_steers}
    return side


def recompute(subj: Subject, plan: Plan) -> dict:
    """The tested backend's one-forward capture of the reference's generated sequence (the expected
    side of a vLLM column's decode rows)."""
    ref = plan.reference
    if not isinstance(ref, Generation):
        return {a: ref for a in plan.addresses}
    return subj.capture(decode_case(ref.tokens), plan.addresses)


def steer_fn(sc: SteerCase, prompt_len: int, n: int):
    """fn(canonical tensor [b, q, ...], pos0) -> the tensor with `sc` applied by the validator's maths, for
    a call over `n` absolute positions of a prompt of `prompt_len` tokens."""
    mask = maths.touched(sc.positions, prompt_len, n)
    params = sc.params()

    def fn(t: torch.Tensor, pos0: int) -> torch.Tensor:
        if sc.head is None:
            return maths.steer_rows(t, sc.op, mask, pos0, **params)
        out = t.clone()
        out[:, :, sc.head] = maths.steer_rows(t[:, :, sc.head], sc.op, mask, pos0, **params)
        return out
    return fn


def _lens(ref, plan: Plan, caps: dict) -> dict:
    """{layer: logits}: the reference's own head applied to its own resid_post at each lens layer."""
    out = {}
    last = plan.n_layers - 1
    for layer in plan.lens_layers:
        h = caps.get(f"resid_post.{layer}")
        if not isinstance(h, torch.Tensor):
            out[layer] = h if isinstance(h, Missing) else Missing(f"the reference captured no resid_post.{layer}")
            continue
        try:
            out[layer] = ref.intervene(plan.short, "resid_post", last,
                                       lambda t, pos0, h=h: h.to(device=t.device, dtype=t.dtype))
        except Exception as e:  # noqa: BLE001
            out[layer] = _missing(e, "the reference's lens failed")
    return out


def readouts_from(plan: Plan, caps: dict, lens: dict) -> dict:
    """Each readout of the plan reduced by the validator's maths from a side's tensors (short prompt)."""
    out = {}
    sae = None
    if plan.sae_dir is not None:
        from pathlib import Path

        from safetensors.torch import load_file
        w = load_file(str(Path(plan.sae_dir) / "sae_weights.safetensors"))
        sae = maths.SAEWeights(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"])
    for rc in plan.readouts:
        x = caps.get(rc.address)
        if not isinstance(x, torch.Tensor):
            out[rc.name] = x if isinstance(x, Missing) else Missing(f"no capture of {rc.address}")
            continue
        rows = x[0]  # [P, *shape] (short prompt, batch 1)
        if rc.kind == "lens_topk":
            logits = lens.get(split_address(rc.address)[1])
            if not isinstance(logits, torch.Tensor):
                out[rc.name] = logits if isinstance(logits, Missing) else Missing("no lens logits")
                continue
            out[rc.name] = maths.top_k(maths.log_softmax(logits[0]), rc.k)
        elif rc.kind == "sae":
            if sae is None:
                out[rc.name] = Missing("the plan has no SAE")
                continue
            out[rc.name] = maths.top_k(sae.encode(rows.reshape(rows.shape[0], -1)), rc.k)
        else:
            out[rc.name] = maths.reduce(rc.kind, rows, rc.W, rc.b, rc.act)
    return out


def expected(ref, plan: Plan, with_generation: bool = False) -> Side:
    """The reference adapter's side of every check it can take part in."""
    side = Side()
    for c in plan.cases:
        try:
            side.captures[c.name] = ref.capture(c, plan.addresses)
        except Exception as e:  # noqa: BLE001  (a crashing forward fails the case, with its text)
            side.captures[c.name] = {a: _missing(e, "reference forward failed") for a in plan.addresses}
    if plan.decode_tokens:
        gen = plan.reference
        if isinstance(gen, Generation):
            try:
                side.decode = ref.capture(decode_case(gen.tokens), plan.addresses)
            except Exception as e:  # noqa: BLE001
                side.decode = {a: _missing(e, "reference forward failed") for a in plan.addresses}
        else:
            side.decode = {a: gen for a in plan.addresses}
    caps = side.captures.get(plan.short.name, {})
    side.base = caps.get("lm_head") if "lm_head" in caps else None
    if getattr(ref, "intervenes", False):
        prompt_len = int(plan.short.input_ids.shape[1])
        for sc in plan.steers:
            try:
                side.steers[sc.name] = ref.intervene(plan.short, sc.point, sc.layer, steer_fn(sc, prompt_len, prompt_len))
            except Exception as e:  # noqa: BLE001
                side.steers[sc.name] = _missing(e, "the reference cannot apply this steer")
        side.lens = _lens(ref, plan, caps)
        if side.base is None:
            side.base = ref.intervene(plan.short, "resid_post", plan.n_layers - 1, lambda t, pos0: t)
    else:  # an API that only adds one vector at resid_post everywhere (nnterp, interp-engine): that case only
        for sc in plan.steers:
            if sc.op == "add" and sc.point == "resid_post" and sc.positions == "all" and sc.head is None:
                try:
                    side.steers[sc.name] = ref.steer_logits(plan.short, sc.layer, sc.value)
                except Exception as e:  # noqa: BLE001
                    side.steers[sc.name] = _missing(e, "the reference's steering failed")
            else:
                side.steers[sc.name] = Missing(f"{ref.name} steers only by adding one vector at resid_post on every "
                                               f"position (its API): {sc.describe()} is compared in the hf, "
                                               f"transformer_lens and nnsight columns")
        side.lens = {layer: Missing(f"{ref.name} offers no hook to replace the last layer's output: the lens is "
                                    f"compared in the hf, transformer_lens and nnsight columns")
                     for layer in plan.lens_layers}
    side.readouts = readouts_from(plan, caps, side.lens)
    if with_generation and plan.decode_tokens:
        side.generation = plan.reference
        side.gen_steers = hf_gen_steers(ref, plan)
    return side


def hf_generation(ref, plan: Plan) -> "Generation | Missing":
    """The reference tokens: HF's own greedy generate on the hf reference (independent of the engine)."""
    try:
        return ref.generate(plan.short, plan.decode_tokens)
    except Exception as e:  # noqa: BLE001
        return _missing(e, "HF generate failed")


def hf_gen_steers(ref, plan: Plan) -> dict:
    prompt_len = int(plan.short.input_ids.shape[1])
    n = prompt_len + plan.decode_tokens - 1
    out = {}
    for sc in plan.gen_steers:
        try:
            out[sc.name] = ref.generate(plan.short, plan.decode_tokens, sc.point, sc.layer, steer_fn(sc, prompt_len, n))
        except Exception as e:  # noqa: BLE001
            out[sc.name] = _missing(e, "HF generate with the steer failed")
    return out
